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
