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
mod tests {
    use super::*;

    const MINUTE: Micros = 60_000_000;

    /// The most a bucket admits over one window from full.
    fn per_window(grant: Grant, window_us: Micros) -> u64 {
        match grant {
            Grant::DenyAll => 0,
            Grant::AllowAll => u64::MAX,
            Grant::Tokens(bucket) => {
                let fills = u128::from(bucket.tokens_per_fill) * u128::from(window_us)
                    / u128::from(bucket.fill_interval_us);
                u64::from(bucket.max_tokens) + u64::try_from(fills).unwrap_or(u64::MAX)
            }
        }
    }

    #[test]
    fn a_share_becomes_a_bucket_admitting_at_most_the_share_per_window() {
        for share in [1, 2, 11, 12, 13, 100, 299, 300, 1_000_000, 60 * 1_000_000] {
            let grant = Grant::for_share(share, MINUTE);
            let admitted = per_window(grant, MINUTE);
            assert!(
                admitted <= share,
                "share {share}: {grant:?} admits {admitted}"
            );
            // Nothing lost beyond rounding: the share is the bucket's rate.
            assert!(
                admitted + 1 >= share,
                "share {share}: {grant:?} admits {admitted}"
            );
        }
    }

    #[test]
    fn the_burst_is_a_twelfth_of_the_share_and_at_least_one() {
        assert_eq!(
            Grant::for_share(120, MINUTE),
            Grant::Tokens(EnvoyTokenBucket {
                max_tokens: 10,
                tokens_per_fill: 110,
                fill_interval_us: MINUTE,
            })
        );
        assert_eq!(
            Grant::for_share(5, MINUTE),
            Grant::Tokens(EnvoyTokenBucket {
                max_tokens: 1,
                tokens_per_fill: 4,
                fill_interval_us: MINUTE,
            })
        );
    }

    /// What Envoy compares to tell a new bucket from the one it has.
    fn as_envoy_compares(grant: Grant) -> Option<(u32, u32, u128)> {
        match grant {
            Grant::Tokens(it) => Some((
                it.max_tokens,
                it.tokens_per_fill,
                it.fill_interval_ns() % 1_000_000_000,
            )),
            _ => None,
        }
    }

    #[test]
    fn envoy_tells_apart_buckets_that_differ_only_in_whole_seconds() {
        const SECOND: Micros = 1_000_000;
        let windows = [
            SECOND,
            MINUTE,
            60 * MINUTE,
            24 * 60 * MINUTE,
            7 * 24 * 60 * MINUTE,
            30 * 24 * 60 * MINUTE,
            365 * 24 * 60 * MINUTE,
        ];
        for share in [1, 2, 3, 300] {
            for (i, a) in windows.iter().enumerate() {
                for b in &windows[i + 1..] {
                    let (one, other) = (Grant::for_share(share, *a), Grant::for_share(share, *b));
                    assert_ne!(
                        as_envoy_compares(one),
                        as_envoy_compares(other),
                        "share {share}: {a} µs and {b} µs look the same to Envoy"
                    );
                }
            }
        }
        // A share moving between 1 and 2 per window.
        assert_ne!(
            as_envoy_compares(Grant::for_share(1, MINUTE)),
            as_envoy_compares(Grant::for_share(2, MINUTE))
        );
    }

    #[test]
    fn the_tag_lengthens_the_interval_by_under_a_microsecond() {
        for window in [1_000_000, MINUTE, 3_600_000_000, 1_234_567] {
            let Grant::Tokens(bucket) = Grant::for_share(300, window) else {
                panic!("a share of 300 is a token bucket");
            };
            let ns = bucket.fill_interval_ns();
            let exact = u128::from(bucket.fill_interval_us) * 1_000;
            assert!(ns >= exact && ns < exact + 1_000, "{window}: {ns}");
        }
    }

    #[test]
    fn no_share_denies_all() {
        assert_eq!(Grant::for_share(0, MINUTE), Grant::DenyAll);
    }
}
