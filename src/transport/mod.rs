//! The edges of the service: the gRPC and HTTP servers, what both share
//! (bounded accepting, TLS, the health answer, the stages of a graceful
//! stop),
//! and the one mapping between wire messages and decisions.
//!
//! Prost types stop here: [`wire`] turns them into `crate::decision`'s
//! types, and nothing past this module names `crate::proto`.

pub mod grpc;
pub mod health;
pub mod http;
pub mod listener;
pub mod shutdown;
pub mod tls;
pub mod wire;
