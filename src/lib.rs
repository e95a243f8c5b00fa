//! throttlegate: an Envoy-compatible rate-limit decision service.
//!
//! Crate map, one module each:
//! - `algorithms`: the rate-limit math, pure integer functions of time;
//! - `backends`: where counters live (memory, Redis through a Lua script);
//! - `clock`: time sources (the system clock, a manual clock for tests);
//! - `config`: YAML files to a validated `rules::RuleSet`;
//! - `http`: the HTTP endpoints (health, JSON decisions, config, metrics);
//! - `limiter`: the decision on one request;
//! - `listener`: bounded accepting for both servers;
//! - `log_gate`: rate-limited log lines;
//! - `metrics`: Prometheus metrics;
//! - `proto`: generated Envoy wire types;
//! - `reload`: hot reload of the config;
//! - `rules`: rule trees and descriptor matching;
//! - `server`: the gRPC server;
//! - `service`: the gRPC rate-limit service, wire messages to the limiter;
//! - `wildcard`: the index of a rule level's wildcard patterns.

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
        let mapped: Vec<&str> = source
            .lines()
            .filter_map(|line| line.strip_prefix("//! - `")?.split('`').next())
            .collect();
        assert!(!modules.is_empty());
        assert_eq!(mapped, modules);
    }
}
