//! GCRA: one theoretical arrival time, exact; decides as a token bucket does.

use super::LimitParams;

/// Theoretical arrival time `tat_us + frac / rate.per_us` µs. The fraction
/// keeps the emission interval `W / N` exact when it is not whole µs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gcra {
    tat_us: u64,
    frac: u64,
    /// The `rate.per_us` the fraction is counted in; converted (rounding
    /// down) when a reload changes the rate.
    per_us: u64,
}

impl Gcra {
    /// The stored triple (tat µs, fraction, per_us), as Redis holds it.
    pub fn parts(&self) -> (u64, u64, u64) {
        (self.tat_us, self.frac, self.per_us)
    }

    /// How far the arrival time is ahead of `at`, in scaled token units
    /// (`rate.per_us` per µs): the bucket's missing tokens × scale.
    ///
    /// It exceeds the capacity when `at` lags the time of the last
    /// consumption (a clock moving backwards) or when a reload shrank the
    /// burst: the arithmetic below saturates instead of underflowing.
    fn debt(&self, params: &LimitParams, at: u64) -> u64 {
        if self.tat_us < at {
            return 0;
        }
        (self.tat_us - at)
            .saturating_mul(params.rate().per_us)
            .saturating_add(self.frac)
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let per_us = params.rate().per_us;
        if self.per_us != per_us {
            self.frac = if self.per_us == 0 {
                0
            } else {
                (self.frac as u128 * per_us as u128 / self.per_us as u128) as u64
            };
            self.per_us = per_us;
        }
        if self.debt(params, now) == 0 {
            *self = Gcra {
                tat_us: 0,
                frac: 0,
                per_us,
            };
        }
        now
    }

    pub(super) fn available(&self, params: &LimitParams, at: u64) -> u64 {
        let rate = params.rate();
        (params.capacity() * rate.scale).saturating_sub(self.debt(params, at)) / rate.scale
    }

    /// Whole units that can still be recorded before the debt reaches the
    /// capacity plus the debt the limit may carry.
    pub(super) fn debt_room(&self, params: &LimitParams, at: u64) -> u64 {
        let rate = params.rate();
        let most = (params.capacity() + params.debt_capacity()) * rate.scale;
        most.saturating_sub(self.debt(params, at)) / rate.scale
    }

    /// Takes `cost` units, past the capacity when in debt; the caller keeps
    /// `cost` within [`Self::debt_room`].
    pub(super) fn consume(&mut self, params: &LimitParams, at: u64, cost: u64) {
        let rate = params.rate();
        let debt = self.debt(params, at) + cost * rate.scale;
        self.tat_us = at + debt / rate.per_us;
        self.frac = debt % rate.per_us;
    }

    pub(super) fn until_full(&self, params: &LimitParams, at: u64) -> u64 {
        let debt = self.debt(params, at);
        if debt == 0 {
            return 0;
        }
        debt.div_ceil(params.rate().per_us)
    }

    pub(super) fn until_available(&self, params: &LimitParams, at: u64, need: u64) -> u64 {
        let rate = params.rate();
        // No room, so this is positive even when the debt saturated.
        let over = self.debt(params, at).saturating_add(need * rate.scale)
            - params.capacity() * rate.scale;
        over.div_ceil(rate.per_us)
    }
}
