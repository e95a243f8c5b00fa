//! The built binary's commands and start-ups: `check-config`, `check`, exit
//! codes and signals, `simulate`, the load generator, and `serve` started
//! from envoyproxy/ratelimit's or Envoy Gateway's environment.

#[path = "../support/mod.rs"]
mod support;

mod commands;
mod envoy_gateway;
mod load_generator;
mod migrate;
mod simulate;
