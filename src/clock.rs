//! Time sources: the system clock in production, a manual clock in tests.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Microseconds since the Unix epoch.
pub type Micros = u64;

/// A source of the current time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now_us(&self) -> Micros;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> Micros {
        // A clock before 1970 is a broken host; answering 0 keeps decisions
        // deterministic instead of panicking in the request path.
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|elapsed| elapsed.as_micros() as Micros)
            .unwrap_or(0)
    }
}

/// Microseconds since it was made, on the operating system's monotonic
/// clock: for measuring durations, which a wall clock stepped by NTP would
/// stretch or shrink.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock {
    start: Instant,
}

impl MonotonicClock {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
        }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now_us(&self) -> Micros {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// A clock that moves only when told to; cloning shares the same time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    pub fn new(start_us: Micros) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start_us)),
        }
    }

    pub fn set(&self, now_us: Micros) {
        self.now.store(now_us, Ordering::SeqCst);
    }

    pub fn advance(&self, by_us: Micros) {
        self.now.fetch_add(by_us, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_us(&self) -> Micros {
        self.now.load(Ordering::SeqCst)
    }
}
