//! Generated Envoy rate-limit (RLS) and rate-limit-quota (RLQS) protocol
//! types.
//!
//! Within the service they stop at `crate::transport`: `transport::wire`
//! maps them to and from `crate::decision`'s types (unit and code names
//! included), `transport::grpc` serves them, and no other module names
//! them, except `crate::xds`, the client of a management server. Clients (the tests, the `throttlegate-load` generator) use them
//! directly.
#![allow(clippy::all, missing_docs, unreachable_pub)]

pub mod envoy {
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
            }
        }
        pub mod rate_limit_quota {
            pub mod v3 {
                tonic::include_proto!("envoy.service.rate_limit_quota.v3");
            }
        }
    }
    pub mod extensions {
        pub mod common {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                }
            }
        }
    }
    pub mod r#type {
        pub mod v3 {
            tonic::include_proto!("envoy.r#type.v3");
        }
    }
    pub mod config {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
}

/// The rules over xDS: the aggregated discovery stream (`crate::xds` is its
/// client) and the resource it carries.
pub mod xds {
    pub mod envoy {
        pub mod service {
            pub mod discovery {
                pub mod v3 {
                    tonic::include_proto!("envoy.service.discovery.v3");
                }
            }
        }
        pub use crate::proto::envoy::config;
    }
    pub mod google {
        pub mod rpc {
            tonic::include_proto!("google.rpc");
        }
    }
    pub mod ratelimit {
        pub mod config {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("ratelimit.config.ratelimit.v3");
                }
            }
        }
    }
}

/// The codec of the generated clients and servers: tonic-prost's, with
/// buffers sized for rate-limit messages. tonic's default reserves 8 KiB
/// to decode each request and 8 KiB to encode each answer; a
/// `ShouldRateLimit` request or answer is a few hundred bytes, and a larger
/// one grows its buffer as it needs (up to the server's message limit).
pub mod codec {
    use std::marker::PhantomData;

    use tonic::codec::{BufferSettings, Codec};
    use tonic_prost::{ProstDecoder, ProstEncoder};

    /// Bytes reserved per message to decode or encode it.
    pub const BUFFER_BYTES: usize = 512;
    /// tonic's own: how much a streaming response encodes before yielding
    /// it (unary calls encode one message).
    const YIELD_THRESHOLD: usize = 32 * 1024;

    /// Prost encoding with [`BUFFER_BYTES`] buffers.
    #[derive(Debug, Clone)]
    pub struct SmallBuffers<T, U>(PhantomData<(T, U)>);

    impl<T, U> Default for SmallBuffers<T, U> {
        fn default() -> Self {
            Self(PhantomData)
        }
    }

    fn settings() -> BufferSettings {
        BufferSettings::new(BUFFER_BYTES, YIELD_THRESHOLD)
    }

    impl<T, U> Codec for SmallBuffers<T, U>
    where
        T: prost::Message + Send + 'static,
        U: prost::Message + Default + Send + 'static,
    {
        type Encode = T;
        type Decode = U;
        type Encoder = ProstEncoder<T>;
        type Decoder = ProstDecoder<U>;

        fn encoder(&mut self) -> Self::Encoder {
            ProstEncoder::new(settings())
        }

        fn decoder(&mut self) -> Self::Decoder {
            ProstDecoder::new(settings())
        }
    }
}

/// Encoded `FileDescriptorSet` of our protos, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rls_descriptor");
