//! throttlegate: an Envoy-compatible rate-limit decision service.
//!
//! Crate map: `config` (YAML → `rules`), `rules` (descriptor matching),
//! `algorithms` (pure rate-limit math), `backends` (memory, Redis),
//! `wildcard` (the index of a level's wildcard patterns),
//! `clock`, `limiter` (the decision on a request), `log_gate`
//! (rate-limited log lines), `metrics` (Prometheus),
//! `reload` (hot reload of the config), `proto` (generated wire types),
//! `service` (gRPC <-> limiter), `server` (the gRPC server) and `listener`
//! (bounded accepting for both servers).

pub mod algorithms;
pub mod backends;
pub mod clock;
pub mod config;
pub mod http;
pub mod limiter;
pub mod listener;
pub mod log_gate;
pub mod metrics;
pub mod proto;
pub mod reload;
pub mod rules;
pub mod server;
pub mod service;
pub mod wildcard;

#[cfg(test)]
pub(crate) mod testing;

pub use server::serve;
