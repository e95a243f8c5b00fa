//! Token bucket: exact continuous refill on scaled integer tokens.

use super::LimitParams;

/// Tokens × `scale` (see [`LimitParams::rate`]) at `last_us`. Scaling by the
/// reduced window makes refill an integer per microsecond: no float drift.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenBucket {
    scaled: u64,
    last_us: u64,
    /// The scale `scaled` was stored with; a config reload that changes the
    /// rate converts the level (rounding down) instead of misreading it.
    scale: u64,
}

impl TokenBucket {
    pub(super) fn full(params: &LimitParams, now: u64) -> TokenBucket {
        TokenBucket {
            scaled: full_scaled(params),
            last_us: now,
            scale: params.rate().scale,
        }
    }

    /// The stored triple (scaled tokens, last refill µs, scale), as Redis
    /// holds it.
    pub fn parts(&self) -> (u64, u64, u64) {
        (self.scaled, self.last_us, self.scale)
    }

    pub(super) fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        let at = now.max(self.last_us);
        let full = full_scaled(params);
        let scale = params.rate().scale;
        if self.scale != scale {
            // Capped at full before narrowing: an extreme reload (a huge
            // level moved to a far finer scale) must not wrap around.
            let rescaled = self.scaled as u128 * scale as u128 / self.scale as u128;
            self.scaled = rescaled.min(full as u128) as u64;
            self.scale = scale;
        }
        let refill = (at - self.last_us) as u128 * params.rate().per_us as u128;
        self.scaled = (self.scaled as u128 + refill).min(full as u128) as u64;
        self.last_us = at;
        at
    }

    pub(super) fn available(&self, params: &LimitParams) -> u64 {
        self.scaled / params.rate().scale
    }

    pub(super) fn consume(&mut self, params: &LimitParams, cost: u64) {
        self.scaled -= cost * params.rate().scale;
    }

    pub(super) fn until_full(&self, params: &LimitParams) -> u64 {
        let missing = full_scaled(params) - self.scaled;
        if missing == 0 {
            return 0;
        }
        missing.div_ceil(params.rate().per_us)
    }

    pub(super) fn until_available(&self, params: &LimitParams, need: u64) -> u64 {
        let rate = params.rate();
        (need * rate.scale - self.scaled).div_ceil(rate.per_us)
    }
}

fn full_scaled(params: &LimitParams) -> u64 {
    params.capacity() * params.rate().scale
}
