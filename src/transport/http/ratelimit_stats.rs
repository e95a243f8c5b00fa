//! The envoyproxy/ratelimit-compatible Prometheus endpoint
//! (`--ratelimit-prometheus-addr`, envoyproxy/ratelimit's
//! `PROMETHEUS_ADDR`): `GET <path>` answers the page of
//! [`crate::metrics::ratelimit_prometheus::render`], any other path 404.
//! A port of its own, beside the HTTP port and its own `/metrics`.
//!
//! Bounded as a scrape port needs: at most [`MAX_CONNECTIONS`] open (more
//! wait in the backlog), a request head due within [`HEAD_TIMEOUT`], and
//! no connection open longer than [`CONNECTION_LIFETIME`]. The page is
//! built on the blocking pool. The listener closes at the stop's closing
//! stage.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Response, StatusCode, header};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;

use crate::metrics::Metrics;
use crate::metrics::ratelimit_prometheus::{CONTENT_TYPE, render};
use crate::metrics::statsd_mapping::Mapping;
use crate::transport::shutdown::Shutdown;

/// Scrapers served at once.
pub const MAX_CONNECTIONS: usize = 64;
/// A request head must arrive within this of the accept or of the last
/// answer.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a connection stays open.
pub const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);

/// What the endpoint serves.
#[derive(Debug, Clone)]
pub struct RatelimitStatsPage {
    pub metrics: Arc<Metrics>,
    pub mapping: Arc<Mapping>,
    /// The page's path (`/metrics` unless `PROMETHEUS_PATH` says otherwise).
    pub path: String,
}

/// Serves `page` on `listener` until `shutdown` reaches its closing stage.
pub async fn serve(listener: TcpListener, page: RatelimitStatsPage, shutdown: Shutdown) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEAD_TIMEOUT);
    let closing = shutdown.closing();
    tokio::pin!(closing);
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of descriptors or buffers: wait rather than spin.
                    tracing::debug!("ratelimit statistics endpoint accept failed: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut closing => return,
        };
        let page = page.clone();
        let builder = builder.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let page = page.clone();
                async move { Ok::<_, Infallible>(answer(&page, &request).await) }
            });
            let connection =
                builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, connection).await;
            drop(permit);
        });
    }
}

async fn answer<B>(page: &RatelimitStatsPage, request: &hyper::Request<B>) -> Response<Body> {
    if request.uri().path() != page.path {
        return plain(StatusCode::NOT_FOUND, "not found\n".into());
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "GET only\n".into());
    }
    let metrics = page.metrics.clone();
    let mapping = page.mapping.clone();
    match tokio::task::spawn_blocking(move || render(&metrics.ratelimit_stats(), &mapping)).await {
        Ok(text) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, CONTENT_TYPE)
            .body(Body::from(text))
            .unwrap_or_else(|_| plain(StatusCode::INTERNAL_SERVER_ERROR, String::new())),
        Err(_) => plain(StatusCode::INTERNAL_SERVER_ERROR, "page failed\n".into()),
    }
}

fn plain(status: StatusCode, text: String) -> Response<Body> {
    let mut response = Response::new(Body::from(text));
    *response.status_mut() = status;
    response
}
