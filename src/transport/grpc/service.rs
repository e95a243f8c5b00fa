//! The gRPC RateLimitService: each call decided by the [`Limiter`], its
//! request and answer mapped by [`crate::transport::wire`].

use std::sync::Arc;

use tonic::{Request, Response};

use crate::decision::{self, Limiter};
use crate::metrics::Metrics;
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::transport::wire::{from_wire, to_wire};

/// Serves `ShouldRateLimit` through a [`Limiter`].
#[derive(Debug, Clone)]
pub struct RateLimitService {
    limiter: Arc<Limiter>,
    /// Where calls in flight are counted.
    metrics: Arc<Metrics>,
}

impl RateLimitService {
    pub fn new(limiter: Arc<Limiter>, metrics: Arc<Metrics>) -> Self {
        Self { limiter, metrics }
    }

    /// The generated tonic server around this service.
    pub fn into_server(
        self,
    ) -> rls::rate_limit_service_server::RateLimitServiceServer<RateLimitService> {
        rls::rate_limit_service_server::RateLimitServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl rls::rate_limit_service_server::RateLimitService for RateLimitService {
    async fn should_rate_limit(
        &self,
        request: Request<rls::RateLimitRequest>,
    ) -> Result<Response<rls::RateLimitResponse>, tonic::Status> {
        let _in_flight = self.metrics.track_in_flight();
        let request = from_wire(request.into_inner());
        let decision = self.limiter.decide(&request).await.map_err(to_status)?;
        Ok(Response::new(to_wire(decision)))
    }
}

/// The one place a limiter error becomes a gRPC status.
///
/// Envoy's rate-limit filter treats any error (and `Code::UNKNOWN` in the
/// response) as "the service could not decide" and then applies its own
/// `failure_mode_deny` (default: allow). So an infrastructure failure must be
/// a real error status, and a clear one: `UNAVAILABLE` tells operators and
/// retry policies that the backend is down, not that the request was bad.
/// A malformed request is `INVALID_ARGUMENT`: retrying it cannot help.
pub fn to_status(error: decision::Error) -> tonic::Status {
    match error {
        decision::Error::InvalidArgument(message) => tonic::Status::invalid_argument(message),
        decision::Error::Backend(error) => tonic::Status::unavailable(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_failure_is_unavailable_never_unknown() {
        let cases = [
            crate::backends::Error::Timeout(250),
            crate::backends::Error::Unavailable("refused".to_owned()),
            crate::backends::Error::Protocol("bad reply".to_owned()),
        ];
        for error in cases {
            let status = to_status(decision::Error::Backend(error));
            assert_eq!(status.code(), tonic::Code::Unavailable);
        }
        let status = to_status(decision::Error::InvalidArgument("empty domain".to_owned()));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "empty domain");
    }
}
