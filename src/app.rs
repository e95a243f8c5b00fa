//! The composition root of `throttlegate serve`: from [`Settings`] (the
//! flags as `main` parses them) it builds the rules, metrics, backend,
//! limiter and both servers, wires hot reload, and follows signals through
//! start-up, serving and a graceful stop to an exit code.
//!
//! Only `main` and this module read the environment, arguments and
//! signals; everything they build is handed down explicitly.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::net::TcpListener;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::task::JoinHandle;
use tokio::time::error::Elapsed;
use tokio_stream::StreamExt;
use tokio_util::task::AbortOnDropHandle;
use tracing_subscriber::EnvFilter;

use crate::backends::Backend;
use crate::backends::keys::{HashTag, KeyFormat};
use crate::backends::memory::{MemoryBackend, SweeperGuard};
use crate::backends::redis::cluster::{ClusterBackend, ClusterSettings};
use crate::backends::redis::{
    BatchSettings, ClockSource, RedisBackend, RedisSettings, RedisTls, SentinelSettings,
    ServerConnector,
};
use crate::clock::SystemClock;
use crate::config::reload::{ReloadGuard, Reloader};
use crate::config::{self, ConfigStatus, LoadOptions};
use crate::decision::{FailureMode, HeaderNames, Limiter, NearLimitRatio, Options};
use crate::metrics::Metrics;
use crate::metrics::statsd::{self, StatsdGuard, StatsdSettings};
use crate::metrics::statsd_mapping::Mapping;
use crate::quota::redis::RedisPools;
use crate::quota::{self, QuotaBook};
use crate::rules::RuleSet;
use crate::traces::{TraceSettings, Tracing};
use crate::transport::grpc::{self, GrpcLimits};
use crate::transport::health::Health;
use crate::transport::http::ratelimit_stats::{self, RatelimitStatsPage};
use crate::transport::http::{self, HttpLimits};
use crate::transport::listener::DescriptorBudget;
use crate::transport::shutdown::{Shutdown, ShutdownControl, shutdown_channel};
use crate::transport::tls::{self, Side, Tls, TlsFiles, TlsReloadGuard};
use crate::xds::{self, Subscription, XdsSettings};

/// Exit code of a start-up failure (bad config, bad flags, unusable backend).
const EXIT_STARTUP: u8 = 2;

/// How often the memory backend reclaims idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Descriptors kept free of client connections beyond the Redis pool:
/// standard streams, the listening sockets, the config watcher, the
/// runtime's own, and Redis reconnections.
const DESCRIPTOR_RESERVE: u64 = 128;

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
    init_logging(settings.json_logs, settings.log_filter.as_deref());
    let runtime = match runtime() {
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

/// The multi-threaded runtime everything runs on, with tokio's LIFO slot
/// off where the build allows it (`--cfg tokio_unstable`, set in
/// `.cargo/config.toml`).
///
/// With the slot on, a task woken by the running one runs next: each
/// stream task that finishes an answer wakes its connection's task, which
/// then runs at once and writes that one answer (one `writev` per answer).
/// With it off, the connection's task waits its turn behind the stream
/// tasks already ready and writes their answers together: at 500 requests
/// in flight, 0.2 writes per answer instead of 0.95, and about a quarter
/// less CPU per decision (measured 2026-12-04 at 50×10 under h2load).
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder.build()
}

fn init_logging(json: bool, default_filter: Option<&str>) {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(default_filter.unwrap_or("info")));
    // Colour only on a terminal: a log file or journald gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
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
    let sockets = redis_sockets(&settings.redis, settings.limits.grpc.threads);
    let (grpc_limits, http_limits) = limits(&settings.limits, sockets);
    let tls_files = tls_files(&settings.tls).map_err(Aborted::Failed)?;
    let rules = Arc::new(ArcSwap::from_pointee(load_rules(&settings, stop).await?));
    let status = Arc::new(ConfigStatus::new(
        config_source(&settings),
        SystemTime::now(),
    ));
    let metrics = Arc::new(Metrics::with_max_values_per_rule(
        settings.max_metric_values_per_rule,
    ));
    // Right after the load: the reloader records the files as loaded.
    if settings.config.is_some() {
        metrics.record_config_loaded(status.loaded_at());
    }
    let ratelimit_stats = prepare_ratelimit_stats(&settings.ratelimit_stats).await?;
    let reloader = reloader(&settings, &rules, &metrics, &status);
    let reloads = reload_triggers(reloader.as_ref(), settings.watch_config, hangups);
    let subscription = xds_subscription(&settings, &rules, &metrics, &status, stop).await?;
    let options = limiter_options(&settings)?;
    let tls = match tls_files {
        Some(files) => Some(load_tls(files, &metrics)?),
        None => None,
    };
    let (backend, sweeper) = backend(&settings, &metrics, stop).await?;
    let traces = start_traces(settings.traces.as_ref())?;
    // In the background: start-up never waits for Redis, and a request
    // that comes first simply makes the connection itself.
    tokio::spawn({
        let backend = backend.clone();
        async move { backend.warm_up().await }
    });
    // HTTP first: once the gRPC port accepts connections, the health,
    // metrics and admin port does too, and a port that cannot be bound
    // stops the start before anything can connect to the other.
    let http_listener = bind(settings.http_addr).await?;
    let grpc_listener = bind(settings.grpc_addr).await?;
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
    if let Some(book) = quota_book(&settings.redis)? {
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

// === envoyproxy/ratelimit's statistics ===

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

/// The endpoint's mapping loaded and its port bound: what start-up
/// checks before anything serves.
struct RatelimitStatsPrepared {
    endpoint: Option<(TcpListener, Arc<Mapping>, String)>,
    statsd: Option<StatsdSettings>,
}

/// What keeps them running; dropping it stops them.
struct RatelimitStatsRunning {
    _endpoint: Option<AbortOnDropHandle<()>>,
    _statsd: Option<StatsdGuard>,
}

/// Loads the mapping (an unusable one stops the start, saying why) and
/// binds the endpoint's port.
async fn prepare_ratelimit_stats(
    settings: &RatelimitStatsSettings,
) -> Result<RatelimitStatsPrepared, Aborted> {
    let endpoint = match &settings.prometheus {
        None => None,
        Some(prometheus) => {
            let mapping = match &prometheus.mapping {
                None => Mapping::envoy_gateway(),
                // Envoy Gateway mounts its mapping from an optional
                // ConfigMap: while it is absent, its mapping (the built-in
                // one) serves rather than a pod that cannot start.
                Some(path) if !path.exists() => {
                    tracing::warn!(
                        path = %path.display(),
                        "--ratelimit-prometheus-mapping: no such file; Envoy Gateway's mapping is used"
                    );
                    Mapping::envoy_gateway()
                }
                Some(path) => Mapping::load(path).map_err(|err| {
                    Aborted::Failed(format!("--ratelimit-prometheus-mapping: {err}"))
                })?,
            };
            if !prometheus.path.starts_with('/') {
                return Err(Aborted::Failed(format!(
                    "--ratelimit-prometheus-path {:?} must start with /",
                    prometheus.path
                )));
            }
            let listener = bind(prometheus.addr).await?;
            Some((listener, Arc::new(mapping), prometheus.path.clone()))
        }
    };
    Ok(RatelimitStatsPrepared {
        endpoint,
        statsd: settings.statsd.clone(),
    })
}

impl RatelimitStatsPrepared {
    fn start(self, metrics: &Arc<Metrics>, shutdown: &Shutdown) -> RatelimitStatsRunning {
        let endpoint = self.endpoint.map(|(listener, mapping, path)| {
            tracing::info!(
                addr = %listener.local_addr().map_or_else(|_| "?".to_owned(), |it| it.to_string()),
                path,
                "serving envoyproxy/ratelimit's statistics for Prometheus"
            );
            let page = RatelimitStatsPage {
                metrics: metrics.clone(),
                mapping,
                path,
            };
            AbortOnDropHandle::new(tokio::spawn(ratelimit_stats::serve(
                listener,
                page,
                shutdown.clone(),
            )))
        });
        let statsd = self.statsd.map(|settings| {
            tracing::info!(
                addr = settings.addr,
                protocol = ?settings.protocol,
                "sending envoyproxy/ratelimit's statistics to statsd"
            );
            statsd::spawn(metrics.clone(), settings)
        });
        RatelimitStatsRunning {
            _endpoint: endpoint,
            _statsd: statsd,
        }
    }
}

// === traces ===

/// How long the spans still queued at the stop may take to be sent.
const TRACES_FLUSH: Duration = Duration::from_secs(2);

/// The OTLP exporter, when tracing is on; a bad endpoint stops the start.
fn start_traces(settings: Option<&TraceSettings>) -> Result<Option<Arc<Tracing>>, Aborted> {
    let Some(settings) = settings else {
        return Ok(None);
    };
    let traces = Tracing::start(settings, tokio::runtime::Handle::current())
        .map_err(|err| Aborted::Failed(format!("tracing: {err}")))?;
    tracing::info!(
        endpoint = %settings.endpoint,
        protocol = ?settings.protocol,
        sampling_rate = settings.sampling_rate,
        service_name = %settings.service_name,
        "tracing decisions"
    );
    Ok(Some(Arc::new(traces)))
}

/// Sends the spans still queued, off the runtime's workers (the exports
/// themselves run on them).
async fn flush_traces(traces: Option<Arc<Tracing>>) {
    if let Some(traces) = traces {
        let _ = tokio::task::spawn_blocking(move || traces.flush(TRACES_FLUSH)).await;
    }
}

/// The TLS files the flags name; `None` without TLS. A key without a
/// certificate (or the reverse), or a client CA without both, is refused.
fn tls_files(flags: &TlsFlags) -> Result<Option<TlsFiles>, String> {
    let (cert, key) = match (&flags.cert, &flags.key) {
        (Some(cert), Some(key)) => (cert.clone(), key.clone()),
        (Some(_), None) => return Err("--tls-cert needs --tls-key (its private key)".to_owned()),
        (None, Some(_)) => return Err("--tls-key needs --tls-cert (its certificate)".to_owned()),
        (None, None) => {
            if flags.client_ca.is_some() || flags.client_san.is_some() {
                return Err(
                    "--tls-client-ca and --tls-client-san need --tls-cert and --tls-key: \
                     client certificates are asked for only over TLS"
                        .to_owned(),
                );
            }
            return Ok(None);
        }
    };
    if flags.client_san.is_some() && flags.client_ca.is_none() {
        return Err(
            "--tls-client-san needs --tls-client-ca: only a verified client certificate's \
             names can be trusted"
                .to_owned(),
        );
    }
    Ok(Some(TlsFiles {
        cert,
        key,
        client_ca: flags.client_ca.clone(),
        client_san: flags.client_san.clone(),
    }))
}

/// Loads the TLS files (an error names the file); their reloads are counted
/// in `metrics`.
fn load_tls(files: TlsFiles, metrics: &Arc<Metrics>) -> Result<Arc<Tls>, Aborted> {
    let tls = Tls::load(files).map_err(|err| Aborted::Failed(format!("tls: {err}")))?;
    metrics.enable_tls_reloads();
    let metrics = metrics.clone();
    Ok(Arc::new(
        tls.with_observer(move |ok| metrics.record_tls_reload(ok)),
    ))
}

/// What the two servers serve: one limiter over `rules` and `backend`,
/// one health answer over `backend`, both recording into `metrics`;
/// `/rlconfig` shows `status` above the rules.
pub fn server_apps(
    rules: Arc<ArcSwap<RuleSet>>,
    status: Arc<ConfigStatus>,
    backend: Arc<dyn Backend>,
    options: Options,
    metrics: Arc<Metrics>,
    drain_timeout: Duration,
) -> (grpc::GrpcApp, http::HttpApp) {
    let limiter = Arc::new(Limiter::new(
        rules.clone(),
        backend.clone(),
        options,
        metrics.clone(),
    ));
    let health = Health::new(backend);
    let quota = Arc::new(QuotaBook::new(Arc::new(SystemClock)));
    let http = http::HttpApp {
        limiter: limiter.clone(),
        metrics: metrics.clone(),
        health: health.clone(),
        quota: quota.clone(),
        rules,
        config: status,
        tls: None,
    };
    let grpc = grpc::GrpcApp {
        limiter,
        metrics,
        health,
        quota,
        drain_timeout,
        tls: None,
        traces: None,
    };
    (grpc, http)
}

/// The rules to start with: the config's, loaded off the runtime, or none.
async fn load_rules(settings: &Settings, stop: &mut StopSignals) -> Result<RuleSet, Aborted> {
    if let Some(xds) = &settings.xds {
        if settings.config.is_some() {
            return Err(Aborted::Failed(
                "--config and --config-xds-server exclude each other: the rules come from \
                 files or from the xDS server"
                    .to_owned(),
            ));
        }
        xds.settings
            .check()
            .map_err(|err| Aborted::Failed(format!("xds: {err}")))?;
        return Ok(RuleSet::awaiting_first_config());
    }
    let Some(path) = &settings.config else {
        tracing::warn!("no --config given: every domain is unknown and every request is OK");
        return Ok(RuleSet::default());
    };
    match stop.or_stop(load_config(path, settings.load)).await {
        Some(Ok(it)) => Ok(it),
        Some(Err(message)) => Err(Aborted::Failed(message)),
        None => Err(Aborted::Stopped),
    }
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

/// Reloads into `rules`, counted in `metrics` and recorded in `status`;
/// `None` without a config.
fn reloader(
    settings: &Settings,
    rules: &Arc<ArcSwap<RuleSet>>,
    metrics: &Arc<Metrics>,
    status: &Arc<ConfigStatus>,
) -> Option<Arc<Reloader>> {
    let path = settings.config.as_ref()?;
    let metrics = metrics.clone();
    let reloader = Reloader::new(path.clone(), settings.load, rules.clone())
        .with_status(status.clone())
        .with_observer(move |ok| metrics.record_reload(ok));
    Some(Arc::new(reloader))
}

// === rules over xDS ===

/// Where the rules come from, as `/rlconfig` names it.
fn config_source(settings: &Settings) -> Option<PathBuf> {
    match &settings.xds {
        Some(xds) => Some(PathBuf::from(xds_source(&xds.settings))),
        None => settings.config.clone(),
    }
}

fn xds_source(settings: &XdsSettings) -> String {
    format!(
        "xds://{}:{} (node {})",
        settings.server.host, settings.server.port, settings.node_id
    )
}

/// With `--config-xds-server`: the subscription, whose configs go through
/// a reloader into `rules` (counted in `metrics`, recorded in `status`).
/// Without `--config-xds-force-start`, start-up waits here for the first
/// config the server sends that is accepted (SIGTERM or SIGINT end the
/// wait); with it, serving starts with no rules.
async fn xds_subscription(
    settings: &Settings,
    rules: &Arc<ArcSwap<RuleSet>>,
    metrics: &Arc<Metrics>,
    status: &Arc<ConfigStatus>,
    stop: &mut StopSignals,
) -> Result<Option<Subscription>, Aborted> {
    let Some(flags) = &settings.xds else {
        return Ok(None);
    };
    let observed = metrics.clone();
    let reloader = Reloader::new(
        PathBuf::from(xds_source(&flags.settings)),
        settings.load,
        rules.clone(),
    )
    .with_status(status.clone())
    .with_observer(move |ok| observed.record_reload(ok));
    let mut subscription =
        xds::subscribe(flags.settings.clone(), Arc::new(reloader), settings.load);
    if flags.force_start {
        tracing::warn!(
            "--config-xds-force-start: serving before the first config; until it arrives \
             every request is answered through --failure-mode"
        );
        return Ok(Some(subscription));
    }
    tracing::info!("waiting for the first config from the xDS server");
    match stop.or_stop(subscription.first_config()).await {
        Some(()) => Ok(Some(subscription)),
        None => Err(Aborted::Stopped),
    }
}

/// SIGHUP (`hangups`, listened for since start-up; one received during
/// start-up reloads right away) reloads the config, and so does a change
/// of its files with `watch`; the guards stop both.
fn reload_triggers(
    reloader: Option<&Arc<Reloader>>,
    watch: bool,
    hangups: Option<Signal>,
) -> Vec<ReloadGuard> {
    let mut guards = Vec::new();
    // Without a config there is nothing to reload; the handler, once
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
    if watch {
        guards.push(reloader.spawn_watcher());
    }
    guards
}

/// The limiter's options; fails on a response header name HTTP refuses.
fn limiter_options(settings: &Settings) -> Result<Options, Aborted> {
    if let Some(names) = &settings.response_headers {
        for name in [
            &names.limit,
            &names.remaining,
            &names.reset,
            &names.retry_after,
        ] {
            if tonic::codegen::http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(Aborted::Failed(format!(
                    "invalid response header name '{name}'"
                )));
            }
        }
    }
    Ok(Options {
        shadow_mode: settings.shadow_mode,
        response_headers: settings.response_headers.clone(),
        failure_mode: settings.failure_mode,
        near_limit_ratio: settings.near_limit_ratio,
        over_limit_cache: settings.over_limit_cache,
    })
}

/// Redis when a URL is given (connected now), otherwise the in-memory
/// backend with its sweeper, whose guard is returned.
async fn backend(
    settings: &Settings,
    metrics: &Metrics,
    stop: &mut StopSignals,
) -> Result<(Arc<dyn Backend>, Option<SweeperGuard>), Aborted> {
    warn_about_redis_tls(&settings.redis.tls);
    let redis = match redis_settings(&settings.redis).map_err(Aborted::Failed)? {
        None => {
            tracing::warn!("no --redis-url: using the in-memory backend, limits are per instance");
            let (memory, sweeper) = memory_backend(settings.memory_max_counters, metrics);
            return Ok((memory, Some(sweeper)));
        }
        Some(RedisTarget::Cluster(cluster)) => {
            return match ClusterBackend::connect(cluster) {
                Ok(it) => Ok((Arc::new(it), None)),
                Err(err) => Err(Aborted::Failed(format!("redis cluster: {err}"))),
            };
        }
        Some(RedisTarget::Single(redis)) => redis,
    };
    let hash_tag = settings.redis.hash_tag;
    match stop.or_stop(RedisBackend::connect(redis)).await {
        Some(Ok(it)) => {
            let it = it
                .with_hash_tag(hash_tag)
                .with_serving_threads(settings.limits.grpc.threads);
            Ok((Arc::new(it), None))
        }
        Some(Err(err)) => Err(Aborted::Failed(format!("redis: {err}"))),
        None => Err(Aborted::Stopped),
    }
}

/// With Redis (a server, Sentinel or a cluster, with the `--redis-tls-*`
/// settings), rate-limit quota budgets are kept there and shared with
/// every instance on it; without, each instance shares them among its own
/// streams. `None`: the in-memory book `server_apps` made stays.
fn quota_book(flags: &RedisFlags) -> Result<Option<Arc<QuotaBook>>, Aborted> {
    let failed = |err: crate::backends::Error| Aborted::Failed(format!("redis for quotas: {err}"));
    let connector: Box<dyn quota::redis::Connect> =
        match redis_settings(flags).map_err(Aborted::Failed)? {
            None => return Ok(None),
            Some(RedisTarget::Single(settings)) => {
                Box::new(QuotaServer(settings.connector().map_err(failed)?))
            }
            Some(RedisTarget::Cluster(settings)) => Box::new(
                settings
                    .redirecting_client(QUOTA_CLUSTER_RETRIES)
                    .map_err(failed)?,
            ),
        };
    Ok(Some(Arc::new(QuotaBook::with_redis(
        Arc::new(SystemClock),
        RedisPools::on(connector),
    ))))
}

/// How often one quota call on a cluster is sent again (after MOVED, ASK,
/// TRYAGAIN, a lost connection): both scripts may run twice (a pool's
/// write checks its version).
const QUOTA_CLUSTER_RETRIES: u32 = 8;

/// The quota pools' connections to the backend's server (or Sentinel's
/// master).
struct QuotaServer(ServerConnector);

impl quota::redis::Connect for QuotaServer {
    fn connect(&self) -> quota::redis::Connecting<'_> {
        Box::pin(async move { self.0.connect().await.map(quota::redis::Connection::Server) })
    }
}

/// Verification turned off, in part or whole, is said at start-up.
fn warn_about_redis_tls(tls: &RedisTls) {
    if tls.insecure {
        tracing::warn!(
            "--redis-tls-insecure: the redis server's certificate is not verified; \
             anyone on the path can pose as redis"
        );
    } else if tls.skip_hostname_verification {
        tracing::warn!(
            "--redis-tls-skip-hostname-verification: any certificate the trusted CAs \
             signed is accepted for redis, whatever host it names"
        );
    }
}

/// The URL a Sentinel master is reached with when `--redis-url` is not
/// given: plain TCP, no password, db 0 (the host is replaced by the
/// master's).
const SENTINEL_MASTER_URL: &str = "redis://sentinel-master/";

/// The Redis deployment the flags name.
enum RedisTarget {
    Single(RedisSettings),
    Cluster(ClusterSettings),
}

/// `None` without a URL, Sentinel or cluster nodes.
fn redis_settings(flags: &RedisFlags) -> Result<Option<RedisTarget>, String> {
    let sentinel = sentinel_settings(flags)?;
    if sentinel.is_some() && !flags.cluster_nodes.is_empty() {
        return Err(
            "--redis-cluster-nodes and --redis-sentinel-nodes exclude each other: \
             a cluster fails over by itself, sentinel watches one master"
                .to_owned(),
        );
    }
    if !flags.cluster_nodes.is_empty() {
        return cluster_settings(flags).map(|it| Some(RedisTarget::Cluster(it)));
    }
    let url = match (&flags.url, &sentinel) {
        (Some(url), _) => url.clone(),
        (None, Some(_)) => SENTINEL_MASTER_URL.to_owned(),
        (None, None) => return Ok(None),
    };
    Ok(Some(RedisTarget::Single(RedisSettings {
        url,
        sentinel,
        pool_size: flags.pool_size,
        timeout_ms: flags.timeout_ms,
        key_prefix: flags.key_prefix.clone(),
        clock: flags.clock.clone(),
        expiry_grace_ms: flags.expiry_grace_ms,
        batch: flags.batch,
        tls: flags.tls.clone(),
    })))
}

/// The cluster flags; one deployment only.
fn cluster_settings(flags: &RedisFlags) -> Result<ClusterSettings, String> {
    if flags.url.is_some() {
        return Err(
            "--redis-url and --redis-cluster-nodes name two redis deployments: give one".to_owned(),
        );
    }
    Ok(ClusterSettings {
        nodes: flags.cluster_nodes.clone(),
        pool_size: flags.pool_size,
        timeout_ms: flags.timeout_ms,
        keys: KeyFormat::new(flags.key_prefix.clone(), flags.hash_tag),
        clock: flags.clock.clone(),
        expiry_grace_ms: flags.expiry_grace_ms,
        tls: flags.tls.clone(),
    })
}

/// `None` without Sentinel flags; nodes and a master name come together.
fn sentinel_settings(flags: &RedisFlags) -> Result<Option<SentinelSettings>, String> {
    let nodes = &flags.sentinel_nodes;
    match (&flags.sentinel_master, nodes.is_empty()) {
        (None, true) if flags.sentinel_password.is_none() => Ok(None),
        (Some(master), false) => Ok(Some(SentinelSettings {
            nodes: nodes.clone(),
            master: master.clone(),
            password: flags.sentinel_password.clone(),
        })),
        (None, false) => Err("--redis-sentinel-nodes needs --redis-sentinel-master".to_owned()),
        (_, true) => Err(
            "--redis-sentinel-master and --redis-sentinel-password need --redis-sentinel-nodes"
                .to_owned(),
        ),
    }
}

/// The in-memory backend on the system clock, its sweeper, and the gauge
/// of the counters it stores.
fn memory_backend(max_counters: usize, metrics: &Metrics) -> (Arc<dyn Backend>, SweeperGuard) {
    let memory =
        Arc::new(MemoryBackend::new(Arc::new(SystemClock)).with_max_counters(max_counters));
    let sweeper = memory.spawn_sweeper(SWEEP_EVERY);
    // Weak: the gauge must not keep the counters alive.
    let weak = Arc::downgrade(&memory);
    metrics.observe_stored_counters(move || {
        weak.upgrade().map_or(0, |it| {
            u64::try_from(it.stored_entries()).unwrap_or(u64::MAX)
        })
    });
    (memory, sweeper)
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, Aborted> {
    TcpListener::bind(addr)
        .await
        .map_err(|err| Aborted::Failed(format!("cannot listen on {addr}: {err}")))
}

// === connection caps ===

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logs both, and
/// returns the descriptor budget the connection caps come from.
fn descriptor_budget(redis_sockets: u64) -> DescriptorBudget {
    let reserve = DESCRIPTOR_RESERVE + redis_sockets;
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

/// The most sockets the Redis backend holds: its pool, once more per
/// serving thread (`--grpc-threads`, each has its own), or once per node
/// on a cluster. The primaries are not known before connecting, so the
/// seeds count, and never fewer than the three primaries a cluster has at
/// least (an operator listing a few seeds of a larger cluster sets the
/// caps). The quota pools (RLQS) hold one connection more: two sockets
/// on a server (the one kept and one being opened to replace it, or the
/// Sentinel asked for the master), one per node on a cluster. Without
/// Redis the reserve for it is kept all the same: it is small.
fn redis_sockets(flags: &RedisFlags, serving_threads: usize) -> u64 {
    let pool = u64::from(flags.pool_size);
    if flags.cluster_nodes.is_empty() {
        return pool * (1 + serving_threads as u64) + 2;
    }
    let nodes = (flags.cluster_nodes.len() as u64).max(3);
    pool * nodes + nodes
}

/// Both servers' limits, with the connection caps not given derived from
/// the descriptor budget (warned about when the given ones exceed it).
fn limits(limits: &ServerLimits, redis_sockets: u64) -> (GrpcLimits, HttpLimits) {
    let budget = descriptor_budget(redis_sockets);
    let (grpc_default, http_default) = budget.default_caps();
    let grpc_max_connections = limits.grpc_max_connections.unwrap_or(grpc_default);
    let http_max_connections = limits.http_max_connections.unwrap_or(http_default);
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
        ..limits.grpc
    };
    let http = HttpLimits {
        max_connections: http_max_connections,
        ..limits.http
    };
    (grpc, http)
}

// === stop ===

impl Serving {
    /// Serves until SIGTERM or SIGINT, then: NOT_SERVING (gRPC health and
    /// `/healthcheck`) while both servers still answer for the shutdown
    /// delay, so that load balancers stop sending first; then both
    /// listeners close and both servers drain within one drain timeout.
    /// Health Watch streams are ended, not waited for.
    async fn stop_gracefully(mut self, mut stop: StopSignals) -> ExitCode {
        // gRPC only stops on its own when it fails.
        let early = tokio::select! {
            res = &mut self.grpc => Some(res),
            name = stop.recv() => {
                tracing::info!("{name}: shutting down");
                None
            }
        };
        let grpc_res = match early {
            Some(res) => Some(res),
            None => self.not_serving(&mut stop).await,
        };
        self.control.close();
        // One deadline for both servers, from the moment the listeners close.
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        let (grpc_res, http_res) = tokio::join!(
            async {
                match grpc_res {
                    Some(res) => Ok(res),
                    None => tokio::time::timeout_at(deadline, &mut self.grpc).await,
                }
            },
            tokio::time::timeout_at(deadline, &mut self.http),
        );
        self.http.abort();
        flush_traces(self.traces.take()).await;
        exit_code(grpc_res, http_res, self.drain_timeout)
    }

    /// Health turns NOT_SERVING for the shutdown delay, which a second
    /// signal cuts short; `Some` if gRPC ended meanwhile.
    async fn not_serving(&mut self, stop: &mut StopSignals) -> Option<Result<(), grpc::Error>> {
        self.control.not_serving();
        if self.shutdown_delay.is_zero() {
            return None;
        }
        tracing::info!(
            delay_ms = self.shutdown_delay.as_millis() as u64,
            "not serving; closing the listeners after the delay"
        );
        tokio::select! {
            res = &mut self.grpc => Some(res),
            () = tokio::time::sleep(self.shutdown_delay) => None,
            name = stop.recv() => {
                tracing::info!("{name} again: closing the listeners now");
                None
            }
        }
    }
}

/// 0 unless a server failed; a drain cut short at its deadline is logged,
/// not a failure.
fn exit_code(
    grpc_res: Result<Result<(), grpc::Error>, Elapsed>,
    http_res: Result<Result<std::io::Result<()>, tokio::task::JoinError>, Elapsed>,
    drain_timeout: Duration,
) -> ExitCode {
    let timeout_ms = drain_timeout.as_millis() as u64;
    let grpc_res = grpc_res.map(|res| res.map_err(|err| err.to_string()));
    let http_res = http_res.map(|res| match res {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(format!("http server failed: {err}")),
        Err(err) => Err(format!("http server task failed: {err}")),
    });
    // Both, so that both outcomes are logged.
    let grpc_ok = ended_well("grpc", grpc_res, timeout_ms);
    let http_ok = ended_well("http", http_res, timeout_ms);
    if !(grpc_ok && http_ok) {
        return ExitCode::FAILURE;
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Logs how the `server` ended; false if it failed.
fn ended_well(server: &str, res: Result<Result<(), String>, Elapsed>, timeout_ms: u64) -> bool {
    match res {
        Ok(Ok(())) => true,
        Ok(Err(message)) => {
            tracing::error!("{message}");
            false
        }
        Err(_) => {
            tracing::warn!(
                timeout_ms,
                "{server} requests still running at the drain deadline; stopping anyway"
            );
            true
        }
    }
}

// === signals ===

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

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(pool_size: u32, cluster_nodes: &[&str]) -> RedisFlags {
        RedisFlags {
            url: None,
            pool_size,
            timeout_ms: 250,
            key_prefix: "tg".to_owned(),
            expiry_grace_ms: 0,
            batch: None,
            clock: ClockSource::Redis,
            hash_tag: HashTag::None,
            cluster_nodes: cluster_nodes.iter().map(|it| (*it).to_owned()).collect(),
            sentinel_nodes: Vec::new(),
            sentinel_master: None,
            sentinel_password: None,
            tls: RedisTls::default(),
        }
    }

    #[test]
    fn a_cluster_reserves_its_pool_once_per_node() {
        // The pool, and the quota pools' two sockets.
        assert_eq!(redis_sockets(&flags(8, &[]), 0), 8 + 2);
        // One seed of a cluster that has at least three primaries: the
        // pool and the quota pools' connection to each.
        assert_eq!(redis_sockets(&flags(8, &["a:1"]), 0), 24 + 3);
        let six = ["a:1", "b:1", "c:1", "d:1", "e:1", "f:1"];
        assert_eq!(redis_sockets(&flags(4, &six), 0), 24 + 6);
    }

    #[test]
    fn each_serving_thread_reserves_a_pool_of_its_own() {
        assert_eq!(redis_sockets(&flags(8, &[]), 2), 24 + 2);
        // A cluster's connections stay on the shared runtime.
        assert_eq!(redis_sockets(&flags(8, &["a:1"]), 2), 24 + 3);
    }
}
