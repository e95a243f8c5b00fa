//! `grpc.health.v1.Health`: the status of [`Health`] for every name the
//! service is known by, kept in step by a monitor, NOT_SERVING once a stop
//! begins, with Watch streams that end when the listeners close.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{self, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_health::server::{HealthReporter, HealthService};

use crate::transport::health::Health;

/// Names reported by `grpc.health.v1.Health`: the whole server, the name
/// envoyproxy/ratelimit uses, and the fully qualified services (RLS and
/// RLQS).
pub const HEALTH_SERVICES: [&str; 4] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
];

/// How often the backend is probed for health.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);

/// What moves the health service through a graceful stop while serving:
/// the reporter every status goes through, the monitor probing the
/// backend, and the switch that ends every Watch stream.
pub(super) struct HealthReports {
    reporter: HealthReporter,
    monitor: HealthMonitor,
    end_watches: watch::Sender<bool>,
}

/// The Watch streams of a server that reports NOT_SERVING, still open
/// until [`OpenWatches::end`] (or a drop) ends them.
pub(super) struct OpenWatches {
    end: watch::Sender<bool>,
}

impl HealthReports {
    /// Starts reporting `health` (which follows the server's shutdown) and
    /// returns the service answering from it. The backend is probed once
    /// before: the first answer is known before the first connection.
    pub(super) async fn start(health: Health) -> (Self, HealthServer<HealthUntilClosed>) {
        let reporter = HealthReporter::new();
        let healthy = health.probe().await.is_ok();
        set_health(&reporter, healthy).await;
        let (end_watches, ended) = watch::channel(false);
        let service = HealthServer::new(HealthUntilClosed {
            inner: HealthService::from_health_reporter(reporter.clone()),
            health: health.clone(),
            ended,
        });
        let monitor = HealthMonitor::spawn(health, reporter.clone(), healthy);
        let reports = Self {
            reporter,
            monitor,
            end_watches,
        };
        (reports, service)
    }

    /// Reports NOT_SERVING from now on, whatever the backend says (the
    /// monitor stops): load balancers must see it while requests are still
    /// answered. Every watcher is sent it before its stream can end.
    pub(super) async fn not_serving(self) -> OpenWatches {
        let Self {
            reporter,
            monitor,
            end_watches,
        } = self;
        drop(monitor);
        set_health(&reporter, false).await;
        OpenWatches { end: end_watches }
    }
}

impl OpenWatches {
    /// Ends every Watch stream, with UNAVAILABLE so that clients look for
    /// another server.
    pub(super) fn end(self) {
        let _ = self.end.send(true);
    }
}

/// `grpc.health.v1.Health` that answers NOT_SERVING from the moment a
/// stop begins, and whose Watch streams end when the listeners close. A
/// Watch never ends on its own, so an open one would otherwise hold the
/// drain until its deadline.
pub(super) struct HealthUntilClosed {
    inner: HealthService,
    /// Read by Check itself, so that it never answers SERVING once the stop
    /// has begun, even before the reporter has been told.
    health: Health,
    /// Turns true when every Watch stream is to end.
    ended: watch::Receiver<bool>,
}

#[tonic::async_trait]
impl health_server::Health for HealthUntilClosed {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        // Unknown service names stay NOT_FOUND.
        let res = self.inner.check(request).await?;
        if !self.health.stopping() {
            return Ok(res);
        }
        Ok(Response::new(HealthCheckResponse {
            status: tonic_health::pb::health_check_response::ServingStatus::NotServing.into(),
        }))
    }

    type WatchStream = WatchUntilClosed;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut ended = self.ended.clone();
        Ok(Response::new(WatchUntilClosed {
            statuses,
            // An error means the server is gone: end the stream as well.
            ended: Some(Box::pin(async move {
                let _ = ended.wait_for(|it| *it).await;
            })),
            finished: false,
        }))
    }
}

/// The status changes of one Watch call, then UNAVAILABLE when the
/// listeners close, so that the client looks for another server.
pub(super) struct WatchUntilClosed {
    statuses: tonic_health::server::WatchStream,
    /// Completes when the stream is to end; `None` once it has.
    ended: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    finished: bool,
}

impl Stream for WatchUntilClosed {
    type Item = Result<HealthCheckResponse, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if let Some(ended) = self.ended.as_mut()
            && ended.as_mut().poll(cx).is_ready()
        {
            self.ended = None;
        }
        // A change not yet sent (NOT_SERVING) goes out before the end.
        match Pin::new(&mut self.statuses).poll_next(cx) {
            Poll::Ready(Some(change)) => Poll::Ready(Some(change)),
            Poll::Ready(None) => {
                self.finished = true;
                Poll::Ready(None)
            }
            Poll::Pending if self.ended.is_none() => {
                self.finished = true;
                Poll::Ready(Some(Err(Status::unavailable("server is shutting down"))))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

async fn set_health(reporter: &HealthReporter, serving: bool) {
    let status = if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in HEALTH_SERVICES {
        reporter.set_service_status(name, status).await;
    }
}

/// Probes the backend every second and keeps health in step; the task
/// stops when this guard is dropped, so it never outlives the server.
struct HealthMonitor {
    task: JoinHandle<()>,
}

impl HealthMonitor {
    fn spawn(health: Health, reporter: HealthReporter, mut healthy: bool) -> Self {
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(PROBE_INTERVAL);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick completes at once; the initial probe was just made.
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let now_healthy = health.probe().await.is_ok();
                if now_healthy != healthy {
                    if now_healthy {
                        tracing::info!(
                            backend = health.backend_name(),
                            "backend recovered: serving"
                        );
                    } else {
                        tracing::warn!(
                            backend = health.backend_name(),
                            "backend probe failed: not serving"
                        );
                    }
                    set_health(&reporter, now_healthy).await;
                    healthy = now_healthy;
                }
            }
        });
        Self { task }
    }
}

impl Drop for HealthMonitor {
    fn drop(&mut self) {
        self.task.abort();
    }
}
