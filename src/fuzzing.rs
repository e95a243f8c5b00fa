//! The bodies of the fuzz targets in `fuzz/` and of their proptest twins
//! (the tests at the end of this file): one function per target, taking
//! the fuzzer's bytes. Each panics only when an invariant breaks, so a
//! crash is a bug in the service, never in the harness.
//!
//! - [`config`]: bytes as a config file, through the loader `serve` and
//!   `check-config` use, alone and beside another file in a directory;
//! - [`request`]: bytes as a protobuf `RateLimitRequest`, through
//!   `from_wire`, the request's bounds and a decision on the memory
//!   backend;
//! - [`decision`]: bytes decoded into a [`Scenario`] (a small generated
//!   config and a run of requests, costs and clock steps) and checked by
//!   [`run_scenario`]: a sliding log or fixed window never allows more than
//!   its number within its window, and a denied request consumes nothing.
//!
//! Compiled for the unit tests and with the `fuzzing` feature, which the
//! fuzz crate turns on; the service never contains it.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use futures_util::FutureExt as _;
use prost::Message as _;

use crate::algorithms::Algorithm;
use crate::backends::memory::MemoryBackend;
use crate::clock::{Clock as _, ManualClock};
use crate::config::{self, ConfigLimits, LoadOptions};
use crate::decision::{
    self, Code, Decision, Descriptor, Entry, Limiter, MAX_DESCRIPTORS, MAX_ENTRIES, Options,
    Request,
};
use crate::metrics::Metrics;
use crate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use crate::rules::{RuleSet, Unit};
use crate::transport::wire;

/// A fixed start time, at a whole minute, so runs are reproducible.
const T0: u64 = 1_700_000_040_000_000;

// === config ===

/// The file name the single-file form is loaded under.
pub const CONFIG_FILE: &str = "fuzz.yaml";

/// Another file of the directory form: a valid config of its own domain,
/// and a descriptor of the domain `fuzz` for the merge to meet.
const DIR_NEIGHBOUR: &str = "domain: fuzz\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";

/// Load options from the first byte: merge domains, the default
/// algorithm.
fn config_options(mode: u8) -> LoadOptions {
    LoadOptions {
        merge_domains: mode & 1 != 0,
        default_algorithm: Algorithm::ALL[usize::from(mode >> 1) % Algorithm::ALL.len()],
        max_log_entries: config::DEFAULT_MAX_LOG_ENTRIES,
        limits: ConfigLimits::STANDARD,
    }
}

/// The `config` target: the first byte chooses the options and whether
/// the rest is also loaded as one file of a directory; the rest is the
/// file. Any text is accepted or refused with problems naming the file;
/// an accepted config loads the same twice and renders its summary.
pub fn config(data: &[u8]) {
    let Some((&mode, text)) = data.split_first() else {
        return;
    };
    let options = config_options(mode);
    if let Ok(text) = std::str::from_utf8(text) {
        let first = config::parse_str(CONFIG_FILE, text, &options);
        check_loaded(&first, &[CONFIG_FILE], &options);
        let again = config::parse_str(CONFIG_FILE, text, &options);
        assert_eq!(first, again, "loading the same text twice differs");
    }
    if mode & 0x80 != 0 {
        config_dir(text, &options);
    }
}

/// `text` as `a.yaml` of a directory beside `b.yaml`, loaded by
/// [`config::load`] from disk (non-UTF-8 bytes included).
fn config_dir(text: &[u8], options: &LoadOptions) {
    let dir = scratch_dir();
    std::fs::create_dir_all(&dir).expect("make the scratch directory");
    let a = dir.join("a.yaml");
    let b = dir.join("b.yaml");
    std::fs::write(&a, text).expect("write the fuzzed file");
    std::fs::write(&b, DIR_NEIGHBOUR).expect("write the neighbour file");
    let loaded = config::load(&dir, options);
    let names = [a.display().to_string(), b.display().to_string()];
    let dir_name = dir.display().to_string();
    let allowed = [names[0].as_str(), names[1].as_str(), dir_name.as_str()];
    check_loaded(&loaded, &allowed, options);
    if let Ok(loaded) = &loaded {
        assert_eq!(loaded.files, vec![a, b]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A directory of this thread of this process, removed after each use.
fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!(
        "throttlegate-fuzz-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ))
}

/// What every load answer must be: refused with at least one problem,
/// each naming one of `files` and saying something; or accepted within
/// the limits, with a summary.
fn check_loaded(
    res: &Result<config::Loaded, config::Error>,
    files: &[&str],
    options: &LoadOptions,
) {
    match res {
        Err(err) => {
            assert!(!err.problems.is_empty(), "refused without a problem");
            for problem in &err.problems {
                assert!(
                    files.contains(&problem.file.as_str()),
                    "problem names {:?}, not one of {files:?}",
                    problem.file
                );
                assert!(!problem.message.is_empty(), "empty message: {problem:?}");
            }
            let text = format!("{err:#}");
            assert!(!text.is_empty());
        }
        Ok(loaded) => {
            for domain in loaded.rules.domains() {
                let count: usize = domain.children().iter().map(count_nodes).sum();
                assert!(count <= options.limits.max_descriptors);
            }
            let _ = config::summary(&loaded.rules);
        }
    }
}

fn count_nodes(node: &crate::rules::Node) -> usize {
    1 + node.children().iter().map(count_nodes).sum::<usize>()
}

// === request ===

/// The rules the `request` target decides against: the fixture configs
/// `basic.yaml` and `wildcard.yaml`, whose domains the seeds name.
fn request_rules() -> Arc<RuleSet> {
    static RULES: OnceLock<Arc<RuleSet>> = OnceLock::new();
    RULES
        .get_or_init(|| {
            let options = config_options(0);
            let mut domains = Vec::new();
            for (name, yaml) in [
                (
                    "basic.yaml",
                    include_str!("../tests/fixtures/config/valid/basic.yaml"),
                ),
                (
                    "wildcard.yaml",
                    include_str!("../tests/fixtures/config/valid/wildcard.yaml"),
                ),
            ] {
                let loaded = config::parse_str(name, yaml, &options).expect("fixture config");
                domains.extend(loaded.rules.domains().cloned());
            }
            Arc::new(RuleSet::new(domains, config::DEFAULT_MAX_LOG_ENTRIES))
        })
        .clone()
}

/// Limiter options as `serve` starts by default.
fn limiter_options() -> Options {
    Options::default()
}

/// A limiter over `rules` on a fresh memory backend reading `clock`.
fn memory_limiter(rules: Arc<RuleSet>, clock: &ManualClock) -> Limiter {
    Limiter::new(
        Arc::new(ArcSwap::new(rules)),
        Arc::new(MemoryBackend::new(Arc::new(clock.clone()))),
        limiter_options(),
        Arc::new(Metrics::new()),
    )
}

/// The memory backend never waits: its decision is ready at once.
fn decide_now(limiter: &Limiter, request: &Request) -> Result<Decision, decision::Error> {
    limiter
        .decide(request)
        .now_or_never()
        .expect("a decision on the memory backend is ready at once")
}

/// The `request` target: bytes that decode as a `RateLimitRequest` are
/// decided on the memory backend. A request within the bounds gets one
/// status per descriptor and an answer that encodes; one outside gets
/// INVALID_ARGUMENT; no request gets a backend error.
pub fn request(data: &[u8]) {
    let Ok(wire_request) = RateLimitRequest::decode(data) else {
        return;
    };
    let request = wire::from_wire(wire_request);
    let clock = ManualClock::new(T0);
    let limiter = memory_limiter(request_rules(), &clock);
    let within = within_bounds(&request);
    match decide_now(&limiter, &request) {
        Ok(decision) => {
            assert!(within, "decided a request outside the bounds: {request:?}");
            assert_eq!(decision.statuses.len(), request.descriptors.len());
            check_overall(&decision);
            let _ = wire::to_wire(decision).encode_to_vec();
        }
        Err(decision::Error::InvalidArgument(message)) => {
            assert!(!within, "refused a request within the bounds: {message}");
            assert!(!message.is_empty());
        }
        Err(decision::Error::Backend(err)) => panic!("the memory backend failed: {err}"),
        Err(decision::Error::NoConfig) => panic!("rules are loaded"),
    }
}

/// The bounds of `decision::request`, restated: what may be refused.
fn within_bounds(request: &Request) -> bool {
    !request.domain.is_empty()
        && (1..=MAX_DESCRIPTORS).contains(&request.descriptors.len())
        && request.descriptors.iter().all(|it| {
            (1..=MAX_ENTRIES).contains(&it.entries.len())
                && it.entries.iter().all(|entry| !entry.key.is_empty())
        })
}

/// Overall OVER_LIMIT exactly when a status is.
fn check_overall(decision: &Decision) {
    let over = decision
        .statuses
        .iter()
        .any(|it| it.code == Code::OverLimit);
    assert_eq!(
        decision.overall == Code::OverLimit,
        over,
        "overall code disagrees with the statuses: {decision:?}"
    );
}

// === decision ===

/// A limit of the generated config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScenarioLimit {
    pub algorithm: Algorithm,
    /// 0 to 5.
    pub requests: u32,
    pub unit: Unit,
}

/// The generated config: `a` (any value, one limit), `b` (any value, two
/// stacked limits: a per-second and a per-minute one) and, below `b`, `c`
/// (values matching `x*`, one limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioConfig {
    pub a: ScenarioLimit,
    pub b: [ScenarioLimit; 2],
    pub c: ScenarioLimit,
}

/// Which rule a descriptor reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScenarioRule {
    /// `[a=v<value>]`.
    A,
    /// `[b=v<value>]`.
    B,
    /// `[b=v<value>, c=x<value>]`: the wildcard child of `b`.
    C,
    /// `[b=v<value>, c=y]`: below `b`, matching no rule.
    Unmatched,
}

/// One descriptor of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepDescriptor {
    pub target: ScenarioRule,
    /// 0 to 2.
    pub value: u8,
    /// The descriptor's own `hits_addend`, 0 to 4.
    pub cost: Option<u64>,
}

/// One request, after the clock moved on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScenarioStep {
    pub advance_us: u64,
    /// The request's `hits_addend`, 0 to 3 (0 means 1).
    pub hits_addend: u32,
    /// 1 to 4 descriptors.
    pub descriptors: Vec<StepDescriptor>,
}

/// A config and the requests made against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scenario {
    pub config: ScenarioConfig,
    /// At most [`MAX_STEPS`].
    pub steps: Vec<ScenarioStep>,
}

/// Most steps of a scenario.
pub const MAX_STEPS: usize = 64;

/// Clock steps worth trying: window edges of seconds and minutes.
const ADVANCES: [u64; 8] = [
    999_999,
    1_000_000,
    1_000_001,
    59_999_999,
    60_000_000,
    60_000_001,
    120_000_000,
    1,
];

/// Reads bytes one at a time, then zeros.
struct Bytes<'d>(&'d [u8]);

impl Bytes<'_> {
    fn next(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&first, rest)) => {
                self.0 = rest;
                first
            }
            None => 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl ScenarioLimit {
    fn decode(bytes: &mut Bytes<'_>, unit: Unit) -> ScenarioLimit {
        let byte = bytes.next();
        ScenarioLimit {
            algorithm: Algorithm::ALL[usize::from(byte & 0x0f) % Algorithm::ALL.len()],
            requests: u32::from(byte >> 4) % 6,
            unit,
        }
    }

    fn yaml(&self) -> String {
        format!(
            "{{unit: {}, requests_per_unit: {}, algorithm: {}}}",
            self.unit.name(),
            self.requests,
            self.algorithm.name()
        )
    }
}

impl ScenarioConfig {
    /// The config file's text.
    pub fn yaml(&self) -> String {
        format!(
            "domain: fuzz\ndescriptors:\n  - key: a\n    rate_limit: {}\n  - key: b\n    rate_limits:\n      - {}\n      - {}\n    descriptors:\n      - key: c\n        value: \"x*\"\n        rate_limit: {}\n",
            self.a.yaml(),
            self.b[0].yaml(),
            self.b[1].yaml(),
            self.c.yaml()
        )
    }

    /// The limits a descriptor of `target` is decided by, with an index
    /// naming each.
    fn limits(&self, target: ScenarioRule) -> Vec<(usize, ScenarioLimit)> {
        match target {
            ScenarioRule::A => vec![(0, self.a)],
            ScenarioRule::B => vec![(1, self.b[0]), (2, self.b[1])],
            ScenarioRule::C => vec![(3, self.c)],
            ScenarioRule::Unmatched => Vec::new(),
        }
    }
}

impl Scenario {
    /// Decodes any bytes: four limits, then steps (an advance, a cost and
    /// up to four descriptors each) while bytes are left.
    pub fn decode(data: &[u8]) -> Scenario {
        let mut bytes = Bytes(data);
        let config = ScenarioConfig {
            a: ScenarioLimit::decode(&mut bytes, Unit::Second),
            b: [
                ScenarioLimit::decode(&mut bytes, Unit::Second),
                ScenarioLimit::decode(&mut bytes, Unit::Minute),
            ],
            c: ScenarioLimit::decode(&mut bytes, Unit::Second),
        };
        let mut steps = Vec::new();
        while !bytes.is_empty() && steps.len() < MAX_STEPS {
            let advance = bytes.next();
            let advance_us = if advance < 0x80 {
                u64::from(advance) * 10_000
            } else {
                ADVANCES[usize::from(advance) % ADVANCES.len()]
            };
            let shape = bytes.next();
            let count = 1 + usize::from(shape & 0x03);
            let descriptors = (0..count)
                .map(|_| {
                    let byte = bytes.next();
                    StepDescriptor {
                        target: [
                            ScenarioRule::A,
                            ScenarioRule::B,
                            ScenarioRule::C,
                            ScenarioRule::Unmatched,
                        ][usize::from(byte & 0x03)],
                        value: (byte >> 2 & 0x03) % 3,
                        cost: (byte & 0x10 != 0).then_some(u64::from(byte >> 5) % 5),
                    }
                })
                .collect();
            steps.push(ScenarioStep {
                advance_us,
                hits_addend: u32::from(shape >> 2 & 0x03),
                descriptors,
            });
        }
        Scenario { config, steps }
    }
}

impl StepDescriptor {
    fn request_descriptor(&self, cost: Option<u64>) -> Descriptor {
        let entry = |key: &str, value: String| Entry {
            key: key.as_bytes().to_vec(),
            value: value.into_bytes(),
        };
        let v = format!("v{}", self.value);
        let entries = match self.target {
            ScenarioRule::A => vec![entry("a", v)],
            ScenarioRule::B => vec![entry("b", v)],
            ScenarioRule::C => vec![entry("b", v), entry("c", format!("x{}", self.value))],
            ScenarioRule::Unmatched => vec![entry("b", v), entry("c", "y".to_owned())],
        };
        Descriptor {
            entries,
            limit: None,
            hits_addend: cost,
        }
    }

    /// The counter's identity within the scenario: the rule's values.
    fn counter_values(&self) -> u8 {
        self.value
    }
}

/// The `decision` target: [`Scenario::decode`], then [`run_scenario`].
pub fn decision(data: &[u8]) {
    run_scenario(&Scenario::decode(data));
}

/// Runs `scenario` on two limiters sharing one clock: `all` decides every
/// request, `allowed` only the requests `all` allowed. Checks that:
/// - both answer an allowed request identically, and after every step a
///   probe of cost 0 on every counter gets identical answers: the denied
///   requests `allowed` never saw consumed nothing in `all`;
/// - the overall code is OVER_LIMIT exactly when a status is;
/// - a sliding-window log never allows more than its number in any
///   window, a fixed window never more than its number in one window.
pub fn run_scenario(scenario: &Scenario) {
    let rules = config::parse_str("fuzz.yaml", &scenario.config.yaml(), &config_options(0))
        .expect("the generated config is valid")
        .rules;
    let rules = Arc::new(rules);
    let clock = ManualClock::new(T0);
    let all = memory_limiter(rules.clone(), &clock);
    let allowed_only = memory_limiter(rules, &clock);
    // Allowed costs per (limit, value): (time, cost).
    let mut history: HashMap<(usize, u8), Vec<(u64, u64)>> = HashMap::new();
    for step in &scenario.steps {
        clock.advance(step.advance_us);
        let now = clock.now_us();
        let request = Request {
            domain: "fuzz".to_owned(),
            descriptors: step
                .descriptors
                .iter()
                .map(|it| it.request_descriptor(it.cost))
                .collect(),
            hits_addend: step.hits_addend,
        };
        let decision = decide_now(&all, &request).expect("a valid request is decided");
        assert_eq!(decision.statuses.len(), request.descriptors.len());
        check_overall(&decision);
        if decision.overall == Code::Ok {
            let twin = decide_now(&allowed_only, &request).expect("decided");
            assert_eq!(
                decision, twin,
                "an allowed request answered differently after denied ones"
            );
            for descriptor in &step.descriptors {
                let cost = descriptor
                    .cost
                    .unwrap_or(u64::from(step.hits_addend.max(1)));
                for (limit, spec) in scenario.config.limits(descriptor.target) {
                    let key = (limit, descriptor.counter_values());
                    history.entry(key).or_default().push((now, cost));
                    check_window(spec, &history[&key], now);
                }
            }
        }
        let probe = probe_all();
        assert_eq!(
            decide_now(&all, &probe).expect("decided"),
            decide_now(&allowed_only, &probe).expect("decided"),
            "a denied request consumed something"
        );
    }
}

/// A request of cost 0 on every counter of the scenario's config.
fn probe_all() -> Request {
    let mut descriptors = Vec::new();
    for target in [ScenarioRule::A, ScenarioRule::B, ScenarioRule::C] {
        for value in 0..3 {
            let it = StepDescriptor {
                target,
                value,
                cost: Some(0),
            };
            descriptors.push(it.request_descriptor(Some(0)));
        }
    }
    Request {
        domain: "fuzz".to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

/// No more than the limit's number allowed in its window, for the exact
/// algorithms: the last `W` µs of a sliding log, the current aligned
/// window of a fixed one.
fn check_window(spec: ScenarioLimit, history: &[(u64, u64)], now: u64) {
    let window = spec.unit.seconds() * 1_000_000;
    let counted = |from: u64| -> u64 {
        history
            .iter()
            .filter(|(at, _)| *at >= from)
            .map(|(_, cost)| cost)
            .sum()
    };
    let used = match spec.algorithm {
        Algorithm::SlidingWindowLog => counted((now + 1).saturating_sub(window)),
        Algorithm::FixedWindow => counted(now - now % window),
        _ => return,
    };
    assert!(
        used <= u64::from(spec.requests),
        "{} allowed {used} within one window of {} per {}: {history:?}",
        spec.algorithm.name(),
        spec.requests,
        spec.unit.name()
    );
}

#[cfg(test)]
mod tests;
