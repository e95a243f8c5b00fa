//! The flags that say how a config is loaded, shared by `serve`,
//! `check-config` and `simulate`. Invariant: the three subcommands load a
//! config alike, so `check-config` accepts what `serve` would.

use clap::Args;

use crate::algorithms::Algorithm;
use crate::config::{self, LoadOptions};

#[derive(Debug, Args)]
pub(super) struct ConfigArgs {
    /// Merge files naming the same domain instead of refusing them.
    #[arg(long, env = "THROTTLEGATE_MERGE_DOMAINS")]
    pub(super) merge_domains: bool,
    /// Algorithm where neither the rule nor its file names one.
    #[arg(long, env = "THROTTLEGATE_DEFAULT_ALGORITHM", default_value = "sliding_window_log", value_parser = parse_algorithm)]
    default_algorithm: Algorithm,
    /// Most requests per window of a sliding-window log, which keeps one
    /// entry per request: a rule over it that inherits the log uses
    /// sliding_window_counter, one that names the log is refused.
    #[arg(long, env = "THROTTLEGATE_MAX_LOG_ENTRIES", default_value_t = config::DEFAULT_MAX_LOG_ENTRIES)]
    max_log_entries: u32,
    /// Most bytes in one config file; a larger file is refused.
    #[arg(long, env = "THROTTLEGATE_MAX_CONFIG_FILE_BYTES", default_value_t = config::ConfigLimits::STANDARD.max_file_bytes)]
    max_config_file_bytes: u64,
    /// Most bytes in all the files of a config directory together.
    #[arg(long, env = "THROTTLEGATE_MAX_CONFIG_BYTES", default_value_t = config::ConfigLimits::STANDARD.max_total_bytes)]
    max_config_bytes: u64,
    /// Most descriptors (at every depth) in one domain.
    #[arg(long, env = "THROTTLEGATE_MAX_CONFIG_DESCRIPTORS", default_value_t = config::ConfigLimits::STANDARD.max_descriptors)]
    max_config_descriptors: usize,
}

fn parse_algorithm(name: &str) -> Result<Algorithm, String> {
    Algorithm::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = Algorithm::ALL.iter().map(|it| it.name()).collect();
        format!(
            "unknown algorithm '{name}', expected one of {}",
            known.join(", ")
        )
    })
}

pub(super) fn load_options(args: &ConfigArgs) -> LoadOptions {
    LoadOptions {
        merge_domains: args.merge_domains,
        default_algorithm: args.default_algorithm,
        max_log_entries: args.max_log_entries,
        limits: config::ConfigLimits {
            max_file_bytes: args.max_config_file_bytes,
            max_total_bytes: args.max_config_bytes,
            max_descriptors: args.max_config_descriptors,
        },
    }
}
