//! The over-limit cache: answers equal to the backend's, fewer backend
//! calls, cleared by a reload, bounded.

use std::sync::Arc;

use proptest::prelude::*;

use crate::algorithms::{Algorithm, Check, LimitParams, Mode};
use crate::backends::{Backend, CounterKey, KeyEntry, KeyValue, KeyedCheck};
use crate::clock::{Clock, ManualClock};
use crate::decision::{Limiter, Options, OverLimitCache, Request};
use crate::metrics::Metrics;
use crate::testing::decision::*;
use crate::testing::metrics_text::sample;
use crate::testing::{self, FakeBackend, T0, memory_backend};

/// A limiter whose backend reports `clock` as its local clock (as Redis
/// does), so that its denials are cached, and that backend.
fn cached(yaml: &str, clock: &ManualClock, capacity: usize) -> (Limiter, Arc<FakeBackend>) {
    let backend = Arc::new(
        FakeBackend::slow(memory_backend(clock), std::time::Duration::ZERO)
            .with_local_clock(Arc::new(clock.clone())),
    );
    let options = Options {
        over_limit_cache: capacity,
        ..testing::default_options()
    };
    let limiter = yaml_limiter_on(yaml, backend.clone() as Arc<dyn Backend>, options);
    (limiter, backend)
}

/// The same rules on a memory backend of their own, never cached.
fn reference(yaml: &str, clock: &ManualClock) -> Limiter {
    yaml_limiter_on(yaml, memory_backend(clock), testing::default_options())
}

fn tree(algorithm: Algorithm, extra: &str) -> String {
    format!(
        "domain: api
descriptors:
  - key: user
    rate_limit: {{unit: second, requests_per_unit: 3, algorithm: {algorithm}{extra}}}
  - key: watched
    shadow_mode: true
    rate_limit: {{unit: second, requests_per_unit: 1, algorithm: {algorithm}}}
  - key: team
    quota_mode: true
    rate_limit: {{unit: second, requests_per_unit: 1, algorithm: {algorithm}}}
"
    )
}

fn user(value: &str, hits_addend: u32) -> Request {
    request_in("api", vec![desc(&[("user", value)])], hits_addend)
}

#[tokio::test]
async fn a_full_counter_is_answered_without_the_backend_until_it_has_room() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(T0);
        let yaml = tree(algorithm, "");
        let (limiter, backend) = cached(&yaml, &clock, 100);
        let twin = reference(&yaml, &clock);
        let request = user("a", 1);
        let mut calls = 0;
        // Three pass, the fourth is denied by the backend, then the cache
        // answers exactly what the backend would, without asking it.
        for step in 0..10 {
            let got = limiter.decide(&request).await.unwrap();
            assert_eq!(
                got,
                twin.decide(&request).await.unwrap(),
                "{algorithm} {step}"
            );
            if step < 4 {
                calls += 1;
            }
            assert_eq!(backend.calls(), calls, "{algorithm} step {step}");
            clock.advance(1_000);
        }
        let hits = sample(
            &limiter.metrics().encode(),
            "throttlegate_over_limit_cache_hits_total",
        );
        assert_eq!(hits, Some(6.0), "{algorithm}");
        // Once room may be back, the backend decides again.
        clock.advance(2_000_000);
        let got = limiter.decide(&request).await.unwrap();
        assert_eq!(got, twin.decide(&request).await.unwrap(), "{algorithm}");
        assert_eq!(got.overall, OK, "{algorithm}");
        assert_eq!(backend.calls(), calls + 1, "{algorithm}");
    }
}

#[tokio::test]
async fn only_enforcing_limits_and_costs_up_to_one_are_cached() {
    let clock = ManualClock::new(T0);
    let (limiter, backend) = cached(&tree(Algorithm::FixedWindow, ""), &clock, 100);
    let shadow = request_in("api", vec![desc(&[("watched", "a")])], 0);
    let quota = request_in("api", vec![desc(&[("team", "a")])], 0);
    let costly = user("b", 5);
    for request in [&shadow, &quota, &costly] {
        let before = backend.calls();
        for _ in 0..5 {
            limiter.decide(request).await.unwrap();
        }
        assert_eq!(backend.calls(), before + 5, "{request:?}");
    }
}

#[tokio::test]
async fn a_request_with_a_counter_not_known_full_asks_the_backend() {
    let clock = ManualClock::new(T0);
    let (limiter, backend) = cached(&tree(Algorithm::SlidingWindowLog, ""), &clock, 100);
    for _ in 0..4 {
        limiter.decide(&user("full", 1)).await.unwrap();
    }
    let both = request_in(
        "api",
        vec![desc(&[("user", "full")]), desc(&[("user", "fresh")])],
        1,
    );
    let before = backend.calls();
    let decision = limiter.decide(&both).await.unwrap();
    assert_eq!(decision.overall, OVER);
    assert_eq!(
        decision.statuses[1].limit_remaining, 3,
        "fresh: not consumed"
    );
    assert_eq!(backend.calls(), before + 1);
    // The fresh counter had room: it is not cached, so the next one asks again.
    limiter.decide(&both).await.unwrap();
    assert_eq!(backend.calls(), before + 2);
    // The full one alone is still answered locally.
    limiter.decide(&user("full", 1)).await.unwrap();
    assert_eq!(backend.calls(), before + 2);
}

#[tokio::test]
async fn a_reload_empties_the_cache() {
    let clock = ManualClock::new(T0);
    let yaml = tree(Algorithm::TokenBucket, "");
    let (limiter, backend) = cached(&yaml, &clock, 100);
    for _ in 0..5 {
        limiter.decide(&user("a", 1)).await.unwrap();
    }
    assert_eq!(backend.calls(), 4);
    // The same rules, loaded again: a new rule set, so nothing cached holds.
    limiter
        .rules()
        .store(Arc::new(testing::rules_from("api.yaml", &yaml)));
    let decision = limiter.decide(&user("a", 1)).await.unwrap();
    assert_eq!(decision.overall, OVER);
    assert_eq!(backend.calls(), 5);
    // And what the backend said under the new rules is cached again.
    limiter.decide(&user("a", 1)).await.unwrap();
    assert_eq!(backend.calls(), 5);
}

#[tokio::test]
async fn a_zero_capacity_turns_the_cache_off() {
    let clock = ManualClock::new(T0);
    let (limiter, backend) = cached(&tree(Algorithm::Gcra, ""), &clock, 0);
    for _ in 0..10 {
        limiter.decide(&user("a", 1)).await.unwrap();
    }
    assert_eq!(backend.calls(), 10);
}

#[test]
fn the_cache_holds_at_most_its_capacity_and_reuses_expired_room() {
    let clock = ManualClock::new(T0);
    let cache = OverLimitCache::new(16, Arc::new(clock.clone())).unwrap();
    let rules = Arc::new(testing::rules_from(
        "api.yaml",
        &tree(Algorithm::FixedWindow, ""),
    ));
    let full = |value: &str| {
        let check = keyed_check(value);
        let verdict = crate::algorithms::Verdict {
            allowed: false,
            outcomes: vec![crate::algorithms::Outcome {
                has_room: false,
                consumed: false,
                remaining: 0,
                overdraft: 0,
                reset_us: 1_000_000,
            }],
        };
        (check, verdict)
    };
    for n in 0..1_000 {
        let (check, verdict) = full(&format!("v{n}"));
        cache.record(
            &rules,
            std::slice::from_ref(&check),
            &verdict,
            clock.now_us(),
        );
        assert!(cache.len() <= 16, "{} after {n}", cache.len());
    }
    assert!(cache.len() >= 8, "spread over the shards: {}", cache.len());
    // Entries expire: later ones take their place.
    clock.advance(1_000_001);
    let (check, verdict) = full("late");
    cache.record(
        &rules,
        std::slice::from_ref(&check),
        &verdict,
        clock.now_us(),
    );
    let answer = cache.lookup(&rules, std::slice::from_ref(&check));
    assert!(answer.is_some(), "the late counter is cached");
}

/// An enforcing check of cost 1 on `user=value`, 3 per second.
fn keyed_check(value: &str) -> KeyedCheck {
    let params = LimitParams::new(Algorithm::FixedWindow, 3, 1_000_000, None).unwrap();
    KeyedCheck {
        key: CounterKey {
            domain: "api".into(),
            rule: "user".into(),
            algorithm: Algorithm::FixedWindow,
            window_s: 1,
            is_override: false,
            entries: vec![KeyEntry {
                key: "user".into(),
                value: KeyValue::Value(value.into()),
            }],
        },
        check: Check {
            params,
            cost: 1,
            mode: Mode::Enforce,
        },
    }
}

/// One step of a random run: time passes, then a request on one of two
/// values with a cost of 0, 1 or 2.
#[derive(Debug, Clone)]
struct Step {
    advance_us: u64,
    value: &'static str,
    hits_addend: u32,
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop_oneof![Just(0u64), 0..2_000u64, 0..400_000u64, 0..3_000_000u64],
        prop_oneof![Just("a"), Just("b")],
        prop_oneof![3 => Just(1u32), 1 => Just(0u32), 1 => Just(2u32)],
    )
        .prop_map(|(advance_us, value, hits_addend)| Step {
            advance_us,
            value,
            hits_addend,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the algorithm, the times and the costs, a limiter with the
    /// cache answers every request exactly as one without it.
    #[test]
    fn cached_answers_equal_the_backends(
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
        burst in prop_oneof![Just(""), Just(", burst: 5")],
        steps in prop::collection::vec(step(), 1..60),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let clock = ManualClock::new(T0);
            let extra = if algorithm.has_burst() { burst } else { "" };
            let yaml = tree(algorithm, extra);
            let (limiter, _) = cached(&yaml, &clock, 100);
            let twin = reference(&yaml, &clock);
            for (idx, step) in steps.iter().enumerate() {
                clock.advance(step.advance_us);
                let request = user(step.value, step.hits_addend);
                let got = limiter.decide(&request).await.unwrap();
                let want = twin.decide(&request).await.unwrap();
                prop_assert_eq!(got, want, "{} step {}: {:?}", algorithm, idx, step);
            }
            Ok(())
        })?;
    }
}

#[test]
fn metrics_start_at_zero() {
    let text = Metrics::new().encode();
    assert_eq!(
        sample(&text, "throttlegate_over_limit_cache_hits_total"),
        Some(0.0)
    );
    assert_eq!(
        sample(&text, "throttlegate_over_limit_cache_entries"),
        Some(0.0)
    );
}

/// A limit charged always is never answered from the cache: every charge
/// (cost 1 included) and every check reaches the backend, so the debt the
/// charges build is recorded and the reset reported is the backend's, and
/// the answers are the uncached limiter's. The units past the room are
/// counted per rule.
#[tokio::test]
async fn limits_charged_always_are_never_cached() {
    for algorithm in Algorithm::ALL {
        let clock = ManualClock::new(T0);
        let yaml = tree(algorithm, ", charge: always");
        let (limiter, backend) = cached(&yaml, &clock, 100);
        let twin = reference(&yaml, &clock);
        for (step, cost) in [1, 1, 1, 1, 1, 0, 0, 2, 0].into_iter().enumerate() {
            let request = user("a", cost);
            let got = limiter.decide(&request).await.unwrap();
            assert_eq!(
                got,
                twin.decide(&request).await.unwrap(),
                "{algorithm} {step}"
            );
            assert_eq!(backend.calls(), step + 1, "{algorithm} step {step}");
            clock.advance(1_000);
        }
        let text = limiter.metrics().encode();
        assert_eq!(
            sample(&text, "throttlegate_over_limit_cache_hits_total"),
            Some(0.0)
        );
        // Three pass; the next two (cost 1) go 1 + 1 past the room, the
        // cost of 2 only 1: the debt stops at one capacity (3).
        assert_eq!(
            sample(
                &text,
                "throttlegate_overdraft_units_total{domain=\"api\",rule=\"user\"}"
            ),
            Some(3.0),
            "{algorithm}"
        );
    }
}
