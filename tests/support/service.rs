//! Starts the real gRPC server on an ephemeral port for a test.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use throttlegate::backends::Backend;
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::clock::ManualClock;
use throttlegate::config::{self, ConfigStatus};
use throttlegate::decision::{Limiter, Options};
use throttlegate::metrics::Metrics;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use throttlegate::quota::QuotaBook;
use throttlegate::rules::RuleSet;
use throttlegate::transport::grpc;
use throttlegate::transport::http;

use super::request::{descriptor, request};

/// A fixed start time, so windows do not roll over mid-test.
pub const T0: u64 = 1_700_000_000_000_000;

/// A request in `domain` with one descriptor of one entry `key=value`.
pub fn one_entry_request(domain: &str, key: &str, value: &str) -> RateLimitRequest {
    request(domain, vec![descriptor(&[(key, value)])])
}

/// A running server; stops (without draining) when dropped.
pub struct TestService {
    pub addr: SocketAddr,
    pub client: RateLimitServiceClient<Channel>,
    pub channel: Channel,
    pub limiter: Arc<Limiter>,
    /// What the HTTP routes of this service answer from.
    pub http: http::HttpApp,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), grpc::Error>>>,
}

/// Limiter options as `serve` starts by default: headers on, errors fail.
pub fn default_options() -> Options {
    Options::default()
}

/// A memory backend on a manual clock starting at [`T0`].
pub fn memory_backend() -> (Arc<dyn Backend>, ManualClock) {
    let clock = ManualClock::new(T0);
    (Arc::new(MemoryBackend::new(Arc::new(clock.clone()))), clock)
}

/// Parses one config file's text, panicking with the problems if invalid.
pub fn rules_from(yaml: &str) -> RuleSet {
    match config::parse_str("test.yaml", yaml, &super::config::load_options()) {
        Ok(loaded) => loaded.rules,
        Err(err) => panic!("invalid test config:\n{err:#}"),
    }
}

/// Starts a server with `yaml` as its only config file.
pub async fn start_with_config(
    yaml: &str,
    backend: Arc<dyn Backend>,
    options: Options,
) -> TestService {
    start_service(rules_from(yaml), backend, options).await
}

/// Starts a server on 127.0.0.1:0 (bound before spawning, so no wait is
/// needed) and connects a client to it.
pub async fn start_service(
    rules: RuleSet,
    backend: Arc<dyn Backend>,
    options: Options,
) -> TestService {
    start_service_with_metrics(rules, backend, options, Metrics::new()).await
}

/// [`start_service`] recording into `metrics`.
pub async fn start_service_with_metrics(
    rules: RuleSet,
    backend: Arc<dyn Backend>,
    options: Options,
    metrics: Metrics,
) -> TestService {
    start_service_on_threads(rules, backend, options, metrics, 0).await
}

/// [`start_on_memory`] with gRPC connections served by `threads` serving
/// threads (`--grpc-threads`).
#[allow(dead_code)]
pub async fn start_on_memory_threaded(yaml: &str, options: Options, threads: usize) -> TestService {
    let (backend, _clock) = memory_backend();
    start_service_on_threads(rules_from(yaml), backend, options, Metrics::new(), threads).await
}

/// [`start_with_config`] on the memory backend, with the rate-limit
/// quota shares (RLQS) timed by `clock`, so a test can move their time.
#[allow(dead_code)]
pub async fn start_with_quota_clock(yaml: &str, clock: ManualClock) -> TestService {
    let (backend, _clock) = memory_backend();
    let quota = Arc::new(QuotaBook::new(Arc::new(clock)));
    let apps = apps(rules_from(yaml), backend, default_options(), Metrics::new());
    let (mut app, mut http) = apps;
    app.quota = quota.clone();
    http.quota = quota;
    serve(app, http, 0).await
}

/// [`start_service_with_metrics`] with gRPC connections served by
/// `threads` serving threads (0: on the test's runtime).
pub async fn start_service_on_threads(
    rules: RuleSet,
    backend: Arc<dyn Backend>,
    options: Options,
    metrics: Metrics,
    threads: usize,
) -> TestService {
    let (app, http) = apps(rules, backend, options, metrics);
    serve(app, http, threads).await
}

fn apps(
    rules: RuleSet,
    backend: Arc<dyn Backend>,
    options: Options,
    metrics: Metrics,
) -> (grpc::GrpcApp, http::HttpApp) {
    throttlegate::app::server_apps(
        Arc::new(ArcSwap::from_pointee(rules)),
        Arc::new(ConfigStatus::new(None, SystemTime::now())),
        backend,
        options,
        Arc::new(metrics),
        Duration::from_secs(5),
    )
}

/// Serves `app` (its connections on `threads` serving threads, 0: on the
/// test's runtime) and connects a client.
async fn serve(app: grpc::GrpcApp, http: http::HttpApp, threads: usize) -> TestService {
    let limiter = app.limiter.clone();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral port");
    let addr = listener.local_addr().expect("bound address");
    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let limits = grpc::GrpcLimits {
        threads,
        ..grpc::GrpcLimits::standard()
    };
    let task = tokio::spawn(async move {
        let (control, stages) = grpc::shutdown_channel();
        let serving = grpc::serve_limited(listener, app, limits, stages);
        tokio::pin!(serving);
        tokio::select! {
            res = &mut serving => return res,
            _ = shutdown_rx => control.close(),
        }
        serving.await
    });
    let channel = connect(addr).await;
    TestService {
        addr,
        client: RateLimitServiceClient::new(channel.clone()),
        channel,
        http,
        limiter,
        shutdown: Some(shutdown_tx),
        task: Some(task),
    }
}

/// The value of `series` (name and labels) in a metrics exposition.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .map(|value| value.parse().expect("a number"))
}

/// Sends `request` to `service`, panicking if the answer is an error
/// status rather than a decision.
pub async fn call(service: &TestService, request: RateLimitRequest) -> RateLimitResponse {
    service
        .client()
        .should_rate_limit(request)
        .await
        .unwrap_or_else(|status| panic!("a decision, not an error: {status:?}"))
        .into_inner()
}

/// Sends `request` to `service` and returns the error status it is
/// answered with, panicking with `what` if it is decided instead.
pub async fn refusal(
    service: &TestService,
    request: RateLimitRequest,
    what: &str,
) -> tonic::Status {
    service
        .client()
        .should_rate_limit(request)
        .await
        .expect_err(what)
}

/// A channel to `addr`.
pub async fn connect(addr: SocketAddr) -> Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("valid uri")
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap_or_else(|err| panic!("connect to {addr}: {err}"))
}

impl TestService {
    /// A fresh client on the shared channel.
    pub fn client(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::new(self.channel.clone())
    }

    /// The health status of `service` (`""`, `ratelimit`, ...).
    pub async fn health(&self, service: &str) -> Result<ServingStatus, tonic::Status> {
        let mut client = HealthClient::new(self.channel.clone());
        let res = client
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await?;
        Ok(res.into_inner().status())
    }

    /// Waits until `service` reports `expected`, for at most `within`.
    pub async fn wait_for_health(&self, service: &str, expected: ServingStatus, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let status = self.health(service).await;
            if matches!(&status, Ok(it) if *it == expected) {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "health of {service:?} is {status:?}, expected {expected:?} within {within:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Signals shutdown and waits for the server to finish draining.
    pub async fn stop(mut self) -> Result<(), grpc::Error> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let task = self.task.take().expect("running");
        task.await.expect("server task panicked")
    }
}

impl Drop for TestService {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Sends `body` as the raw message of a `ShouldRateLimit` call, to test
/// what the server does with bytes no generated client would send.
pub async fn should_rate_limit_raw(
    channel: Channel,
    body: Vec<u8>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|err| tonic::Status::unavailable(err.to_string()))?;
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
    );
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A codec that writes and reads message bytes unchanged.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        let mut out = vec![0; prost::bytes::Buf::remaining(src)];
        prost::bytes::Buf::copy_to_slice(src, &mut out);
        Ok(Some(out))
    }
}

/// Starts a server with `yaml` as its only config file, on a memory
/// backend whose clock stands still at [`T0`].
pub async fn start_on_memory(yaml: &str, options: Options) -> TestService {
    let (backend, _clock) = memory_backend();
    start_with_config(yaml, backend, options).await
}

/// Every name the health service answers for: the server as a whole, the
/// short name and the full gRPC service name.
pub const HEALTH_SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];
