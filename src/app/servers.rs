//! What the gRPC and HTTP servers serve: one limiter (and its options),
//! one health answer and one quota book shared by both. Invariant: both
//! servers answer from the same limiter, so a decision is the same
//! whichever port asked.

use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::backends::Backend;
use crate::clock::SystemClock;
use crate::config::ConfigStatus;
use crate::decision::{Limiter, Options};
use crate::metrics::Metrics;
use crate::quota::QuotaBook;
use crate::rules::RuleSet;
use crate::transport::grpc;
use crate::transport::health::Health;
use crate::transport::http;

use super::{Aborted, Settings};

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

/// The limiter's options; fails on a response header name HTTP refuses.
pub(super) fn limiter_options(settings: &Settings) -> Result<Options, Aborted> {
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
