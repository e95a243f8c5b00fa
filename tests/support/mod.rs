//! Shared test harness: each test binary uses the parts it needs.
#![allow(dead_code, reason = "every test binary uses a different subset")]

pub mod certs;
pub mod cluster;
pub mod config;
pub mod envoy;
pub mod keys;
pub mod process;
pub mod proxy;
pub mod redis;
pub mod reflection;
pub mod request;
pub mod rng;
pub mod sentinel;
pub mod service;
pub mod tls;
pub mod tools;
pub mod xds;

/// Taken by the tests that measure wall time or load both cores, so that
/// no two of them run at once in one test binary.
pub static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
