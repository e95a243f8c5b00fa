//! Algorithm tests with an explicit clock: exact tables, edge cases, and
//! property tests against small, independently written reference models.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;

const SECOND: u64 = 1_000_000;
const MINUTE: u64 = 60 * SECOND;
const DAY: u64 = 86_400 * SECOND;
const WEEK: u64 = 7 * DAY;
const YEAR: u64 = 365 * DAY;
/// 2023-11-14T00:00:00Z: aligned to every window up to a day, and 5 days
/// into an epoch-aligned week.
const T0: u64 = 1_699_920_000 * SECOND;

fn params(algorithm: Algorithm, limit: u64, window_us: u64, burst: Option<u64>) -> LimitParams {
    LimitParams::new(algorithm, limit, window_us, burst).unwrap()
}

fn check_of(params: LimitParams, cost: u64, mode: Mode) -> Check {
    Check { params, cost, mode }
}

/// What one step of one limit answers: (allowed, remaining, reset_us).
type Answer = (bool, u64, u64);

/// One decision on a single enforcing limit.
fn step(params: &LimitParams, state: &mut Option<State>, now: u64, cost: u64) -> Answer {
    let mut states = [state.take()];
    let verdict = decide(&[check_of(*params, cost, Mode::Enforce)], &mut states, now);
    *state = states[0].take();
    let it = verdict.outcomes[0];
    assert_eq!(it.consumed, verdict.allowed && cost > 0);
    (verdict.allowed, it.remaining, it.reset_us)
}

/// One row of a table: at `T0 + at` µs, a request of `cost` answers
/// (allowed, remaining, reset_us).
type Row = (u64, u64, bool, u64, u64);

/// Runs `rows` in order on one key and compares every answer.
fn check(params: LimitParams, rows: &[Row]) {
    let mut state = None;
    for (idx, &(at, cost, allowed, remaining, reset_us)) in rows.iter().enumerate() {
        let got = step(&params, &mut state, T0 + at, cost);
        assert_eq!(
            got,
            (allowed, remaining, reset_us),
            "{} {}/{}µs burst {}: row {idx} (at +{at} µs, cost {cost})",
            params.algorithm(),
            params.limit(),
            params.window_us(),
            params.capacity(),
        );
    }
}

// === tables ===

#[test]
fn burst_of_each_algorithm_admits_exactly_the_limit() {
    for algorithm in Algorithm::ALL {
        let params = params(algorithm, 10, SECOND, None);
        let mut state = None;
        let allowed = (0..12)
            .filter(|_| step(&params, &mut state, T0, 1).0)
            .count();
        assert_eq!(allowed, 10, "{algorithm}");
    }
}

#[test]
fn sliding_window_log_slides_to_the_microsecond() {
    check(
        params(Algorithm::SlidingWindowLog, 3, SECOND, None),
        &[
            (0, 1, true, 2, SECOND),
            (100_000, 1, true, 1, SECOND),
            (200_000, 1, true, 0, SECOND),
            // The oldest unit (at 0) leaves the window at exactly 1 s.
            (300_000, 1, false, 0, 700_000),
            (999_999, 1, false, 0, 1),
            (1_000_000, 1, true, 0, SECOND),
            (1_000_000, 0, false, 0, 100_000),
            (1_100_000, 0, true, 1, 900_000),
            // Two units need the unit at 200 ms to leave too.
            (1_100_000, 2, false, 1, 100_000),
            (1_199_999, 2, false, 1, 1),
            (1_200_000, 2, true, 0, SECOND),
            (1_200_000, 4, false, 0, SECOND),
            (5_000_000, 0, true, 3, 0),
        ],
    );
}

/// The same table for both: GCRA decides exactly as the token bucket does.
const BUCKET_ALGORITHMS: [Algorithm; 2] = [Algorithm::TokenBucket, Algorithm::Gcra];

#[test]
fn bucket_with_a_fractional_emission_interval_refills_to_the_microsecond() {
    // 3 per second: one token every 333,333.33… µs.
    for algorithm in BUCKET_ALGORITHMS {
        check(
            params(algorithm, 3, SECOND, None),
            &[
                (0, 1, true, 2, 333_334),
                (0, 1, true, 1, 666_667),
                (0, 1, true, 0, SECOND),
                (0, 1, false, 0, 333_334),
                (333_333, 1, false, 0, 1),
                (333_334, 1, true, 0, SECOND),
                (333_334, 0, false, 0, 333_333),
                (1_333_334, 0, true, 3, 0),
                (1_333_334, 3, true, 0, SECOND),
                (1_333_334, 4, false, 0, SECOND),
            ],
        );
    }
}

#[test]
fn bucket_with_a_burst_below_the_limit_holds_only_the_burst() {
    // 10 per second, at most 2 at once: a token every 100 ms.
    for algorithm in BUCKET_ALGORITHMS {
        check(
            params(algorithm, 10, SECOND, Some(2)),
            &[
                (0, 1, true, 1, 100_000),
                (0, 1, true, 0, 200_000),
                (0, 1, false, 0, 100_000),
                (50_000, 1, false, 0, 50_000),
                (100_000, 1, true, 0, 200_000),
                (10_000_000, 0, true, 2, 0),
                // Above the burst: never, whatever the limit.
                (10_000_000, 3, false, 2, SECOND),
                (10_000_000, 2, true, 0, 200_000),
                (10_150_000, 2, false, 1, 50_000),
            ],
        );
    }
}

#[test]
fn bucket_with_a_burst_above_the_limit_takes_the_whole_burst_at_once() {
    // 2 per second, up to 5 at once: a token every 500 ms.
    for algorithm in BUCKET_ALGORITHMS {
        check(
            params(algorithm, 2, SECOND, Some(5)),
            &[
                (0, 1, true, 4, 500_000),
                (0, 1, true, 3, 1_000_000),
                (0, 3, true, 0, 2_500_000),
                (0, 1, false, 0, 500_000),
                (499_999, 1, false, 0, 1),
                (500_000, 1, true, 0, 2_500_000),
                (3_000_000, 0, true, 5, 0),
                (3_000_000, 5, true, 0, 2_500_000),
                (3_000_000, 6, false, 0, SECOND),
            ],
        );
    }
}

#[test]
fn fixed_window_counts_per_epoch_aligned_window() {
    let window = 10 * SECOND;
    check(
        params(Algorithm::FixedWindow, 3, window, None),
        &[
            (2 * SECOND, 1, true, 2, 8 * SECOND),
            (3 * SECOND, 2, true, 0, 7 * SECOND),
            (4 * SECOND, 0, false, 0, 6 * SECOND),
            (4 * SECOND, 1, false, 0, 6 * SECOND),
            (window - 1, 1, false, 0, 1),
            // A new window: the boundary burst envoyproxy/ratelimit allows.
            (window, 3, true, 0, window),
            (window + 1, 1, false, 0, window - 1),
            (2 * window, 4, false, 3, window),
            (2 * window + 5 * SECOND, 0, true, 3, 0),
        ],
    );
}

#[test]
fn sliding_window_counter_weighs_the_previous_window_by_the_millisecond() {
    let window = 10 * SECOND;
    check(
        params(Algorithm::SlidingWindowCounter, 10, window, None),
        &[
            // This window's 5 stop weighing in once floor(5 × (W − e) / W)
            // is 0: 8,001 ms into the next window.
            (0, 5, true, 5, 18_001_000),
            (5 * SECOND, 5, true, 0, 14_001_000),
            // In the next window, 10 × 9,999/10,000 rounds down to 9 after 1 ms.
            (6 * SECOND, 1, false, 0, 4 * SECOND + 1_000),
            (window + 999, 1, false, 0, 1),
            // A lone 1 weighs nothing 1 ms into the window after.
            (window + 1_000, 1, true, 0, window),
            // Halfway: 1 + floor(10 × 0.5) = 6.
            (15 * SECOND, 0, true, 4, 5_001_000),
            // Five more need the weighted 10 to drop to 4: 4,999 ms of 10,000 left.
            (15 * SECOND, 5, false, 4, 1_000),
            (15 * SECOND + 1_000, 5, true, 0, 13_333_000),
            (15 * SECOND + 1_000, 11, false, 0, window),
            // Two windows later nothing is left of either.
            (35 * SECOND, 0, true, 10, 0),
        ],
    );
}

#[test]
fn windows_are_aligned_to_the_unix_epoch() {
    // T0 is 5 days into an epoch-aligned week (1970-01-01 was a Thursday).
    assert_eq!(T0 % WEEK, 5 * DAY);
    check(
        params(Algorithm::FixedWindow, 1, WEEK, None),
        &[
            (0, 1, true, 0, 2 * DAY),
            (2 * DAY - 1, 1, false, 0, 1),
            (2 * DAY, 1, true, 0, WEEK),
        ],
    );
    check(
        params(Algorithm::SlidingWindowCounter, 1, WEEK, None),
        &[
            (0, 1, true, 0, 2 * DAY + 1_000),
            // At the week's start the previous week weighs in fully.
            (2 * DAY, 1, false, 0, 1_000),
            (2 * DAY + 1_000, 1, true, 0, WEEK),
        ],
    );
    // Minute windows start at whole minutes, wherever the first request falls.
    let mut state = None;
    let minute = params(Algorithm::FixedWindow, 1, MINUTE, None);
    assert_eq!(
        step(&minute, &mut state, T0 + 59 * SECOND, 1),
        (true, 0, SECOND)
    );
    assert_eq!(step(&minute, &mut state, T0 + MINUTE, 1), (true, 0, MINUTE));
}

// === edge cases, for every algorithm ===

#[test]
fn a_cost_above_capacity_never_passes_and_stores_nothing() {
    for algorithm in Algorithm::ALL {
        for burst in [None, Some(3)] {
            let params = params(algorithm, 5, MINUTE, burst);
            let capacity = params.capacity();
            let mut state = None;
            for at in [0, MINUTE, 10 * MINUTE] {
                assert_eq!(
                    step(&params, &mut state, T0 + at, capacity + 1),
                    (false, capacity, MINUTE),
                    "{algorithm} burst {burst:?}"
                );
                assert_eq!(state, None, "{algorithm}");
            }
            // Denied even when mixed with limits that have room.
            let mut states = [None, None];
            let other = check_of(self::params(algorithm, 100, MINUTE, None), 1, Mode::Enforce);
            let verdict = decide(
                &[other, check_of(params, u64::MAX, Mode::Enforce)],
                &mut states,
                T0,
            );
            assert!(!verdict.allowed);
            assert_eq!(verdict.outcomes[1].reset_us, MINUTE);
            assert_eq!(states, [None, None]);
        }
    }
}

#[test]
fn zero_requests_per_unit_denies_everything_including_checks() {
    for algorithm in Algorithm::ALL {
        for burst in [None, Some(10)] {
            let params = params(algorithm, 0, MINUTE, burst);
            assert_eq!(params.capacity(), 0);
            let mut state = None;
            for (at, cost) in [(0, 1), (0, 0), (SECOND, 5), (DAY, 0), (DAY, 1)] {
                assert_eq!(
                    step(&params, &mut state, T0 + at, cost),
                    (false, 0, MINUTE),
                    "{algorithm} burst {burst:?} cost {cost}"
                );
                assert_eq!(state, None, "{algorithm}");
            }
        }
    }
}

#[test]
fn a_cost_zero_check_needs_one_unit_of_room_and_consumes_nothing() {
    for algorithm in Algorithm::ALL {
        let params = params(algorithm, 4, MINUTE, None);
        let mut state = None;
        assert_eq!(
            step(&params, &mut state, T0, 0),
            (true, 4, 0),
            "{algorithm}"
        );
        assert_eq!(state, None, "a check on a fresh key stores nothing");

        assert!(step(&params, &mut state, T0, 3).0);
        let before = state.clone();
        let (allowed, remaining, _) = step(&params, &mut state, T0, 0);
        assert_eq!((allowed, remaining), (true, 1), "{algorithm}");
        assert_eq!(state, before, "{algorithm}: a check took something");

        assert!(step(&params, &mut state, T0, 1).0);
        let before = state.clone();
        let (allowed, remaining, reset_us) = step(&params, &mut state, T0, 0);
        assert_eq!((allowed, remaining), (false, 0), "{algorithm}");
        assert!(reset_us > 0);
        assert_eq!(state, before, "{algorithm}: a denied check took something");
    }
}

#[test]
fn a_clock_moving_backwards_is_evaluated_at_the_stored_time() {
    // 2 per second, all taken at +100 s, then asked from 10 s earlier and
    // from 100 s earlier: every algorithm still sees the consumption and
    // reports the wait from the caller's own clock.
    let late = 100 * SECOND;
    let early = 90 * SECOND;
    // (algorithm, reset after taking both, wait from `early`, then at
    // `early + wait`: remaining and reset after taking one)
    let cases = [
        (Algorithm::SlidingWindowLog, SECOND, 11 * SECOND, 1, SECOND),
        // Half a second per token.
        (Algorithm::TokenBucket, SECOND, 10_500_000, 0, SECOND),
        (Algorithm::Gcra, SECOND, 10_500_000, 0, SECOND),
        // Aligned windows: [100 s, 101 s) holds the count.
        (Algorithm::FixedWindow, SECOND, 11 * SECOND, 1, SECOND),
        // 1 ms into the next window, floor(2 × 999/1000) = 1.
        (
            Algorithm::SlidingWindowCounter,
            1_501_000,
            11 * SECOND + 1_000,
            0,
            SECOND,
        ),
    ];
    for (algorithm, full_reset, wait, remaining, reset_us) in cases {
        check(
            params(algorithm, 2, SECOND, None),
            &[
                (late, 2, true, 0, full_reset),
                (early, 1, false, 0, wait),
                (early, 0, false, 0, wait),
                (0, 1, false, 0, wait + early),
                (early + wait - 1, 1, false, 0, 1),
                (early + wait, 1, true, remaining, reset_us),
            ],
        );
    }
}

#[test]
fn a_clock_moving_backwards_never_moves_stored_time_back() {
    for algorithm in Algorithm::ALL {
        let params = params(algorithm, 3, SECOND, None);
        let mut state = None;
        assert!(step(&params, &mut state, T0 + 10 * SECOND, 1).0);
        let mut stored = stored_time(state.as_ref().unwrap());
        for at in [5 * SECOND, 0, 9 * SECOND, 10 * SECOND - 1, 10 * SECOND] {
            let (_, remaining, _) = step(&params, &mut state, T0 + at, 1);
            assert!(remaining <= 2, "{algorithm}: the past gave tokens back");
            let now_stored = stored_time(state.as_ref().unwrap());
            assert!(now_stored >= stored, "{algorithm}: stored time moved back");
            stored = now_stored;
        }
    }
}

/// What a state records that must never move back: a bucket's last refill,
/// GCRA's arrival time, a window's start; for the log, whose timestamps are
/// private, the units it holds, which cannot leave while the clock goes back.
fn stored_time(state: &State) -> u64 {
    match state {
        State::SlidingWindowLog(it) => it.total(),
        State::TokenBucket(it) => it.parts().1,
        State::Gcra(it) => it.parts().0,
        State::SlidingWindowCounter(it) => it.parts().0,
        State::FixedWindow(it) => it.parts().0,
    }
}

#[test]
fn a_reload_that_shrinks_the_burst_never_panics() {
    for algorithm in BUCKET_ALGORITHMS {
        let wide = params(algorithm, 10, SECOND, Some(10));
        let narrow = params(algorithm, 10, SECOND, Some(2));
        let mut state = None;
        assert!(step(&wide, &mut state, T0, 10).0);
        let (allowed, remaining, reset_us) = step(&narrow, &mut state, T0, 1);
        assert_eq!((allowed, remaining), (false, 0), "{algorithm}");
        assert!(
            reset_us > 0 && reset_us <= SECOND,
            "{algorithm}: {reset_us}"
        );
        assert!(step(&narrow, &mut state, T0 + reset_us, 1).0, "{algorithm}");
        // A wider burst again: the level carries over, never above it.
        let (_, remaining, _) = step(&wide, &mut state, T0 + reset_us, 0);
        assert!(remaining < 10, "{algorithm}");
    }
}

// === exactness over long traces ===

/// Rates whose emission interval is not a whole number of µs, with bursts
/// equal to, below and above the limit.
const FRACTIONAL_RATES: [(u64, u64, u64); 4] = [
    (3, SECOND, 3),
    (7, MINUTE, 7),
    (7, MINUTE, 3),
    (3, SECOND, 10),
];

#[test]
fn an_idle_bucket_is_exactly_full_after_burst_times_the_interval() {
    for algorithm in BUCKET_ALGORITHMS {
        for (limit, window, burst) in FRACTIONAL_RATES {
            let params = params(algorithm, limit, window, Some(burst));
            let refill_us = (burst * window).div_ceil(limit);
            let mut state = None;
            let mut now = T0 + 12_345;
            for cycle in 0..500 {
                assert!(step(&params, &mut state, now, burst).0);
                let (_, remaining, _) = step(&params, &mut state, now + refill_us - 1, 0);
                assert_eq!(remaining, burst - 1, "{algorithm} cycle {cycle}");
                let (_, remaining, reset_us) = step(&params, &mut state, now + refill_us, 0);
                assert_eq!(
                    (remaining, reset_us),
                    (burst, 0),
                    "{algorithm} cycle {cycle}"
                );
                assert_eq!(state, None, "{algorithm}: a full bucket is a fresh one");
                // An odd idle time, so cycles start at every phase.
                now += refill_us + (cycle as u64 % 7) * window + 777_777;
            }
        }
    }
}

#[test]
fn a_steady_stream_gets_exactly_the_rate_with_no_drift() {
    // Take the burst at 0, then poll every `every` µs (less than one
    // token's time) for `span`: by each poll at time t the bucket has let
    // through exactly burst + floor(t × N / W), the tokens it has made.
    for algorithm in BUCKET_ALGORITHMS {
        for (limit, window, burst, every, span) in [
            (3, SECOND, 3, 1_000, 100 * SECOND),
            (7, MINUTE, 7, 20_000, 3_600 * SECOND),
            (7, MINUTE, 2, 20_000, 3_600 * SECOND),
        ] {
            let params = params(algorithm, limit, window, Some(burst));
            let mut state = None;
            assert!(step(&params, &mut state, T0, burst).0);
            let mut admitted = burst;
            let mut at = every;
            while at <= span {
                if step(&params, &mut state, T0 + at, 1).0 {
                    admitted += 1;
                }
                let expected = burst + (at as u128 * limit as u128 / window as u128) as u64;
                assert_eq!(
                    admitted, expected,
                    "{algorithm} {limit}/{window}µs at +{at} µs"
                );
                at += every;
            }
        }
    }
}

// === one request, several limits ===

#[test]
fn a_denied_request_leaves_every_limit_untouched() {
    for first in Algorithm::ALL {
        for second in Algorithm::ALL {
            let a = params(first, 5, MINUTE, None);
            let b = params(second, 2, MINUTE, None);
            let mut states = [None, None];
            let both = [check_of(a, 1, Mode::Enforce), check_of(b, 2, Mode::Enforce)];
            assert!(decide(&both, &mut states, T0).allowed);
            let before = states.clone();
            // B is now exhausted: [A, B] is denied and A keeps its 4.
            let verdict = decide(&both, &mut states, T0 + SECOND);
            assert!(!verdict.allowed, "{first} + {second}");
            let [a_out, b_out] = [verdict.outcomes[0], verdict.outcomes[1]];
            assert!(a_out.has_room && !a_out.consumed, "{first} + {second}");
            assert_eq!(a_out.remaining, 4, "{first} + {second}");
            assert!(!b_out.has_room && !b_out.consumed);
            assert_eq!(b_out.remaining, 0);
            let mut probe = [states[0].clone()];
            let again = decide(&[check_of(a, 0, Mode::Enforce)], &mut probe, T0 + SECOND);
            assert_eq!(again.outcomes[0].remaining, 4, "{first} + {second}");
            // The states only moved forward in time, nothing was taken.
            let mut advanced = before.clone();
            for (state, params) in advanced.iter_mut().zip([a, b]) {
                state.as_mut().unwrap().advance(&params, T0 + SECOND);
            }
            assert_eq!(states, advanced, "{first} + {second}");
        }
    }
}

#[test]
fn shadow_limits_are_reported_but_never_deny() {
    let tight = params(Algorithm::SlidingWindowLog, 1, MINUTE, None);
    let loose = params(Algorithm::TokenBucket, 10, MINUTE, None);
    let mut states = [None, None];
    let request = [
        check_of(loose, 1, Mode::Enforce),
        check_of(tight, 1, Mode::Shadow),
    ];
    let first = decide(&request, &mut states, T0);
    assert!(first.allowed);
    assert!(
        first.outcomes[1].consumed,
        "a shadow limit with room counts"
    );
    let second = decide(&request, &mut states, T0);
    assert!(second.allowed, "a shadow limit without room does not deny");
    assert!(!second.outcomes[1].has_room && !second.outcomes[1].consumed);
    assert_eq!(second.outcomes[1].reset_us, MINUTE);
    assert_eq!(second.outcomes[0].remaining, 8);

    // In a request denied by an enforcing limit, a shadow limit takes nothing.
    let exhausted = params(Algorithm::FixedWindow, 0, MINUTE, None);
    let mut states = [None, None];
    let verdict = decide(
        &[
            check_of(exhausted, 1, Mode::Enforce),
            check_of(loose, 1, Mode::Shadow),
        ],
        &mut states,
        T0,
    );
    assert!(!verdict.allowed);
    assert!(verdict.outcomes[1].has_room && !verdict.outcomes[1].consumed);
    assert_eq!(states, [None, None]);
}

#[test]
fn quota_limits_deny_only_when_all_of_them_are_out_of_room() {
    let one = params(Algorithm::Gcra, 1, MINUTE, None);
    let three = params(Algorithm::SlidingWindowCounter, 3, MINUTE, None);
    let mut states = [None, None];
    let request = [
        check_of(one, 1, Mode::Quota),
        check_of(three, 1, Mode::Quota),
    ];
    let remaining = |verdict: &Verdict| {
        (
            verdict.allowed,
            verdict.outcomes[0].remaining,
            verdict.outcomes[1].remaining,
        )
    };
    assert_eq!(remaining(&decide(&request, &mut states, T0)), (true, 0, 2));
    // The first is over: the second still lets the request through, and
    // only the one with room consumes.
    let verdict = decide(&request, &mut states, T0);
    assert_eq!(remaining(&verdict), (true, 0, 1));
    assert!(!verdict.outcomes[0].consumed && verdict.outcomes[1].consumed);
    assert_eq!(remaining(&decide(&request, &mut states, T0)), (true, 0, 0));
    let verdict = decide(&request, &mut states, T0);
    assert_eq!(remaining(&verdict), (false, 0, 0), "all quota limits over");

    // An enforcing limit without room denies whatever the quota says.
    let mut states = [None, None];
    let verdict = decide(
        &[
            check_of(three, 1, Mode::Quota),
            check_of(
                params(Algorithm::TokenBucket, 0, MINUTE, None),
                1,
                Mode::Enforce,
            ),
        ],
        &mut states,
        T0,
    );
    assert!(!verdict.allowed);
    assert!(!verdict.outcomes[0].consumed);
}

#[test]
fn an_empty_request_is_allowed() {
    let verdict = decide(&[], &mut [], T0);
    assert!(verdict.allowed && verdict.outcomes.is_empty());
}

// === parameters ===

/// (algorithm, limit, window µs, burst, the capacity or the refusal)
type ParamsCase = (Algorithm, u64, u64, Option<u64>, Result<u64, ParamsError>);

#[test]
fn limit_params_refuse_what_cannot_be_exact() {
    use Algorithm::*;
    let too_precise = |algorithm, limit, window_s, capacity| {
        Err(ParamsError::TooPrecise {
            algorithm,
            limit,
            window_s,
            capacity,
        })
    };
    let cases: [ParamsCase; 19] = [
        (SlidingWindowLog, 10, 0, None, Err(ParamsError::ZeroWindow)),
        (
            FixedWindow,
            10,
            SECOND - 1,
            None,
            Err(ParamsError::ZeroWindow),
        ),
        (
            TokenBucket,
            10,
            SECOND + 500,
            None,
            Err(ParamsError::ZeroWindow),
        ),
        (
            TokenBucket,
            10,
            SECOND,
            Some(0),
            Err(ParamsError::ZeroBurst),
        ),
        (Gcra, 10, SECOND, Some(0), Err(ParamsError::ZeroBurst)),
        // Burst means nothing to the window algorithms.
        (FixedWindow, 10, SECOND, Some(0), Ok(10)),
        (SlidingWindowLog, 10, SECOND, Some(3), Ok(10)),
        (TokenBucket, 10, SECOND, Some(3), Ok(3)),
        (Gcra, 10, SECOND, None, Ok(10)),
        (TokenBucket, 0, SECOND, Some(5), Ok(0)),
        // 7 per year: a token is 31,536,000,000,000 scaled units; 245 of
        // them refill in 35 years, 285 (still exact) in 40.7, past
        // MAX_SPAN_US.
        (TokenBucket, 7, YEAR, Some(245), Ok(245)),
        (
            TokenBucket,
            7,
            YEAR,
            Some(285),
            Err(ParamsError::RefillTooLong {
                algorithm: TokenBucket,
                limit: 7,
                window_s: 31_536_000,
                capacity: 285,
                refill_s: 1_283_965_715,
                max_s: 1_125_899_906,
            }),
        ),
        // The longest window, and one second more.
        (FixedWindow, 10, MAX_SPAN_US / SECOND * SECOND, None, Ok(10)),
        (
            SlidingWindowLog,
            10,
            (MAX_SPAN_US / SECOND + 1) * SECOND,
            None,
            Err(ParamsError::WindowTooLong {
                window_s: 1_125_899_907,
                max_s: 1_125_899_906,
            }),
        ),
        (
            Gcra,
            7,
            YEAR,
            Some(286),
            too_precise(Gcra, 7, 31_536_000, 286),
        ),
        (SlidingWindowCounter, 285_615, YEAR, None, Ok(285_615)),
        (
            SlidingWindowCounter,
            285_616,
            YEAR,
            None,
            too_precise(SlidingWindowCounter, 285_616, 31_536_000, 285_616),
        ),
        (
            SlidingWindowLog,
            MAX_EXACT - 1,
            SECOND,
            None,
            Ok(MAX_EXACT - 1),
        ),
        (
            FixedWindow,
            MAX_EXACT,
            SECOND,
            None,
            too_precise(FixedWindow, MAX_EXACT, 1, MAX_EXACT),
        ),
    ];
    for (algorithm, limit, window_us, burst, expected) in cases {
        let got = LimitParams::new(algorithm, limit, window_us, burst).map(|it| it.capacity());
        assert_eq!(
            got, expected,
            "{algorithm} {limit}/{window_us}µs burst {burst:?}"
        );
    }
    let message = LimitParams::new(Gcra, 7, YEAR, Some(286))
        .unwrap_err()
        .to_string();
    assert!(
        message.starts_with("gcra with 7 per 31536000s"),
        "{message}"
    );
    assert_eq!(
        ParamsError::ZeroBurst.to_string(),
        "burst must be at least 1"
    );
}

#[test]
fn rates_are_reduced_fractions() {
    let rate = |limit, window_us| params(Algorithm::TokenBucket, limit, window_us, None).rate();
    assert_eq!(
        rate(3, SECOND),
        Rate {
            per_us: 3,
            scale: SECOND
        }
    );
    assert_eq!(
        rate(10, SECOND),
        Rate {
            per_us: 1,
            scale: 100_000
        }
    );
    assert_eq!(
        rate(7, MINUTE),
        Rate {
            per_us: 7,
            scale: MINUTE
        }
    );
    assert_eq!(
        rate(0, MINUTE),
        Rate {
            per_us: 0,
            scale: 1
        }
    );
}

#[test]
fn algorithm_names_round_trip() {
    for algorithm in Algorithm::ALL {
        assert_eq!(Algorithm::from_name(algorithm.name()), Some(algorithm));
        assert_eq!(algorithm.to_string(), algorithm.name());
    }
    assert_eq!(Algorithm::from_name("leaky_bucket"), None);
}

// === reference models ===

/// An independent model of one algorithm, written from its definition.
trait Model {
    fn step(&mut self, now: u64, cost: u64) -> Answer;
}

/// Sliding log: every unit's timestamp in a plain list.
struct LogModel {
    limit: u64,
    window: u64,
    units: Vec<u64>,
}

impl Model for LogModel {
    fn step(&mut self, now: u64, cost: u64) -> Answer {
        let window = self.window;
        self.units.retain(|&ts| ts + window > now);
        let need = cost.max(1);
        let room = self.units.len() as u64 + need <= self.limit;
        if room {
            self.units.extend((0..cost).map(|_| now));
        }
        let held = self.units.len() as u64;
        let reset = if room {
            self.units
                .iter()
                .max()
                .map_or(0, |newest| newest + window - now)
        } else if need > self.limit {
            window
        } else {
            // The oldest units must leave until `need` fit.
            let mut sorted = self.units.clone();
            sorted.sort_unstable();
            sorted[(held + need - self.limit - 1) as usize] + window - now
        };
        (room, self.limit - held, reset)
    }
}

/// Token bucket (and GCRA): tokens as the exact fraction `scaled / window`,
/// refilled continuously at `limit` per window, capped at the burst.
struct BucketModel {
    limit: u128,
    window: u128,
    burst: u128,
    scaled: u128,
    last: Option<u64>,
}

impl BucketModel {
    fn new(limit: u64, window: u64, burst: Option<u64>) -> BucketModel {
        let burst = if limit == 0 {
            0
        } else {
            burst.unwrap_or(limit)
        } as u128;
        BucketModel {
            limit: limit as u128,
            window: window as u128,
            burst,
            scaled: burst * window as u128,
            last: None,
        }
    }
}

impl Model for BucketModel {
    fn step(&mut self, now: u64, cost: u64) -> Answer {
        let full = self.burst * self.window;
        let elapsed = (now - self.last.unwrap_or(now)) as u128;
        self.scaled = (self.scaled + elapsed * self.limit).min(full);
        self.last = Some(now);
        let need = cost.max(1) as u128;
        let room = need * self.window <= self.scaled;
        if room {
            self.scaled -= cost as u128 * self.window;
        }
        let reset = if room {
            (full - self.scaled).div_ceil(self.limit.max(1))
        } else if need > self.burst {
            self.window
        } else {
            (need * self.window - self.scaled).div_ceil(self.limit)
        };
        (room, (self.scaled / self.window) as u64, reset as u64)
    }
}

/// Fixed window: a count per epoch-aligned window.
struct FixedModel {
    limit: u64,
    window: u64,
    counts: HashMap<u64, u64>,
}

impl Model for FixedModel {
    fn step(&mut self, now: u64, cost: u64) -> Answer {
        let idx = now / self.window;
        let count = self.counts.entry(idx).or_default();
        let need = cost.max(1);
        let room = *count + need <= self.limit;
        if room {
            *count += cost;
        }
        let end = (idx + 1) * self.window - now;
        let reset = if room {
            if *count > 0 { end } else { 0 }
        } else if need > self.limit {
            self.window
        } else {
            end
        };
        (room, self.limit - *count, reset)
    }
}

/// Sliding-window counter: counts per aligned window and the estimate
/// `current + floor(previous × (W − elapsed) / W)` in whole milliseconds.
struct CounterModel {
    limit: u64,
    window: u64,
    counts: HashMap<u64, u64>,
}

impl CounterModel {
    fn count(&self, idx: u64) -> u64 {
        self.counts.get(&idx).copied().unwrap_or(0)
    }

    fn estimate(&self, at: u64) -> u64 {
        let idx = at / self.window;
        let window_ms = self.window / 1_000;
        let elapsed_ms = (at % self.window) / 1_000;
        let previous = if idx == 0 { 0 } else { self.count(idx - 1) };
        self.count(idx) + previous * (window_ms - elapsed_ms) / window_ms
    }
}

impl Model for CounterModel {
    fn step(&mut self, now: u64, cost: u64) -> Answer {
        let idx = now / self.window;
        let need = cost.max(1);
        let room = self.estimate(now) + need <= self.limit;
        if room {
            *self.counts.entry(idx).or_default() += cost;
        }
        // The estimate never rises as time passes without requests:
        // binary-search the first whole millisecond (from `now`'s) at which
        // `passes`; two windows on the estimate is 0.
        let first_passing = |passes: &dyn Fn(u64) -> bool| {
            let first_ms = now / 1_000;
            let at_step = |k: u64| (first_ms + k) * 1_000;
            if passes(at_step(0)) {
                return 0;
            }
            let (mut lo, mut hi) = (0, (idx + 2) * self.window / 1_000 - first_ms);
            while hi - lo > 1 {
                let mid = (lo + hi) / 2;
                if passes(at_step(mid)) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            at_step(hi) - now
        };
        let reset = if room {
            // Fully replenished: the estimate is 0.
            first_passing(&|at| self.estimate(at) == 0)
        } else if need > self.limit {
            self.window
        } else {
            first_passing(&|at| self.estimate(at) + need <= self.limit)
        };
        (room, self.limit.saturating_sub(self.estimate(now)), reset)
    }
}

fn model_of(algorithm: Algorithm, limit: u64, window: u64, burst: Option<u64>) -> Box<dyn Model> {
    match algorithm {
        Algorithm::SlidingWindowLog => Box::new(LogModel {
            limit,
            window,
            units: Vec::new(),
        }),
        Algorithm::TokenBucket | Algorithm::Gcra => {
            Box::new(BucketModel::new(limit, window, burst))
        }
        Algorithm::FixedWindow => Box::new(FixedModel {
            limit,
            window,
            counts: HashMap::new(),
        }),
        Algorithm::SlidingWindowCounter => Box::new(CounterModel {
            limit,
            window,
            counts: HashMap::new(),
        }),
    }
}

// === properties ===

/// (µs since the previous request, cost): bursts in the same µs, small
/// steps, and gaps of a few windows.
fn arb_trace(max_cost: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    let delta = prop_oneof![
        2 => Just(0u64),
        3 => 0..2_000u64,
        4 => 0..2 * SECOND,
        1 => 0..8 * SECOND,
    ];
    prop::collection::vec((delta, 0..=max_cost), 1..=64)
}

/// Runs `trace` through `decide` and the model, step by step, and checks
/// the answers agree, that each reset is exact (one µs earlier is not
/// enough), and that admissions stay within the limit.
fn run_against_model(
    algorithm: Algorithm,
    limit: u64,
    window_s: u64,
    burst: Option<u64>,
    start: u64,
    trace: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    let window = window_s * SECOND;
    let params = params(algorithm, limit, window, burst);
    let capacity = params.capacity();
    let mut model = model_of(algorithm, limit, window, burst);
    let mut state = None;
    let mut now = T0 + start;
    let mut admitted: Vec<(u64, u64)> = Vec::new();
    for (idx, &(delta, cost)) in trace.iter().enumerate() {
        now += delta;
        let before = state.clone();
        let got = step(&params, &mut state, now, cost);
        prop_assert_eq!(
            got,
            model.step(now, cost),
            "step {} at {} cost {}",
            idx,
            now,
            cost
        );
        let (allowed, remaining, reset_us) = got;
        prop_assert!(remaining <= capacity);
        if allowed && cost > 0 {
            admitted.push((now, cost));
        }
        let need = cost.max(1);
        if !allowed && need <= capacity {
            // Exactly at `reset_us` the same request passes, not a µs before.
            let mut early = before.clone();
            prop_assert!(!step(&params, &mut early, now + reset_us - 1, cost).0);
            let mut on_time = before;
            prop_assert!(step(&params, &mut on_time, now + reset_us, cost).0);
        }
        if allowed {
            // Fully replenished at `reset_us`; for the exact algorithms not
            // a µs earlier (the counter's is an upper bound).
            let mut later = state.clone();
            prop_assert_eq!(step(&params, &mut later, now + reset_us, 0).1, capacity);
            if reset_us > 0 && algorithm != Algorithm::SlidingWindowCounter {
                let mut early = state.clone();
                prop_assert!(step(&params, &mut early, now + reset_us - 1, 0).1 < capacity);
            }
        }
    }
    check_admissions(algorithm, limit, window, capacity, &admitted)
}

/// No window admits more than the algorithm promises.
fn check_admissions(
    algorithm: Algorithm,
    limit: u64,
    window: u64,
    capacity: u64,
    admitted: &[(u64, u64)],
) -> Result<(), TestCaseError> {
    match algorithm {
        Algorithm::SlidingWindowLog => {
            for &(end, _) in admitted {
                let in_window: u64 = admitted
                    .iter()
                    .filter(|(at, _)| *at + window > end && *at <= end)
                    .map(|(_, cost)| cost)
                    .sum();
                prop_assert!(
                    in_window <= limit,
                    "{} in the window ending {}",
                    in_window,
                    end
                );
            }
        }
        Algorithm::TokenBucket | Algorithm::Gcra => {
            // From any admission to any later one: the burst plus refill.
            for (first_idx, &(first, _)) in admitted.iter().enumerate() {
                let mut taken = 0;
                for &(at, cost) in &admitted[first_idx..] {
                    taken += cost;
                    let made = (at - first) as u128 * limit as u128 / window as u128;
                    prop_assert!(taken as u128 <= capacity as u128 + made);
                }
            }
        }
        Algorithm::FixedWindow | Algorithm::SlidingWindowCounter => {
            let mut per_window: HashMap<u64, u64> = HashMap::new();
            for &(at, cost) in admitted {
                *per_window.entry(at / window).or_default() += cost;
            }
            prop_assert!(per_window.values().all(|it| *it <= limit));
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn sliding_window_log_matches_its_model(
        limit in 0..8u64,
        window_s in 1..=3u64,
        start in 0..10 * SECOND,
        trace in arb_trace(9),
    ) {
        run_against_model(Algorithm::SlidingWindowLog, limit, window_s, None, start, &trace)?;
    }

    #[test]
    fn token_bucket_matches_exact_rational_refill(
        limit in 0..10u64,
        window_s in prop::sample::select(vec![1u64, 3, 7, 60]),
        burst in prop::option::of(1..12u64),
        start in 0..10 * SECOND,
        trace in arb_trace(12),
    ) {
        run_against_model(Algorithm::TokenBucket, limit, window_s, burst, start, &trace)?;
    }

    #[test]
    fn gcra_decides_as_the_token_bucket_model(
        limit in 0..10u64,
        window_s in prop::sample::select(vec![1u64, 3, 7, 60]),
        burst in prop::option::of(1..12u64),
        start in 0..10 * SECOND,
        trace in arb_trace(12),
    ) {
        run_against_model(Algorithm::Gcra, limit, window_s, burst, start, &trace)?;
    }

    #[test]
    fn fixed_window_matches_a_count_per_aligned_window(
        limit in 0..8u64,
        window_s in 1..=3u64,
        start in 0..10 * SECOND,
        trace in arb_trace(9),
    ) {
        run_against_model(Algorithm::FixedWindow, limit, window_s, None, start, &trace)?;
    }

    #[test]
    fn sliding_window_counter_matches_its_formula(
        limit in 0..12u64,
        window_s in 1..=3u64,
        start in 0..10 * SECOND,
        trace in arb_trace(13),
    ) {
        run_against_model(Algorithm::SlidingWindowCounter, limit, window_s, None, start, &trace)?;
    }

    /// With a clock that jumps back and forth, nothing panics, nothing
    /// exceeds capacity, stored time never moves back, and resets stay exact.
    #[test]
    fn a_clock_jumping_backwards_is_harmless(
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        limit in 0..8u64,
        burst in prop::option::of(1..10u64),
        trace in prop::collection::vec((-5 * SECOND as i64..5 * SECOND as i64, 0..10u64), 1..=64),
    ) {
        let params = params(algorithm, limit, 2 * SECOND, burst);
        let capacity = params.capacity();
        let mut state: Option<State> = None;
        let mut now = T0 + 100 * SECOND;
        for (delta, cost) in trace {
            now = now.checked_add_signed(delta).unwrap();
            let stored = state.as_ref().map(stored_time);
            let before = state.clone();
            let (allowed, remaining, reset_us) = step(&params, &mut state, now, cost);
            prop_assert!(remaining <= capacity);
            // The log's measure is the units it holds, which may leave when
            // the clock moves forward.
            let forward = delta > 0 && algorithm == Algorithm::SlidingWindowLog;
            if let (Some(stored), Some(state), false) = (stored, state.as_ref(), forward) {
                prop_assert!(stored_time(state) >= stored, "stored time moved back");
            }
            if !allowed && cost.max(1) <= capacity {
                let mut on_time = before.clone();
                prop_assert!(step(&params, &mut on_time, now + reset_us, cost).0);
                let mut early = before;
                prop_assert!(!step(&params, &mut early, now + reset_us - 1, cost).0);
            }
        }
    }
}

// === sliding-log layout ===

/// One unit per entry made a single request of cost N write N entries:
/// the work and memory of a request must not grow with its cost.
#[test]
fn a_sliding_log_keeps_one_entry_per_request_whatever_its_cost() {
    let limit = 3_000_000;
    let params = params(Algorithm::SlidingWindowLog, limit, MINUTE, None);
    let mut state = None;
    assert_eq!(step(&params, &mut state, T0, limit), (true, 0, MINUTE));
    assert_eq!(step(&params, &mut state, T0 + 1, 1), (false, 0, MINUTE - 1));
    let Some(State::SlidingWindowLog(log)) = &state else {
        panic!("a log state is kept");
    };
    assert_eq!((log.len(), log.total()), (1, limit));

    // Costs 2, 3, 4 at three times: a request of 5 waits for the first two
    // entries (5 units) to leave, a request of 2 only for the first.
    let params = self::params(Algorithm::SlidingWindowLog, 10, SECOND, None);
    let mut state = None;
    for (at, cost) in [(0, 2), (10, 3), (20, 4)] {
        assert!(step(&params, &mut state, T0 + at, cost).0);
    }
    assert_eq!(step(&params, &mut state, T0 + 30, 5).2, SECOND + 10 - 30);
    assert_eq!(step(&params, &mut state, T0 + 30, 2).2, SECOND - 30);
    let Some(State::SlidingWindowLog(log)) = &state else {
        panic!("a log state is kept");
    };
    assert_eq!((log.len(), log.total()), (3, 9));
    // Expiry subtracts exactly the costs of the entries that left.
    assert_eq!(step(&params, &mut state, T0 + SECOND, 0), (true, 3, 20));
}

mod charge;
