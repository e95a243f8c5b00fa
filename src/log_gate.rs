//! Rate-limited logging: at most one line a second per kind, with a count of the lines held back.
//!
//! Every log line that a client's request can cause goes through a gate,
//! so that no stream of requests (a rule that denies everything, a backend
//! outage, a full memory backend) can flood the logs: the first line of a
//! second is written with the number of lines suppressed since the previous
//! one, the rest of that second only counts.
//!
//! ```
//! use throttlegate::log_gate::LogGate;
//!
//! static FULL: LogGate = LogGate::new();
//! if let Some(suppressed) = FULL.admit() {
//!     tracing::warn!(suppressed, "no room for a new counter");
//! }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// One kind of log line: lets one through per wall-clock second and counts
/// the ones it held back.
#[derive(Debug, Default)]
pub struct LogGate {
    /// The second of the last line let through; 0 before the first.
    last_s: AtomicU64,
    suppressed: AtomicU64,
}

impl LogGate {
    /// A gate that lets the next line through. `const`, so a kind of line
    /// can have its own `static` gate.
    pub const fn new() -> Self {
        Self {
            last_s: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(lines suppressed since the last one)` when this line may be
    /// logged now; `None` (and the line is counted) otherwise. Every
    /// suppressed line is reported once; one held back at the very moment
    /// a second's first line is let through may be reported by that line.
    pub fn admit(&self) -> Option<u64> {
        // Wall-clock seconds, not a monotonic clock: a step of the clock
        // at worst lets one extra line through.
        let now_s = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|it| it.as_secs())
            .unwrap_or(0);
        self.admit_at(now_s)
    }

    /// [`LogGate::admit`] at the second `now_s`.
    pub fn admit_at(&self, now_s: u64) -> Option<u64> {
        let last = self.last_s.load(Ordering::Relaxed);
        // Of several threads in a new second, only the one whose exchange
        // succeeds logs; the others count as suppressed.
        if now_s != last
            && self
                .last_s
                .compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests;
