//! throttlegate: an Envoy-compatible rate-limit decision service.
//!
//! Crate map: `cli` reads the command line, `app` builds the service,
//! then the modules in the order a request meets them:
//! - `cli`: the `throttlegate` command line: subcommands, flags, and
//!   envoyproxy/ratelimit's variables as their defaults;
//! - `app`: the composition root of `serve`: settings to running servers,
//!   signals to an exit code;
//! - `transport`: the gRPC and HTTP servers, bounded accepting, wire mapping;
//! - `decision`: the decision on one request (`Limiter`);
//! - `rules`: validated rule trees and descriptor matching;
//! - `backends`: where counters live (memory, Redis through a Lua script);
//! - `algorithms`: the rate-limit math, pure integer functions of time;
//! - `config`: YAML files to a validated `rules::RuleSet`, and hot reload;
//! - `quota`: Envoy's rate-limit quotas (RLQS): rules as budgets shared
//!   among proxies, max-min fair by their reported demand;
//! - `fuzzing`: the bodies of the fuzz targets and of their proptest
//!   twins (unit tests and the `fuzzing` feature only);
//! - `simulate`: `throttlegate simulate`, a traffic pattern replayed
//!   through one rule with each algorithm, drawn as SVG;
//! - `metrics`: Prometheus metrics;
//! - `traces`: OpenTelemetry traces of decisions, exported over OTLP;
//! - `log_gate`: rate-limited log lines;
//! - `serving_thread`: which serving thread (`--grpc-threads`) code runs on;
//! - `pem`: certificates and keys read from PEM files, errors naming files;
//! - `clock`: time sources (the system clock, a manual clock for tests);
//! - `testing`: the fake backend and builders the tests share (unit tests
//!   and the `testing` feature only);
//! - `proto`: generated Envoy wire types;
//! - `compat`: envoyproxy/ratelimit's environment variables as `serve` flags;
//! - `xds`: rules pushed by a management server over xDS (the client of
//!   its aggregated discovery stream).

pub mod algorithms;
pub mod app;
pub mod backends;
pub mod cli;
pub mod clock;
pub mod compat;
pub mod config;
pub mod decision;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod log_gate;
pub mod metrics;
pub mod pem;
pub mod proto;
pub mod quota;
pub mod rules;
pub mod serving_thread;
pub mod simulate;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
pub mod traces;
pub mod transport;
pub mod xds;

pub use transport::grpc::serve;

#[cfg(test)]
mod tests;
