//! The service without external servers: the gRPC and HTTP servers in
//! process and as the built binary, config loading and reload, TLS, xDS,
//! traces, metrics, and hostile clients.

#[path = "../support/mod.rs"]
mod support;

mod concurrency;
mod config;
mod config_hostile;
mod floods;
mod grpc;
mod hostile;
mod memory_backend;
mod metrics_flood;
mod overrides;
mod ratelimit_stats;
mod reflection;
mod reload;
mod tls;
mod traces;
mod xds;
