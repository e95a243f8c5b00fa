//! Server reflection in both protocol versions, with status messages cut
//! to a size every client accepts.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::Status;
use tonic::codegen::http;
use tonic::server::NamedService;

use super::layers::cap_status_message;

/// Longest `grpc-message` a reflection service sends, in bytes as sent.
/// Its errors quote the symbol or file name asked for, which a client can
/// make as long as a whole message: a trailer that big is refused by
/// clients.
pub const MAX_REFLECTION_STATUS_MESSAGE: usize = 256;

/// Every service this server answers, in both reflection versions, so that
/// `grpcurl list` shows them whichever version the tool speaks.
fn reflection_builder() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
}

/// `grpc.reflection.v1`.
pub(super) fn reflection_v1() -> tonic_reflection::server::v1::ServerReflectionServer<
    impl tonic_reflection::server::v1::ServerReflection,
> {
    reflection_builder()
        .build_v1()
        .expect("the embedded descriptor sets are valid")
}

/// `grpc.reflection.v1alpha`, still the only version older grpcurl,
/// Postman and Evans speak.
pub(super) fn reflection_v1alpha() -> tonic_reflection::server::v1alpha::ServerReflectionServer<
    impl tonic_reflection::server::v1alpha::ServerReflection,
> {
    reflection_builder()
        .build_v1alpha()
        .expect("the embedded descriptor sets are valid")
}

/// A gRPC service whose status messages, in headers or trailers, are cut
/// to [`MAX_REFLECTION_STATUS_MESSAGE`].
#[derive(Debug, Clone)]
pub(super) struct ShortStatus<S>(pub(super) S);

impl<S: NamedService> NamedService for ShortStatus<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for ShortStatus<S>
where
    S: tower::Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send + 'static>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let (mut parts, body) = response.await?.into_parts();
            shorten_status_message(&mut parts.headers);
            Ok(http::Response::from_parts(
                parts,
                tonic::body::Body::new(ShortStatusBody(body)),
            ))
        })
    }
}

/// A response body whose trailers go through [`shorten_status_message`].
struct ShortStatusBody(tonic::body::Body);

impl http_body::Body for ShortStatusBody {
    type Data = tonic::codegen::Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.0).poll_frame(cx).map(|frame| {
            frame.map(|frame| {
                frame.map(|mut frame| {
                    if let Some(trailers) = frame.trailers_mut() {
                        shorten_status_message(trailers);
                    }
                    frame
                })
            })
        })
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

/// Cuts a `grpc-message` longer than [`MAX_REFLECTION_STATUS_MESSAGE`].
fn shorten_status_message(headers: &mut http::HeaderMap) {
    cap_status_message(headers, MAX_REFLECTION_STATUS_MESSAGE);
}
