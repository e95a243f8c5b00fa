//! The `throttlegate` binary: its flags (and their environment variables),
//! parsed into [`app::Settings`] for [`app::run`]; `check-config` loads and
//! summarises a config. envoyproxy/ratelimit's environment variables
//! ([`compat`]) become flag defaults, below our flags and variables.

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Arg, Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use throttlegate::algorithms::Algorithm;
use throttlegate::app::{
    self, RatelimitPrometheus, RatelimitStatsSettings, RedisFlags, ServerLimits, Settings,
    TlsFlags, XdsFlags,
};
use throttlegate::backends::keys::HashTag;
use throttlegate::backends::memory::DEFAULT_MAX_COUNTERS;
use throttlegate::backends::redis::{BatchSettings, ClockSource, RedisTls};
use throttlegate::clock::SystemClock;
use throttlegate::compat::{self, FlagValue};
use throttlegate::config::{self, LoadOptions};
use throttlegate::decision::{DEFAULT_OVER_LIMIT_CACHE, FailureMode, HeaderNames, NearLimitRatio};
use throttlegate::metrics::statsd::{StatsdProtocol, StatsdSettings, TagFormat};
use throttlegate::simulate;
use throttlegate::traces::{OtlpProtocol, TraceSettings};
use throttlegate::transport::grpc::GrpcLimits;
use throttlegate::transport::grpc::client;
use throttlegate::transport::http::HttpLimits;
use throttlegate::xds::{XdsServerAddress, XdsSettings, XdsTls};

// No `Debug` on `Cli`, `Command` or `ServeArgs`: they hold Redis URLs and
// passwords, and nothing may print them whole.

/// Rate-limit decision service for Envoy's global rate-limit filter.
#[derive(Parser)]
#[command(
    name = "throttlegate",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `serve` is the default: its flags are accepted without the subcommand.
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve gRPC (the default).
    Serve(Box<ServeArgs>),
    /// Load and validate a config file or directory, print a summary.
    CheckConfig(CheckConfigArgs),
    /// Replay a traffic pattern through one rule with each algorithm (on the
    /// memory backend and a simulated clock); print the counts, draw an SVG.
    Simulate(SimulateArgs),
    /// Print the Lua the Redis backend sends (for measuring it by hand).
    #[command(hide = true)]
    PrintLua(PrintLuaArgs),
    /// Ask a running service over gRPC (one ShouldRateLimit call) and print
    /// its answer as JSON. Exit code 0: OK; 3: OVER_LIMIT; 1: no answer
    /// (connection, TLS or RPC error); 2: bad arguments.
    Check(CheckArgs),
}

// === `check` ===

#[derive(Debug, Args)]
struct CheckArgs {
    /// The service's gRPC address: `host:port`, or `http://host:port`, or
    /// `https://host:port` (TLS).
    #[arg(long, default_value = "localhost:8081")]
    addr: String,
    /// The request's domain.
    #[arg(long)]
    domain: String,
    /// One descriptor, `key=value[,key=value...]`, entries outermost first;
    /// repeat for more descriptors. Inside a key or value write a comma as
    /// `\,`, an equals sign as `\=`, a backslash as `\\` (a value may
    /// also hold `=` unescaped: an entry splits at its first).
    #[arg(long = "descriptor", value_name = "KEY=VALUE[,...]", required = true, value_parser = parse_descriptor)]
    descriptors: Vec<DescriptorArg>,
    /// Units the request costs (its `hits_addend`).
    #[arg(long, default_value_t = 1)]
    hits: u32,
    /// TLS (implied by an `https://` address or any of the flags below).
    #[arg(long)]
    tls: bool,
    /// Trust the CA certificates in this PEM file [default: the public web
    /// roots].
    #[arg(long, value_name = "FILE")]
    ca_cert: Option<PathBuf>,
    /// Mutual TLS: this client certificate chain (PEM); needs --key.
    #[arg(long, value_name = "FILE", requires = "key")]
    cert: Option<PathBuf>,
    /// The private key of --cert (PEM).
    #[arg(long, value_name = "FILE", requires = "cert")]
    key: Option<PathBuf>,
    /// The name the server's certificate must be valid for [default: the
    /// address's host].
    #[arg(long, value_name = "NAME")]
    server_name: Option<String>,
    /// Bound on connecting and answering together.
    #[arg(long, default_value_t = 5_000)]
    timeout_ms: u64,
}

/// One `--descriptor`'s entries.
#[derive(Debug, Clone)]
struct DescriptorArg(Vec<(String, String)>);

fn parse_descriptor(text: &str) -> Result<DescriptorArg, String> {
    client::parse_descriptor(text).map(DescriptorArg)
}

/// `check`: the answer on stdout; see [`Command::Check`] for exit codes.
fn check(args: CheckArgs) -> ExitCode {
    let tls_flags =
        args.tls || args.ca_cert.is_some() || args.cert.is_some() || args.server_name.is_some();
    let call = client::Call {
        addr: args.addr,
        tls: tls_flags.then_some(client::ClientTls {
            ca: args.ca_cert,
            cert: args.cert,
            key: args.key,
            server_name: args.server_name,
        }),
        domain: args.domain,
        descriptors: args.descriptors.into_iter().map(|it| it.0).collect(),
        hits: args.hits,
        timeout: Duration::from_millis(args.timeout_ms),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(it) => it,
        Err(err) => {
            eprintln!("error: cannot start a runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(client::check(&call)) {
        Ok(answer) => {
            println!("{}", answer.json);
            if answer.over_limit {
                ExitCode::from(3)
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Debug, Args)]
struct PrintLuaArgs {
    /// Which text to print.
    #[arg(value_enum)]
    what: LuaText,
}

/// What `print-lua` prints.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LuaText {
    /// The function library's source (FUNCTION LOAD), and nothing else.
    Library,
    /// The library's name and its functions' names, one a line (decide,
    /// decide_batch, refund).
    Names,
    /// The EVALSHA script deciding one request.
    Decide,
    /// The EVALSHA script deciding a batch.
    DecideBatch,
    /// The EVALSHA script of a refund.
    Refund,
}

#[derive(Debug, Args)]
struct SimulateArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files.
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    config_options: ConfigArgs,
    /// The request's domain.
    #[arg(long)]
    domain: String,
    /// One entry of the request's descriptor, `key=value`; repeat for
    /// nested entries, outermost first.
    #[arg(long = "descriptor", value_name = "KEY=VALUE", required = true)]
    descriptors: Vec<String>,
    /// burst: 2x the limit within the first fiftieth of a window, then 2x in
    /// the fiftieth before and 2x in the fiftieth after the window boundary
    /// nearest the middle of the run.
    /// steady: 1.5x the limit, evenly spaced. ramp: a rate rising from 0 to
    /// 3x the limit over the run. trace FILE: one request per line, `<offset
    /// ms> [cost]`. Scaled to the rule's first limit.
    #[arg(long, num_args = 1..=2, value_names = ["NAME", "FILE"], default_value = "burst")]
    pattern: Vec<String>,
    /// Length of the run in seconds [default: four windows; a trace: up to
    /// its last request, rounded up to a window].
    #[arg(long, value_name = "SECONDS")]
    duration: Option<String>,
    /// Only the rule's own algorithm, instead of one lane per algorithm.
    #[arg(long)]
    only_configured: bool,
    /// Where to write the picture (SVG), one lane per algorithm.
    #[arg(long, value_name = "OUT")]
    svg: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct ConfigArgs {
    /// Merge files naming the same domain instead of refusing them.
    #[arg(long, env = "THROTTLEGATE_MERGE_DOMAINS")]
    merge_domains: bool,
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

#[derive(Debug, Args)]
struct CheckConfigArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files.
    path: PathBuf,
    #[command(flatten)]
    config: ConfigArgs,
}

#[derive(Args)]
struct ServeArgs {
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

/// Rules from a management server over xDS instead of files.
#[derive(Debug, Default, Args)]
struct XdsArgs {
    /// Take the rules from this xDS management server (`host:port`), over
    /// its aggregated discovery stream (state of the world), as
    /// `ratelimit.config.ratelimit.v3.RateLimitConfig` resources, one per
    /// domain; excludes --config.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_SERVER", value_name = "HOST:PORT", value_parser = XdsServerAddress::parse)]
    config_xds_server: Option<XdsServerAddress>,
    /// The node id the xDS server picks the resources by.
    #[arg(
        long,
        env = "THROTTLEGATE_CONFIG_XDS_NODE_ID",
        default_value = "default"
    )]
    config_xds_node_id: String,
    /// Node metadata sent to the xDS server, `key=value` (repeat, or
    /// comma-separated).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_NODE_METADATA", value_name = "KEY=VALUE", value_delimiter = ',', value_parser = parse_key_value)]
    config_xds_node_metadata: Vec<(String, String)>,
    /// Serve before the xDS server's first config arrives: until it does,
    /// every request is answered through --failure-mode and health reports
    /// SERVING. Without it nothing is served until then.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_FORCE_START")]
    config_xds_force_start: bool,
    /// The first wait before reconnecting to the xDS server after a failed
    /// connection or stream; doubled after each failure, up to 60 s.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_RETRY_INTERVAL_MS", default_value_t = 3_000, value_parser = clap::value_parser!(u64).range(1..))]
    config_xds_retry_interval_ms: u64,
    /// TLS to the xDS server (checked against --config-xds-tls-ca, or the
    /// built-in web roots).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS")]
    config_xds_tls: bool,
    /// With --config-xds-tls: the CA certificates (PEM) the xDS server's
    /// certificate must chain to.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_CA", value_name = "FILE")]
    config_xds_tls_ca: Option<PathBuf>,
    /// With --config-xds-tls: present this client certificate (PEM chain)
    /// to the xDS server (mutual TLS); needs --config-xds-tls-key.
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_CERT", value_name = "FILE")]
    config_xds_tls_cert: Option<PathBuf>,
    /// The private key of --config-xds-tls-cert (PEM).
    #[arg(long, env = "THROTTLEGATE_CONFIG_XDS_TLS_KEY", value_name = "FILE")]
    config_xds_tls_key: Option<PathBuf>,
    /// With --config-xds-tls: the name the xDS server's certificate must be
    /// valid for (and the TLS server name sent) [default: the server's host].
    #[arg(
        long,
        env = "THROTTLEGATE_CONFIG_XDS_TLS_SERVER_NAME",
        value_name = "NAME"
    )]
    config_xds_tls_server_name: Option<String>,
}

fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("'{text}' is not key=value")),
    }
}

/// The xDS flags as `app` takes them; `None` without a server. TLS files
/// given without --config-xds-tls are refused (they would be ignored).
fn xds_flags(args: XdsArgs) -> Result<Option<XdsFlags>, String> {
    let tls_given = args.config_xds_tls_ca.is_some()
        || args.config_xds_tls_cert.is_some()
        || args.config_xds_tls_key.is_some()
        || args.config_xds_tls_server_name.is_some();
    let Some(server) = args.config_xds_server else {
        if tls_given || args.config_xds_tls || args.config_xds_force_start {
            return Err("the --config-xds-* flags need --config-xds-server".to_owned());
        }
        return Ok(None);
    };
    if tls_given && !args.config_xds_tls {
        return Err(
            "--config-xds-tls-* need --config-xds-tls: without it the xDS server is reached in plain text"
                .to_owned(),
        );
    }
    let tls = args.config_xds_tls.then_some(XdsTls {
        ca: args.config_xds_tls_ca,
        cert: args.config_xds_tls_cert,
        key: args.config_xds_tls_key,
        server_name: args.config_xds_tls_server_name,
    });
    Ok(Some(XdsFlags {
        settings: XdsSettings {
            server,
            node_id: args.config_xds_node_id,
            node_metadata: args.config_xds_node_metadata,
            tls,
            retry_interval: Duration::from_millis(args.config_xds_retry_interval_ms),
        },
        force_start: args.config_xds_force_start,
    }))
}

// === traces ===

/// OpenTelemetry traces of decisions (envoyproxy/ratelimit's TRACING_*
/// variables and OTEL_EXPORTER_OTLP_ENDPOINT become their defaults).
#[derive(Debug, Args)]
struct TraceArgs {
    /// Trace ShouldRateLimit decisions over OTLP: a span per decision (its
    /// domain and verdict) with the backend call as its child, continuing
    /// the caller's trace (W3C traceparent, or B3).
    #[arg(long, env = "THROTTLEGATE_TRACING", value_enum, default_value_t = Switch::Off)]
    tracing: Switch,
    /// The OTLP collector, `http://host:port`; over HTTP spans go to its
    /// /v1/traces [default: http://localhost:4318, with --tracing-protocol
    /// grpc http://localhost:4317].
    #[arg(long, env = "THROTTLEGATE_TRACING_ENDPOINT", value_name = "URL")]
    tracing_endpoint: Option<String>,
    /// OTLP over HTTP (protobuf) or over gRPC.
    #[arg(long, env = "THROTTLEGATE_TRACING_PROTOCOL", value_enum, default_value_t = TraceProtocolArg::Http)]
    tracing_protocol: TraceProtocolArg,
    /// Share of the traces started here that are sampled, from 0 to 1; a
    /// caller's own sampling decision (traceparent or B3) is followed.
    #[arg(
        long,
        env = "THROTTLEGATE_TRACING_SAMPLING_RATE",
        default_value = "1",
        value_parser = parse_sampling_rate
    )]
    tracing_sampling_rate: f64,
    /// The `service.name` of the spans.
    #[arg(
        long,
        env = "THROTTLEGATE_TRACING_SERVICE_NAME",
        default_value = "throttlegate"
    )]
    tracing_service_name: String,
    /// The `service.namespace` of the spans [default: none].
    #[arg(long, env = "THROTTLEGATE_TRACING_SERVICE_NAMESPACE")]
    tracing_service_namespace: Option<String>,
    /// The `service.instance.id` of the spans [default: a random UUID].
    #[arg(long, env = "THROTTLEGATE_TRACING_SERVICE_INSTANCE_ID")]
    tracing_service_instance_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TraceProtocolArg {
    Http,
    Grpc,
}

fn parse_sampling_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("'{text}' is not a number from 0 to 1")),
    }
}

/// The `--tracing*` flags as [`app::Settings`] takes them; `None`: off.
fn trace_settings(args: TraceArgs) -> Option<TraceSettings> {
    if args.tracing == Switch::Off {
        return None;
    }
    let (protocol, default_endpoint) = match args.tracing_protocol {
        TraceProtocolArg::Http => (OtlpProtocol::Http, "http://localhost:4318"),
        TraceProtocolArg::Grpc => (OtlpProtocol::Grpc, "http://localhost:4317"),
    };
    Some(TraceSettings {
        endpoint: args
            .tracing_endpoint
            .unwrap_or_else(|| default_endpoint.to_owned()),
        protocol,
        sampling_rate: args.tracing_sampling_rate,
        service_name: args.tracing_service_name,
        service_namespace: args.tracing_service_namespace,
        service_instance_id: args.tracing_service_instance_id,
    })
}

/// What one client may hold of the servers.
#[derive(Debug, Args)]
struct LimitArgs {
    /// Most gRPC connections open at once [default: from the descriptor
    /// limit, see docs/configuration.md].
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    grpc_max_connections: Option<u32>,
    /// Streams one gRPC connection may have open (advertised as
    /// SETTINGS_MAX_CONCURRENT_STREAMS; more are refused).
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    grpc_max_concurrent_streams: u32,
    /// A gRPC connection that has not sent the HTTP/2 preface and one
    /// complete request's headers within this time is closed.
    #[arg(long, env = "THROTTLEGATE_GRPC_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_handshake_timeout_ms: u64,
    /// An HTTP/2 PING is sent to a gRPC peer silent for this long.
    #[arg(long, env = "THROTTLEGATE_GRPC_KEEPALIVE_INTERVAL_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_keepalive_interval_ms: u64,
    /// A gRPC connection whose PING is not acknowledged within this is closed.
    #[arg(long, env = "THROTTLEGATE_GRPC_KEEPALIVE_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_keepalive_timeout_ms: u64,
    /// A gRPC connection older than this gets GOAWAY (clients reconnect;
    /// running requests finish).
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONNECTION_AGE_MS", default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_max_connection_age_ms: u64,
    /// How long after its GOAWAY a gRPC connection with streams still open
    /// is closed.
    #[arg(
        long,
        env = "THROTTLEGATE_GRPC_MAX_CONNECTION_AGE_GRACE_MS",
        default_value_t = 30_000
    )]
    grpc_max_connection_age_grace_ms: u64,
    /// A gRPC request not answered within this (its body included) is ended
    /// with CANCELLED.
    #[arg(long, env = "THROTTLEGATE_GRPC_REQUEST_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_request_timeout_ms: u64,
    /// Threads serving gRPC connections, each with its own single-threaded
    /// runtime; connections are dealt to them in turn and stay on theirs. 0
    /// serves them on the shared runtime with everything else.
    #[arg(long, env = "THROTTLEGATE_GRPC_THREADS", default_value_t = 0)]
    grpc_threads: u16,
    /// Most HTTP connections open at once [default: from the descriptor
    /// limit, see docs/configuration.md].
    #[arg(long, env = "THROTTLEGATE_HTTP_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    http_max_connections: Option<u32>,
    /// An HTTP request head must arrive whole within this of its first
    /// byte (of the accept, for a connection's first request).
    #[arg(long, env = "THROTTLEGATE_HTTP_HEADER_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_header_timeout_ms: u64,
    /// An HTTP request body must arrive whole within this of its head.
    #[arg(long, env = "THROTTLEGATE_HTTP_BODY_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_body_timeout_ms: u64,
    /// An HTTP keep-alive connection is closed after this long without a
    /// request.
    #[arg(long, env = "THROTTLEGATE_HTTP_IDLE_TIMEOUT_MS", default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_idle_timeout_ms: u64,
}

// === envoyproxy/ratelimit's statistics ===

/// envoyproxy/ratelimit's statistics, under its names, beside our own
/// `/metrics` (which stays as it is).
#[derive(Debug, Args)]
struct RatelimitStatsArgs {
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

fn ratelimit_stats_settings(args: RatelimitStatsArgs) -> RatelimitStatsSettings {
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

fn parse_algorithm(name: &str) -> Result<Algorithm, String> {
    Algorithm::from_name(name).ok_or_else(|| {
        let known: Vec<&str> = Algorithm::ALL.iter().map(|it| it.name()).collect();
        format!(
            "unknown algorithm '{name}', expected one of {}",
            known.join(", ")
        )
    })
}

/// mimalloc instead of the system allocator: a decision allocates and frees
/// many small buffers across the runtime's threads, where glibc's malloc
/// spends measurable time consolidating and moving chunks between arenas
/// (with everything else equal, the system allocator cost 5–26% more CPU
/// per decision).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let vars: HashMap<String, String> = std::env::vars_os()
        .filter_map(|(key, value)| Some((key.into_string().ok()?, value.into_string().ok()?)))
        .collect();
    let args: Vec<OsString> = std::env::args_os().collect();
    let (flags, mut warnings) = compat_flags(&vars, &args);
    let log_filter = log_level_filter(&vars).unwrap_or_else(|warning| {
        warnings.push(warning);
        None
    });
    let takes_redis_url = vars.get("REDIS_URL").is_some_and(|it| !it.contains("://"));
    let matches = with_defaults(Cli::command(), &flags, takes_redis_url).get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    let refusals = compat::refusals(&vars);
    match cli.command {
        Some(Command::CheckConfig(args)) => check_config(&args),
        Some(Command::Simulate(args)) => simulate(args),
        Some(Command::PrintLua(args)) => print_lua(&args),
        Some(Command::Check(args)) => check(args),
        Some(Command::Serve(args)) => serve(*args, log_filter, &warnings, &refusals),
        None => serve(cli.serve, log_filter, &warnings, &refusals),
    }
}

fn serve(
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

/// Flags whose presence on the command line says where Redis is: then
/// envoyproxy/ratelimit's `REDIS_URL` is not translated.
const REDIS_TARGET_FLAGS: &[&str] = &[
    "redis-url",
    "redis-cluster-nodes",
    "redis-sentinel-nodes",
    "redis-sentinel-master",
];

/// [`compat::from_envoyproxy_env`], less the Redis target when the
/// command line names one.
fn compat_flags(
    vars: &HashMap<String, String>,
    args: &[OsString],
) -> (Vec<FlagValue>, Vec<String>) {
    let (mut flags, warnings) = compat::from_envoyproxy_env(vars);
    let named_on_command_line = |flag: &str| {
        let long = format!("--{flag}");
        args.iter().filter_map(|it| it.to_str()).any(|it| {
            it == long
                || it
                    .strip_prefix(long.as_str())
                    .is_some_and(|rest| rest.starts_with('='))
        })
    };
    if REDIS_TARGET_FLAGS
        .iter()
        .any(|it| named_on_command_line(it))
    {
        flags.retain(|(flag, _)| !REDIS_TARGET_FLAGS.contains(flag));
    }
    (flags, warnings)
}

/// envoyproxy/ratelimit's `LOG_LEVEL` as the log filter used when
/// `RUST_LOG` is not set, or a warning when the level is unknown.
fn log_level_filter(vars: &HashMap<String, String>) -> Result<Option<String>, String> {
    let Some(level) = vars.get("LOG_LEVEL") else {
        return Ok(None);
    };
    if vars.contains_key("RUST_LOG") {
        return Ok(None);
    }
    match compat::log_filter(level) {
        Some(filter) => Ok(Some(filter.to_owned())),
        None => Err(format!(
            "LOG_LEVEL={level} is not a log level; RUST_LOG applies"
        )),
    }
}

/// `command` with `flags` as the defaults of its `serve` flags (both at the
/// top level and under `serve`), so that a flag given or one of our
/// variables still wins. With `takes_redis_url`, `REDIS_URL` is not read
/// as `--redis-url`: it is envoyproxy/ratelimit's, translated in `flags`.
fn with_defaults(
    mut command: clap::Command,
    flags: &[FlagValue],
    takes_redis_url: bool,
) -> clap::Command {
    let mut grouped: Vec<(&str, Vec<&'static str>)> = Vec::new();
    for (flag, value) in flags {
        // Leaked once at start-up: clap keeps defaults as 'static strings.
        let value: &'static str = Box::leak(value.clone().into_boxed_str());
        match grouped.iter_mut().find(|(it, _)| it == flag) {
            Some((_, values)) => values.push(value),
            None => grouped.push((flag, vec![value])),
        }
    }
    if takes_redis_url && !grouped.iter().any(|(flag, _)| *flag == "redis-url") {
        grouped.push(("redis-url", Vec::new()));
    }
    for (flag, values) in grouped {
        let id = flag.replace('-', "_");
        let change = |arg: Arg| {
            let arg = if values.is_empty() {
                arg
            } else {
                arg.default_values(values.clone())
            };
            if takes_redis_url && flag == "redis-url" {
                arg.env(None)
            } else {
                arg
            }
        };
        command = command
            .mut_arg(&id, change)
            .mut_subcommand("serve", |serve| serve.mut_arg(&id, change));
    }
    command
}

fn load_options(args: &ConfigArgs) -> LoadOptions {
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

fn print_lua(args: &PrintLuaArgs) -> ExitCode {
    use throttlegate::backends::redis::script;
    let library = script::library();
    match args.what {
        LuaText::Library => print!("{}", library.source),
        LuaText::Names => println!(
            "{}\n{}\n{}\n{}",
            library.name, library.decide, library.decide_batch, library.refund
        ),
        LuaText::Decide => print!("{}", script::DECIDE_LUA),
        LuaText::DecideBatch => print!("{}", script::DECIDE_BATCH_LUA),
        LuaText::Refund => print!("{}", script::REFUND_LUA),
    }
    ExitCode::SUCCESS
}

fn check_config(args: &CheckConfigArgs) -> ExitCode {
    match config::load(&args.path, &load_options(&args.config)) {
        Ok(loaded) => {
            for warning in &loaded.warnings {
                eprintln!("warning: {warning}");
            }
            print!("{}", config::summary(&loaded.rules));
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("{err:#}");
            ExitCode::FAILURE
        }
    }
}

/// `simulate`: the summary on stdout, the picture in `--svg`; exit code 2
/// when nothing could be simulated.
fn simulate(args: SimulateArgs) -> ExitCode {
    let options = simulate::Options {
        load: load_options(&args.config_options),
        config: args.config,
        domain: args.domain,
        descriptor: args.descriptors,
        pattern: args.pattern,
        duration: args.duration,
        only_configured: args.only_configured,
    };
    let written = simulate::run(&options).and_then(|report| {
        for warning in &report.warnings {
            eprintln!("warning: {warning}");
        }
        if let Some(path) = &args.svg {
            simulate::write_svg(&report, path)?;
        }
        print!("{report}");
        Ok(())
    });
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(2)
        }
    }
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
        limits: limits(&args.limits),
        json_logs: args.log_format == LogFormat::Json,
        log_filter: None,
        ratelimit_stats: ratelimit_stats_settings(args.ratelimit_stats),
        traces: trace_settings(args.traces),
    }
}

fn limits(args: &LimitArgs) -> ServerLimits {
    ServerLimits {
        grpc_max_connections: args.grpc_max_connections.map(|it| it as usize),
        http_max_connections: args.http_max_connections.map(|it| it as usize),
        grpc: GrpcLimits {
            max_concurrent_streams: args.grpc_max_concurrent_streams,
            handshake_timeout: Duration::from_millis(args.grpc_handshake_timeout_ms),
            keepalive_interval: Duration::from_millis(args.grpc_keepalive_interval_ms),
            keepalive_timeout: Duration::from_millis(args.grpc_keepalive_timeout_ms),
            max_connection_age: Duration::from_millis(args.grpc_max_connection_age_ms),
            max_connection_age_grace: Duration::from_millis(args.grpc_max_connection_age_grace_ms),
            request_timeout: Duration::from_millis(args.grpc_request_timeout_ms),
            threads: usize::from(args.grpc_threads),
            ..GrpcLimits::standard()
        },
        http: HttpLimits {
            header_timeout: Duration::from_millis(args.http_header_timeout_ms),
            body_timeout: Duration::from_millis(args.http_body_timeout_ms),
            idle_timeout: Duration::from_millis(args.http_idle_timeout_ms),
            ..HttpLimits::standard()
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn serve_args(pairs: &[(&str, &str)], argv: &[&str]) -> ServeArgs {
        let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
        let (flags, warnings) = compat_flags(&vars(pairs), &argv);
        assert!(warnings.is_empty(), "{warnings:?}");
        let matches = with_defaults(Cli::command(), &flags, true)
            .try_get_matches_from(argv)
            .expect("parses");
        let cli = Cli::from_arg_matches(&matches).expect("arguments");
        match cli.command {
            Some(Command::Serve(args)) => *args,
            None => cli.serve,
            Some(
                Command::CheckConfig(_)
                | Command::Simulate(_)
                | Command::PrintLua(_)
                | Command::Check(_),
            ) => {
                panic!("not serve")
            }
        }
    }

    /// Every flag the translation can name exists and takes its value,
    /// with or without the `serve` subcommand.
    #[test]
    fn translated_variables_become_serve_defaults() {
        let env = [
            ("REDIS_TYPE", "cluster"),
            ("REDIS_URL", "a:7000,b:7001"),
            ("REDIS_POOL_SIZE", "20"),
            ("GRPC_PORT", "9081"),
            ("HOST", "127.0.0.1"),
            ("LOG_FORMAT", "json"),
            ("SHADOW_MODE", "true"),
            ("MERGE_DOMAIN_CONFIG", "true"),
            ("CACHE_KEY_PREFIX", "rl_"),
            ("NEAR_LIMIT_RATIO", "0.5"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "false"),
            ("LIMIT_REMAINING_HEADER", "X-Left"),
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
            ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
            ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.pem"),
            ("GRPC_CLIENT_TLS_SAN", "envoy"),
            ("REDIS_TLS_CACERT", "/r/ca.pem"),
            ("REDIS_TLS_CLIENT_CERT", "/r/cert.pem"),
            ("REDIS_TLS_CLIENT_KEY", "/r/key.pem"),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
        ];
        for argv in [&["throttlegate"][..], &["throttlegate", "serve"]] {
            let args = serve_args(&env, argv);
            assert_eq!(args.redis_cluster_nodes, ["a:7000", "b:7001"]);
            assert_eq!(args.redis_url, None);
            assert_eq!(args.redis_pool_size, 20);
            assert_eq!(args.grpc_addr.to_string(), "0.0.0.0:9081");
            assert_eq!(args.http_addr.to_string(), "127.0.0.1:8080");
            assert_eq!(args.log_format, LogFormat::Json);
            assert!(args.shadow_mode);
            assert!(args.config_options.merge_domains);
            assert_eq!(args.redis_key_prefix, "rl_");
            assert_eq!(args.near_limit_ratio, NearLimitRatio::new(0.5).unwrap());
            assert_eq!(args.response_headers, Switch::Off);
            assert_eq!(args.remaining_header, "X-Left");
            assert_eq!(args.config, Some(PathBuf::from("/data/rl/config")));
            assert_eq!(args.tls_cert, Some(PathBuf::from("/tls/cert.pem")));
            assert_eq!(args.tls_key, Some(PathBuf::from("/tls/key.pem")));
            assert_eq!(args.tls_client_ca, Some(PathBuf::from("/tls/ca.pem")));
            assert_eq!(args.tls_client_san.as_deref(), Some("envoy"));
            assert_eq!(args.redis_tls_ca, Some(PathBuf::from("/r/ca.pem")));
            assert_eq!(args.redis_tls_cert, Some(PathBuf::from("/r/cert.pem")));
            assert_eq!(args.redis_tls_key, Some(PathBuf::from("/r/key.pem")));
            assert!(args.redis_tls_skip_hostname_verification);
            assert!(!args.redis_tls_insecure);
        }
    }

    /// Envoy Gateway's variables for rules over xDS become the xDS flags,
    /// and its runtime directory no config path.
    #[test]
    fn xds_variables_become_the_xds_settings() {
        let env = [
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "a=1,b=2"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ];
        let mut args = serve_args(&env, &["throttlegate"]);
        assert_eq!(args.config, None);
        let xds = xds_flags(std::mem::take(&mut args.xds))
            .unwrap()
            .expect("rules over xds");
        assert!(xds.force_start);
        let settings = xds.settings;
        assert_eq!(
            settings.server,
            XdsServerAddress::parse("envoy-gateway:18001").unwrap()
        );
        assert_eq!(settings.node_id, "envoy-ratelimit");
        assert_eq!(
            settings.node_metadata,
            [
                ("a".to_owned(), "1".to_owned()),
                ("b".to_owned(), "2".to_owned())
            ]
        );
        assert_eq!(settings.retry_interval, Duration::from_secs(3));
        assert_eq!(
            settings.tls,
            Some(XdsTls {
                ca: Some(PathBuf::from("/certs/ca.crt")),
                cert: Some(PathBuf::from("/certs/tls.crt")),
                key: Some(PathBuf::from("/certs/tls.key")),
                server_name: None,
            })
        );
        let plain = serve_args(&[], &["throttlegate"]);
        assert!(xds_flags(plain.xds).unwrap().is_none());
    }

    #[test]
    fn flags_on_the_command_line_win() {
        let args = serve_args(
            &[
                ("REDIS_URL", "r:6379"),
                ("GRPC_PORT", "9081"),
                ("REDIS_POOL_SIZE", "20"),
            ],
            &[
                "throttlegate",
                "--redis-cluster-nodes=a:1",
                "--grpc-addr",
                "127.0.0.1:7000",
            ],
        );
        assert_eq!(args.redis_url, None, "REDIS_URL yields to cluster nodes");
        assert_eq!(args.redis_cluster_nodes, ["a:1"]);
        assert_eq!(args.grpc_addr.to_string(), "127.0.0.1:7000");
        assert_eq!(args.redis_pool_size, 20);
    }

    /// envoyproxy/ratelimit's statistics variables reach the flags.
    #[test]
    fn statistics_variables_become_serve_defaults() {
        let args = serve_args(
            &[
                ("USE_PROMETHEUS", "true"),
                ("PROMETHEUS_ADDR", ":19001"),
                ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
                ("USE_STATSD", "true"),
                ("STATSD_HOST", "exporter"),
                ("STATSD_PORT", "9125"),
                ("EXTRA_TAGS", "env:prod,team:edge"),
                ("STATS_FLUSH_INTERVAL", "2s"),
            ],
            &["throttlegate"],
        );
        let settings = ratelimit_stats_settings(args.ratelimit_stats);
        let prometheus = settings.prometheus.expect("on");
        assert_eq!(prometheus.addr.to_string(), "0.0.0.0:19001");
        assert_eq!(prometheus.path, "/metrics");
        assert_eq!(
            prometheus.mapping,
            Some(PathBuf::from("/etc/statsd-exporter/conf.yaml"))
        );
        let statsd = settings.statsd.expect("on");
        assert_eq!(statsd.addr, "exporter:9125");
        assert_eq!(statsd.protocol, StatsdProtocol::Tcp);
        assert_eq!(statsd.flush_interval, Duration::from_secs(2));
        assert_eq!(
            statsd.tags,
            [
                ("env".to_owned(), "prod".to_owned()),
                ("team".to_owned(), "edge".to_owned())
            ]
        );
        assert_eq!(statsd.tag_format, TagFormat::Name);
        let args = serve_args(&[("USE_DOG_STATSD", "true")], &["throttlegate", "serve"]);
        let statsd = ratelimit_stats_settings(args.ratelimit_stats)
            .statsd
            .expect("on");
        assert_eq!(statsd.addr, "localhost:8125");
        assert_eq!(statsd.protocol, StatsdProtocol::Udp);
        assert_eq!(statsd.tag_format, TagFormat::DogStatsd);
    }

    /// Tracing is off unless asked for; their variables turn it on, and
    /// the endpoint's default follows the protocol.
    #[test]
    fn tracing_flags_and_variables_become_trace_settings() {
        assert_eq!(
            trace_settings(serve_args(&[], &["throttlegate"]).traces),
            None
        );
        let on = trace_settings(
            serve_args(
                &[
                    ("TRACING_ENABLED", "true"),
                    ("TRACING_EXPORTER_PROTOCOL", "grpc"),
                ],
                &["throttlegate"],
            )
            .traces,
        )
        .expect("tracing on");
        assert_eq!(on.endpoint, "http://localhost:4317");
        assert_eq!(on.protocol, OtlpProtocol::Grpc);
        assert_eq!(on.service_name, "RateLimit");
        assert_eq!(on.sampling_rate, 1.0);
        let http = trace_settings(
            serve_args(
                &[("TRACING_SAMPLING_RATE", "0.01")],
                &["throttlegate", "--tracing", "on"],
            )
            .traces,
        )
        .expect("tracing on");
        assert_eq!(http.endpoint, "http://localhost:4318");
        assert_eq!(http.service_name, "throttlegate");
        assert_eq!(http.sampling_rate, 0.01);
        assert!(parse_sampling_rate("1.5").is_err());
        assert!(parse_sampling_rate("-0.1").is_err());
    }

    #[test]
    fn without_their_variables_our_defaults_stand() {
        let args = serve_args(&[], &["throttlegate"]);
        assert_eq!(args.grpc_addr.to_string(), "0.0.0.0:8081");
        assert_eq!(args.redis_key_prefix, "throttlegate");
        assert!(!args.shadow_mode);
        let stats = ratelimit_stats_settings(args.ratelimit_stats);
        assert!(stats.prometheus.is_none() && stats.statsd.is_none());
    }
}
