//! What `serve` is asked to do, as plain data: the flags as the command
//! line gives them, before anything is checked or built. Invariant: no
//! behaviour here; start-up checks and uses these.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::backends::keys::HashTag;
use crate::backends::redis::{BatchSettings, ClockSource, RedisTls};
use crate::config::LoadOptions;
use crate::decision::{FailureMode, HeaderNames, NearLimitRatio};
use crate::metrics::statsd::StatsdSettings;
use crate::traces::TraceSettings;
use crate::transport::grpc::GrpcLimits;
use crate::transport::http::HttpLimits;
use crate::xds::XdsSettings;

/// What `serve` runs with. Names are checked and Redis is reached during
/// start-up, after the config load, so a bad config is reported first.
pub struct Settings {
    /// A YAML file or directory; `None`: every domain is unknown.
    pub config: Option<PathBuf>,
    pub load: LoadOptions,
    /// Reload when the config files change (SIGHUP reloads either way).
    pub watch_config: bool,
    /// Rules from a management server over xDS instead of files.
    pub xds: Option<XdsFlags>,
    pub grpc_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// TLS on the gRPC server, and on the HTTP one unless `tls.http` is off.
    pub tls: TlsFlags,
    pub redis: RedisFlags,
    /// Most counters the in-memory backend holds.
    pub memory_max_counters: usize,
    pub failure_mode: FailureMode,
    pub shadow_mode: bool,
    /// `None`: no response headers.
    pub response_headers: Option<HeaderNames>,
    pub max_metric_values_per_rule: usize,
    /// When a decision counts as near its limit.
    pub near_limit_ratio: NearLimitRatio,
    /// Most counters the over-limit cache holds (Redis backends only); 0: off.
    pub over_limit_cache: usize,
    /// How long in-flight requests of both servers together may run once
    /// the listeners have closed.
    pub drain_timeout: Duration,
    /// How long health reports NOT_SERVING, requests still answered,
    /// before the listeners close.
    pub shutdown_delay: Duration,
    pub limits: ServerLimits,
    /// JSON log lines instead of text.
    pub json_logs: bool,
    /// The log filter when `RUST_LOG` is not set (`info` without one).
    pub log_filter: Option<String>,
    /// envoyproxy/ratelimit's statistics: its Prometheus endpoint, statsd.
    pub ratelimit_stats: RatelimitStatsSettings,
    /// OpenTelemetry traces of decisions; `None`: off.
    pub traces: Option<TraceSettings>,
}

/// The TLS flags of both servers: none given is plain text.
#[derive(Debug, Clone, Default)]
pub struct TlsFlags {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// Mutual TLS: the CA client certificates must chain to.
    pub client_ca: Option<PathBuf>,
    /// The name (DNS or IP subject alternative name) client certificates
    /// must carry.
    pub client_san: Option<String>,
    /// TLS on the HTTP port too (with a certificate); off, it stays plain.
    pub http: bool,
}

/// Rules over xDS (`--config-xds-server` and its flags).
#[derive(Debug, Clone)]
pub struct XdsFlags {
    pub settings: XdsSettings,
    /// Serve before the first config arrives (`--config-xds-force-start`):
    /// requests are answered through `--failure-mode` until it does, and
    /// health reports SERVING. Without it, nothing is served until then.
    pub force_start: bool,
}

/// The Redis flags; without a URL the in-memory backend is used.
pub struct RedisFlags {
    pub url: Option<String>,
    pub pool_size: u32,
    pub timeout_ms: u64,
    pub key_prefix: String,
    pub expiry_grace_ms: u64,
    /// `--redis-batch` and its bounds; `None`: one call per request.
    pub batch: Option<BatchSettings>,
    pub clock: ClockSource,
    /// The service's hash tag in every key (`--redis-hash-tag`).
    pub hash_tag: HashTag,
    /// Redis Cluster seed nodes; exclusive with `url` and Sentinel.
    pub cluster_nodes: Vec<String>,
    /// Sentinel: the master is found through these nodes; `url`, if given,
    /// only says how to reach it (TLS, user, password, db).
    pub sentinel_nodes: Vec<String>,
    pub sentinel_master: Option<String>,
    pub sentinel_password: Option<String>,
    /// CA, client certificate, verification: with `rediss://` only.
    pub tls: RedisTls,
}

/// What one client may hold of either server. The connection caps not
/// given follow from the descriptor limit; the caps given replace the
/// `max_connections` of `grpc` and `http`.
pub struct ServerLimits {
    pub grpc_max_connections: Option<usize>,
    pub http_max_connections: Option<usize>,
    pub grpc: GrpcLimits,
    pub http: HttpLimits,
}

/// envoyproxy/ratelimit's statistics, beside our own `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct RatelimitStatsSettings {
    /// Its Prometheus endpoint; `None`: off.
    pub prometheus: Option<RatelimitPrometheus>,
    /// Its statsd lines; `None`: off.
    pub statsd: Option<StatsdSettings>,
}

/// Where envoyproxy/ratelimit's Prometheus endpoint is served.
#[derive(Debug, Clone)]
pub struct RatelimitPrometheus {
    pub addr: SocketAddr,
    pub path: String,
    /// A statsd_exporter mapping file; `None`: Envoy Gateway's mapping.
    pub mapping: Option<PathBuf>,
}
