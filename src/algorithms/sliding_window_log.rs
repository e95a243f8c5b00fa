//! Sliding-window log: exact; remembers when each request took its cost.

use std::collections::VecDeque;

use super::LimitParams;

/// Requests taken in the last window, oldest first, one entry per distinct
/// timestamp: `(time µs, running total through this entry)`.
///
/// The running total is a counter of every unit ever taken by this state
/// (wrapping, only differences matter): the units in the window are the
/// newest entry's total minus `base`, the total before the oldest entry, so
/// the sum needs no pass over the entries, and the entry at which a given
/// number of units has left the window is found by binary search. Memory
/// is one entry per request in the window, whatever the costs; Redis keeps
/// the same layout (one sorted-set member per request).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowLog {
    entries: VecDeque<(u64, u64)>,
    /// Running total before the oldest entry.
    base: u64,
}

impl SlidingWindowLog {
    /// Units currently in the window.
    pub fn total(&self) -> u64 {
        self.entries
            .back()
            .map_or(0, |&(_, end)| end.wrapping_sub(self.base))
    }

    /// Entries kept (one per distinct timestamp of an allowed request).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries as Redis holds them, oldest first: (time µs, running
    /// total through the entry, units the entry took).
    pub fn parts(&self) -> Vec<(u64, u64, u64)> {
        let mut before = self.base;
        self.entries
            .iter()
            .map(|&(ts, end)| {
                let cost = end.wrapping_sub(before);
                before = end;
                (ts, end, cost)
            })
            .collect()
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let at = self
            .entries
            .back()
            .map_or(now, |&(newest, _)| now.max(newest));
        // An entry at `ts` counts while `ts > at - W`; each pop is one
        // expired entry, so the work is bounded by what expires.
        while let Some(&(ts, end)) = self.entries.front() {
            if ts + params.window_us() > at {
                break;
            }
            self.base = end;
            self.entries.pop_front();
        }
        if self.entries.is_empty() {
            self.base = 0;
        }
        at
    }

    pub(super) fn available(&self, params: &LimitParams) -> u64 {
        params.limit().saturating_sub(self.total())
    }

    /// Units that can still be logged: the window's total stops at the
    /// limit plus the debt the limit may carry.
    pub(super) fn debt_room(&self, params: &LimitParams) -> u64 {
        (params.limit() + params.debt_capacity()).saturating_sub(self.total())
    }

    pub(super) fn consume(&mut self, at: u64, cost: u64) {
        let newest_end = self.entries.back().map_or(self.base, |&(_, end)| end);
        let end = newest_end.wrapping_add(cost);
        match self.entries.back_mut() {
            Some((ts, last)) if *ts == at => *last = end,
            _ => self.entries.push_back((at, end)),
        }
    }

    pub(super) fn until_full(&self, params: &LimitParams, at: u64) -> u64 {
        match self.entries.back() {
            Some(&(newest, _)) => newest + params.window_us() - at,
            None => 0,
        }
    }

    pub(super) fn until_available(&self, params: &LimitParams, at: u64, need: u64) -> u64 {
        // The oldest entries holding `expire` units must leave the window:
        // the first entry whose running total reaches it is the last to go.
        let expire = self.total() + need - params.limit();
        let idx = self
            .entries
            .partition_point(|&(_, end)| end.wrapping_sub(self.base) < expire);
        // `need <= limit` puts it inside the log; the newest entry is the
        // safe answer should a caller break that.
        match self.entries.get(idx).or(self.entries.back()) {
            Some(&(ts, _)) => ts + params.window_us() - at,
            None => params.window_us(),
        }
    }
}
