//! Shared test harness: each test binary uses the parts it needs.
// Each tests/*.rs file compiles this module on its own and uses only part of it.
#![allow(dead_code)]

pub mod redis;
