//! Fixed window: one counter per epoch-aligned window (envoyproxy's model).

use super::LimitParams;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FixedWindow {
    window_start: u64,
    count: u64,
}

impl FixedWindow {
    /// The stored pair (window start µs, count), as Redis holds it.
    pub fn parts(&self) -> (u64, u64) {
        (self.window_start, self.count)
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let start = now - now % params.window_us();
        if start > self.window_start {
            self.window_start = start;
            self.count = 0;
        }
        now.max(self.window_start)
    }

    pub(super) fn available(&self, params: &LimitParams) -> u64 {
        params.limit().saturating_sub(self.count)
    }

    /// Units that can still be counted: the count stops at the limit plus
    /// the debt the limit may carry.
    pub(super) fn debt_room(&self, params: &LimitParams) -> u64 {
        (params.limit() + params.debt_capacity()).saturating_sub(self.count)
    }

    pub(super) fn consume(&mut self, cost: u64) {
        self.count += cost;
    }

    pub(super) fn until_full(&self, params: &LimitParams, at: u64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        self.window_start + params.window_us() - at
    }

    pub(super) fn until_available(&self, params: &LimitParams, at: u64) -> u64 {
        // need <= limit, so the next window always has room.
        self.window_start + params.window_us() - at
    }
}
