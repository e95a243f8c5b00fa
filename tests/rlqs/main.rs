//! Envoy's rate-limit quota service (RLQS): the gRPC stream in process,
//! what one client may hold, and budgets kept in Redis.

#[path = "../support/mod.rs"]
mod support;

mod bounds;
mod grpc;
mod redis;
