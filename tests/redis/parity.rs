//! Differential test: the memory and Redis backends give identical verdicts
//! on the same traces with the same manual clock, and after every step hold
//! the same state for every key it touched, with the TTL in Redis matching
//! the memory backend's expiry.
//!
//! Redis expires keys on its own (real) clock while a trace moves a manual
//! one, so keys get an hour of grace against real time. Then either Redis
//! keeps every key past its lifetime, as a grace does in production, and a
//! state read after its lifetime must decide as a fresh one
//! ([`Expiry::Kept`]); or the test expires keys on the trace's clock in
//! both backends ([`Expiry::OnTraceClock`]). Either way every write checks
//! that the TTL Redis set ends when the memory backend's entry expires (to
//! the ms, Redis's granularity).

use std::collections::HashMap;
use std::sync::Arc;

use crate::support;
use crate::support::redis::RedisServer;
use crate::support::rng::Rng;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::{
    Algorithm, Charge, Check, LimitParams, MAX_SPAN_US, Mode, State, Verdict,
};
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, CounterKey, KeyEntry, KeyValue, KeyedCheck};
use throttlegate::clock::{Clock, ManualClock};

const T0: u64 = 1_700_000_000_000_000;
const SEEDS: u64 = 40;
const STEPS: usize = 150;

/// Keeps keys from expiring in real time: see the module's comment.
const GRACE_MS: u64 = 3_600_000;

/// When a key past its lifetime leaves Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expiry {
    /// Never during a trace: a state past its lifetime is read again.
    Kept,
    /// When the memory backend drops its entry: the memory backend sweeps
    /// before every step, and the keys it no longer holds are deleted from
    /// Redis.
    OnTraceClock,
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
    reloads: Reloads,
    charges: Charges,
) -> Vec<LimitParams> {
    // A token bucket idle past its lifetime is full under the parameters it
    // was written with, not under reloaded ones: the memory backend then
    // starts it fresh, while Redis, still holding the key, refills the old
    // level at the new rate. Its reloads agree only when keys leave Redis
    // when they leave memory ([`Expiry::OnTraceClock`]).
    let reloaded = match reloads {
        Reloads::None => false,
        Reloads::ButTokenBuckets => algorithm != Algorithm::TokenBucket,
        Reloads::All => true,
    };
    let n_variants = if reloaded { 1 + rng.below(3) } else { 1 };
    (0..n_variants)
        .map(|_| {
            let limit = rng.pick(&[0, 1, 2, 3, 5, 7, 10, 100]);
            let burst = if algorithm.has_burst() && rng.below(2) == 0 {
                Some(1 + rng.below(2 * limit.max(1)))
            } else {
                None
            };
            let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                .expect("valid params");
            let charge = match charges {
                Charges::IfAllowed => Charge::IfAllowed,
                // A reload may switch a counter between the two.
                Charges::Mixed if rng.below(3) == 0 => Charge::IfAllowed,
                Charges::Mixed => Charge::Always,
            };
            params.with_charge(charge).expect("small limits carry debt")
        })
        .collect()
}

/// Whether the counters of a trace are charged always.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Charges {
    IfAllowed,
    /// Two thirds of the parameter sets charge always.
    Mixed,
}

/// Which counters of a trace switch between parameter sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reloads {
    None,
    ButTokenBuckets,
    All,
}

fn random_slots(
    rng: &mut Rng,
    algorithms: &[Algorithm],
    reloads: Reloads,
    charges: Charges,
) -> Vec<Slot> {
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
                variants: random_params(rng, algorithm, window_s, reloads, charges),
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

/// A key's state as Redis holds it: a log's entries as (µs, running total,
/// units), or the integers of a string state in order.
#[derive(Debug, PartialEq, Eq)]
enum Stored {
    Log(Vec<(u64, u64, u64)>),
    Fields(Vec<i64>),
}

impl Stored {
    fn of(state: &State) -> Stored {
        match state {
            State::SlidingWindowLog(it) => Stored::Log(it.parts()),
            State::TokenBucket(it) => {
                let (scaled, last_us, scale) = it.parts();
                Stored::fields(scaled, &[last_us, scale])
            }
            State::Gcra(it) => {
                let (tat_us, frac, per_us) = it.parts();
                Stored::fields(int(tat_us), &[frac, per_us])
            }
            State::SlidingWindowCounter(it) => {
                let (start, current, previous) = it.parts();
                Stored::fields(int(start), &[current, previous])
            }
            State::FixedWindow(it) => {
                let (start, count) = it.parts();
                Stored::fields(int(start), &[count])
            }
        }
    }
}

impl Stored {
    /// A string state's integers: the first may be negative (a token
    /// bucket in debt).
    fn fields(first: i64, rest: &[u64]) -> Stored {
        Stored::Fields(
            std::iter::once(first)
                .chain(rest.iter().map(|&it| int(it)))
                .collect(),
        )
    }
}

fn int(value: u64) -> i64 {
    i64::try_from(value).expect("stored integers are below 2^53")
}

/// Both backends on one manual clock, and a connection to read Redis with.
struct Pair {
    clock: ManualClock,
    memory: MemoryBackend,
    redis: RedisBackend,
    conn: MultiplexedConnection,
    expiry: Expiry,
    /// Redis keys written and not deleted since, with their counters.
    held: HashMap<String, CounterKey>,
}

impl Pair {
    async fn new(server: &RedisServer, key_prefix: String, now: u64, expiry: Expiry) -> Pair {
        let clock = ManualClock::new(now);
        let memory = MemoryBackend::new(Arc::new(clock.clone()));
        let mut settings =
            support::redis::settings(server, ClockSource::Local(Arc::new(clock.clone())));
        settings.key_prefix = key_prefix;
        settings.expiry_grace_ms = GRACE_MS;
        let redis = RedisBackend::connect(settings).await.expect("connect");
        Pair {
            clock,
            memory,
            redis,
            conn: server.connection().await,
            expiry,
            held: HashMap::new(),
        }
    }

    /// Decides `checks` on both backends: the verdicts must be equal, and
    /// so must the state and expiry of every key the request touched.
    async fn step(&mut self, checks: &[KeyedCheck]) -> Result<Verdict, String> {
        self.expire().await;
        let expected = self.memory.decide(checks).await.expect("memory decides");
        let started = std::time::Instant::now();
        let actual = self
            .redis
            .decide(checks)
            .await
            .map_err(|err| format!("redis failed: {err}"))?;
        if actual != expected {
            return Err(format!("redis answered {actual:?}, memory {expected:?}"));
        }
        for it in checks {
            self.compare_stored(it, started).await?;
        }
        Ok(expected)
    }

    /// Expires keys on the trace's clock in both backends: the memory
    /// backend's sweep removes its expired entries (which a clock moving
    /// back would otherwise find live again, while an expired Redis key is
    /// gone for good), and the keys whose state it no longer holds are
    /// deleted from Redis.
    async fn expire(&mut self) {
        if self.expiry == Expiry::Kept {
            return;
        }
        self.memory.purge_expired();
        let gone: Vec<String> = self
            .held
            .iter()
            .filter(|(_, key)| self.memory.stored(key).is_none())
            .map(|(name, _)| name.clone())
            .collect();
        for name in gone {
            let _: () = redis::cmd("DEL")
                .arg(&name)
                .query_async(&mut self.conn)
                .await
                .expect("del");
            self.held.remove(&name);
        }
    }

    /// The key of `check` holds the same state in both backends, and its
    /// TTL in Redis (less the grace, and the real time passed since
    /// `started`) ends when the memory backend's entry expires, rounded up
    /// to the ms.
    async fn compare_stored(
        &mut self,
        check: &KeyedCheck,
        started: std::time::Instant,
    ) -> Result<(), String> {
        let now = self.clock.now_us();
        let name = self.redis.key_of(&check.key);
        let window_us = check.check.params.window_us();
        let in_redis = redis_stored(&mut self.conn, &name, check.key.algorithm, window_us, now);
        let in_redis = in_redis.await;
        let in_memory = self.memory.stored(&check.key);
        let Some((mut state, expires_us)) = in_memory else {
            return match in_redis {
                None => Ok(()),
                Some(it) => Err(format!("{name}: redis holds {it:?}, memory nothing")),
            };
        };
        let in_memory = Stored::of(&state);
        if in_redis.as_ref() != Some(&in_memory) {
            return Err(format!(
                "{name}: redis holds {in_redis:?}, memory {in_memory:?}"
            ));
        }
        self.held.insert(name.clone(), check.key.clone());
        // The stored state is advanced already: this returns its effective
        // time, which the TTL counts from.
        let at = state.advance(&check.check.params, now);
        let expected = (expires_us - at).div_ceil(1_000) as i64 + GRACE_MS as i64;
        let pttl: i64 = redis::cmd("PTTL")
            .arg(&name)
            .query_async(&mut self.conn)
            .await
            .expect("pttl");
        let passed = started.elapsed().as_millis() as i64 + 1;
        if pttl > expected || pttl < expected - passed {
            return Err(format!(
                "{name}: pttl {pttl} ms, expected {expected} ms less up to {passed} ms passed"
            ));
        }
        Ok(())
    }
}

/// The state Redis holds at `name`, decoded; for a log, only the entries
/// still in the window at the effective time (the script leaves some
/// expired ones for later calls to remove).
async fn redis_stored(
    conn: &mut MultiplexedConnection,
    name: &str,
    algorithm: Algorithm,
    window_us: u64,
    now: u64,
) -> Option<Stored> {
    if algorithm != Algorithm::SlidingWindowLog {
        let raw: Option<String> = redis::cmd("GET").arg(name).query_async(conn).await.ok()?;
        let fields = raw?
            .split(':')
            .map(|it| it.parse().expect("integer"))
            .collect();
        return Some(Stored::Fields(fields));
    }
    let members: Vec<(String, u64)> = redis::cmd("ZRANGE")
        .arg(name)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(conn)
        .await
        .expect("zrange");
    let at = now.max(members.last()?.1);
    let live = members
        .iter()
        .filter(|(_, ts)| ts + window_us > at)
        .map(|(member, ts)| {
            let (end, cost) = member.split_once(',').expect("member <end>,<cost>");
            (*ts, end.parse().expect("end"), cost.parse().expect("cost"))
        })
        .collect();
    Some(Stored::Log(live))
}

async fn run_trace(
    server: &RedisServer,
    seed: u64,
    reloads: Reloads,
    expiry: Expiry,
    charges: Charges,
) {
    let mut rng = Rng(seed);
    let mut now = T0 + rng.below(10_000_000_000);
    let prefix = format!("parity{seed}");
    let mut pair = Pair::new(server, prefix, now, expiry).await;
    // Half the traces move the clock back now and then.
    let backwards = seed.is_multiple_of(2);
    let slots = random_slots(&mut rng, &Algorithm::ALL, reloads, charges);
    for step in 0..STEPS {
        step_clock(&mut rng, &pair.clock, &mut now, backwards);
        let checks = random_request(&mut rng, &slots);
        if let Err(err) = pair.step(&checks).await {
            panic!("seed {seed} step {step} at {now}: {err} for {checks:#?}");
        }
    }
}

#[tokio::test]
async fn memory_and_redis_agree_on_random_traces() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(
            &server,
            seed,
            Reloads::None,
            Expiry::Kept,
            Charges::IfAllowed,
        )
        .await;
    }
}

#[tokio::test]
async fn memory_and_redis_agree_when_limits_are_reloaded() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(
            &server,
            1_000 + seed,
            Reloads::ButTokenBuckets,
            Expiry::Kept,
            Charges::IfAllowed,
        )
        .await;
    }
}

#[tokio::test]
async fn memory_and_redis_agree_when_token_buckets_are_reloaded() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(
            &server,
            2_000 + seed,
            Reloads::All,
            Expiry::OnTraceClock,
            Charges::IfAllowed,
        )
        .await;
    }
}

/// Limits charged always (and reloads switching a counter between the two
/// charges): every algorithm in debt, on both backends alike, with random
/// requests stacking them with limits charged only when allowed.
#[tokio::test]
async fn memory_and_redis_agree_when_limits_charge_always() {
    let server = RedisServer::start();
    for seed in 0..SEEDS {
        run_trace(
            &server,
            3_000 + seed,
            Reloads::None,
            Expiry::Kept,
            Charges::Mixed,
        )
        .await;
        run_trace(
            &server,
            4_000 + seed,
            Reloads::All,
            Expiry::OnTraceClock,
            Charges::Mixed,
        )
        .await;
    }
}

/// A limit and an optional burst.
type Variant = (u64, Option<u64>);

/// Large numbers near the 53-bit bound exercise the exact division and
/// multiplication helpers of the script.
#[tokio::test]
async fn memory_and_redis_agree_near_the_exactness_bound() {
    let server = RedisServer::start();
    let mut pair = Pair::new(&server, "bound".to_owned(), T0, Expiry::Kept).await;
    let year_s = 365 * 86_400;
    // (algorithm, window, the (limit, burst) variants a reload switches
    // between): switching exercises the exact rescaling of stored state.
    let cases: [(Algorithm, u64, &[Variant]); 8] = [
        // per_us / scale = 7 / 31_536_000_000_000, burst near 2^53 / scale
        // (245 tokens refill in 35 years, the longest span a limit may
        // cover); reloading to 245 per year rescales through a 2^96 product.
        (
            Algorithm::TokenBucket,
            year_s,
            &[(7, Some(245)), (245, None)],
        ),
        (Algorithm::Gcra, year_s, &[(7, Some(245))]),
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
    run_bound_cases(&mut pair, &cases, Charge::IfAllowed).await;
}

/// Limits charged always at the edge of what they may hold: twice the
/// capacity just below 2^53 (so a whole capacity of debt stays exact in a
/// double), with costs up to 2^64 − 1.
#[tokio::test]
async fn memory_and_redis_agree_on_debt_near_the_exactness_bound() {
    let server = RedisServer::start();
    let mut pair = Pair::new(&server, "debt".to_owned(), T0, Expiry::Kept).await;
    let year_s = 365 * 86_400;
    let cases: [(Algorithm, u64, &[Variant]); 8] = [
        // 2 × 142 × 31_536_000_000_000 < 2^53 <= 2 × 143 × ...
        (
            Algorithm::TokenBucket,
            year_s,
            &[(7, Some(142)), (142, None)],
        ),
        (Algorithm::Gcra, year_s, &[(7, Some(142))]),
        (
            Algorithm::TokenBucket,
            1,
            &[(1_000_003, Some(4_000_000_000))],
        ),
        (Algorithm::Gcra, 3_600, &[(1_250_003, None)]),
        (
            Algorithm::Gcra,
            1,
            &[(999_999_937, None), (10_000_019, None)],
        ),
        (Algorithm::SlidingWindowCounter, year_s, &[(285_000, None)]),
        (Algorithm::FixedWindow, 1, &[((1 << 52) - 1, None)]),
        (Algorithm::SlidingWindowLog, 1, &[(1_500, None)]),
    ];
    run_bound_cases(&mut pair, &cases, Charge::Always).await;
}

async fn run_bound_cases(pair: &mut Pair, cases: &[(Algorithm, u64, &[Variant])], charge: Charge) {
    let mut rng = Rng(7);
    for (idx, &(algorithm, window_s, variants)) in cases.iter().enumerate() {
        let variants: Vec<LimitParams> = variants
            .iter()
            .map(|&(limit, burst)| {
                LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                    .and_then(|it| it.with_charge(charge))
                    .unwrap_or_else(|err| panic!("case {idx}: {err}"))
            })
            .collect();
        let key = support::keys::counter_key(algorithm, window_s, &[("big", &idx.to_string())]);
        for step in 0..80 {
            pair.clock
                .advance(rng.pick(&[0, 1, 7, 1_000_003, 86_400_000_000]));
            let params = variants[rng.below(variants.len() as u64) as usize];
            let capacity = params.capacity();
            let cost = match charge {
                Charge::IfAllowed => rng.pick(&[0, 1, 3, capacity / 2, capacity]),
                Charge::Always => rng.pick(&[
                    0,
                    1,
                    capacity / 2,
                    capacity,
                    capacity + 1,
                    2 * capacity - 1,
                    2 * capacity,
                    2 * capacity + 1,
                    u64::MAX,
                ]),
            };
            let checks = [KeyedCheck {
                key: key.clone(),
                check: Check {
                    params,
                    cost,
                    mode: Mode::Enforce,
                },
            }];
            if let Err(err) = pair.step(&checks).await {
                panic!("case {idx} step {step}: {err} for {checks:?}");
            }
        }
    }
}

/// A limit at the longest span any backend decides (MAX_SPAN_US): its
/// algorithm, limit, window in whole seconds and burst.
type SpanCase = (Algorithm, u64, u64, Option<u64>);

/// Limits at the span bound: a window of the longest whole-second length
/// (or a little shorter), or a token bucket or GCRA whose capacity refills
/// in as close to the bound as a whole burst gets.
fn arb_span_case() -> impl Strategy<Value = SpanCase> {
    let max_s = MAX_SPAN_US / 1_000_000;
    let windowed = (
        prop::sample::select(vec![
            Algorithm::SlidingWindowLog,
            Algorithm::SlidingWindowCounter,
            Algorithm::FixedWindow,
        ]),
        1..=2_000u64,
        prop_oneof![Just(max_s), (max_s - 86_400)..=max_s],
    )
        .prop_map(|(algorithm, limit, window_s)| (algorithm, limit, window_s, None));
    let refilled = (
        prop::sample::select(vec![Algorithm::TokenBucket, Algorithm::Gcra]),
        // Small enough that most bursts at the bound stay within 53 bits.
        prop_oneof![1..=8u64, Just(1_000), Just(86_400)],
        prop::sample::select(vec![1u64, 60, 3_600, 86_400, 31_536_000, 315_360_000]),
    )
        .prop_map(|(algorithm, limit, window_s)| {
            // The largest burst refilling within the bound.
            let burst = MAX_SPAN_US as u128 * limit as u128 / (window_s as u128 * 1_000_000);
            (algorithm, limit, window_s, Some(burst as u64))
        });
    prop_oneof![windowed, refilled]
}

/// One second more than the longest window, or one token more burst:
/// past the bound.
fn past_the_span(case: SpanCase) -> SpanCase {
    match case {
        (algorithm, limit, _, None) => (algorithm, limit, MAX_SPAN_US / 1_000_000 + 1, None),
        (algorithm, limit, window_s, Some(burst)) => (algorithm, limit, window_s, Some(burst + 1)),
    }
}

/// Limits at the longest span a limit may cover are decided identically
/// by both backends over steps of up to a whole window, costs 0 to past
/// the capacity; one second (or one token) more is refused at load, so
/// nothing loads that a script cannot decide (a window of 2^53 µs or
/// more loaded, and the script refused every request on it).
#[test]
fn memory_and_redis_agree_at_the_longest_span_and_refuse_past_it() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut runner = TestRunner::new(Config {
        cases: 48,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let res = runner.run(&(arb_span_case(), any::<u64>()), |(span, seed)| {
        let (algorithm, limit, window_s, burst) = span;
        let Ok(params) = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst) else {
            // Only where the 53-bit bound on the state comes first.
            let err = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst).unwrap_err();
            prop_assert!(err.to_string().contains("53 bits"), "{span:?}: {err}");
            return Ok(());
        };
        let (algorithm, limit, window_s, burst) = past_the_span(span);
        let past = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst);
        prop_assert!(past.is_err(), "{:?} loads", past_the_span(span));
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        runtime.block_on(run_span_trace(&server, case, params, seed))
    });
    if let Err(err) = res {
        panic!("{err}");
    }
    let traced = case.into_inner();
    assert!(
        traced >= 24,
        "only {traced} of 48 cases decided: the strategy misses"
    );
}

async fn run_span_trace(
    server: &RedisServer,
    case: u64,
    params: LimitParams,
    seed: u64,
) -> Result<(), TestCaseError> {
    let mut pair = Pair::new(server, format!("span{case}"), T0, Expiry::Kept).await;
    let mut rng = Rng(seed);
    let window_us = params.window_us();
    let key = support::keys::counter_key(
        params.algorithm(),
        window_us / 1_000_000,
        &[("span", &case.to_string())],
    );
    for step in 0..24 {
        // Now stays below T0 + 6 windows of at most 2^50 µs: below 2^53.
        let jump = rng.pick(&[0, 1, 999_983, window_us / 7, window_us / 2]);
        pair.clock.advance(jump);
        let capacity = params.capacity();
        let cost = rng.pick(&[0, 1, capacity / 3, capacity, capacity + 1]);
        let checks = [KeyedCheck {
            key: key.clone(),
            check: Check {
                params,
                cost,
                mode: Mode::Enforce,
            },
        }];
        pair.step(&checks).await.map_err(|err| {
            TestCaseError::fail(format!("step {step}: {err} for {params:?} cost {cost}"))
        })?;
    }
    Ok(())
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

/// [`COST_LIMITS`] charged always: the largest fixed window that can carry
/// a whole capacity of debt exactly.
const DEBT_LIMITS: [(Algorithm, u64, u64, Option<u64>); 10] = {
    let mut limits = COST_LIMITS;
    limits[9] = (Algorithm::FixedWindow, (1 << 52) - 1, 1, None);
    limits
};

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
        let name = format!("costs{case}");
        runtime.block_on(run_cost_trace(&server, name, &trace, Charge::IfAllowed))
    });
    if let Err(err) = res {
        panic!("{err}");
    }
}

/// The same with every limit charged always: each cost of the whole u64
/// range is recorded (into debt, up to one capacity) on both backends
/// alike, and a cost past the room is still answered without room.
#[test]
fn memory_and_redis_agree_on_charges_across_the_u64_range() {
    let server = RedisServer::start();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let case = std::sync::atomic::AtomicU64::new(0);
    let res = runner.run(&arb_cost_trace(), |trace| {
        let case = case.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("charges{case}");
        runtime.block_on(run_cost_trace(&server, name, &trace, Charge::Always))
    });
    if let Err(err) = res {
        panic!("{err}");
    }
}

async fn run_cost_trace(
    server: &RedisServer,
    prefix: String,
    trace: &CostTrace,
    charge: Charge,
) -> Result<(), TestCaseError> {
    let mut now = T0;
    let mut pair = Pair::new(server, prefix, now, Expiry::Kept).await;
    let table = match charge {
        Charge::IfAllowed => COST_LIMITS,
        Charge::Always => DEBT_LIMITS,
    };
    for (step, (delta, limits)) in trace.iter().enumerate() {
        now += delta;
        pair.clock.set(now);
        let mut checks: Vec<KeyedCheck> = Vec::new();
        for &(idx, cost) in limits {
            let (algorithm, limit, window_s, burst) = table[idx];
            let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                .and_then(|it| it.with_charge(charge))
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
        let verdict = pair
            .step(&checks)
            .await
            .map_err(|err| TestCaseError::fail(format!("step {step}: {err} for {checks:?}")))?;
        for (check, outcome) in checks.iter().zip(&verdict.outcomes) {
            let params = check.check.params;
            if check.check.cost > params.capacity() {
                prop_assert!(!outcome.has_room && !outcome.consumed);
            }
            // What a charge records past the room is at most one capacity.
            prop_assert!(outcome.overdraft <= params.debt_capacity());
            if outcome.overdraft > 0 {
                prop_assert!(!outcome.has_room && outcome.remaining == 0);
            }
        }
    }
    Ok(())
}
