//! Differential test: the memory and Redis backends give identical verdicts
//! on the same random traces with the same manual clock.

mod support;

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use support::redis::RedisServer;
use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode, Verdict};
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, CounterKey, KeyEntry, KeyValue, KeyedCheck};
use throttlegate::clock::ManualClock;

const T0: u64 = 1_700_000_000_000_000;
const SEEDS: u64 = 40;
const STEPS: usize = 150;

/// splitmix64: a reproducible trace per seed without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// A counter of the trace: its key and the parameter sets a "reload" may
/// switch between (the key does not include the number, only the window).
struct Slot {
    key: CounterKey,
    variants: Vec<LimitParams>,
}

fn random_params(
    rng: &mut Rng,
    algorithm: Algorithm,
    window_s: u64,
    reloads: bool,
) -> Vec<LimitParams> {
    // Both backends treat a key as fresh once it is idle past the time it
    // would be full under the parameters it was written with. A token
    // bucket refills at the rate in force, so after a reload that changes
    // its rate or capacity that moment is not "full" under the new
    // parameters, and the memory backend (expiring to the µs) and Redis
    // (to the ms, and here with the trace's grace) part ways: token buckets
    // do not reload here; their rescaling is covered by the test near the
    // exactness bound, whose keys never expire.
    let n_variants = if reloads && algorithm != Algorithm::TokenBucket {
        1 + rng.below(3)
    } else {
        1
    };
    (0..n_variants)
        .map(|_| {
            let limit = rng.pick(&[0, 1, 2, 3, 5, 7, 10, 100]);
            let burst = if algorithm.has_burst() && rng.below(2) == 0 {
                Some(1 + rng.below(2 * limit.max(1)))
            } else {
                None
            };
            LimitParams::new(algorithm, limit, window_s * 1_000_000, burst).expect("valid params")
        })
        .collect()
}

fn random_slots(rng: &mut Rng, algorithms: &[Algorithm], reloads: bool) -> Vec<Slot> {
    let mut slots = Vec::new();
    for idx in 0..6 {
        let algorithm = rng.pick(algorithms);
        let window_s = rng.pick(&[1, 2, 60, 3_600]);
        for value in ["a", "b"] {
            slots.push(Slot {
                key: CounterKey {
                    domain: Arc::from("parity"),
                    rule: Arc::from(format!("rule{idx}")),
                    algorithm,
                    window_s,
                    is_override: false,
                    entries: vec![KeyEntry {
                        key: "user".into(),
                        value: KeyValue::Value(value.into()),
                    }],
                },
                variants: random_params(rng, algorithm, window_s, reloads),
            });
        }
    }
    slots
}

fn random_request(rng: &mut Rng, slots: &[Slot]) -> Vec<KeyedCheck> {
    let n_checks = 1 + rng.below(3) as usize;
    let mut chosen: Vec<usize> = Vec::new();
    while chosen.len() < n_checks {
        let idx = rng.below(slots.len() as u64) as usize;
        if !chosen.contains(&idx) {
            chosen.push(idx);
        }
    }
    chosen
        .into_iter()
        .map(|idx| {
            let slot = &slots[idx];
            let params = slot.variants[rng.below(slot.variants.len() as u64) as usize];
            let cost = match rng.below(12) {
                0 => 0,
                1 => 2,
                2 => 5,
                3 => params.capacity() + 1,
                4 => params.capacity(),
                // Costs no Lua number holds exactly (descriptor hits_addend
                // is a uint64).
                5 => rng.pick(&[(1 << 53) - 1, 1 << 53, 1 << 63, u64::MAX]),
                _ => 1,
            };
            let mode = match rng.below(8) {
                0 => Mode::Shadow,
                1 | 2 => Mode::Quota,
                _ => Mode::Enforce,
            };
            KeyedCheck {
                key: slot.key.clone(),
                check: Check { params, cost, mode },
            }
        })
        .collect()
}

/// Moves the clock: mostly small steps, sometimes whole windows, and
/// sometimes backwards (a replica whose clock lags the stored state).
fn step_clock(rng: &mut Rng, clock: &ManualClock, now: &mut u64, backwards: bool) {
    let delta: i64 = match rng.below(12) {
        0 | 1 => 0,
        2 => 1,
        3 => 999,
        4 => 1_000,
        5 => 100_000,
        6 => 333_333,
        7 => 1_000_000,
        8 => 2_000_001,
        9 => 61_000_000,
        10 if backwards => -(rng.below(1_500_000) as i64),
        _ => rng.below(5_000_000) as i64,
    };
    *now = now.saturating_add_signed(delta);
    clock.set(*now);
}

async fn run_trace(server: &RedisServer, seed: u64, reloads: bool) {
    let mut rng = Rng(seed);
    let mut now = T0 + rng.below(10_000_000_000);
    let clock = ManualClock::new(now);
    let memory = MemoryBackend::new(Arc::new(clock.clone()));
    let mut settings =
        support::redis::settings(server, ClockSource::Local(Arc::new(clock.clone())));
    settings.key_prefix = format!("parity{seed}{}", if reloads { "r" } else { "" });
    // Keys expire by Redis's real clock while this trace's clock jumps
    // ahead and back; the grace keeps a key from expiring in real time
    // before its state is fresh by the trace's clock.
    settings.expiry_grace_ms = 3_600_000;
    let redis = RedisBackend::connect(settings).await.expect("connect");
    // Half the traces move the clock back now and then.
    let backwards = seed.is_multiple_of(2);
    let slots = random_slots(&mut rng, &Algorithm::ALL, reloads);
    for step in 0..STEPS {
        step_clock(&mut rng, &clock, &mut now, backwards);
        let checks = random_request(&mut rng, &slots);
        let expected: Verdict = memory.decide(&checks).await.expect("memory decides");
        let actual = redis.decide(&checks).await.expect("redis decides");
        assert_eq!(
            actual, expected,
            "seed {seed} step {step} at {now}: redis differs from memory for {checks:#?}"
        );
    }
}

#[tokio::test]
async fn memory_and_redis_agree_on_random_traces() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(&server, seed, false).await;
    }
}

#[tokio::test]
async fn memory_and_redis_agree_when_limits_are_reloaded() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(&server, 1_000 + seed, true).await;
    }
}

/// A limit and an optional burst.
type Variant = (u64, Option<u64>);

/// Large numbers near the 53-bit bound exercise the exact division and
/// multiplication helpers of the script.
#[tokio::test]
async fn memory_and_redis_agree_near_the_exactness_bound() {
    let server = RedisServer::start();
    let clock = ManualClock::new(T0);
    let memory = MemoryBackend::new(Arc::new(clock.clone()));
    let mut settings =
        support::redis::settings(&server, ClockSource::Local(Arc::new(clock.clone())));
    settings.expiry_grace_ms = 3_600_000;
    let redis = RedisBackend::connect(settings).await.expect("connect");
    let year_s = 365 * 86_400;
    // (algorithm, window, the (limit, burst) variants a reload switches
    // between): switching exercises the exact rescaling of stored state.
    let cases: [(Algorithm, u64, &[Variant]); 8] = [
        // per_us / scale = 7 / 31_536_000_000_000, burst near 2^53 / scale;
        // reloading to 285 per year rescales through a 2^96 product.
        (
            Algorithm::TokenBucket,
            year_s,
            &[(7, Some(285)), (285, None)],
        ),
        (Algorithm::Gcra, year_s, &[(7, Some(285))]),
        (
            Algorithm::TokenBucket,
            1,
            &[(1_000_003, Some(8_000_000_000))],
        ),
        (Algorithm::Gcra, 3_600, &[(2_500_001, None)]),
        // The fraction's rescale: frac ~ 1e9 times per_us ~ 1e7.
        (
            Algorithm::Gcra,
            1,
            &[(999_999_937, None), (10_000_019, None)],
        ),
        (Algorithm::SlidingWindowCounter, year_s, &[(285_000, None)]),
        (Algorithm::FixedWindow, 1, &[((1 << 53) - 1, None)]),
        (Algorithm::SlidingWindowLog, 1, &[(1_500, None)]),
    ];
    let mut rng = Rng(7);
    for (idx, (algorithm, window_s, variants)) in cases.into_iter().enumerate() {
        let variants: Vec<LimitParams> = variants
            .iter()
            .map(|&(limit, burst)| {
                LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                    .unwrap_or_else(|err| panic!("case {idx}: {err}"))
            })
            .collect();
        let key = support::keys::counter_key(algorithm, window_s, &[("big", &idx.to_string())]);
        for step in 0..80 {
            clock.advance(rng.pick(&[0, 1, 7, 1_000_003, 86_400_000_000]));
            let params = variants[rng.below(variants.len() as u64) as usize];
            let cost = rng.pick(&[0, 1, 3, params.capacity() / 2, params.capacity()]);
            let checks = [KeyedCheck {
                key: key.clone(),
                check: Check {
                    params,
                    cost,
                    mode: Mode::Enforce,
                },
            }];
            let expected = memory.decide(&checks).await.expect("memory decides");
            let actual = redis.decide(&checks).await.expect("redis decides");
            assert_eq!(actual, expected, "case {idx} step {step}: {checks:?}");
        }
    }
}

/// A cost anywhere in the uint64 range a descriptor's hits_addend can
/// carry, weighted towards the edges of what a double holds exactly.
fn arb_cost() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0..=12u64,
        2 => any::<u64>(),
        2 => (1u64 << 52)..=(1u64 << 54),
        1 => prop::sample::select(vec![
            (1u64 << 53) - 1,
            1 << 53,
            (1 << 53) + 1,
            1 << 63,
            u64::MAX - 1,
            u64::MAX,
        ]),
    ]
}

/// Limits of every algorithm, small and large, that the random requests
/// below draw from: (algorithm, limit, window in s, burst).
const COST_LIMITS: [(Algorithm, u64, u64, Option<u64>); 10] = [
    (Algorithm::SlidingWindowLog, 10, 60, None),
    (Algorithm::SlidingWindowLog, 3_000_000, 3_600, None),
    (Algorithm::TokenBucket, 10, 60, Some(20)),
    (Algorithm::TokenBucket, 1_000_000, 3_600, None),
    (Algorithm::Gcra, 10, 60, None),
    (Algorithm::Gcra, 100_003, 3_600, None),
    (Algorithm::SlidingWindowCounter, 10, 60, None),
    (Algorithm::SlidingWindowCounter, 1_000_000, 3_600, None),
    (Algorithm::FixedWindow, 10, 60, None),
    (Algorithm::FixedWindow, (1 << 53) - 1, 1, None),
];

/// Requests of 1–4 limits, each (limit index, cost), with µs since the
/// previous request.
type CostTrace = Vec<(u64, Vec<(usize, u64)>)>;

fn arb_cost_trace() -> impl Strategy<Value = CostTrace> {
    let request = prop::collection::vec((0..COST_LIMITS.len(), arb_cost()), 1..=4);
    let delta = prop_oneof![Just(0u64), 0..2_000_000u64, Just(61_000_000u64)];
    prop::collection::vec((delta, request), 1..=12)
}

/// Costs across the whole uint64 range, alone or on several limits of a
/// request, get the same verdict from both backends: costs at and above
/// 2^53 were refused by the script as bad parameters (a backend error)
/// while the memory backend answered OVER_LIMIT.
#[test]
fn memory_and_redis_agree_on_costs_across_the_u64_range() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    // Every case (and every shrinking step) gets keys of its own.
    let case = std::sync::atomic::AtomicU64::new(0);
    let res = runner.run(&arb_cost_trace(), |trace| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(run_cost_trace(&server, case, &trace))
    });
    if let Err(err) = res {
        panic!("{err}");
    }
}

async fn run_cost_trace(
    server: &RedisServer,
    case: u64,
    trace: &CostTrace,
) -> Result<(), TestCaseError> {
    let mut now = T0;
    let clock = ManualClock::new(now);
    let memory = MemoryBackend::new(Arc::new(clock.clone()));
    let mut settings =
        support::redis::settings(server, ClockSource::Local(Arc::new(clock.clone())));
    settings.key_prefix = format!("costs{case}");
    settings.expiry_grace_ms = 3_600_000;
    let redis = RedisBackend::connect(settings).await.expect("connect");
    for (step, (delta, limits)) in trace.iter().enumerate() {
        now += delta;
        clock.set(now);
        let mut checks: Vec<KeyedCheck> = Vec::new();
        for &(idx, cost) in limits {
            let (algorithm, limit, window_s, burst) = COST_LIMITS[idx];
            let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                .expect("valid params");
            let key =
                support::keys::counter_key(algorithm, window_s, &[("limit", &idx.to_string())]);
            // Two costs on one counter add up, as the limiter merges them.
            if let Some(it) = checks.iter_mut().find(|it| it.key == key) {
                it.check.cost = it.check.cost.saturating_add(cost);
                continue;
            }
            checks.push(KeyedCheck {
                key,
                check: Check {
                    params,
                    cost,
                    mode: Mode::Enforce,
                },
            });
        }
        let expected = memory.decide(&checks).await.expect("memory decides");
        let actual = redis
            .decide(&checks)
            .await
            .map_err(|err| TestCaseError::fail(format!("step {step}: redis failed: {err}")))?;
        prop_assert_eq!(&actual, &expected, "step {} for {:?}", step, checks);
        for (check, outcome) in checks.iter().zip(&expected.outcomes) {
            if check.check.cost > check.check.params.capacity() {
                prop_assert!(!outcome.has_room && !outcome.consumed);
            }
        }
    }
    Ok(())
}
