//! `charge: always`: costs recorded whatever the verdict, into a debt of
//! at most one capacity that each algorithm carries and pays off.

use super::*;

fn always(algorithm: Algorithm, limit: u64, window_us: u64, burst: Option<u64>) -> LimitParams {
    params(algorithm, limit, window_us, burst)
        .with_charge(Charge::Always)
        .unwrap()
}

/// One decision on a single limit charged always: the outcome.
fn charge(params: &LimitParams, state: &mut Option<State>, now: u64, cost: u64) -> Outcome {
    let mut states = [state.take()];
    let verdict = decide(&[check_of(*params, cost, Mode::Enforce)], &mut states, now);
    *state = states[0].take();
    assert_eq!(verdict.allowed, verdict.outcomes[0].has_room);
    verdict.outcomes[0]
}

/// Whether a cost-0 check would pass at `now`, leaving `state` as it is.
fn has_room_at(params: &LimitParams, state: &Option<State>, now: u64) -> bool {
    let mut probe = state.clone();
    charge(params, &mut probe, now, 0).has_room
}

/// The pattern of Envoy's token limits: check at 0, then report usage.
/// 10 per minute, three reports of 4: the third goes 2 past the room, is
/// answered OVER_LIMIT, and every later check (cost 0 included) is denied
/// until the reset it was given, to the microsecond; then one passes.
#[test]
fn a_charge_past_the_room_is_recorded_and_denies_until_its_reset() {
    for algorithm in Algorithm::ALL {
        let params = always(algorithm, 10, MINUTE, None);
        let mut state = None;
        for idx in 0..2 {
            let it = charge(&params, &mut state, T0 + idx, 4);
            assert!(it.has_room && it.consumed, "{algorithm}");
            assert_eq!(it.overdraft, 0, "{algorithm}");
        }
        let over = charge(&params, &mut state, T0 + 2, 4);
        assert!(!over.has_room && !over.consumed, "{algorithm}");
        assert_eq!((over.remaining, over.overdraft), (0, 2), "{algorithm}");

        let check = charge(&params, &mut state.clone(), T0 + 3, 0);
        assert!(!check.has_room, "{algorithm}: a cost-0 check is denied");
        assert_eq!(check.remaining, 0, "{algorithm}");
        let room_at = T0 + 3 + check.reset_us;
        assert!(!has_room_at(&params, &state, room_at - 1), "{algorithm}");
        assert!(has_room_at(&params, &state, room_at), "{algorithm}");
    }
}

/// What each algorithm makes of the same debt: 10 per minute, 20 units
/// charged at once at T0 (10 past the room). Fixed window: the window
/// ends; sliding log: the entry leaves; token bucket and GCRA: the refill
/// pays the debt (1 minute) and then one unit (6 s); sliding counter: the
/// 20 weigh into the next window until floor(20 × (W − e) / W) <= 9.
#[test]
fn each_algorithm_carries_the_debt_as_its_own_state_does() {
    let expected = [
        (Algorithm::FixedWindow, MINUTE),
        (Algorithm::SlidingWindowLog, MINUTE),
        (Algorithm::TokenBucket, MINUTE + 6 * SECOND),
        (Algorithm::Gcra, MINUTE + 6 * SECOND),
        // floor(20 × (60000 − e) / 60000) <= 9  ⇔  e >= 30001 ms.
        (Algorithm::SlidingWindowCounter, MINUTE + 30_001_000),
    ];
    for (algorithm, room_after) in expected {
        let params = always(algorithm, 10, MINUTE, None);
        let mut state = None;
        let it = charge(&params, &mut state, T0, 20);
        assert_eq!((it.has_room, it.overdraft), (false, 10), "{algorithm}");
        let check = charge(&params, &mut state.clone(), T0, 0);
        assert_eq!(check.reset_us, room_after, "{algorithm}");
        assert!(!has_room_at(&params, &state, T0 + room_after - 1));
        assert!(has_room_at(&params, &state, T0 + room_after));
    }
}

/// The bound: one charge, or any number, leaves at most one capacity of
/// debt. A cost of 2^64 − 1 on a fresh limit records twice the capacity
/// (an overdraft of one capacity); the next records nothing more. The
/// limit then needs as long as two capacities take to come back.
#[test]
fn debt_stops_at_one_capacity_whatever_the_cost() {
    for algorithm in Algorithm::ALL {
        let burst = algorithm.has_burst().then_some(7);
        let params = always(algorithm, 5, MINUTE, burst);
        let capacity = params.capacity();
        let mut state = None;
        let first = charge(&params, &mut state, T0, u64::MAX);
        assert_eq!((first.has_room, first.overdraft), (false, capacity));
        let second = charge(&params, &mut state, T0, u64::MAX);
        assert_eq!(second.overdraft, 0, "{algorithm}: the debt is full");
        let third = charge(&params, &mut state, T0, capacity + 1);
        assert_eq!(third.overdraft, 0, "{algorithm}");
        // Just below the bound the charge is whole.
        let mut near = None;
        let it = charge(&params, &mut near, T0, 2 * capacity - 1);
        assert_eq!(it.overdraft, capacity - 1, "{algorithm}");
        let it = charge(&params, &mut near, T0, 1);
        assert_eq!(it.overdraft, 1, "{algorithm}");
        assert_eq!(near, state, "{algorithm}: the same full debt");

        let check = charge(&params, &mut state.clone(), T0, 0);
        let expected = match algorithm {
            Algorithm::FixedWindow | Algorithm::SlidingWindowLog => MINUTE,
            // 7 units of debt at 5 per minute, then one more.
            Algorithm::TokenBucket | Algorithm::Gcra => 8 * MINUTE / 5,
            // floor(10 × (W − e) / W) <= 4  ⇔  e >= 30001 ms.
            Algorithm::SlidingWindowCounter => MINUTE + 30_001_000,
        };
        assert_eq!(check.reset_us, expected, "{algorithm}");
    }
}

/// The reset answered to a charge past the capacity (which can never
/// pass) is when room for one unit comes back, from the debt it left: a
/// check passes then and not a microsecond before (a token bucket of 10 a
/// minute charged 2^64 − 1 says 66 s, not the 60 s window). A limit
/// charged only when allowed still answers the window.
#[test]
fn a_charge_past_the_capacity_answers_when_room_comes_back() {
    for algorithm in Algorithm::ALL {
        for cost in [11, 15, u64::MAX] {
            let params = always(algorithm, 10, MINUTE, None);
            let mut state = None;
            let it = charge(&params, &mut state, T0, cost);
            assert!(!it.has_room, "{algorithm} {cost}");
            assert!(
                !has_room_at(&params, &state, T0 + it.reset_us - 1),
                "{algorithm} {cost}"
            );
            assert!(
                has_room_at(&params, &state, T0 + it.reset_us),
                "{algorithm} {cost}"
            );
            if algorithm == Algorithm::TokenBucket && cost == u64::MAX {
                assert_eq!(it.reset_us, MINUTE + 6 * SECOND);
            }
        }
        let params = params(algorithm, 10, MINUTE, None);
        let it = charge(&params, &mut None, T0, 11);
        assert_eq!(it.reset_us, MINUTE, "{algorithm}");
    }
}

/// A limit charged only when allowed is unchanged: a denied request
/// records nothing, whatever its cost.
#[test]
fn if_allowed_limits_still_take_nothing_when_denied() {
    for algorithm in Algorithm::ALL {
        let params = params(algorithm, 10, MINUTE, None);
        assert_eq!(params.charge(), Charge::IfAllowed);
        assert_eq!(params.debt_capacity(), 0);
        let mut state = None;
        charge(&params, &mut state, T0, 8);
        let before = state.clone();
        let it = charge(&params, &mut state, T0, u64::MAX);
        assert_eq!((it.has_room, it.overdraft, it.remaining), (false, 0, 2));
        assert_eq!(state, before, "{algorithm}");
    }
}

/// Stacked limits: each limit charged always takes its cost in full; the
/// others are all or nothing among themselves, as before.
#[test]
fn a_stacked_request_charges_the_always_limits_and_no_other_when_denied() {
    for first in Algorithm::ALL {
        for second in Algorithm::ALL {
            let tokens = always(first, 10, MINUTE, None);
            let requests = params(second, 1, MINUTE, None);
            let mut states = [None, None];
            let request = |cost| {
                [
                    check_of(tokens, cost, Mode::Enforce),
                    check_of(requests, cost, Mode::Enforce),
                ]
            };
            assert!(decide(&request(1), &mut states, T0).allowed);
            // Denied by the request limit: the tokens are charged anyway.
            let denied = decide(&request(1), &mut states, T0 + 1);
            assert!(!denied.allowed, "{first} + {second}");
            assert!(denied.outcomes[0].has_room && !denied.outcomes[0].consumed);
            assert_eq!(denied.outcomes[0].remaining, 8, "{first} + {second}");
            assert_eq!(denied.outcomes[0].overdraft, 0);
            assert_eq!(denied.outcomes[1].remaining, 0);
            // Denied by the token limit (13 past 8): the request limit
            // keeps its state, the tokens go 5 into debt.
            let before = states[1].clone();
            let over = decide(&request(13), &mut states, T0 + 2);
            assert!(!over.allowed);
            assert_eq!(over.outcomes[0].overdraft, 5, "{first} + {second}");
            let mut advanced = before;
            advanced.as_mut().unwrap().advance(&requests, T0 + 2);
            assert_eq!(states[1], advanced, "{first} + {second}");
        }
    }
}

/// A shadow limit charged always records every cost and never denies.
#[test]
fn a_shadow_limit_charged_always_records_and_never_denies() {
    let tokens = always(Algorithm::FixedWindow, 3, MINUTE, None);
    let mut states = [None];
    for (idx, overdraft) in [(0, 0), (1, 1), (2, 2)] {
        let verdict = decide(&[check_of(tokens, 2, Mode::Shadow)], &mut states, T0 + idx);
        assert!(verdict.allowed);
        assert_eq!(verdict.outcomes[0].overdraft, overdraft);
    }
    let Some(State::FixedWindow(window)) = &states[0] else {
        panic!("a fixed-window state is kept");
    };
    assert_eq!(window.parts().1, 6, "every cost is counted, to the bound");
}

/// A token bucket in debt stores a negative level that the refill pays
/// off; the same limit reloaded as `if_allowed` forgives the debt.
#[test]
fn a_bucket_in_debt_refills_through_zero_and_a_reload_to_if_allowed_forgives_it() {
    let params = always(Algorithm::TokenBucket, 10, 10 * SECOND, None);
    let mut state = None;
    charge(&params, &mut state, T0, 15);
    let Some(State::TokenBucket(bucket)) = &state else {
        panic!("a bucket is kept");
    };
    let (scaled, _, scale) = bucket.parts();
    assert_eq!(scaled, -5 * scale as i64);
    // One unit a second: 5 s pay the debt, the 6th brings one unit.
    assert!(!has_room_at(&params, &state, T0 + 6 * SECOND - 1));
    assert!(has_room_at(&params, &state, T0 + 6 * SECOND));

    let reloaded = super::params(Algorithm::TokenBucket, 10, 10 * SECOND, None);
    let mut probe = state.clone();
    let it = charge(&reloaded, &mut probe, T0 + SECOND, 0);
    // The level is floored at 0, then a second refills one unit.
    assert_eq!((it.has_room, it.remaining), (true, 1));
}

/// `with_charge` refuses a limit whose state could not hold two
/// capacities exactly in a double, and accepts the one just below.
#[test]
fn charging_always_needs_twice_the_capacity_exactly() {
    let max = MAX_EXACT / 2;
    for algorithm in [Algorithm::FixedWindow, Algorithm::SlidingWindowLog] {
        let ok = params(algorithm, max - 1, SECOND, None);
        assert!(ok.with_charge(Charge::Always).is_ok(), "{algorithm}");
        let over = params(algorithm, max, SECOND, None);
        let err = over.with_charge(Charge::Always).unwrap_err();
        assert!(matches!(err, ParamsError::DebtTooPrecise { .. }), "{err}");
        assert!(over.with_charge(Charge::IfAllowed).is_ok());
    }
    // 8 per µs: scale 1, so 2 × capacity must stay below 2^53 (and the
    // refill of 2^52 units takes 2^49 µs, within MAX_SPAN_US).
    let most = MAX_EXACT / 2 - 1;
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let ok = params(algorithm, 8_000_000, SECOND, Some(most));
        assert!(ok.with_charge(Charge::Always).is_ok(), "{algorithm}");
        let over = params(algorithm, 8_000_000, SECOND, Some(most + 1));
        let err = over.with_charge(Charge::Always).unwrap_err();
        assert!(err.to_string().contains("charge: always"), "{err}");
    }
}

#[test]
fn charge_names_round_trip() {
    for charge in Charge::ALL {
        assert_eq!(Charge::from_name(charge.name()), Some(charge));
    }
    assert_eq!(Charge::default(), Charge::IfAllowed);
    assert_eq!(Charge::from_name("sometimes"), None);
}
