//! Server reflection in both versions clients speak, and the size of its errors.

use tonic::Code;

use crate::support;
use crate::support::service::{TestService, memory_backend, start_with_config};

const CONFIG: &str = "domain: test\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 3}\n";

/// A symbol name as long as a client cares to send.
const HUGE_SYMBOL_BYTES: usize = 60 * 1024;

async fn start() -> TestService {
    let (backend, _clock) = memory_backend();
    start_with_config(CONFIG, backend, support::service::default_options()).await
}

/// The services every reflection version lists.
const SERVICES: [&str; 5] = [
    "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
    "envoy.service.ratelimit.v3.RateLimitService",
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

#[tokio::test]
async fn v1alpha_lists_the_services_and_resolves_a_symbol() {
    use crate::support::reflection::v1alpha;
    use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse;

    let service = start().await;
    let requests = [
        MessageRequest::ListServices(String::new()),
        MessageRequest::FileContainingSymbol(
            "envoy.service.ratelimit.v3.RateLimitService".to_owned(),
        ),
    ];
    let mut inbound = v1alpha::ask(service.channel.clone(), requests)
        .await
        .expect("v1alpha reflection call");
    let first = v1alpha::next(&mut inbound).await;
    assert_eq!(v1alpha::service_names(first), SERVICES);
    let second = v1alpha::next(&mut inbound).await;
    assert!(
        matches!(&second, MessageResponse::FileDescriptorResponse(it) if !it.file_descriptor_proto.is_empty()),
        "{second:?}"
    );
}

#[tokio::test]
async fn v1_lists_the_v1alpha_service_too() {
    use crate::support::reflection::v1;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;

    let service = start().await;
    let requests = [MessageRequest::ListServices(String::new())];
    let mut inbound = v1::ask(service.channel.clone(), requests)
        .await
        .expect("v1 reflection call");
    let first = v1::next(&mut inbound).await;
    assert_eq!(v1::service_names(first), SERVICES);
}

/// The status of a 60 KB unknown symbol is NOT_FOUND with a message short
/// enough for any client, and the connection stays usable.
fn assert_short_not_found(status: &tonic::Status) {
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    let message = status.message();
    assert!(
        message.len() <= throttlegate::transport::grpc::MAX_REFLECTION_STATUS_MESSAGE,
        "{} bytes: {}...",
        message.len(),
        &message[..message.len().min(80)]
    );
    assert!(message.starts_with("symbol 'xxxx"), "{message}");
    assert!(message.ends_with("..."), "{message}");
}

/// The 60 KB unknown-symbol test in one reflection version.
macro_rules! huge_unknown_symbol {
    ($test:ident, $version:ident) => {
        #[tokio::test]
        async fn $test() {
            use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;

            let service = start().await;
            let requests = [MessageRequest::FileContainingSymbol(
                "x".repeat(HUGE_SYMBOL_BYTES),
            )];
            let status =
                support::reflection::$version::refused(service.channel.clone(), requests).await;
            assert_short_not_found(&status);
            // The server still answers on the same connection.
            assert!(service.health("").await.is_ok());
        }
    };
}

huge_unknown_symbol!(a_60_kb_unknown_symbol_gets_a_short_message_in_v1, v1);
huge_unknown_symbol!(
    a_60_kb_unknown_symbol_gets_a_short_message_in_v1alpha,
    v1alpha
);
