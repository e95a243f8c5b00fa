//! `throttlegate serve` (the default subcommand): its flags, turned into
//! [`app::Settings`] for [`app::run`]. Each group of flags with its own
//! conversion lives in a submodule. Invariant: a flag's name, default and
//! variable are written once, on its field here or in a submodule.

mod limits;
mod ratelimit_stats;
mod traces;
mod xds;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};

use crate::app::{self, RedisFlags, Settings, TlsFlags};
use crate::backends::keys::HashTag;
use crate::backends::memory::DEFAULT_MAX_COUNTERS;
use crate::backends::redis::{BatchSettings, ClockSource, RedisTls};
use crate::clock::SystemClock;
use crate::decision::{DEFAULT_OVER_LIMIT_CACHE, FailureMode, HeaderNames, NearLimitRatio};

use self::limits::{LimitArgs, server_limits};
use self::ratelimit_stats::{RatelimitStatsArgs, ratelimit_stats_settings};
use self::traces::{TraceArgs, trace_settings};
use self::xds::{XdsArgs, xds_flags};
use super::config_options::{ConfigArgs, load_options};

/// The flags of `serve`.
#[derive(Args)]
pub(super) struct ServeArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files; without it
    /// every domain is unknown.
    #[arg(long, env = "THROTTLEGATE_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    config_options: ConfigArgs,
    /// Reload the config when its files change (SIGHUP reloads it either
    /// way).
    #[arg(long, env = "THROTTLEGATE_WATCH_CONFIG", value_enum, default_value_t = Switch::On)]
    watch_config: Switch,
    /// gRPC listen address.
    #[arg(long, env = "THROTTLEGATE_GRPC_ADDR", default_value = "0.0.0.0:8081")]
    grpc_addr: SocketAddr,
    /// HTTP listen address (health, debugging endpoints).
    #[arg(long, env = "THROTTLEGATE_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    http_addr: SocketAddr,
    /// Serve TLS with this certificate chain (PEM, leaf first) on the gRPC
    /// port, and on the HTTP port unless --http-tls off; needs --tls-key.
    /// Reloaded when the file changes.
    #[arg(long, env = "THROTTLEGATE_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "THROTTLEGATE_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: refuse clients without a certificate signed by a CA in
    /// this PEM file, at the handshake. Needs --tls-cert and --tls-key.
    #[arg(long, env = "THROTTLEGATE_TLS_CLIENT_CA", value_name = "FILE")]
    tls_client_ca: Option<PathBuf>,
    /// With --tls-client-ca: the client certificate must also be valid for
    /// this DNS name or IP address (one of its subject alternative names).
    #[arg(long, env = "THROTTLEGATE_TLS_CLIENT_SAN", value_name = "NAME")]
    tls_client_san: Option<String>,
    /// With --tls-cert: `off` keeps the HTTP port plain (health probes,
    /// metrics, /json) while gRPC is served over TLS, as envoyproxy/ratelimit
    /// does with GRPC_SERVER_USE_TLS.
    #[arg(long, env = "THROTTLEGATE_HTTP_TLS", value_enum, default_value_t = Switch::On)]
    http_tls: Switch,
    /// `redis://`, `rediss://` (TLS) or `redis+unix://`; without it (and
    /// without Sentinel) the in-memory backend is used and limits are per
    /// instance. With `--redis-sentinel-nodes` it is optional and gives
    /// only how to reach the master: `rediss://` for TLS, user, password and
    /// db (`redis://:secret@master/0`); its host and port are ignored.
    #[arg(long, env = "REDIS_URL")]
    redis_url: Option<String>,
    /// Most Redis connections kept open.
    #[arg(long, env = "THROTTLEGATE_REDIS_POOL_SIZE", default_value_t = 8)]
    redis_pool_size: u32,
    /// Bound on every Redis call; also how long an answer may take while
    /// Redis is down.
    #[arg(long, env = "THROTTLEGATE_REDIS_TIMEOUT_MS", default_value_t = 250)]
    redis_timeout_ms: u64,
    /// Prefix of every Redis key.
    #[arg(
        long,
        env = "THROTTLEGATE_REDIS_KEY_PREFIX",
        default_value = "throttlegate"
    )]
    redis_key_prefix: String,
    /// Added to the expiry of every Redis key, in ms. With `--clock local`,
    /// set it to the largest clock skew between replicas, so a replica
    /// whose clock lags never finds a key already expired.
    #[arg(long, env = "THROTTLEGATE_REDIS_EXPIRY_GRACE_MS", default_value_t = 0)]
    redis_expiry_grace_ms: u64,
    /// Coalesce concurrent decisions bound for one Redis into one call
    /// while earlier calls are in flight (one per pooled connection); an
    /// idle service still sends each request at once. Single server and
    /// Sentinel only: a Redis Cluster keeps one call per request and slot.
    #[arg(long, env = "THROTTLEGATE_REDIS_BATCH", value_enum, default_value_t = Switch::On)]
    redis_batch: Switch,
    /// Most requests in one batched Redis call.
    #[arg(
        long,
        env = "THROTTLEGATE_REDIS_BATCH_MAX_REQUESTS",
        default_value_t = 64
    )]
    redis_batch_max_requests: usize,
    /// Most keys in one batched Redis call (a request with more goes alone).
    #[arg(long, env = "THROTTLEGATE_REDIS_BATCH_MAX_KEYS", default_value_t = 512)]
    redis_batch_max_keys: usize,
    /// Redis Cluster seed nodes, `host:port,host:port,...` (any subset of
    /// the cluster; `redis://` or `rediss://` URLs with user:password too).
    /// Instead of --redis-url.
    #[arg(long, env = "THROTTLEGATE_REDIS_CLUSTER_NODES", value_delimiter = ',')]
    redis_cluster_nodes: Vec<String>,
    /// The service's own Redis Cluster hash tag in every key: `domain`
    /// puts a domain's counters in one slot (one script call per request),
    /// `descriptor` one descriptor's limits.
    #[arg(long, env = "THROTTLEGATE_REDIS_HASH_TAG", value_enum, default_value_t = HashTagArg::None)]
    redis_hash_tag: HashTagArg,
    /// Redis Sentinel nodes, `host:port,host:port,...`, asked in this order
    /// for the master's address whenever a connection is made, so a
    /// failover is followed without a restart. Needs
    /// `--redis-sentinel-master`; excludes `--redis-cluster-nodes`.
    #[arg(long, env = "THROTTLEGATE_REDIS_SENTINEL_NODES", value_delimiter = ',')]
    redis_sentinel_nodes: Vec<String>,
    /// The master name Sentinel watches.
    #[arg(long, env = "THROTTLEGATE_REDIS_SENTINEL_MASTER")]
    redis_sentinel_master: Option<String>,
    /// Password of the sentinels themselves (their `requirepass`); the
    /// master's password goes in `--redis-url`.
    #[arg(long, env = "THROTTLEGATE_REDIS_SENTINEL_PASSWORD")]
    redis_sentinel_password: Option<String>,
    /// TLS to Redis (`rediss://` only): trust the CA certificates in this
    /// PEM file instead of the built-in web roots.
    #[arg(long, env = "THROTTLEGATE_REDIS_TLS_CA", value_name = "FILE")]
    redis_tls_ca: Option<PathBuf>,
    /// TLS to Redis: present this client certificate (PEM chain) to servers
    /// that require one (`tls-auth-clients yes`); needs --redis-tls-key.
    #[arg(long, env = "THROTTLEGATE_REDIS_TLS_CERT", value_name = "FILE")]
    redis_tls_cert: Option<PathBuf>,
    /// The private key of --redis-tls-cert (PEM).
    #[arg(long, env = "THROTTLEGATE_REDIS_TLS_KEY", value_name = "FILE")]
    redis_tls_key: Option<PathBuf>,
    /// TLS to Redis without verifying the server's certificate at all
    /// (logged as a warning at start-up). Never for production.
    #[arg(long, env = "THROTTLEGATE_REDIS_TLS_INSECURE")]
    redis_tls_insecure: bool,
    /// TLS to Redis verifying the server's certificate chain but not the
    /// host name in it (logged as a warning at start-up).
    #[arg(long, env = "THROTTLEGATE_REDIS_TLS_SKIP_HOSTNAME_VERIFICATION")]
    redis_tls_skip_hostname_verification: bool,
    /// What to answer when the backend fails: `error` fails the RPC with
    /// UNAVAILABLE so Envoy's `failure_mode_deny` decides.
    #[arg(long, env = "THROTTLEGATE_FAILURE_MODE", value_enum, default_value_t = FailureArg::Error)]
    failure_mode: FailureArg,
    /// Whose time the Redis script uses; `redis` keeps replicas with
    /// skewed clocks in agreement.
    #[arg(long, env = "THROTTLEGATE_CLOCK", value_enum, default_value_t = ClockArg::Redis)]
    clock: ClockArg,
    /// Add RateLimit-* (and Retry-After) response headers.
    #[arg(long, env = "THROTTLEGATE_RESPONSE_HEADERS", value_enum, default_value_t = Switch::On)]
    response_headers: Switch,
    /// Name of the header carrying the limit.
    #[arg(
        long,
        env = "THROTTLEGATE_LIMIT_HEADER",
        default_value = "RateLimit-Limit"
    )]
    limit_header: String,
    /// Name of the header carrying the remaining quota.
    #[arg(
        long,
        env = "THROTTLEGATE_REMAINING_HEADER",
        default_value = "RateLimit-Remaining"
    )]
    remaining_header: String,
    /// Name of the header carrying the seconds until reset.
    #[arg(
        long,
        env = "THROTTLEGATE_RESET_HEADER",
        default_value = "RateLimit-Reset"
    )]
    reset_header: String,
    /// Name of the header carrying the seconds to wait when denied.
    #[arg(
        long,
        env = "THROTTLEGATE_RETRY_AFTER_HEADER",
        default_value = "Retry-After"
    )]
    retry_after_header: String,
    /// Evaluate and count as usual, but answer OK overall.
    #[arg(long, env = "THROTTLEGATE_SHADOW_MODE")]
    shadow_mode: bool,
    /// A decision counts as near its limit (the `near_limit` result in
    /// metrics) once more than this share of the limit is used: a number
    /// from 0 to 1, like envoyproxy/ratelimit's NEAR_LIMIT_RATIO.
    #[arg(
        long,
        env = "THROTTLEGATE_NEAR_LIMIT_RATIO",
        default_value = "0.8",
        value_parser = parse_near_limit_ratio
    )]
    near_limit_ratio: NearLimitRatio,
    /// With Redis: most counters remembered as full (no room until a time
    /// Redis gave), whose requests are answered OVER_LIMIT without a Redis
    /// call until then. Exact: nothing frees room earlier. 0 turns it off.
    #[arg(long, env = "THROTTLEGATE_OVER_LIMIT_CACHE", default_value_t = DEFAULT_OVER_LIMIT_CACHE)]
    over_limit_cache: usize,
    /// Log format; verbosity comes from RUST_LOG (default `info`).
    #[arg(long, env = "THROTTLEGATE_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Most counters the in-memory backend holds; a request needing a new
    /// one beyond it is answered under --failure-mode.
    #[arg(long, env = "THROTTLEGATE_MEMORY_MAX_COUNTERS", default_value_t = DEFAULT_MAX_COUNTERS)]
    memory_max_counters: usize,
    /// Most `rule` label values a rule with `detailed_metric` or
    /// `value_to_metric` creates; later values are counted under
    /// `<rule>:_overflow`.
    #[arg(
        long,
        env = "THROTTLEGATE_MAX_METRIC_VALUES_PER_RULE",
        default_value_t = 10_000
    )]
    max_metric_values_per_rule: usize,
    /// After SIGTERM/SIGINT, how long in-flight requests of both servers
    /// together may run once the listeners have closed.
    #[arg(long, env = "THROTTLEGATE_DRAIN_TIMEOUT_MS", default_value_t = 10_000)]
    drain_timeout_ms: u64,
    /// After SIGTERM/SIGINT, how long health reports NOT_SERVING while
    /// requests are still answered, before the listeners close (behind a
    /// Kubernetes Service: a few seconds more than the readiness probe
    /// period).
    #[arg(long, env = "THROTTLEGATE_SHUTDOWN_DELAY_MS", default_value_t = 0)]
    shutdown_delay_ms: u64,
    #[command(flatten)]
    limits: LimitArgs,
    #[command(flatten)]
    ratelimit_stats: RatelimitStatsArgs,
    #[command(flatten)]
    xds: XdsArgs,
    #[command(flatten)]
    traces: TraceArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum FailureArg {
    Error,
    Allow,
    Deny,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum HashTagArg {
    None,
    Domain,
    Descriptor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ClockArg {
    Redis,
    Local,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Switch {
    On,
    Off,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn parse_near_limit_ratio(text: &str) -> Result<NearLimitRatio, String> {
    let refused = || format!("'{text}' is not a number from 0 to 1");
    let ratio: f64 = text.trim().parse().map_err(|_| refused())?;
    NearLimitRatio::new(ratio).ok_or_else(refused)
}

/// `serve`: refuses what cannot be honoured, prints the warnings about
/// envoyproxy/ratelimit's variables, then runs [`app::run`].
pub(super) fn serve(
    mut args: ServeArgs,
    log_filter: Option<String>,
    warnings: &[String],
    refusals: &[String],
) -> ExitCode {
    // A security setting that cannot be honoured stops the start: serving
    // plain text where TLS was asked for would be worse than not serving.
    if !refusals.is_empty() {
        for refusal in refusals {
            eprintln!("error: {refusal}");
        }
        return ExitCode::from(2);
    }
    for warning in warnings {
        if args.log_format == LogFormat::Json {
            let line = serde_json::json!({
                "level": "WARN",
                "fields": { "message": warning },
                "target": "throttlegate::compat",
            });
            eprintln!("{line}");
        } else {
            eprintln!("warning: {warning}");
        }
    }
    let xds = match xds_flags(std::mem::take(&mut args.xds)) {
        Ok(it) => it,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(2);
        }
    };
    let mut settings = settings(args);
    settings.log_filter = log_filter;
    settings.xds = xds;
    app::run(settings)
}

/// The flags as [`app::run`] takes them.
fn settings(args: ServeArgs) -> Settings {
    let response_headers = (args.response_headers == Switch::On).then_some(HeaderNames {
        limit: args.limit_header,
        remaining: args.remaining_header,
        reset: args.reset_header,
        retry_after: args.retry_after_header,
    });
    Settings {
        config: args.config,
        load: load_options(&args.config_options),
        watch_config: args.watch_config == Switch::On,
        xds: None,
        grpc_addr: args.grpc_addr,
        http_addr: args.http_addr,
        tls: TlsFlags {
            cert: args.tls_cert,
            key: args.tls_key,
            client_ca: args.tls_client_ca,
            client_san: args.tls_client_san,
            http: args.http_tls == Switch::On,
        },
        redis: RedisFlags {
            url: args.redis_url,
            pool_size: args.redis_pool_size,
            timeout_ms: args.redis_timeout_ms,
            key_prefix: args.redis_key_prefix,
            expiry_grace_ms: args.redis_expiry_grace_ms,
            batch: (args.redis_batch == Switch::On).then_some(BatchSettings {
                max_requests: args.redis_batch_max_requests,
                max_keys: args.redis_batch_max_keys,
            }),
            clock: match args.clock {
                ClockArg::Redis => ClockSource::Redis,
                ClockArg::Local => ClockSource::Local(Arc::new(SystemClock)),
            },
            hash_tag: match args.redis_hash_tag {
                HashTagArg::None => HashTag::None,
                HashTagArg::Domain => HashTag::Domain,
                HashTagArg::Descriptor => HashTag::Descriptor,
            },
            cluster_nodes: args.redis_cluster_nodes,
            sentinel_nodes: args.redis_sentinel_nodes,
            sentinel_master: args.redis_sentinel_master,
            sentinel_password: args.redis_sentinel_password,
            tls: RedisTls {
                ca: args.redis_tls_ca,
                client_cert: args.redis_tls_cert,
                client_key: args.redis_tls_key,
                insecure: args.redis_tls_insecure,
                skip_hostname_verification: args.redis_tls_skip_hostname_verification,
            },
        },
        memory_max_counters: args.memory_max_counters,
        failure_mode: match args.failure_mode {
            FailureArg::Error => FailureMode::Error,
            FailureArg::Allow => FailureMode::Allow,
            FailureArg::Deny => FailureMode::Deny,
        },
        shadow_mode: args.shadow_mode,
        response_headers,
        max_metric_values_per_rule: args.max_metric_values_per_rule,
        near_limit_ratio: args.near_limit_ratio,
        over_limit_cache: args.over_limit_cache,
        drain_timeout: Duration::from_millis(args.drain_timeout_ms),
        shutdown_delay: Duration::from_millis(args.shutdown_delay_ms),
        limits: server_limits(&args.limits),
        json_logs: args.log_format == LogFormat::Json,
        log_filter: None,
        ratelimit_stats: ratelimit_stats_settings(args.ratelimit_stats),
        traces: trace_settings(args.traces),
    }
}

#[cfg(test)]
mod tests;
