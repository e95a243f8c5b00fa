//! Rate-limit quotas (Envoy's RLQS): the rules served as assignments each
//! proxy enforces itself, one budget per rule shared by every proxy
//! reporting it.
//!
//! - `assigner`: the quota assigner the transport calls (`QuotaAssigner`,
//!   and each stream's `StreamMembers`): a report resolved, booked,
//!   answered, counted and logged;
//! - `mapping`: a bucket id to a descriptor (entries sorted by key), the
//!   rule it reaches and what that rule says (ALLOW_ALL, DENY_ALL, or a
//!   budget and the pool sharing it);
//! - `claims`: how many pools each client address keeps alive;
//! - `share`: the sharing rule, max-min fair by reported demand, changed
//!   only when it must be, with assignments that expire;
//! - `bucket`: a share as Envoy's token bucket;
//! - `book`: this instance's pools, and the outboxes through which a
//!   changed share reaches the other proxies' streams;
//! - `redis`: pools kept in Redis, shared by several instances (each
//!   change decided on the latest state, written only if nothing changed
//!   it meanwhile).
//!
//! Knows rules, the clock, metrics and log gates (and the `redis` crate),
//! never wire types: `transport::grpc::rlqs` maps the protocol onto
//! `assigner`. docs/rlqs.md derives the bound on what all proxies together
//! admit.

pub mod assigner;
pub mod book;
pub mod bucket;
pub mod claims;
pub mod mapping;
pub mod redis;
pub mod share;

#[cfg(test)]
mod tests;

pub use assigner::{BucketReport, QuotaAssigner, ReportScope, StreamMembers};
pub use book::{BucketNumber, Order, Outbox, PoolView, QuotaBook, Reported};
pub use bucket::{EnvoyTokenBucket, Grant};
pub use mapping::{MAX_BUCKET_ENTRIES, PoolKey, Resolution, bucket_label, descriptor, resolve};
pub use share::{ASSIGNMENT_TTL_US, Budget, REPORT_INTERVAL_US, Usage};
