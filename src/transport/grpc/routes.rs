//! The gRPC server's one router: a request goes to the service its path
//! names (`/SERVICE/METHOD`), found by comparing the name with each
//! service's. tonic's own router matches a path pattern per request,
//! decodes and stores the pattern's parameter, and clones the matched
//! service into a box; with four services a comparison of names does the
//! same job, and the service's own future is returned as it is.
//!
//! `ShouldRateLimit` never comes here: the server sends it to
//! `RateLimitService` itself (`server.rs`). Any other method of the
//! rate-limit service is UNIMPLEMENTED, like any path of no service here.

use std::convert::Infallible;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::codegen::{BoxFuture, http};
use tonic::server::NamedService;

use super::service::status_response;

/// A gRPC service as the server runs it: every request gets an answer
/// (errors are statuses inside it), through a boxed future.
pub(super) trait GrpcService:
    tower::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
        Future = BoxFuture<http::Response<Body>, Infallible>,
    > + Clone
    + Send
    + 'static
{
}

impl<S> GrpcService for S where
    S: tower::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
            Future = BoxFuture<http::Response<Body>, Infallible>,
        > + Clone
        + Send
        + 'static
{
}

/// Each service behind the server: its methods are `/NAME/METHOD`.
pub(super) trait Routed: GrpcService + NamedService {}

impl<S: GrpcService + NamedService> Routed for S {}

/// The services of the gRPC server besides `ShouldRateLimit`, routed by
/// the service name in the path; any other path is UNIMPLEMENTED, as with
/// tonic's router.
#[derive(Debug, Clone)]
pub(super) struct Services<H, V1, V1A, Q> {
    pub(super) health: H,
    pub(super) reflection_v1: V1,
    pub(super) reflection_v1alpha: V1A,
    /// The rate-limit quota service (RLQS).
    pub(super) quota: Q,
}

impl<H: Routed, V1: Routed, V1A: Routed, Q: Routed> tower::Service<http::Request<Body>>
    for Services<H, V1, V1A, Q>
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<http::Response<Body>, Infallible>;

    /// Always ready: the generated servers (and `ShortStatus` around
    /// them) are always ready themselves and hold no per-call state.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let name = service_name(request.uri().path());
        if name == Some(H::NAME) {
            self.health.call(request)
        } else if name == Some(V1::NAME) {
            self.reflection_v1.call(request)
        } else if name == Some(V1A::NAME) {
            self.reflection_v1alpha.call(request)
        } else if name == Some(Q::NAME) {
            self.quota.call(request)
        } else {
            Box::pin(async { Ok(unimplemented()) })
        }
    }
}

/// `SERVICE` of a path `/SERVICE/METHOD` (the method not empty).
fn service_name(path: &str) -> Option<&str> {
    let (service, method) = path.strip_prefix('/')?.split_once('/')?;
    (!method.is_empty()).then_some(service)
}

/// What tonic's router answers for a service it does not have.
fn unimplemented() -> http::Response<Body> {
    status_response(tonic::Status::unimplemented(""))
}

#[cfg(test)]
mod tests;
