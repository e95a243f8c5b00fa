//! The edges of the service: the gRPC and HTTP servers, bounded accepting
//! shared by both, and the mapping between wire messages and decisions.

pub mod grpc;
pub mod http;
pub mod listener;
