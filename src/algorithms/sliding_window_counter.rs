//! Sliding-window counter: the previous window weighted by its overlap
//! plus the current one (approximate, two counters).

use super::LimitParams;

/// Counts of the epoch-aligned window starting at `window_start` and of the
/// one before it. The overlap weight is taken at millisecond granularity so
/// that `N × W` stays exact in a Lua double.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowCounter {
    window_start: u64,
    current: u64,
    previous: u64,
}

impl SlidingWindowCounter {
    /// The stored triple (window start µs, current, previous).
    pub fn parts(&self) -> (u64, u64, u64) {
        (self.window_start, self.current, self.previous)
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let window = params.window_us();
        let start = now - now % window;
        if start > self.window_start {
            self.previous = if start == self.window_start + window {
                self.current
            } else {
                0
            };
            self.current = 0;
            self.window_start = start;
        }
        now.max(self.window_start)
    }

    /// `current + floor(previous × (W − elapsed) / W)`, in ms.
    fn estimate(&self, params: &LimitParams, at: u64) -> u64 {
        let window_ms = params.window_us() / 1_000;
        let elapsed_ms = (at - self.window_start) / 1_000;
        self.current + weighted(self.previous, window_ms - elapsed_ms, window_ms)
    }

    pub(super) fn available(&self, params: &LimitParams, at: u64) -> u64 {
        params.limit().saturating_sub(self.estimate(params, at))
    }

    /// Units that can still be counted: the estimate stops at the limit
    /// plus the debt the limit may carry.
    pub(super) fn debt_room(&self, params: &LimitParams, at: u64) -> u64 {
        (params.limit() + params.debt_capacity()).saturating_sub(self.estimate(params, at))
    }

    pub(super) fn consume(&mut self, cost: u64) {
        self.current += cost;
    }

    /// Until the estimate is 0 for good: this window's count stops weighing
    /// in the next window once `floor(current × (W − e) / W)` is 0, and the
    /// previous window's count stops weighing in this one likewise. From
    /// then on the state is indistinguishable from a fresh one.
    pub(super) fn until_full(&self, params: &LimitParams, at: u64) -> u64 {
        let window = params.window_us();
        let window_ms = window / 1_000;
        let target = if self.current > 0 {
            self.window_start + window + first_elapsed_ms(self.current, 0, window_ms) * 1_000
        } else if self.previous > 0 {
            self.window_start + first_elapsed_ms(self.previous, 0, window_ms) * 1_000
        } else {
            return 0;
        };
        target.saturating_sub(at)
    }

    /// Until the next window boundary after which neither count can weigh
    /// in, however the clock moves.
    pub(super) fn lifetime(&self, params: &LimitParams, at: u64) -> u64 {
        let window = params.window_us();
        if self.current > 0 {
            self.window_start + 2 * window - at
        } else if self.previous > 0 {
            self.window_start + window - at
        } else {
            0
        }
    }

    pub(super) fn until_available(&self, params: &LimitParams, at: u64, need: u64) -> u64 {
        let window = params.window_us();
        let window_ms = window / 1_000;
        let limit = params.limit();
        // Within this window the estimate only falls as the previous
        // window's weight shrinks; otherwise wait for the next window, where
        // this window's count becomes the weighted one.
        let (start, weighed, room) = if self.current + need <= limit {
            (
                self.window_start,
                self.previous,
                limit - need - self.current,
            )
        } else {
            (self.window_start + window, self.current, limit - need)
        };
        let elapsed_ms = first_elapsed_ms(weighed, room, window_ms);
        let target = start + elapsed_ms * 1_000;
        target.saturating_sub(at)
    }
}

/// `floor(count × part / whole)` without overflow.
fn weighted(count: u64, part: u64, whole: u64) -> u64 {
    (count as u128 * part as u128 / whole as u128) as u64
}

/// Smallest elapsed ms `e` in `[0, W]` with `floor(count × (W − e) / W) <= room`.
fn first_elapsed_ms(count: u64, room: u64, window_ms: u64) -> u64 {
    if count == 0 {
        return 0;
    }
    // floor(count × x / W) <= room  <=>  count × x <= (room + 1) × W − 1
    let max_part = ((room as u128 + 1) * window_ms as u128 - 1) / count as u128;
    window_ms.saturating_sub(max_part.min(window_ms as u128) as u64)
}
