//! Rate-limit quotas (Envoy's RLQS): the rules served as assignments each
//! proxy enforces itself, one budget per rule shared by every proxy
//! reporting it.
//!
//! - `mapping`: a bucket id to a descriptor (entries sorted by key), the
//!   rule it reaches and what that rule says (ALLOW_ALL, DENY_ALL, or a
//!   budget and the pool sharing it);
//! - `share`: the sharing rule, max-min fair by reported demand, changed
//!   only when it must be, with assignments that expire;
//! - `bucket`: a share as Envoy's token bucket;
//! - `book`: this instance's pools, and the outboxes through which a
//!   changed share reaches the other proxies' streams;
//! - `redis`: pools kept in Redis, shared by several instances (each
//!   change decided on the latest state, written only if nothing changed
//!   it meanwhile).
//!
//! Knows rules and the clock (and the `redis` crate), never wire types: `transport::grpc::rlqs`
//! maps the protocol onto it. docs/rlqs.md derives the bound on what all
//! proxies together admit.

pub mod book;
pub mod bucket;
pub mod mapping;
pub mod redis;
pub mod share;

#[cfg(test)]
mod tests;

pub use book::{Order, Outbox, PoolView, QuotaBook, Reported, Slot};
pub use bucket::{EnvoyTokenBucket, Grant};
pub use mapping::{MAX_BUCKET_ENTRIES, PoolKey, Resolution, bucket_label, descriptor, resolve};
pub use share::{ASSIGNMENT_TTL_US, Budget, REPORT_INTERVAL_US, Usage};
