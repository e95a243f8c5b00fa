//! Where counters live: one async trait, a memory and a Redis implementation.
//!
//! A backend decides a whole request atomically with
//! [`crate::algorithms::decide`]'s semantics: check every limit, then consume
//! all or nothing.

pub mod keys;
pub mod memory;
pub mod redis;

use std::sync::Arc;

use async_trait::async_trait;

use crate::algorithms::{Algorithm, Check, Verdict};

/// Identity of one counter. Two checks with equal keys share state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CounterKey {
    pub domain: Arc<str>,
    /// The matched rule's path (`tenant.path_/expensive`); for a
    /// RateLimitOverride, the descriptor's keys joined by `.`.
    pub rule: Arc<str>,
    pub algorithm: Algorithm,
    /// The limit's window in seconds: distinguishes the limits of one node.
    pub window_s: u64,
    /// A RateLimitOverride's counter, never shared with a rule's.
    pub is_override: bool,
    /// One per descriptor entry, in order.
    pub entries: Vec<KeyEntry>,
}

/// One descriptor entry as part of a counter's identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyEntry {
    pub key: Arc<str>,
    pub value: KeyValue,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyValue {
    /// The descriptor's own value: one counter per distinct value.
    Value(String),
    /// A `share_threshold` wildcard: every matching value shares the
    /// counter named by the pattern.
    Shared(Arc<str>),
}

/// A check together with the counter it reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedCheck {
    pub key: CounterKey,
    pub check: Check,
}

/// A backend failure, classified where it arises.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// No answer within the configured timeout. The script may have run:
    /// never retried.
    #[error("backend timed out after {0} ms")]
    Timeout(u64),
    /// The backend cannot be reached (refused, dropped, no pooled connection).
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// The backend answered with something we cannot use.
    #[error("backend error: {0}")]
    Protocol(String),
    /// The in-memory backend holds its most counters and the request needs
    /// a new one; existing counters keep working.
    #[error("backend full: {0} counters, the most allowed")]
    Full(usize),
}

impl Error {
    /// Failures an operator expects to pass (network, restarts).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Timeout(_) | Error::Unavailable(_))
    }
}

/// A store of counters that decides requests atomically.
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Decides one request over `checks` (distinct keys) atomically.
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error>;

    /// Whether the backend answers now; drives gRPC health.
    async fn probe(&self) -> Result<(), Error>;

    /// `memory` or `redis`, for logs and metrics.
    fn name(&self) -> &'static str;
}
