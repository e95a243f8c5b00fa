//! `throttlegate simulate`: a traffic pattern replayed through one rule, once per algorithm.
//!
//! Each run is the service's own decision path: the config is loaded as
//! `serve` loads it, the matched rule is rebuilt with each algorithm
//! (`variant`), and every request goes through [`Limiter::decide`] on the
//! memory backend, whose clock is a [`ManualClock`] set to each request's
//! time. `pattern` makes the requests; `svg` draws what was decided.

mod pattern;
mod svg;
mod variant;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::backends::memory::MemoryBackend;
use crate::clock::ManualClock;
use crate::config::{self, LoadOptions};
use crate::decision::{
    Code, Decision, Descriptor, Entry, HeaderNames, Limiter, Options as LimiterOptions, Request,
};
use crate::metrics::Metrics;

pub use pattern::{Arrival, MAX_ARRIVALS, Pattern, Scale, parse_trace};
pub use svg::render as render_svg;
use variant::Variant;

/// What to simulate, as the command line gives it.
#[derive(Debug, Clone)]
pub struct Simulation {
    pub config: PathBuf,
    pub load: LoadOptions,
    pub domain: String,
    /// The descriptor's entries, each `key=value`, outermost first.
    pub descriptor: Vec<String>,
    /// `burst`, `steady`, `ramp`, or `trace` followed by a file.
    pub pattern: Vec<String>,
    /// Length of the run in seconds (decimals allowed); default four
    /// windows, or a trace up to its last request.
    pub duration: Option<String>,
    /// Only the rule's own algorithm(s), instead of one run per algorithm.
    pub only_configured: bool,
}

/// Why nothing could be simulated.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Config(String),
    #[error("trace line {line}: {message}")]
    Trace { line: usize, message: String },
    #[error("{path}: {source}")]
    TraceFile { path: String, source: Box<Error> },
    #[error("{path}: cannot read the trace: {source}")]
    ReadTrace {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    NoRule(String),
    #[error("{0}")]
    Decision(String),
    #[error("{path}: cannot write the picture: {source}")]
    Write {
        path: String,
        source: std::io::Error,
    },
}

/// Everything one simulation decided: one lane per algorithm.
#[derive(Debug, Clone)]
pub struct Report {
    /// The domain, the descriptor and its limits, in words.
    pub rule: String,
    pub pattern: String,
    pub duration_us: u64,
    /// The window of the limit the pattern is scaled to.
    pub window_us: u64,
    pub requests: usize,
    pub lanes: Vec<Lane>,
    /// What the config loader had to say, for stderr.
    pub warnings: Vec<String>,
}

/// One algorithm's run.
#[derive(Debug, Clone)]
pub struct Lane {
    /// The algorithm's name (several joined by `+` for the configured
    /// limits of a node that has more than one).
    pub label: String,
    pub events: Vec<Event>,
    /// The remaining quota over time, `(µs from the start, remaining)`:
    /// after each request, and read between them.
    pub quota: Vec<(u64, u64)>,
    /// Most the remaining quota can be (the most restrictive limit's
    /// capacity, as `RateLimit-Limit` reports it).
    pub capacity: u64,
    pub allowed: usize,
    pub denied: usize,
    /// Most units allowed within any span one window long.
    pub most_in_window: u64,
}

/// One request and its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub at_us: u64,
    pub cost: u32,
    pub allowed: bool,
    /// `RateLimit-Remaining` of the answer.
    pub remaining: u64,
}

/// Simulated time starts here (rounded down to a whole window), so runs
/// do not depend on the wall clock.
const EPOCH_US: u64 = 1_700_000_000_000_000;

/// Loads the config, finds the rule, replays the pattern through it once
/// per algorithm.
pub fn run(simulation: &Simulation) -> Result<Report, Error> {
    let pattern = read_pattern(&simulation.pattern)?;
    let request = request(&simulation.domain, &simulation.descriptor)?;
    let loaded = config::load(&simulation.config, &simulation.load)
        .map_err(|err| Error::Config(format!("{err:#}")))?;
    let reached = variant::find(&loaded.rules, &request)?;
    let scale = reached.scale();
    let duration_us = match &simulation.duration {
        Some(text) => parse_seconds(text)?,
        None => pattern.default_duration_us(scale),
    };
    let arrivals = pattern.arrivals(scale, duration_us)?;
    let start_us = EPOCH_US / reached.longest_window_us() * reached.longest_window_us();
    let lanes = variant::variants(&loaded.rules, &reached, simulation.only_configured)?
        .into_iter()
        .map(|it| {
            simulate_lane(
                it,
                &request,
                &arrivals,
                start_us,
                (duration_us, scale.window_us),
            )
        })
        .collect::<Result<Vec<Lane>, Error>>()?;
    Ok(Report {
        rule: reached.describe(&request),
        pattern: pattern.to_string(),
        duration_us,
        window_us: scale.window_us,
        requests: arrivals.len(),
        lanes,
        warnings: loaded.warnings,
    })
}

/// Writes the report's picture to `path`.
pub fn write_svg(report: &Report, path: &Path) -> Result<(), Error> {
    std::fs::write(path, render_svg(report)).map_err(|source| Error::Write {
        path: path.display().to_string(),
        source,
    })
}

/// The pattern the arguments name, with its trace file read.
fn read_pattern(args: &[String]) -> Result<Pattern, Error> {
    let (name, file) = match args {
        [] => ("burst", None),
        [name] => (name.as_str(), None),
        [name, file] => (name.as_str(), Some(file.as_str())),
        _ => return Err(Error::Usage("--pattern takes a name and a file".to_owned())),
    };
    let Some(file) = file.filter(|_| name == "trace") else {
        return Pattern::from_name(name, file);
    };
    let text = std::fs::read_to_string(file).map_err(|source| Error::ReadTrace {
        path: file.to_owned(),
        source,
    })?;
    Pattern::from_name(name, Some(&text)).map_err(|err| Error::TraceFile {
        path: file.to_owned(),
        source: Box::new(err),
    })
}

/// A request of one descriptor of `entries` (`key=value` each).
fn request(domain: &str, entries: &[String]) -> Result<Request, Error> {
    if domain.is_empty() {
        return Err(Error::Usage("--domain must not be empty".to_owned()));
    }
    if entries.is_empty() {
        return Err(Error::Usage(
            "at least one --descriptor key=value is needed".to_owned(),
        ));
    }
    let entries = entries
        .iter()
        .map(|it| match it.split_once('=') {
            Some((key, value)) if !key.is_empty() => Ok(Entry {
                key: key.as_bytes().to_vec(),
                value: value.as_bytes().to_vec(),
            }),
            _ => Err(Error::Usage(format!(
                "--descriptor '{it}' is not key=value"
            ))),
        })
        .collect::<Result<Vec<Entry>, Error>>()?;
    Ok(Request {
        domain: domain.to_owned(),
        descriptors: vec![Descriptor {
            entries,
            ..Descriptor::default()
        }],
        hits_addend: 1,
    })
}

/// Seconds with at most six decimals, above 0, as microseconds.
fn parse_seconds(text: &str) -> Result<u64, Error> {
    let refused = || {
        Error::Usage(format!(
            "--duration '{text}' is not a number of seconds above 0 (such as 10 or 2.5)"
        ))
    };
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |it: &str| it.bytes().all(|byte| byte.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 6 {
        return Err(refused());
    }
    let whole: u64 = whole.parse().map_err(|_| refused())?;
    let fraction: u64 = format!("{fraction:0<6}").parse().map_err(|_| refused())?;
    let us = whole
        .checked_mul(1_000_000)
        .and_then(|it| it.checked_add(fraction))
        .ok_or_else(refused)?;
    if us == 0 {
        return Err(refused());
    }
    Ok(us)
}

/// Replays `arrivals` through a limiter over `variant`'s rules on a fresh
/// memory backend whose clock is set to each request's time. Between the
/// requests, [`QUOTA_SAMPLES`] checks of cost 0 (which take nothing) read
/// the remaining quota as it refills.
fn simulate_lane(
    variant: Variant,
    request: &Request,
    arrivals: &[Arrival],
    start_us: u64,
    span: (u64, u64),
) -> Result<Lane, Error> {
    let (duration_us, window_us) = span;
    let clock = ManualClock::new(start_us);
    let backend = Arc::new(MemoryBackend::new(Arc::new(clock.clone())));
    let options = LimiterOptions {
        // The memory backend has no local clock: nothing would be cached.
        over_limit_cache: 0,
        ..Default::default()
    };
    let rules = Arc::new(ArcSwap::from_pointee(variant.rules));
    let limiter = Limiter::new(rules, backend, options, Arc::new(Metrics::new()));
    // The memory backend never waits: a single-threaded runtime is enough.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|err| Error::Decision(format!("cannot start a runtime: {err}")))?;
    let decide = |request: &Request, at_us: u64| {
        clock.set(start_us + at_us);
        let decided = runtime.block_on(limiter.decide(request));
        decided.map_err(|err| Error::Decision(format!("{}: {err}", variant.label)))
    };
    let mut probe = request.clone();
    probe.descriptors[0].hits_addend = Some(0);
    let mut samples = (0..=QUOTA_SAMPLES)
        .map(|idx| (u128::from(duration_us) * idx / QUOTA_SAMPLES) as u64)
        .peekable();
    let mut request = request.clone();
    let mut lane = Lane::new(variant.label.clone());
    for arrival in arrivals {
        // A sample at a request's time reads the quota before it.
        while let Some(at_us) = samples.next_if(|it| *it <= arrival.at_us) {
            lane.sample(at_us, &decide(&probe, at_us)?);
        }
        request.hits_addend = arrival.cost;
        let decision = decide(&request, arrival.at_us)?;
        lane.record(*arrival, &decision);
    }
    for at_us in samples {
        lane.sample(at_us, &decide(&probe, at_us)?);
    }
    lane.most_in_window = most_in_window(&lane.events, window_us);
    Ok(lane)
}

/// Checks of cost 0 spread over a run to draw the quota between requests:
/// about one per pixel column of the picture.
const QUOTA_SAMPLES: u128 = 700;

impl Lane {
    fn new(label: String) -> Lane {
        Lane {
            label,
            events: Vec::new(),
            quota: Vec::new(),
            capacity: 0,
            allowed: 0,
            denied: 0,
            most_in_window: 0,
        }
    }

    /// A request and its answer.
    fn record(&mut self, arrival: Arrival, decision: &Decision) {
        let allowed = decision.overall == Code::Ok;
        let remaining = self.sample(arrival.at_us, decision);
        if allowed {
            self.allowed += 1;
        } else {
            self.denied += 1;
        }
        self.events.push(Event {
            at_us: arrival.at_us,
            cost: arrival.cost,
            allowed,
            remaining,
        });
    }

    /// The remaining quota a decision reports, at `at_us`.
    fn sample(&mut self, at_us: u64, decision: &Decision) -> u64 {
        let (limit, remaining) = quota(decision);
        self.capacity = self.capacity.max(limit);
        self.quota.push((at_us, remaining));
        remaining
    }
}

/// The most restrictive limit's capacity and remaining quota, as the
/// `RateLimit-*` headers report them (they count a token bucket's burst,
/// which `limit_remaining` caps at the configured number).
fn quota(decision: &Decision) -> (u64, u64) {
    let names = HeaderNames::standard();
    let header = |name: &str| {
        decision
            .headers
            .iter()
            .find(|(it, _)| *it == name)
            .and_then(|(_, value)| value.parse::<u64>().ok())
    };
    let status = decision.statuses.first();
    let limit = header(&names.limit).or_else(|| {
        let current = status?.current_limit.as_ref()?;
        Some(u64::from(current.requests_per_unit))
    });
    let remaining = header(&names.remaining).or_else(|| Some(status?.limit_remaining.into()));
    (limit.unwrap_or(0), remaining.unwrap_or(0))
}

/// Most units allowed within any half-open span of `window_us`.
pub fn most_in_window(events: &[Event], window_us: u64) -> u64 {
    let allowed: Vec<&Event> = events.iter().filter(|it| it.allowed).collect();
    let mut first = 0;
    let mut units = 0u64;
    let mut most = 0;
    for event in &allowed {
        units += u64::from(event.cost);
        // Stops at `event` itself at the latest: `window_us` is above 0.
        while allowed[first].at_us + window_us <= event.at_us {
            units -= u64::from(allowed[first].cost);
            first += 1;
        }
        most = most.max(units);
    }
    most
}

/// The summary printed to stdout: the rule, the pattern, then one line per
/// algorithm with its counts.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "rule: {}", self.rule)?;
        writeln!(
            f,
            "pattern: {}, {} s, {} requests",
            self.pattern,
            seconds(self.duration_us),
            self.requests
        )?;
        let span = format!("most allowed in any {} s", seconds(self.window_us));
        writeln!(
            f,
            "{:<24} {:>8} {:>8}  {span}",
            "algorithm", "allowed", "denied"
        )?;
        for lane in &self.lanes {
            writeln!(
                f,
                "{:<24} {:>8} {:>8}  {:>width$}",
                lane.label,
                lane.allowed,
                lane.denied,
                lane.most_in_window,
                width = span.len()
            )?;
        }
        Ok(())
    }
}

/// Microseconds as seconds, with only the decimals needed.
fn seconds(us: u64) -> String {
    let whole = us / 1_000_000;
    let fraction = us % 1_000_000;
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:06}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests;
