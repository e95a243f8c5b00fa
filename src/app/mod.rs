//! The composition root of `throttlegate serve`: from [`Settings`] (the
//! flags as the command line gives them) it builds the rules, metrics,
//! backend, limiter and both servers, wires hot reload, and follows
//! signals through start-up, serving and a graceful stop to an exit code.
//!
//! `start` reads top to bottom in start-up order; each step lives in the
//! submodule named for it. Invariant: only `main`, `cli` and this module
//! read the environment, arguments and signals; everything they build is
//! handed down explicitly.

mod backend;
mod listeners;
mod ratelimit_stats;
mod rules_source;
mod runtime;
mod server_tls;
mod servers;
mod settings;
mod signals;
mod stop;
mod traces;

use std::future::Future;
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::signal::unix::{Signal, SignalKind};
use tokio::task::JoinHandle;

use crate::backends::memory::SweeperGuard;
use crate::config::ConfigStatus;
use crate::config::reload::ReloadGuard;
use crate::metrics::Metrics;
use crate::traces::Tracing;
use crate::transport::grpc;
use crate::transport::http;
use crate::transport::shutdown::{ShutdownControl, shutdown_channel};
use crate::transport::tls::{self, Side, TlsReloadGuard};
use crate::xds::Subscription;

use self::ratelimit_stats::RatelimitStatsRunning;
use self::signals::{StopSignals, listen_for};

pub use self::servers::server_apps;
pub use self::settings::{
    RatelimitPrometheus, RatelimitStatsSettings, RedisFlags, ServerLimits, Settings, TlsFlags,
    XdsFlags,
};

/// Exit code of a start-up failure (bad config, bad flags, unusable backend).
const EXIT_STARTUP: u8 = 2;

/// Why start-up ended without serving.
enum Aborted {
    /// Printed; exit code 2.
    Failed(String),
    /// SIGTERM or SIGINT came first; exit code 0.
    Stopped,
}

/// Sets up logging and the runtime, serves until a stop signal, and
/// returns the process's exit code.
pub fn run(settings: Settings) -> ExitCode {
    runtime::init_logging(settings.json_logs, settings.log_filter.as_deref());
    let runtime = match runtime::runtime() {
        Ok(it) => it,
        Err(err) => {
            eprintln!("cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(serve(settings));
    // Without waiting for blocking work: a config load still running (a
    // reload, or the start-up load after SIGTERM) must not hold the exit.
    runtime.shutdown_background();
    code
}

async fn serve(settings: Settings) -> ExitCode {
    // First of all, before the config load (which can take seconds): from
    // here a SIGHUP never ends the process (it reloads once we serve), and
    // SIGTERM or SIGINT ends the start-up at once.
    let hangups = listen_for(SignalKind::hangup(), "SIGHUP");
    let mut stop = StopSignals::install();
    match start(settings, hangups, &mut stop).await {
        Ok(serving) => serving.stop_gracefully(stop).await,
        Err(Aborted::Failed(message)) => startup_failure(message),
        Err(Aborted::Stopped) => ExitCode::SUCCESS,
    }
}

/// Reports a start-up failure and returns exit code 2. Printed plainly
/// rather than logged: it must be readable whatever RUST_LOG says.
fn startup_failure(message: impl std::fmt::Display) -> ExitCode {
    eprintln!("{message}");
    ExitCode::from(EXIT_STARTUP)
}

// === start-up ===

/// What start-up leaves running, and what the stop needs.
struct Serving {
    grpc: Pin<Box<dyn Future<Output = Result<(), grpc::Error>>>>,
    http: JoinHandle<std::io::Result<()>>,
    control: ShutdownControl,
    shutdown_delay: Duration,
    drain_timeout: Duration,
    /// Reloads keep happening for as long as these are held.
    _reloads: Vec<ReloadGuard>,
    /// The rules over xDS keep coming for as long as this is held.
    _xds: Option<Subscription>,
    /// Keeps the memory backend's sweeper running.
    _sweeper: Option<SweeperGuard>,
    /// Keeps the TLS files checked for changes.
    _tls_reloads: Option<TlsReloadGuard>,
    /// Keeps envoyproxy/ratelimit's statistics flowing.
    _ratelimit_stats: RatelimitStatsRunning,
    /// Flushed once both servers have stopped.
    traces: Option<Arc<Tracing>>,
}

/// Builds everything in the order start-up needs it, then starts both
/// servers; SIGTERM or SIGINT during a slow step ends it.
async fn start(
    settings: Settings,
    hangups: Option<Signal>,
    stop: &mut StopSignals,
) -> Result<Serving, Aborted> {
    let sockets = listeners::redis_sockets(&settings.redis, settings.limits.grpc.threads);
    let (grpc_limits, http_limits) = listeners::connection_limits(&settings.limits, sockets);
    let tls_files = server_tls::tls_files(&settings.tls).map_err(Aborted::Failed)?;
    let rules = Arc::new(ArcSwap::from_pointee(
        rules_source::load_rules(&settings, stop).await?,
    ));
    let status = Arc::new(ConfigStatus::new(
        rules_source::config_source(&settings),
        SystemTime::now(),
    ));
    let metrics = Arc::new(Metrics::with_max_values_per_rule(
        settings.max_metric_values_per_rule,
    ));
    // Right after the load: the reloader records the files as loaded.
    if settings.config.is_some() {
        metrics.record_config_loaded(status.loaded_at());
    }
    let ratelimit_stats = ratelimit_stats::prepare(&settings.ratelimit_stats).await?;
    let reloader = rules_source::reloader(&settings, &rules, &metrics, &status);
    let reloads = rules_source::reload_triggers(reloader.as_ref(), settings.watch_config, hangups);
    let subscription =
        rules_source::xds_subscription(&settings, &rules, &metrics, &status, stop).await?;
    let options = servers::limiter_options(&settings)?;
    let tls = match tls_files {
        Some(files) => Some(server_tls::load_tls(files, &metrics)?),
        None => None,
    };
    let (backend, sweeper) = backend::connect(&settings, &metrics, stop).await?;
    let traces = traces::start(settings.traces.as_ref())?;
    // In the background: start-up never waits for Redis, and a request
    // that comes first simply makes the connection itself.
    tokio::spawn({
        let backend = backend.clone();
        async move { backend.warm_up().await }
    });
    // HTTP first: once the gRPC port accepts connections, the health,
    // metrics and admin port does too, and a port that cannot be bound
    // stops the start before anything can connect to the other.
    let http_listener = listeners::bind(settings.http_addr).await?;
    let grpc_listener = listeners::bind(settings.grpc_addr).await?;
    tracing::info!(
        grpc_addr = %grpc_listener.local_addr().map_or(settings.grpc_addr, |it| it),
        http_addr = %http_listener.local_addr().map_or(settings.http_addr, |it| it),
        backend = backend.name(),
        tls = tls.is_some(),
        mutual_tls = settings.tls.client_ca.is_some(),
        "serving"
    );
    let (mut grpc_app, mut http_app) = server_apps(
        rules,
        status,
        backend,
        options,
        metrics,
        settings.drain_timeout,
    );
    if let Some(book) = backend::quota_book(&settings.redis)? {
        grpc_app.quota = book.clone();
        http_app.quota = book;
    }
    grpc_app.tls = tls.as_ref().map(|it| it.acceptor(Side::Grpc));
    grpc_app.traces = traces.clone();
    http_app.tls = tls
        .as_ref()
        .filter(|_| settings.tls.http)
        .map(|it| it.acceptor(Side::Http));
    let tls_reloads = tls.as_ref().map(|it| it.spawn_reloader(tls::CHECK_EVERY));
    let (control, shutdown) = shutdown_channel();
    let ratelimit_stats = ratelimit_stats.start(&http_app.metrics, &shutdown);
    let http = tokio::spawn(http::serve_limited(
        http_listener,
        http_app,
        http_limits,
        shutdown.clone(),
    ));
    let grpc = grpc::serve_limited(grpc_listener, grpc_app, grpc_limits, shutdown);
    Ok(Serving {
        grpc: Box::pin(grpc),
        http,
        control,
        shutdown_delay: settings.shutdown_delay,
        drain_timeout: settings.drain_timeout,
        _reloads: reloads,
        _xds: subscription,
        _sweeper: sweeper,
        _tls_reloads: tls_reloads,
        _ratelimit_stats: ratelimit_stats,
        traces,
    })
}
