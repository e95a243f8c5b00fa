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
use throttlegate::app::{self, Limits, RedisFlags, Settings, TlsFlags};
use throttlegate::backends::keys::HashTag;
use throttlegate::backends::memory::DEFAULT_MAX_COUNTERS;
use throttlegate::backends::redis::{BatchSettings, ClockSource, RedisTls};
use throttlegate::clock::SystemClock;
use throttlegate::compat::{self, FlagValue};
use throttlegate::config::{self, LoadOptions};
use throttlegate::decision::{DEFAULT_OVER_LIMIT_CACHE, FailureMode, HeaderNames, NearLimitRatio};
use throttlegate::simulate;
use throttlegate::transport::grpc::GrpcLimits;
use throttlegate::transport::http::HttpLimits;

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
        Some(Command::Serve(args)) => serve(*args, log_filter, &warnings, &refusals),
        None => serve(cli.serve, log_filter, &warnings, &refusals),
    }
}

fn serve(
    args: ServeArgs,
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
    let mut settings = settings(args);
    settings.log_filter = log_filter;
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
    }
}

fn limits(args: &LimitArgs) -> Limits {
    Limits {
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
            Some(Command::CheckConfig(_) | Command::Simulate(_) | Command::PrintLua(_)) => {
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

    #[test]
    fn without_their_variables_our_defaults_stand() {
        let args = serve_args(&[], &["throttlegate"]);
        assert_eq!(args.grpc_addr.to_string(), "0.0.0.0:8081");
        assert_eq!(args.redis_key_prefix, "throttlegate");
        assert!(!args.shadow_mode);
    }
}
