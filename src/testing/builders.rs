//! Load options, rule sets, backends and limiters as `serve` builds them
//! by default, from a fixed start time.

use std::sync::Arc;

use arc_swap::ArcSwap;

use crate::algorithms::Algorithm;
use crate::backends::Backend;
use crate::backends::memory::MemoryBackend;
use crate::clock::ManualClock;
use crate::config::{self, LoadOptions};
use crate::decision::{Limiter, Options};
use crate::metrics::Metrics;
use crate::rules::RuleSet;

/// A fixed start time, so windows do not roll over mid-test.
pub(crate) const T0: u64 = 1_700_000_000_000_000;

/// Load options as the command line gives them by default: one file per
/// domain, the sliding-window log, the default log cap.
pub(crate) fn load_options() -> LoadOptions {
    LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::SlidingWindowLog,
        max_log_entries: config::DEFAULT_MAX_LOG_ENTRIES,
        limits: config::ConfigLimits::STANDARD,
    }
}

/// Parses one config file's text under [`load_options`], panicking with
/// the problems if it is invalid.
pub(crate) fn rules_from(file_name: &str, yaml: &str) -> RuleSet {
    match config::parse_str(file_name, yaml, &load_options()) {
        Ok(loaded) => loaded.rules,
        Err(err) => panic!("invalid test config {file_name}:\n{err:#}"),
    }
}

/// Limiter options as `serve` starts by default: headers on, errors fail.
pub(crate) fn default_options() -> Options {
    Options::default()
}

/// A memory backend on `clock`.
pub(crate) fn memory_backend(clock: &ManualClock) -> Arc<dyn Backend> {
    Arc::new(MemoryBackend::new(Arc::new(clock.clone())))
}

/// A limiter over `rules` and `backend`, recording into `metrics`.
pub(crate) fn limiter(
    rules: RuleSet,
    backend: Arc<dyn Backend>,
    options: Options,
    metrics: Metrics,
) -> Limiter {
    Limiter::new(
        Arc::new(ArcSwap::from_pointee(rules)),
        backend,
        options,
        Arc::new(metrics),
    )
}
