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
use sha2::{Digest, Sha256};

use crate::algorithms::{Algorithm, Check, Verdict};
use crate::clock::Clock;

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
    pub key: KeyBytes,
    pub value: KeyValue,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyValue {
    /// The descriptor's own value: one counter per distinct value.
    Value(KeyBytes),
    /// A `share_threshold` wildcard: every matching value shares the
    /// counter named by the pattern.
    Shared(Arc<str>),
}

/// Longest descriptor key or value kept as is in a counter's identity.
pub const MAX_INLINE_BYTES: usize = 256;

/// A descriptor key or value (any bytes, any length) as part of a counter's
/// identity: the bytes themselves up to [`MAX_INLINE_BYTES`], else their
/// SHA-256 digest, so that a counter's key stays short whatever a client
/// sends. Two different byte strings get different `KeyBytes` unless both
/// are long and their digests collide.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyBytes(Repr);

/// Bytes held in place, without an allocation: the room a digest takes
/// anyway, and enough for nearly every descriptor key and value.
const SHORT_BYTES: usize = 32;

/// One form per length, so that equal bytes always have equal forms.
#[derive(Clone, PartialEq, Eq)]
enum Repr {
    /// At most [`SHORT_BYTES`]; the bytes past `len` are zero.
    Short {
        len: u8,
        bytes: [u8; SHORT_BYTES],
    },
    /// Longer, up to [`MAX_INLINE_BYTES`].
    Inline(Box<[u8]>),
    Digest([u8; 32]),
}

impl KeyBytes {
    pub fn new(bytes: &[u8]) -> KeyBytes {
        if bytes.len() <= SHORT_BYTES {
            let mut short = [0; SHORT_BYTES];
            short[..bytes.len()].copy_from_slice(bytes);
            // At most SHORT_BYTES: the cast is exact.
            let len = bytes.len() as u8;
            KeyBytes(Repr::Short { len, bytes: short })
        } else if bytes.len() <= MAX_INLINE_BYTES {
            KeyBytes(Repr::Inline(bytes.into()))
        } else {
            KeyBytes(Repr::Digest(Sha256::digest(bytes).into()))
        }
    }

    /// The bytes, when short enough to be kept.
    pub fn inline(&self) -> Option<&[u8]> {
        match &self.0 {
            Repr::Short { len, bytes } => Some(&bytes[..usize::from(*len)]),
            Repr::Inline(bytes) => Some(bytes),
            Repr::Digest(_) => None,
        }
    }

    /// The value whose digest is `digest`, as decoding a counter key finds it.
    #[cfg(test)]
    pub(crate) fn from_digest(digest: [u8; 32]) -> KeyBytes {
        KeyBytes(Repr::Digest(digest))
    }

    /// Bytes held: the value's own length, or a digest's 32.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Short { len, .. } => usize::from(*len),
            Repr::Inline(bytes) => bytes.len(),
            Repr::Digest(digest) => digest.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The SHA-256 digest that stands for a long key or value.
    pub fn digest(&self) -> Option<&[u8; 32]> {
        match &self.0 {
            Repr::Short { .. } | Repr::Inline(_) => None,
            Repr::Digest(digest) => Some(digest),
        }
    }
}

/// Hashes the bytes kept (or the digest), not a short value's unused room.
impl std::hash::Hash for Repr {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            Repr::Short { len, bytes } => bytes[..usize::from(*len)].hash(state),
            Repr::Inline(bytes) => bytes.hash(state),
            Repr::Digest(digest) => digest.hash(state),
        }
    }
}

/// Every kept value shows as `Inline`, short or not: how it is held is no
/// part of what it is.
impl std::fmt::Debug for Repr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Repr::Short { len, bytes } => {
                let kept = &bytes[..usize::from(*len)];
                f.debug_tuple("Inline").field(&kept).finish()
            }
            Repr::Inline(bytes) => f.debug_tuple("Inline").field(bytes).finish(),
            Repr::Digest(digest) => f.debug_tuple("Digest").field(digest).finish(),
        }
    }
}

impl From<&[u8]> for KeyBytes {
    fn from(bytes: &[u8]) -> KeyBytes {
        KeyBytes::new(bytes)
    }
}

impl From<&str> for KeyBytes {
    fn from(text: &str) -> KeyBytes {
        KeyBytes::new(text.as_bytes())
    }
}

impl From<String> for KeyBytes {
    fn from(text: String) -> KeyBytes {
        KeyBytes::new(text.as_bytes())
    }
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
    /// Refused at once, unsent: as many calls as allowed already wait
    /// toward the backend (Redis's queue bound; see `redis::gate`).
    #[error("backend overloaded: {0} calls already waiting, call shed")]
    Shed(usize),
}

impl Error {
    /// Failures an operator expects to pass (network, restarts).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Timeout(_) | Error::Unavailable(_) | Error::Shed(_)
        )
    }
}

/// A store of counters that decides requests atomically.
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Decides one request over `checks` (distinct keys) atomically.
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error>;

    /// Whether the backend answers now; drives gRPC health.
    async fn probe(&self) -> Result<(), Error>;

    /// Makes ready, by the backend's own deadline, what the calling
    /// thread's first decision would otherwise wait for (a connection, code
    /// loaded on the server), so that the first requests after start are
    /// answered as fast as later ones. Called once at start and once on
    /// each serving thread as it starts; a failure is only logged, and
    /// left to the backend to handle as it would a call's. Nothing to do by
    /// default.
    async fn warm_up(&self) {}

    /// `memory` or `redis`, for logs and metrics.
    fn name(&self) -> &'static str;

    /// A clock of this process on which the durations in this backend's
    /// outcomes run from the moment a call is made (for a Redis backend
    /// deciding on the server's clock, a local monotonic one), so that a
    /// counter reported full can be answered locally until it has room
    /// again. `None` (the default) when answering locally would save
    /// nothing, as for the in-memory backend.
    fn local_clock(&self) -> Option<Arc<dyn Clock>> {
        None
    }
}
