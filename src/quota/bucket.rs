//! What a proxy is told to enforce for a bucket, and how a share of a
//! budget becomes Envoy's token bucket.
//!
//! A share of `s` requests per window `W` becomes a bucket of `b =
//! max(1, ⌊s / BURST_PARTS⌋)` tokens (full when assigned) refilled at
//! `s − b` tokens per `W`: over any window of length `W` with one
//! assignment the proxy admits at most `b + (s − b) = s`. A share of 1
//! has nothing left to refill with: it refills one token per two windows,
//! which still admits at most one per window. A share of 0 is DENY_ALL.
//!
//! Envoy tells a new token bucket from the one it has by `max_tokens`,
//! `tokens_per_fill` and the *nanoseconds* of `fill_interval` only (not
//! its seconds): two buckets differing only in whole seconds of interval
//! (300 a minute, then 300 an hour; or a share of 1, refilled every 2 W,
//! then 2, refilled every W) would look the same and the new one be
//! ignored. So every interval is sent with a tag in its nanoseconds below
//! the microsecond ([`EnvoyTokenBucket::fill_interval_ns`]), which differs
//! between intervals of different whole seconds.

use crate::clock::Micros;

/// A bucket holds this fraction (1/N) of its share per window: enough to
/// absorb a burst, small because every new assignment refills it.
pub const BURST_PARTS: u64 = 12;

/// Envoy's `TokenBucket` (the strategy a proxy enforces), in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvoyTokenBucket {
    pub max_tokens: u32,
    pub tokens_per_fill: u32,
    pub fill_interval_us: Micros,
}

/// Intervals whose whole seconds differ by less than this many seconds
/// get distinct tags (a prime, so the usual windows do: a second, a
/// minute, an hour, a day, a week, 30 days, a year).
const INTERVAL_TAGS: u64 = 997;

impl EnvoyTokenBucket {
    /// The fill interval as sent to Envoy, in nanoseconds: the interval,
    /// plus its whole seconds modulo [`INTERVAL_TAGS`] as nanoseconds
    /// below the microsecond (under 1 µs longer, so the bucket admits no
    /// more than the share). Two intervals of different whole seconds
    /// differ in their nanoseconds unless the seconds are a multiple of
    /// 997 s apart.
    pub fn fill_interval_ns(&self) -> u128 {
        let tag = (self.fill_interval_us / 1_000_000) % INTERVAL_TAGS;
        u128::from(self.fill_interval_us) * 1_000 + u128::from(tag)
    }
}

/// What one bucket of one proxy is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    AllowAll,
    DenyAll,
    Tokens(EnvoyTokenBucket),
}

impl Grant {
    /// The token bucket admitting at most `share` requests per
    /// `window_us` (see the module's documentation).
    pub fn for_share(share: u64, window_us: Micros) -> Grant {
        if share == 0 {
            return Grant::DenyAll;
        }
        let burst = (share / BURST_PARTS).max(1);
        let refill = share - burst;
        let fits = |value: u64| u32::try_from(value).unwrap_or(u32::MAX);
        let bucket = if refill == 0 {
            EnvoyTokenBucket {
                max_tokens: fits(burst),
                tokens_per_fill: 1,
                fill_interval_us: window_us.saturating_mul(2),
            }
        } else {
            // A refill too large for Envoy's u32 is sent over a shorter
            // interval at the same (rounded down) rate.
            let parts = refill.div_ceil(u64::from(u32::MAX));
            EnvoyTokenBucket {
                max_tokens: fits(burst),
                tokens_per_fill: fits(refill / parts),
                fill_interval_us: window_us / parts,
            }
        };
        Grant::Tokens(bucket)
    }
}

#[cfg(test)]
mod tests;
