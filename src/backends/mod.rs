//! Where counters live: one async trait, a memory and a Redis implementation.
//!
//! A backend decides a whole request atomically with
//! [`crate::algorithms::decide`]'s semantics: check every limit, then consume
//! all or nothing.
//!
//! Invariant: a failure reaches the caller as one of [`Error`]'s kinds,
//! and a call never written ([`Stage`] short of `Backend`) consumed
//! nothing.

pub mod keys;
pub mod memory;
pub mod redis;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

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

/// A request's few items (its descriptors, limits or checks), held
/// without a heap allocation up to four: nearly every request has fewer.
pub type PerRequest<T> = smallvec::SmallVec<[T; 4]>;

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
    /// Not sent: the caller's deadline came before the call could be
    /// written with time left to answer it. Not a failure of the backend.
    #[error("no time left before the caller's deadline for a backend call")]
    Deadline,
}

impl Error {
    /// Failures an operator expects to pass (network, restarts).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            Error::Timeout(_) | Error::Unavailable(_) | Error::Shed(_) | Error::Deadline
        )
    }
}

/// How far one call has got, for the count of calls whose caller gave up
/// before its answer (`throttlegate_abandoned_calls_total`'s `stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    /// The request's message is still being read.
    Read = 0,
    /// Read, and being decided: the backend not yet asked.
    Decide = 1,
    /// Waiting for a place toward the backend: a permit of Redis's gate,
    /// or a place in a batch of the batch queue.
    Queue = 2,
    /// Waiting for a pooled connection (a connect, the code loaded on it).
    Connect = 3,
    /// The call is with the backend: written to Redis, its answer awaited.
    Backend = 4,
    /// Never sent: the caller's deadline left too little time for a
    /// backend call, so the failure mode answered at once.
    Deadline = 5,
}

impl Stage {
    pub const ALL: [Stage; 6] = [
        Stage::Read,
        Stage::Decide,
        Stage::Queue,
        Stage::Connect,
        Stage::Backend,
        Stage::Deadline,
    ];

    /// The metric label.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Read => "read",
            Stage::Decide => "decide",
            Stage::Queue => "queue",
            Stage::Connect => "connect",
            Stage::Backend => "backend",
            Stage::Deadline => "deadline",
        }
    }
}

/// The [`Stage`] of one call, shared by its caller and the backend's
/// future (which may finish in a task of its own after the caller left),
/// and whether its caller has left ([`Progress::leave`]): a call that its
/// caller left before it reached [`Stage::Backend`] can no longer enter it
/// ([`Progress::enter_backend`]), so a request queued in a batch is never
/// written once its caller has gone.
#[derive(Debug, Clone)]
pub struct Progress(Arc<AtomicU8>);

/// The bit of [`Progress`] that says the caller has left.
const GONE: u8 = 0x80;

impl Progress {
    pub fn new(stage: Stage) -> Progress {
        Progress(Arc::new(AtomicU8::new(stage as u8)))
    }

    /// Reports `stage` (whether or not the caller is still there).
    pub fn set(&self, stage: Stage) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some((n & GONE) | stage as u8)
            });
    }

    pub fn get(&self) -> Stage {
        stage_of(self.0.load(Ordering::Acquire))
    }

    /// Moves the call to [`Stage::Backend`], the moment before it is
    /// written, unless its caller has left: `false` then, and the call
    /// must not be written.
    pub fn enter_backend(&self) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n & GONE == 0).then_some(Stage::Backend as u8)
            })
            .is_ok()
    }

    /// The caller leaves: the stage the call had reached. From then on
    /// [`Progress::enter_backend`] refuses, so a call not yet at
    /// [`Stage::Backend`] stays unwritten.
    pub fn leave(&self) -> Stage {
        stage_of(self.0.fetch_or(GONE, Ordering::AcqRel))
    }

    /// Whether the caller has left.
    pub fn is_gone(&self) -> bool {
        self.0.load(Ordering::Acquire) & GONE != 0
    }
}

fn stage_of(n: u8) -> Stage {
    let n = n & !GONE;
    Stage::ALL
        .into_iter()
        .find(|it| *it as u8 == n)
        .unwrap_or(Stage::Backend)
}

/// What a backend knows of its caller: when the call must be written by,
/// where to report how far it has got, and where a decision that comes
/// too late for it goes.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// The last moment the call may be sent, from the caller's deadline
    /// (less the time to answer); `None`: only the backend's own timeout.
    /// A call not written by then fails with [`Error::Deadline`]. The
    /// answer to a call written in time is still awaited within the
    /// backend's own timeout, so that what it consumed is counted.
    pub send_by: Option<Instant>,
    pub progress: Progress,
    /// Hears the verdict of a call written in time whose reply came after
    /// the backend's own timeout (the call failed with [`Error::Timeout`]
    /// and its caller was answered without it): the backend keeps
    /// awaiting such a reply for a bounded grace, so that what it consumed
    /// is still counted. `None`: a late reply is discarded.
    pub late: Option<LateVerdict>,
}

/// Where the verdict of a call that outlived its timeout is counted.
#[derive(Clone)]
pub struct LateVerdict(Arc<dyn Fn(Verdict) + Send + Sync>);

impl LateVerdict {
    pub fn new(count: impl Fn(Verdict) + Send + Sync + 'static) -> LateVerdict {
        LateVerdict(Arc::new(count))
    }

    /// Hands `verdict`, decided after its call's timeout, to be counted.
    pub fn deliver(&self, verdict: Verdict) {
        (self.0)(verdict);
    }
}

impl std::fmt::Debug for LateVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LateVerdict")
    }
}

impl CallContext {
    /// No deadline of the caller's.
    pub fn unbounded() -> CallContext {
        CallContext {
            send_by: None,
            progress: Progress::new(Stage::Decide),
            late: None,
        }
    }

    /// Hands `verdict`, whose reply came after the call's timeout, to
    /// [`CallContext::late`], if any.
    pub fn deliver_late(&self, verdict: Verdict) {
        if let Some(late) = &self.late {
            late.deliver(verdict);
        }
    }
}

/// A store of counters that decides requests atomically.
#[async_trait]
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Decides one request over `checks` (distinct keys) atomically.
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error>;

    /// [`Backend::decide`] for a caller with a deadline: never sent after
    /// `call.send_by`, its stage reported in `call.progress`. By default
    /// the deadline is not looked at (the call is in the backend at once).
    async fn decide_within(
        &self,
        checks: &[KeyedCheck],
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        call.progress.set(Stage::Backend);
        self.decide(checks).await
    }

    /// Whether a decision is always ready at once (no IO, no wait): then
    /// no caller can leave in the middle of one. `false` by default.
    fn answers_at_once(&self) -> bool {
        false
    }

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

    /// What an operator should know about the backend's stored state, as
    /// lines `/rlconfig` shows (a Redis holding code of other versions of
    /// the service); found within the backend's own deadline. None by
    /// default.
    async fn notes(&self) -> Vec<String> {
        Vec::new()
    }

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
