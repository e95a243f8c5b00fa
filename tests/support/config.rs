//! Load options as the command line gives them by default.

use throttlegate::algorithms::Algorithm;
use throttlegate::config::{DEFAULT_MAX_LOG_ENTRIES, LoadOptions};

/// One file per domain, the sliding-window log, the default log cap.
pub fn load_options() -> LoadOptions {
    LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::SlidingWindowLog,
        max_log_entries: DEFAULT_MAX_LOG_ENTRIES,
    }
}
