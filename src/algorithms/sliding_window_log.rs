//! Sliding-window log: exact; remembers when each unit of cost was taken.

use std::collections::VecDeque;

use super::LimitParams;

/// Costs taken in the last window, oldest first, as (time µs, units) runs;
/// one run per distinct timestamp. Redis keeps one sorted-set member per unit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlidingWindowLog {
    entries: VecDeque<(u64, u64)>,
    total: u64,
}

impl SlidingWindowLog {
    /// Units currently in the window.
    pub fn total(&self) -> u64 {
        self.total
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let at = self
            .entries
            .back()
            .map_or(now, |&(newest, _)| now.max(newest));
        // An entry at `ts` counts while `ts > at - W`.
        while let Some(&(ts, units)) = self.entries.front() {
            if ts + params.window_us() > at {
                break;
            }
            self.total -= units;
            self.entries.pop_front();
        }
        at
    }

    pub(super) fn available(&self, params: &LimitParams) -> u64 {
        params.limit().saturating_sub(self.total)
    }

    pub(super) fn consume(&mut self, at: u64, cost: u64) {
        match self.entries.back_mut() {
            Some((ts, units)) if *ts == at => *units += cost,
            _ => self.entries.push_back((at, cost)),
        }
        self.total += cost;
    }

    pub(super) fn until_full(&self, params: &LimitParams, at: u64) -> u64 {
        match self.entries.back() {
            Some(&(newest, _)) => newest + params.window_us() - at,
            None => 0,
        }
    }

    pub(super) fn until_available(&self, params: &LimitParams, at: u64, need: u64) -> u64 {
        // The `expire`-th oldest unit must leave the window.
        let expire = self.total + need - params.limit();
        let mut seen = 0;
        for &(ts, units) in &self.entries {
            seen += units;
            if seen >= expire {
                return ts + params.window_us() - at;
            }
        }
        unreachable!("need <= capacity guarantees enough units in the log")
    }
}
