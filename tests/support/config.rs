//! Configs for tests: load options as the command line gives them by
//! default, config files on disk.

use std::path::Path;

use throttlegate::algorithms::Algorithm;
use throttlegate::config::{DEFAULT_MAX_LOG_ENTRIES, LoadOptions};

/// One file per domain, the sliding-window log, the default log cap.
pub fn load_options() -> LoadOptions {
    LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::SlidingWindowLog,
        max_log_entries: DEFAULT_MAX_LOG_ENTRIES,
        limits: throttlegate::config::ConfigLimits::STANDARD,
    }
}

/// Writes `text` to `dir/name`; the path, as the binary's flags take it.
pub fn write_file(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path.to_str().expect("utf-8 path").to_owned()
}

/// A config of domain `api` with one rule per algorithm, each at the key
/// named after its algorithm, each of `requests_per_unit` a minute.
pub fn every_algorithm(requests_per_unit: u64) -> String {
    let mut yaml = "domain: api\ndescriptors:\n".to_owned();
    for algorithm in Algorithm::ALL {
        yaml.push_str(&format!(
            "  - key: {algorithm}\n    rate_limit: {{unit: minute, requests_per_unit: {requests_per_unit}, algorithm: {algorithm}}}\n"
        ));
    }
    yaml
}
