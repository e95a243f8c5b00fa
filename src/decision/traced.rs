//! What a traced caller learns of its request's backend call: which
//! backend, when the call started, how long it took and how it failed.
//! The transport that traces a decision hands a [`BackendCall`] in its
//! [`super::Caller`] and reads it once the decision is made; an untraced
//! caller hands none, and the decision then records nothing.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime};

/// One request's backend call, as recorded when it returned.
#[derive(Debug, Default)]
pub struct BackendCall {
    // Written once by the call, read once by the caller after it; never
    // held across an await.
    times: Mutex<Option<BackendCallTimes>>,
}

/// A finished backend call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendCallTimes {
    /// `Backend::name`: memory, redis, redis-cluster...
    pub backend: &'static str,
    pub started: SystemTime,
    pub took: Duration,
    /// Why it failed; `None`: it decided.
    pub error: Option<String>,
}

impl BackendCall {
    pub(super) fn record(&self, times: BackendCallTimes) {
        *self.times.lock().unwrap_or_else(PoisonError::into_inner) = Some(times);
    }

    /// The call, if one was made (none for an unknown domain, a request
    /// without counters, or one answered from the over-limit cache).
    pub fn take(&self) -> Option<BackendCallTimes> {
        self.times
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}
