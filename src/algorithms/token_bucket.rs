//! Token bucket: exact continuous refill on scaled integer tokens.

use super::LimitParams;

/// Tokens × `scale` (see [`LimitParams::rate`]) at `last_us`. Scaling by the
/// reduced window makes refill an integer per microsecond: no float drift.
/// Below 0 when a limit charged always is in debt, never below minus its
/// [`LimitParams::debt_capacity`] (scaled): the refill pays the debt off
/// first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    scaled: i64,
    last_us: u64,
    /// The scale `scaled` was stored with; a config reload that changes the
    /// rate converts the level (rounding down) instead of misreading it.
    scale: u64,
}

impl TokenBucket {
    pub(super) fn full(params: &LimitParams, now: u64) -> TokenBucket {
        TokenBucket {
            scaled: full_scaled(params) as i64,
            last_us: now,
            scale: params.rate().scale,
        }
    }

    /// The stored triple (scaled tokens, last refill µs, scale), as Redis
    /// holds it.
    pub fn parts(&self) -> (i64, u64, u64) {
        (self.scaled, self.last_us, self.scale)
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let at = now.max(self.last_us);
        let full = i128::from(full_scaled(params));
        let floor = -i128::from(debt_scaled(params));
        let scale = params.rate().scale;
        let mut level = i128::from(self.scaled);
        if self.scale != scale {
            // Rounded toward 0 (a debt shrinks), then held between the
            // floor and full: an extreme reload (a huge level moved to a far
            // finer scale) must not wrap around.
            level = level * i128::from(scale) / i128::from(self.scale);
            self.scale = scale;
        }
        // Debt past what the limit may carry (a reload that lowered it, or
        // a limit no longer charged always) is forgiven.
        level = level.max(floor);
        let refill = i128::from(at - self.last_us) * i128::from(params.rate().per_us);
        self.scaled = (level + refill).min(full) as i64;
        self.last_us = at;
        at
    }

    pub(super) fn available(&self, params: &LimitParams) -> u64 {
        u64::try_from(self.scaled).map_or(0, |it| it / params.rate().scale)
    }

    /// Whole units that can still be recorded before the debt reaches its
    /// floor.
    pub(super) fn debt_room(&self, params: &LimitParams) -> u64 {
        let above_floor = i128::from(self.scaled) + i128::from(debt_scaled(params));
        u64::try_from(above_floor.max(0) / i128::from(params.rate().scale)).unwrap_or(u64::MAX)
    }

    /// Takes `cost` units, into debt when past the level; the caller keeps
    /// `cost` within [`Self::debt_room`].
    pub(super) fn consume(&mut self, params: &LimitParams, cost: u64) {
        self.scaled -= (cost * params.rate().scale) as i64;
    }

    pub(super) fn until_full(&self, params: &LimitParams) -> u64 {
        let missing = i128::from(full_scaled(params)) - i128::from(self.scaled);
        if missing == 0 {
            return 0;
        }
        (missing as u64).div_ceil(params.rate().per_us)
    }

    pub(super) fn until_available(&self, params: &LimitParams, need: u64) -> u64 {
        let rate = params.rate();
        let short = i128::from(need * rate.scale) - i128::from(self.scaled);
        (short as u64).div_ceil(rate.per_us)
    }
}

fn full_scaled(params: &LimitParams) -> u64 {
    params.capacity() * params.rate().scale
}

/// The most debt the bucket may carry, scaled.
fn debt_scaled(params: &LimitParams) -> u64 {
    params.debt_capacity() * params.rate().scale
}
