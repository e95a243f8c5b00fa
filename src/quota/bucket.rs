//! What a proxy is told to enforce for a bucket, and how a share of a
//! budget becomes Envoy's token bucket.
//!
//! A share of `s` requests per window `W` becomes a bucket of `b =
//! max(1, ⌊s / BURST_PARTS⌋)` tokens (full when assigned) refilled at
//! `s − b` tokens per `W`: over any window of length `W` with one
//! assignment the proxy admits at most `b + (s − b) = s`. A share of 1
//! has nothing left to refill with: it refills one token per two windows,
//! which still admits at most one per window. A share of 0 is DENY_ALL.

use crate::clock::Micros;

/// A bucket holds this fraction (1/N) of its share per window: enough to
/// absorb a burst, small because every new assignment refills it.
pub const BURST_PARTS: u64 = 12;

/// Envoy's `TokenBucket`, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenBucket {
    pub max_tokens: u32,
    pub tokens_per_fill: u32,
    pub fill_interval_us: Micros,
}

/// What one bucket of one proxy is told to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    AllowAll,
    DenyAll,
    Tokens(TokenBucket),
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
            TokenBucket {
                max_tokens: fits(burst),
                tokens_per_fill: 1,
                fill_interval_us: window_us.saturating_mul(2),
            }
        } else {
            // A refill too large for Envoy's u32 is sent over a shorter
            // interval at the same (rounded down) rate.
            let parts = refill.div_ceil(u64::from(u32::MAX));
            TokenBucket {
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
            Grant::Tokens(TokenBucket {
                max_tokens: 10,
                tokens_per_fill: 110,
                fill_interval_us: MINUTE,
            })
        );
        assert_eq!(
            Grant::for_share(5, MINUTE),
            Grant::Tokens(TokenBucket {
                max_tokens: 1,
                tokens_per_fill: 4,
                fill_interval_us: MINUTE,
            })
        );
    }

    #[test]
    fn no_share_denies_all() {
        assert_eq!(Grant::for_share(0, MINUTE), Grant::DenyAll);
    }
}
