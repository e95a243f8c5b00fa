//! The `throttlegate` binary: arguments, logging, start-up, signals, exit codes.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;
use tracing_subscriber::EnvFilter;

use throttlegate::algorithms::Algorithm;
use throttlegate::backends::Backend;
use throttlegate::backends::memory::{DEFAULT_MAX_COUNTERS, MemoryBackend};
use throttlegate::backends::redis::{ClockSource, RedisBackend, RedisSettings};
use throttlegate::clock::SystemClock;
use throttlegate::config::reload::{ReloadGuard, Reloader};
use throttlegate::config::{self, LoadOptions};
use throttlegate::decision::{FailureMode, HeaderNames, Limiter, Options};
use throttlegate::metrics::Metrics;
use throttlegate::rules::RuleSet;
use throttlegate::transport::grpc::{App, GrpcLimits, ShutdownControl};
use throttlegate::transport::http::HttpLimits;
use throttlegate::transport::listener::DescriptorBudget;

/// Exit code of a start-up failure (bad config, bad flags, unusable backend).
const EXIT_STARTUP: u8 = 2;

/// How often the memory backend reclaims idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Rate-limit decision service for Envoy's global rate-limit filter.
#[derive(Debug, Parser)]
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

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve gRPC (the default).
    Serve(Box<ServeArgs>),
    /// Load and validate a config file or directory, print a summary.
    CheckConfig(CheckConfigArgs),
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
}

#[derive(Debug, Args)]
struct CheckConfigArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files.
    path: PathBuf,
    #[command(flatten)]
    config: ConfigArgs,
}

#[derive(Debug, Args)]
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
    /// `redis://`, `rediss://` (TLS) or `redis+unix://`; without it the
    /// in-memory backend is used and limits are per instance.
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
    /// Redis Cluster seed nodes, `host:port,host:port,...`.
    #[arg(long, env = "THROTTLEGATE_REDIS_CLUSTER_NODES", value_delimiter = ',')]
    redis_cluster_nodes: Vec<String>,
    /// Redis Sentinel nodes, `host:port,host:port,...`.
    #[arg(long, env = "THROTTLEGATE_REDIS_SENTINEL_NODES", value_delimiter = ',')]
    redis_sentinel_nodes: Vec<String>,
    /// The master name Sentinel watches.
    #[arg(long, env = "THROTTLEGATE_REDIS_SENTINEL_MASTER")]
    redis_sentinel_master: Option<String>,
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
    /// limit, see README].
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
    /// Most HTTP connections open at once [default: from the descriptor
    /// limit, see README].
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
/// (see docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::CheckConfig(args)) => check_config(&args),
        Some(Command::Serve(args)) => run_serve(*args),
        None => run_serve(cli.serve),
    }
}

fn load_options(args: &ConfigArgs) -> LoadOptions {
    LoadOptions {
        merge_domains: args.merge_domains,
        default_algorithm: args.default_algorithm,
        max_log_entries: args.max_log_entries,
    }
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

fn run_serve(args: ServeArgs) -> ExitCode {
    init_logging(args.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(it) => it,
        Err(err) => {
            eprintln!("cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(serve(args));
    // Without waiting for blocking work: a config load still running (a
    // reload, or the start-up load after SIGTERM) must not hold the exit.
    runtime.shutdown_background();
    code
}

/// Descriptors kept free of client connections beyond the Redis pool:
/// standard streams, the listening sockets, the config watcher, the
/// runtime's own, and Redis reconnections.
const DESCRIPTOR_RESERVE: u64 = 128;

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logs both, and
/// returns the descriptor budget the connection caps come from.
fn descriptor_budget(redis_pool_size: u32) -> DescriptorBudget {
    let reserve = DESCRIPTOR_RESERVE + u64::from(redis_pool_size);
    let limit = match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok((soft, hard)) => match rlimit::increase_nofile_limit(hard) {
            Ok(raised) => {
                tracing::info!(
                    soft = raised,
                    hard,
                    previous_soft = soft,
                    "file descriptor limit"
                );
                raised
            }
            Err(err) => {
                tracing::warn!(soft, hard, "cannot raise the file descriptor limit: {err}");
                soft
            }
        },
        Err(err) => {
            tracing::warn!("cannot read the file descriptor limit, assuming 1024: {err}");
            1024
        }
    };
    DescriptorBudget { limit, reserve }
}

fn limits(args: &LimitArgs, budget: DescriptorBudget) -> (GrpcLimits, HttpLimits) {
    let (grpc_default, http_default) = budget.default_caps();
    let grpc_max_connections = args
        .grpc_max_connections
        .map_or(grpc_default, |it| it as usize);
    let http_max_connections = args
        .http_max_connections
        .map_or(http_default, |it| it as usize);
    let total = (grpc_max_connections + http_max_connections) as u64;
    if total > budget.limit.saturating_sub(budget.reserve) {
        tracing::warn!(
            grpc_max_connections,
            http_max_connections,
            descriptor_limit = budget.limit,
            reserve = budget.reserve,
            "the connection caps exceed the descriptor limit less its reserve: clients can exhaust descriptors"
        );
    }
    tracing::info!(
        grpc_max_connections,
        http_max_connections,
        "connection caps"
    );
    let grpc = GrpcLimits {
        max_connections: grpc_max_connections,
        max_concurrent_streams: args.grpc_max_concurrent_streams,
        handshake_timeout: Duration::from_millis(args.grpc_handshake_timeout_ms),
        keepalive_interval: Duration::from_millis(args.grpc_keepalive_interval_ms),
        keepalive_timeout: Duration::from_millis(args.grpc_keepalive_timeout_ms),
        max_connection_age: Duration::from_millis(args.grpc_max_connection_age_ms),
        max_connection_age_grace: Duration::from_millis(args.grpc_max_connection_age_grace_ms),
        request_timeout: Duration::from_millis(args.grpc_request_timeout_ms),
    };
    let http = HttpLimits {
        max_connections: http_max_connections,
        header_timeout: Duration::from_millis(args.http_header_timeout_ms),
        body_timeout: Duration::from_millis(args.http_body_timeout_ms),
        idle_timeout: Duration::from_millis(args.http_idle_timeout_ms),
    };
    (grpc, http)
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only on a terminal: a log file or journald gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Reports a start-up failure and returns exit code 2. Printed plainly
/// rather than logged: it must be readable whatever RUST_LOG says.
fn startup_failure(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("{message}");
    ExitCode::from(EXIT_STARTUP)
}

async fn serve(args: ServeArgs) -> ExitCode {
    // First of all, before the config load (which can take seconds): from
    // here a SIGHUP never ends the process (it reloads once we serve), and
    // SIGTERM or SIGINT ends the start-up at once.
    let hangups = listen_for(SignalKind::hangup(), "SIGHUP");
    let mut stop = StopSignals::install();
    let (grpc_limits, http_limits) = limits(&args.limits, descriptor_budget(args.redis_pool_size));
    let rules = match &args.config {
        Some(path) => match stop
            .or_stop(load_config(path, load_options(&args.config_options)))
            .await
        {
            Some(Ok(it)) => it,
            Some(Err(message)) => return startup_failure(message),
            None => return ExitCode::SUCCESS,
        },
        None => {
            tracing::warn!("no --config given: every domain is unknown and every request is OK");
            RuleSet::default()
        }
    };
    let rules = Arc::new(ArcSwap::from_pointee(rules));
    let metrics = Arc::new(Metrics::with_max_values_per_rule(
        args.max_metric_values_per_rule,
    ));
    // Right after the load: the reloader records the files as loaded.
    let reloader = args.config.as_ref().map(|path| {
        let reload_metrics = metrics.clone();
        Arc::new(
            Reloader::new(
                path.clone(),
                load_options(&args.config_options),
                rules.clone(),
            )
            .with_observer(move |ok| reload_metrics.record_reload(ok)),
        )
    });
    let _reloads = reload_triggers(reloader.as_ref(), args.watch_config, hangups);
    let headers = match response_headers(&args) {
        Ok(it) => it,
        Err(message) => return startup_failure(message),
    };

    // Keeps the memory backend's sweeper running for as long as we serve.
    let mut _sweeper = None;
    let backend: Arc<dyn Backend> = match redis_settings(&args) {
        Err(message) => return startup_failure(message),
        Ok(Some(settings)) => match stop.or_stop(RedisBackend::connect(settings)).await {
            Some(Ok(it)) => Arc::new(it),
            Some(Err(err)) => return startup_failure(format!("redis: {err}")),
            None => return ExitCode::SUCCESS,
        },
        Ok(None) => {
            tracing::warn!("no --redis-url: using the in-memory backend, limits are per instance");
            let memory = Arc::new(
                MemoryBackend::new(Arc::new(SystemClock))
                    .with_max_counters(args.memory_max_counters),
            );
            _sweeper = Some(memory.spawn_sweeper(SWEEP_EVERY));
            // Weak: the gauge must not keep the counters alive.
            let weak = Arc::downgrade(&memory);
            metrics.observe_stored_counters(move || {
                weak.upgrade().map_or(0, |it| {
                    u64::try_from(it.stored_entries()).unwrap_or(u64::MAX)
                })
            });
            memory
        }
    };

    let options = Options {
        shadow_mode: args.shadow_mode,
        response_headers: headers,
        failure_mode: match args.failure_mode {
            FailureArg::Error => FailureMode::Error,
            FailureArg::Allow => FailureMode::Allow,
            FailureArg::Deny => FailureMode::Deny,
        },
        near_limit_ratio: Default::default(),
    };
    let limiter = Arc::new(Limiter::new(rules, backend.clone(), options, metrics));
    let listener = match tokio::net::TcpListener::bind(args.grpc_addr).await {
        Ok(it) => it,
        Err(err) => return startup_failure(format!("cannot listen on {}: {err}", args.grpc_addr)),
    };
    let http_listener = match tokio::net::TcpListener::bind(args.http_addr).await {
        Ok(it) => it,
        Err(err) => return startup_failure(format!("cannot listen on {}: {err}", args.http_addr)),
    };
    tracing::info!(
        grpc_addr = %listener.local_addr().map_or(args.grpc_addr, |it| it),
        http_addr = %http_listener.local_addr().map_or(args.http_addr, |it| it),
        backend = backend.name(),
        "serving"
    );
    let drain_timeout = Duration::from_millis(args.drain_timeout_ms);

    let (control, shutdown) = throttlegate::transport::grpc::shutdown_channel();
    let http = tokio::spawn(throttlegate::transport::http::serve_limited(
        http_listener,
        limiter.clone(),
        http_limits,
        shutdown.clone(),
    ));
    let app = App {
        limiter,
        drain_timeout,
    };
    let grpc = throttlegate::transport::grpc::serve_limited(listener, app, grpc_limits, shutdown);
    let shutdown_delay = Duration::from_millis(args.shutdown_delay_ms);
    stop_gracefully(grpc, http, control, stop, shutdown_delay, drain_timeout).await
}

/// Serves until SIGTERM or SIGINT, then: NOT_SERVING (gRPC health and
/// `/healthcheck`) while both servers still answer for `shutdown_delay`,
/// so that load balancers stop sending first; then both listeners close
/// and both servers drain within one `drain_timeout`. Health Watch streams
/// are ended, not waited for.
async fn stop_gracefully(
    grpc: impl Future<Output = Result<(), throttlegate::transport::grpc::Error>>,
    mut http: JoinHandle<std::io::Result<()>>,
    control: ShutdownControl,
    mut stop: StopSignals,
    shutdown_delay: Duration,
    drain_timeout: Duration,
) -> ExitCode {
    tokio::pin!(grpc);
    // gRPC only stops on its own when it fails.
    let early = tokio::select! {
        res = &mut grpc => Some(res),
        name = stop.recv() => {
            tracing::info!("{name}: shutting down");
            None
        }
    };
    let grpc_res = match early {
        Some(res) => Some(res),
        None => {
            control.not_serving();
            if shutdown_delay.is_zero() {
                None
            } else {
                tracing::info!(
                    delay_ms = shutdown_delay.as_millis() as u64,
                    "not serving; closing the listeners after the delay"
                );
                tokio::select! {
                    res = &mut grpc => Some(res),
                    () = tokio::time::sleep(shutdown_delay) => None,
                    name = stop.recv() => {
                        tracing::info!("{name} again: closing the listeners now");
                        None
                    }
                }
            }
        }
    };
    control.close();
    // One deadline for both servers, from the moment the listeners close.
    let deadline = tokio::time::Instant::now() + drain_timeout;
    let (grpc_res, http_res) = tokio::join!(
        async {
            match grpc_res {
                Some(res) => Ok(res),
                None => tokio::time::timeout_at(deadline, &mut grpc).await,
            }
        },
        tokio::time::timeout_at(deadline, &mut http),
    );
    http.abort();
    exit_code(grpc_res, http_res, drain_timeout)
}

/// 0 unless a server failed; a drain cut short at its deadline is logged,
/// not a failure.
fn exit_code(
    grpc_res: Result<Result<(), throttlegate::transport::grpc::Error>, tokio::time::error::Elapsed>,
    http_res: Result<
        Result<std::io::Result<()>, tokio::task::JoinError>,
        tokio::time::error::Elapsed,
    >,
    drain_timeout: Duration,
) -> ExitCode {
    let timeout_ms = drain_timeout.as_millis() as u64;
    let mut failed = false;
    match grpc_res {
        Ok(Ok(())) => {}
        Ok(Err(err)) => {
            tracing::error!("{err}");
            failed = true;
        }
        Err(_) => tracing::warn!(
            timeout_ms,
            "grpc requests still running at the drain deadline; stopping anyway"
        ),
    }
    match http_res {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(err))) => {
            tracing::error!("http server failed: {err}");
            failed = true;
        }
        Ok(Err(err)) => {
            tracing::error!("http server task failed: {err}");
            failed = true;
        }
        Err(_) => tracing::warn!(
            timeout_ms,
            "http requests still running at the drain deadline; stopping anyway"
        ),
    }
    if failed {
        return ExitCode::FAILURE;
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Loads the config on a blocking thread: a big one takes seconds, and the
/// runtime keeps handling signals meanwhile.
async fn load_config(path: &Path, options: LoadOptions) -> Result<RuleSet, String> {
    tracing::info!(path = %path.display(), "loading the config");
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || load_config_now(&path, &options))
        .await
        .map_err(|err| format!("config load failed: {err}"))?
}

fn load_config_now(path: &Path, options: &LoadOptions) -> Result<RuleSet, String> {
    let loaded = config::load(path, options).map_err(|err| format!("{err:#}"))?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        path = %path.display(),
        domains = loaded.rules.domains().len(),
        files = loaded.files.len(),
        "config loaded"
    );
    Ok(loaded.rules)
}

/// SIGHUP (`hangups`, listened for since start-up; one received during
/// start-up reloads right away) reloads the config, and so does a change
/// of its files with `--watch-config on`; the guards stop both.
fn reload_triggers(
    reloader: Option<&Arc<Reloader>>,
    watch: Switch,
    hangups: Option<Signal>,
) -> Vec<ReloadGuard> {
    let mut guards = Vec::new();
    // Without --config there is nothing to reload; the handler, once
    // registered, still keeps SIGHUP from ending the process.
    let Some(reloader) = reloader else {
        return guards;
    };
    if let Some(hangups) = hangups {
        let hangups = tokio_stream::wrappers::SignalStream::new(hangups).map(|()| {
            tracing::info!("SIGHUP: reloading the config");
        });
        guards.push(reloader.spawn_on(hangups));
    }
    if watch == Switch::On {
        guards.push(reloader.spawn_watcher());
    }
    guards
}

fn response_headers(args: &ServeArgs) -> Result<Option<HeaderNames>, String> {
    if args.response_headers == Switch::Off {
        return Ok(None);
    }
    let names = HeaderNames {
        limit: args.limit_header.clone(),
        remaining: args.remaining_header.clone(),
        reset: args.reset_header.clone(),
        retry_after: args.retry_after_header.clone(),
    };
    for name in [
        &names.limit,
        &names.remaining,
        &names.reset,
        &names.retry_after,
    ] {
        if tonic::codegen::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
            return Err(format!("invalid response header name '{name}'"));
        }
    }
    Ok(Some(names))
}

/// `None` without `--redis-url`.
fn redis_settings(args: &ServeArgs) -> Result<Option<RedisSettings>, String> {
    if args.redis_sentinel_master.is_some() || !args.redis_sentinel_nodes.is_empty() {
        return Err("redis sentinel is not supported yet".to_owned());
    }
    if !args.redis_cluster_nodes.is_empty() {
        return Err("redis cluster is not supported yet".to_owned());
    }
    let Some(url) = &args.redis_url else {
        return Ok(None);
    };
    Ok(Some(RedisSettings {
        url: url.clone(),
        pool_size: args.redis_pool_size,
        timeout_ms: args.redis_timeout_ms,
        key_prefix: args.redis_key_prefix.clone(),
        clock: match args.clock {
            ClockArg::Redis => ClockSource::Redis,
            ClockArg::Local => ClockSource::Local(Arc::new(SystemClock)),
        },
        expiry_grace_ms: args.redis_expiry_grace_ms,
    }))
}

/// Listens for `kind` from now on; `None` (logged) if that cannot be set up.
fn listen_for(kind: SignalKind, name: &str) -> Option<Signal> {
    match signal(kind) {
        Ok(it) => Some(it),
        Err(err) => {
            tracing::error!("cannot listen for {name}: {err}");
            None
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), listened for from creation on: a signal
/// received before [`StopSignals::recv`] is called is not lost.
struct StopSignals {
    terminate: Option<Signal>,
    interrupt: Option<Signal>,
}

impl StopSignals {
    fn install() -> Self {
        StopSignals {
            terminate: listen_for(SignalKind::terminate(), "SIGTERM"),
            interrupt: listen_for(SignalKind::interrupt(), "SIGINT"),
        }
    }

    /// Waits for the next SIGTERM or SIGINT and returns its name.
    async fn recv(&mut self) -> &'static str {
        async fn next(signal: &mut Option<Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(&mut self.terminate) => "SIGTERM",
            () = next(&mut self.interrupt) => "SIGINT",
        }
    }

    /// Runs a start-up `step`; `None` (logged) if SIGTERM or SIGINT comes
    /// first. The step is dropped, but blocking work it started may still
    /// run: the runtime is shut down without waiting for it.
    async fn or_stop<T>(&mut self, step: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            res = step => Some(res),
            name = self.recv() => {
                tracing::info!("{name} during start-up: exiting");
                None
            }
        }
    }
}
