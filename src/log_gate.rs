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
mod tests {
    use super::*;

    #[test]
    fn lets_one_line_through_per_second_with_the_count_held_back() {
        let gate = LogGate::new();
        let got: Vec<Option<u64>> = [100, 100, 100, 100, 101, 101, 105]
            .into_iter()
            .map(|at| gate.admit_at(at))
            .collect();
        assert_eq!(got, vec![Some(0), None, None, None, Some(3), None, Some(1)]);
    }

    #[test]
    fn gates_of_different_kinds_are_independent() {
        let backend = LogGate::new();
        let cost = LogGate::new();
        assert_eq!(backend.admit_at(7), Some(0));
        assert_eq!(backend.admit_at(7), None);
        assert_eq!(cost.admit_at(7), Some(0));
        assert_eq!(backend.admit_at(8), Some(1));
        assert_eq!(cost.admit_at(8), Some(0));
    }

    /// 8,000 lines at once in one second: exactly one is let through, and
    /// every other one is reported once, by that line or by the next
    /// second's (a line held back between the first line's exchange and
    /// its reading of the count is reported by the first line).
    #[test]
    fn concurrent_lines_in_one_second_let_exactly_one_through() {
        let gate = std::sync::Arc::new(LogGate::new());
        let reports: Vec<u64> = (0..8)
            .map(|_| {
                let gate = gate.clone();
                std::thread::spawn(move || {
                    (0..1_000)
                        .filter_map(|_| gate.admit_at(42))
                        .collect::<Vec<_>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .flat_map(|it| it.join().unwrap())
            .collect();
        assert_eq!(reports.len(), 1, "{reports:?}");
        let next = gate.admit_at(43).expect("the next second's first line");
        assert_eq!(reports[0] + next, 7_999);
    }
}
