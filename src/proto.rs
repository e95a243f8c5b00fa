//! Generated Envoy rate-limit protocol types.
//!
//! Within the service they stop at `crate::transport`: `transport::wire`
//! maps them to and from `crate::decision`'s types (unit and code names
//! included), `transport::grpc` serves them, and no other module names
//! them. Clients (the tests, the `throttlegate-load` generator) use them
//! directly.
#![allow(clippy::all, missing_docs, unreachable_pub)]

pub mod envoy {
    pub mod service {
        pub mod ratelimit {
            pub mod v3 {
                tonic::include_proto!("envoy.service.ratelimit.v3");
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

/// Encoded `FileDescriptorSet` of our protos, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rls_descriptor");
