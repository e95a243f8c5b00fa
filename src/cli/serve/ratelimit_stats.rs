//! The flags of envoyproxy/ratelimit's statistics: its Prometheus
//! endpoint and its statsd lines, beside our own `/metrics`. Invariant:
//! each is off unless its address is given.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::app::{RatelimitPrometheus, RatelimitStatsSettings};
use crate::metrics::statsd::{StatsdProtocol, StatsdSettings, TagFormat};

/// envoyproxy/ratelimit's statistics, under its names, beside our own
/// `/metrics` (which stays as it is).
#[derive(Debug, Args)]
pub(super) struct RatelimitStatsArgs {
    /// Serve envoyproxy/ratelimit's statistics for Prometheus on this
    /// address, under the names the mapping gives (envoyproxy/ratelimit's
    /// USE_PROMETHEUS and PROMETHEUS_ADDR); off without it.
    #[arg(
        long,
        env = "THROTTLEGATE_RATELIMIT_PROMETHEUS_ADDR",
        value_name = "ADDR"
    )]
    ratelimit_prometheus_addr: Option<SocketAddr>,
    /// The path of that page.
    #[arg(
        long,
        env = "THROTTLEGATE_RATELIMIT_PROMETHEUS_PATH",
        default_value = "/metrics"
    )]
    ratelimit_prometheus_path: String,
    /// A statsd_exporter mapping file giving that page's names and labels
    /// (PROMETHEUS_MAPPER_YAML); without it, Envoy Gateway's mapping.
    #[arg(
        long,
        env = "THROTTLEGATE_RATELIMIT_PROMETHEUS_MAPPING",
        value_name = "FILE"
    )]
    ratelimit_prometheus_mapping: Option<PathBuf>,
    /// Send envoyproxy/ratelimit's statistics as statsd lines to this
    /// host:port (USE_STATSD, STATSD_HOST, STATSD_PORT); off without it.
    #[arg(long, env = "THROTTLEGATE_STATSD_ADDR", value_name = "HOST:PORT")]
    statsd_addr: Option<String>,
    /// How statsd lines travel.
    #[arg(long, env = "THROTTLEGATE_STATSD_PROTOCOL", value_enum, default_value_t = StatsdProtocolArg::Tcp)]
    statsd_protocol: StatsdProtocolArg,
    /// Send what changed this often (STATS_FLUSH_INTERVAL).
    #[arg(long, env = "THROTTLEGATE_STATSD_FLUSH_INTERVAL_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    statsd_flush_interval_ms: u64,
    /// A tag on every statsd line, repeatable or comma-separated
    /// (EXTRA_TAGS).
    #[arg(
        long,
        env = "THROTTLEGATE_STATSD_TAGS",
        value_name = "KEY:VALUE",
        value_delimiter = ',',
        value_parser = parse_statsd_tag
    )]
    statsd_tag: Vec<(String, String)>,
    /// How tags are written: in the name (`.__key=value`, as
    /// envoyproxy/ratelimit's statsd sink), or `|#key:value` (DogStatsD,
    /// USE_DOG_STATSD).
    #[arg(long, env = "THROTTLEGATE_STATSD_TAG_FORMAT", value_enum, default_value_t = StatsdTagFormatArg::Name)]
    statsd_tag_format: StatsdTagFormatArg,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StatsdProtocolArg {
    Tcp,
    Udp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StatsdTagFormatArg {
    Name,
    Dogstatsd,
}

fn parse_statsd_tag(text: &str) -> Result<(String, String), String> {
    match text.split_once(':') {
        Some((key, value)) if !key.trim().is_empty() => {
            Ok((key.trim().to_owned(), value.trim().to_owned()))
        }
        _ => Err(format!("{text:?} is not KEY:VALUE")),
    }
}

pub(super) fn ratelimit_stats_settings(args: RatelimitStatsArgs) -> RatelimitStatsSettings {
    RatelimitStatsSettings {
        prometheus: args
            .ratelimit_prometheus_addr
            .map(|addr| RatelimitPrometheus {
                addr,
                path: args.ratelimit_prometheus_path,
                mapping: args.ratelimit_prometheus_mapping,
            }),
        statsd: args.statsd_addr.map(|addr| StatsdSettings {
            addr,
            protocol: match args.statsd_protocol {
                StatsdProtocolArg::Tcp => StatsdProtocol::Tcp,
                StatsdProtocolArg::Udp => StatsdProtocol::Udp,
            },
            flush_interval: Duration::from_millis(args.statsd_flush_interval_ms),
            tags: args.statsd_tag,
            tag_format: match args.statsd_tag_format {
                StatsdTagFormatArg::Name => TagFormat::Name,
                StatsdTagFormatArg::Dogstatsd => TagFormat::DogStatsd,
            },
        }),
    }
}
