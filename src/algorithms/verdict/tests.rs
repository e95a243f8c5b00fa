use super::*;
use crate::algorithms::{Algorithm, LimitParams};

fn check(mode: Mode) -> Check {
    Check {
        params: LimitParams::new(Algorithm::FixedWindow, 5, 60_000_000, None).unwrap(),
        cost: 1,
        mode,
    }
}

#[test]
fn enforcing_limits_all_decide_quota_limits_any_one_shadow_none() {
    use Mode::*;
    assert!(allows([]));
    assert!(allows([(Enforce, true), (Shadow, false)]));
    assert!(!allows([(Enforce, true), (Enforce, false)]));
    assert!(allows([(Quota, false), (Quota, true)]));
    assert!(!allows([(Quota, false), (Quota, false), (Shadow, true)]));
    assert!(!allows([(Enforce, false), (Quota, true)]));
}

#[test]
fn a_denied_request_reports_what_its_limits_have_with_nothing_taken() {
    let taken = Outcome {
        has_room: true,
        consumed: true,
        remaining: 4,
        overdraft: 0,
        reset_us: 10,
    };
    let given_back = Outcome {
        consumed: false,
        remaining: 5,
        reset_us: 0,
        ..taken
    };
    let full = Outcome {
        has_room: false,
        consumed: false,
        remaining: 0,
        overdraft: 0,
        reset_us: 60,
    };
    let shadow = Provisional {
        if_allowed: taken,
        if_denied: given_back,
    };
    let no_room = Provisional {
        if_allowed: full,
        if_denied: full,
    };
    let checks = [check(Mode::Shadow), check(Mode::Enforce)];
    let verdict = settle(&checks, &[shadow, no_room]);
    assert!(!verdict.allowed);
    assert_eq!(verdict.outcomes, [given_back, full]);
    // Two quota limits, one full: allowed, the other took its cost.
    let checks = [check(Mode::Quota), check(Mode::Quota)];
    let verdict = settle(&checks, &[shadow, no_room]);
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes, [taken, full]);
}
