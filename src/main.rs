//! The `throttlegate` binary: arguments, logging, start-up, signals, exit codes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use clap::{Args, Parser, Subcommand, ValueEnum};
use tokio_stream::StreamExt;
use tracing_subscriber::EnvFilter;

use throttlegate::algorithms::Algorithm;
use throttlegate::backends::Backend;
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::redis::{ClockSource, RedisBackend, RedisSettings};
use throttlegate::clock::SystemClock;
use throttlegate::config::{self, LoadOptions};
use throttlegate::limiter::{FailureMode, HeaderNames, Limiter, Options};
use throttlegate::metrics::Metrics;
use throttlegate::reload::{ReloadGuard, Reloader};
use throttlegate::rules::RuleSet;
use throttlegate::server::App;

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
    /// Whose time the Redis scripts use; `redis` keeps replicas with
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
    /// How long in-flight requests may run after SIGTERM.
    #[arg(long, env = "THROTTLEGATE_DRAIN_TIMEOUT_MS", default_value_t = 10_000)]
    drain_timeout_ms: u64,
    /// Most `rule` label values a rule with `detailed_metric` or
    /// `value_to_metric` creates; later values are counted under
    /// `<rule>:_overflow`.
    #[arg(
        long,
        env = "THROTTLEGATE_MAX_METRIC_VALUES_PER_RULE",
        default_value_t = 10_000
    )]
    max_metric_values_per_rule: usize,
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
    runtime.block_on(serve(args))
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
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
    let rules = match &args.config {
        Some(path) => match load_config(path, &args.config_options) {
            Ok(it) => it,
            Err(message) => return startup_failure(message),
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
    // Set up before the listeners, so a SIGHUP once we answer never takes
    // the default action (ending the process).
    let _reloads = reload_triggers(reloader.as_ref(), args.watch_config);
    let headers = match response_headers(&args) {
        Ok(it) => it,
        Err(message) => return startup_failure(message),
    };

    // Keeps the memory backend's sweeper running for as long as we serve.
    let mut _sweeper = None;
    let backend: Arc<dyn Backend> = match redis_settings(&args) {
        Err(message) => return startup_failure(message),
        Ok(Some(settings)) => match RedisBackend::connect(settings).await {
            Ok(it) => Arc::new(it),
            Err(err) => return startup_failure(format!("redis: {err}")),
        },
        Ok(None) => {
            tracing::warn!("no --redis-url: using the in-memory backend, limits are per instance");
            let memory = Arc::new(MemoryBackend::new(Arc::new(SystemClock)));
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

    // The gRPC server waits for the signal and passes it on to HTTP; if
    // gRPC stops on its own, the sender is dropped and HTTP stops too.
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let http = tokio::spawn(throttlegate::http::serve(
        http_listener,
        limiter.clone(),
        async move {
            let _ = stop_rx.wait_for(|stop| *stop).await;
        },
    ));
    let app = App {
        limiter,
        drain_timeout,
    };
    let grpc_res = throttlegate::serve(listener, app, async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    })
    .await;
    let http_res = match tokio::time::timeout(drain_timeout, http).await {
        Ok(Ok(res)) => res.map_err(|err| format!("http server failed: {err}")),
        Ok(Err(err)) => Err(format!("http server task failed: {err}")),
        Err(_) => {
            tracing::warn!("http requests still running at the drain deadline; stopping anyway");
            Ok(())
        }
    };
    match (grpc_res.map_err(|err| err.to_string()), http_res) {
        (Ok(()), Ok(())) => {
            tracing::info!("stopped");
            ExitCode::SUCCESS
        }
        (Err(err), _) | (_, Err(err)) => {
            tracing::error!("{err}");
            ExitCode::FAILURE
        }
    }
}

fn load_config(path: &Path, args: &ConfigArgs) -> Result<RuleSet, String> {
    let loaded = config::load(path, &load_options(args)).map_err(|err| format!("{err:#}"))?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        path = %path.display(),
        domains = loaded.rules.domains.len(),
        files = loaded.files.len(),
        "config loaded"
    );
    Ok(loaded.rules)
}

/// SIGHUP reloads the config, and so does a change of its files with
/// `--watch-config on`; the guards stop both.
fn reload_triggers(reloader: Option<&Arc<Reloader>>, watch: Switch) -> Vec<ReloadGuard> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut guards = Vec::new();
    let hangups = match signal(SignalKind::hangup()) {
        Ok(it) => Some(it),
        Err(err) => {
            tracing::error!("cannot listen for SIGHUP: {err}");
            None
        }
    };
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
        expiry_grace_ms: 0,
    }))
}

/// Completes on SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let interrupt = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for SIGINT: {err}");
            std::future::pending::<()>().await;
        }
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::error!("cannot listen for SIGTERM: {err}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        () = interrupt => tracing::info!("SIGINT: shutting down"),
        () = terminate => tracing::info!("SIGTERM: shutting down"),
    }
}
