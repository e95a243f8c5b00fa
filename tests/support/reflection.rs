//! Server reflection streams in both protocol versions clients speak.

/// One module per reflection version: its `ask` sends requests on one
/// stream. The versions share message shapes but not types.
macro_rules! reflection_version {
    ($version:ident) => {
        pub mod $version {
            use tonic::transport::Channel;
            use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
            use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
            use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
            use tonic_reflection::pb::$version::{
                ServerReflectionRequest, ServerReflectionResponse,
            };

            /// Opens a reflection stream on `channel` that sends `requests`,
            /// one message each; the stream of answers, or the call's error.
            pub async fn ask(
                channel: Channel,
                requests: impl IntoIterator<Item = MessageRequest>,
            ) -> Result<tonic::Streaming<ServerReflectionResponse>, tonic::Status> {
                let outbound: Vec<ServerReflectionRequest> = requests
                    .into_iter()
                    .map(|it| ServerReflectionRequest {
                        host: String::new(),
                        message_request: Some(it),
                    })
                    .collect();
                ServerReflectionClient::new(channel)
                    .server_reflection_info(tokio_stream::iter(outbound))
                    .await
                    .map(tonic::Response::into_inner)
            }

            /// The names of the services a `ListServices` answer lists,
            /// sorted; panics on any other answer.
            pub fn service_names(answer: MessageResponse) -> Vec<String> {
                let MessageResponse::ListServicesResponse(list) = answer else {
                    panic!("{answer:?}");
                };
                let mut names: Vec<String> = list.service.into_iter().map(|it| it.name).collect();
                names.sort();
                names
            }

            /// The status a stream that sends `requests` fails with: the
            /// call's own, or its first answer's; panics if it answers.
            pub async fn refused(
                channel: Channel,
                requests: impl IntoIterator<Item = MessageRequest>,
            ) -> tonic::Status {
                match ask(channel, requests).await {
                    Ok(mut stream) => stream.message().await.expect_err("an error"),
                    Err(status) => status,
                }
            }

            /// The next answer on `inbound`; panics if the stream fails or
            /// ends first.
            pub async fn next(
                inbound: &mut tonic::Streaming<ServerReflectionResponse>,
            ) -> MessageResponse {
                inbound
                    .message()
                    .await
                    .expect("an answer")
                    .expect("an answer")
                    .message_response
                    .expect("a response")
            }
        }
    };
}

reflection_version!(v1);
reflection_version!(v1alpha);
