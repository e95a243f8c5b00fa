//! throttlegate: an Envoy-compatible rate-limit decision service.
//!
//! Crate map: `config` (YAML → `rules`), `rules` (descriptor matching),
//! `algorithms` (pure rate-limit math), `backends` (memory, Redis),
//! `clock`, `proto` (generated wire types), and the gRPC service.

pub mod algorithms;
pub mod backends;
pub mod clock;
pub mod config;
pub mod proto;
pub mod rules;
