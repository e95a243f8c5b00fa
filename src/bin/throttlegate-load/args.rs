//! The generator's flags and the small value parsers they use.

use std::time::Duration;

use clap::{Parser, ValueEnum};

#[derive(Debug, Parser)]
#[command(
    name = "throttlegate-load",
    about = "gRPC load against any Envoy rate-limit service (RLS v3)",
    after_help = "Prints decisions/s, the answers, errors by gRPC code, latency \
                  percentiles and one line `summary {json}` for scripts."
)]
pub struct Args {
    /// Server address.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub addr: String,
    /// HTTP/2 connections, each a channel of its own.
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    /// Requests in flight on each connection (concurrent streams).
    #[arg(long, default_value_t = 16)]
    pub streams: usize,
    /// Requests to count (the measured part ends after this many answers).
    /// Without --duration the default is 100000.
    #[arg(long)]
    pub requests: Option<u64>,
    /// Length of the measured part (e.g. `10s`, `500ms`, `2m`); with
    /// --requests too, whichever comes first ends it.
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Load sent before the measured part, not counted (e.g. `1s`).
    #[arg(long, value_parser = parse_duration, default_value = "0s")]
    pub warmup: Duration,
    #[arg(long, default_value = "loadgen")]
    pub domain: String,
    /// The varying descriptor entry's key.
    #[arg(long, default_value = "client")]
    pub key: String,
    /// Entries put before the varying one in every descriptor, `KEY=VALUE`
    /// (repeatable), for rules nested under a fixed entry.
    #[arg(long = "prefix-entry", value_parser = parse_entry)]
    pub prefix_entries: Vec<(String, String)>,
    /// Distinct values of the varying entry (1 = one hot key).
    #[arg(long, visible_alias = "distinct-values", default_value_t = 1)]
    pub keys: u64,
    /// How values are drawn: from the `--keys` values (uniform, zipf), or
    /// hot-and-fresh (see --hot-keys, --hot-share).
    #[arg(long, value_enum, default_value_t = Distribution::Uniform)]
    pub distribution: Distribution,
    /// With `--distribution hot-and-fresh`: how many hot values (`0` to
    /// `K-1`), each equally likely among the hot requests.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub hot_keys: u64,
    /// With `--distribution hot-and-fresh`: the share of requests on the
    /// hot values, in [0, 1]; every other request carries a value no
    /// request of this run carried before (from `K` upwards), so a store
    /// sees a new counter for each.
    #[arg(long, default_value_t = 0.9, value_parser = parse_share)]
    pub hot_share: f64,
    /// Paced, open-loop: N requests/s overall, each with a planned send
    /// time (start + i/N). A request whose stream is still busy at that
    /// time goes out late, and its latency counts from the planned time,
    /// so queueing shows in the percentiles; requests more than 1 ms
    /// behind plan are counted as `late`. Streams then bound the requests
    /// in flight. Without it, each stream sends as fast as answers come
    /// (closed loop).
    #[arg(long, value_parser = parse_rate)]
    pub rate: Option<f64>,
    /// During the measured part, print one line for each interval of this
    /// length (and an `interval {json}` line): that interval's answers,
    /// late requests, latency percentiles and CPU of the `--pid`
    /// processes. The whole-run report is printed at the end as always.
    #[arg(long, value_parser = parse_interval)]
    pub report_every: Option<Duration>,
    /// Exponent `s` of the Zipf distribution: value rank k is drawn with
    /// probability proportional to 1/k^s.
    #[arg(long, default_value_t = 1.0, value_parser = parse_exponent)]
    pub zipf_exponent: f64,
    /// Descriptors per request: the first with key `<key>`, then
    /// `<key>_1`, `<key>_2`, ..., all with the same value. Each key needs a
    /// rule of its own; each descriptor is then a counter of its own, which
    /// on a Redis Cluster without a hash tag lands in a slot of its own.
    #[arg(long, default_value_t = 1)]
    pub descriptors: usize,
    /// Seed of the value sequence (each stream derives its own).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A process whose CPU time to report over the measured part,
    /// `PID` or `LABEL=PID` (repeatable).
    #[arg(long = "pid", value_parser = parse_pid)]
    pub pids: Vec<(String, u32)>,
    /// `NAME=VALUE` copied into the summary line's `labels` (repeatable).
    #[arg(long = "label", value_parser = parse_entry)]
    pub labels: Vec<(String, String)>,
    /// Deadline of each request; a request past it counts as an error
    /// (DeadlineExceeded).
    #[arg(long, value_parser = parse_duration, default_value = "10s")]
    pub timeout: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Distribution {
    /// Every value equally likely.
    Uniform,
    /// Value rank k with probability proportional to 1/k^s.
    Zipf,
    /// `--hot-share` of requests on `--hot-keys` hot values, the rest on
    /// values never used before in the run (`--keys` is not used).
    HotAndFresh,
}

impl Args {
    /// The request budget of the measured part: `--requests`, or 100000
    /// when neither `--requests` nor `--duration` is given.
    pub fn request_budget(&self) -> Option<u64> {
        match (self.requests, self.duration) {
            (None, None) => Some(100_000),
            (requests, _) => requests,
        }
    }
}

/// `10s`, `500ms`, `1.5s`, `2m`, `100us`; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|it: char| !(it.is_ascii_digit() || it == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("not a duration: {text:?} (e.g. 10s, 500ms, 2m)"))?;
    let seconds = match unit.trim() {
        "" | "s" => number,
        "ms" => number / 1e3,
        "us" | "µs" => number / 1e6,
        "m" | "min" => number * 60.0,
        "h" => number * 3600.0,
        other => return Err(format!("unknown duration unit {other:?} in {text:?}")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("duration out of range: {text:?}"))
}

/// `KEY=VALUE`, the key not empty.
fn parse_entry(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {text:?}")),
    }
}

/// `PID` (labelled `pid<PID>`) or `LABEL=PID`.
fn parse_pid(text: &str) -> Result<(String, u32), String> {
    let (label, pid) = match text.split_once('=') {
        Some((label, pid)) if !label.is_empty() => (Some(label), pid),
        Some(_) => return Err(format!("empty label in {text:?}")),
        None => (None, text),
    };
    let pid: u32 = pid
        .trim()
        .parse()
        .map_err(|_| format!("not a process id: {pid:?}"))?;
    Ok((
        label.map_or_else(|| format!("pid{pid}"), str::to_owned),
        pid,
    ))
}

/// A share in [0, 1].
fn parse_share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err(format!("a share must be in [0, 1], got {text:?}")),
    }
}

/// Requests per second: finite, positive, at most 10^7.
fn parse_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 && rate <= 1e7 => Ok(rate),
        _ => Err(format!(
            "the rate must be in (0, 10000000] requests/s, got {text:?}"
        )),
    }
}

/// A report interval: a duration of at least 1 ms.
fn parse_interval(text: &str) -> Result<Duration, String> {
    let interval = parse_duration(text)?;
    if interval < Duration::from_millis(1) {
        return Err(format!(
            "the report interval must be at least 1ms, got {text:?}"
        ));
    }
    Ok(interval)
}

fn parse_exponent(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 && s <= 20.0 => Ok(s),
        _ => Err(format!(
            "the Zipf exponent must be in (0, 20], got {text:?}"
        )),
    }
}

#[cfg(test)]
mod tests;
