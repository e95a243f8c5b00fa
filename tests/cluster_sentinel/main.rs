//! Several Redis servers per test: Redis Cluster, Sentinel failovers, the
//! same answers on every backend, and secrets kept out of every output.

#[path = "../support/mod.rs"]
mod support;

mod cluster;
mod differential;
mod secrets;
mod sentinel;
