//! throttlegate: an Envoy-compatible rate-limit decision service.
//!
//! Crate map: `app` builds the service, then the modules in the order a
//! request meets them:
//! - `app`: the composition root of `serve`: settings to running servers,
//!   signals to an exit code;
//! - `transport`: the gRPC and HTTP servers, bounded accepting, wire mapping;
//! - `decision`: the decision on one request (`Limiter`);
//! - `rules`: validated rule trees and descriptor matching;
//! - `backends`: where counters live (memory, Redis through a Lua script);
//! - `algorithms`: the rate-limit math, pure integer functions of time;
//! - `config`: YAML files to a validated `rules::RuleSet`, and hot reload;
//! - `metrics`: Prometheus metrics;
//! - `log_gate`: rate-limited log lines;
//! - `clock`: time sources (the system clock, a manual clock for tests);
//! - `proto`: generated Envoy wire types.

pub mod algorithms;
pub mod app;
pub mod backends;
pub mod clock;
pub mod config;
pub mod decision;
pub mod log_gate;
pub mod metrics;
pub mod proto;
pub mod rules;
pub mod transport;

#[cfg(test)]
pub(crate) mod testing;

pub use transport::grpc::serve;

#[cfg(test)]
mod tests {
    /// The crate map above names every module, and only those.
    #[test]
    fn the_crate_map_lists_every_module() {
        let source = include_str!("lib.rs");
        let modules: Vec<&str> = source
            .lines()
            .filter_map(|line| line.strip_prefix("pub mod ")?.strip_suffix(';'))
            .collect();
        let mut mapped: Vec<&str> = source
            .lines()
            .filter_map(|line| line.strip_prefix("//! - `")?.split('`').next())
            .collect();
        assert!(!modules.is_empty());
        mapped.sort_unstable();
        assert_eq!(mapped, modules, "rustfmt keeps the declarations sorted");
    }
}
