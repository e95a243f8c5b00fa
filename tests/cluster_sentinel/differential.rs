//! One answer on every backend: the same requests, at the same moments,
//! decided by the memory backend, Redis, Redis with batching and a Redis
//! Cluster of three primaries (requests over several hash slots included)
//! get the same verdict from each (allowed, and per limit: room, consumed,
//! remaining, overdraft, reset), and leave the same state behind (a final
//! check-only request on every counter answers alike).
//!
//! Every backend reads one manual clock, so all see the same `now`.
//! Random traces come from fixed seeds: `THROTTLEGATE_DIFF_CASES` sets how
//! many (default [`DEFAULT_CASES`], a few seconds);
//! `THROTTLEGATE_DIFF_SEED` the first one.
//!
//! `THROTTLEGATE_DIFF_CASES=2000 cargo test --release --test cluster_sentinel differential::`
//! runs a longer search.

use std::sync::Arc;

use crate::support;
use crate::support::cluster::Cluster;
use crate::support::redis::RedisServer;
use crate::support::rng::Rng;
use futures_util::future::join_all;
use redis::cluster_routing::Slot;
use throttlegate::algorithms::{Algorithm, Charge, Check, LimitParams, Mode, Verdict};
use throttlegate::backends::keys::{HashTag, KeyFormat};
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::redis::cluster::{ClusterBackend, ClusterSettings};
use throttlegate::backends::redis::{BatchSettings, ClockSource, RedisBackend};
use throttlegate::backends::{Backend, CounterKey, KeyEntry, KeyValue, KeyedCheck};
use throttlegate::clock::{Clock, ManualClock};

const T0: u64 = 1_700_000_000_000_000;
/// Traces run by `cargo test` (each [`STEPS`] bursts of requests).
const DEFAULT_CASES: u64 = 24;
const STEPS: usize = 60;
/// Keeps keys from expiring on Redis's own clock while the trace's clock
/// runs far ahead: state past its lifetime must decide as a fresh one.
const GRACE_MS: u64 = 3_600_000;

/// The four backends on one manual clock.
struct Backends {
    clock: ManualClock,
    memory: MemoryBackend,
    redis: RedisBackend,
    batched: RedisBackend,
    cluster: ClusterBackend,
}

impl Backends {
    /// Every backend's keys start with `prefix` (a fresh one per trace);
    /// batches go to `batching`.
    async fn new(
        server: &RedisServer,
        batching: &RedisServer,
        cluster: &Cluster,
        prefix: &str,
    ) -> Backends {
        let clock = ManualClock::new(T0);
        let local = ClockSource::Local(Arc::new(clock.clone()));
        let redis = support::redis::backend_with(server, local.clone(), |it| {
            it.key_prefix = format!("{prefix}r");
            it.expiry_grace_ms = GRACE_MS;
        })
        .await;
        // One connection: while one call is out, the others of a burst
        // queue and go together as one batch.
        let batched = support::redis::backend_with(batching, local.clone(), |it| {
            it.key_prefix = format!("{prefix}b");
            it.expiry_grace_ms = GRACE_MS;
            it.pool_size = 1;
            it.batch = Some(BatchSettings {
                max_requests: 64,
                max_keys: 512,
            });
        })
        .await;
        let cluster = ClusterBackend::connect(ClusterSettings {
            nodes: cluster.seeds(),
            pool_size: 2,
            timeout_ms: 5_000,
            keys: KeyFormat::new(format!("{prefix}c"), HashTag::None),
            clock: local,
            expiry_grace_ms: GRACE_MS,
            tls: Default::default(),
        })
        .expect("cluster settings");
        redis.warm_up().await;
        batched.warm_up().await;
        cluster.warm_up().await;
        Backends {
            memory: MemoryBackend::new(Arc::new(clock.clone())),
            clock,
            redis,
            batched,
            cluster,
        }
    }

    /// Decides `burst` (requests at one moment, on distinct counters) on
    /// every backend; the memory backend's verdicts, or what differed.
    async fn step(&self, burst: &[Vec<KeyedCheck>]) -> Result<Vec<Verdict>, String> {
        let mut expected = Vec::new();
        for checks in burst {
            expected.push(self.memory.decide(checks).await.expect("memory decides"));
        }
        let mut redis = Vec::new();
        let mut cluster = Vec::new();
        for checks in burst {
            redis.push(self.redis.decide(checks).await);
            cluster.push(self.cluster.decide(checks).await);
        }
        let batched = join_all(burst.iter().map(|checks| self.batched.decide(checks))).await;
        for (name, answers) in [("redis", redis), ("batched", batched), ("cluster", cluster)] {
            for ((checks, want), got) in burst.iter().zip(&expected).zip(answers) {
                match got {
                    Ok(got) if got == *want => {}
                    got => {
                        return Err(format!(
                            "{name} answered {got:?}\nmemory {want:?}\nto {}",
                            describe(checks)
                        ));
                    }
                }
            }
        }
        Ok(expected)
    }
}

/// A request's limits, one per line: counter, algorithm, numbers, mode,
/// charge, cost.
fn describe(checks: &[KeyedCheck]) -> String {
    checks
        .iter()
        .map(|it| {
            let p = &it.check.params;
            format!(
                "\n  {} {} {}/{}s cap {} {:?} {} cost {}",
                it.key.rule,
                p.algorithm(),
                p.limit(),
                p.window_us() / 1_000_000,
                p.capacity(),
                it.check.mode,
                p.charge(),
                it.check.cost
            )
        })
        .collect()
}

fn counter(name: &str, algorithm: Algorithm, window_s: u64) -> CounterKey {
    CounterKey {
        domain: Arc::from("differential"),
        rule: Arc::from(name),
        algorithm,
        window_s,
        is_override: false,
        entries: vec![KeyEntry {
            key: "user".into(),
            value: KeyValue::Value(name.into()),
        }],
    }
}

/// One counter of a trace and its parameters.
#[derive(Clone)]
struct Limit {
    key: CounterKey,
    params: LimitParams,
}

impl Limit {
    fn new(name: &str, algorithm: Algorithm, limit: u64, window_s: u64, charge: Charge) -> Limit {
        let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, None)
            .and_then(|it| it.with_charge(charge))
            .expect("valid params");
        Limit {
            key: counter(name, algorithm, window_s),
            params,
        }
    }

    fn check(&self, mode: Mode, cost: u64) -> KeyedCheck {
        KeyedCheck {
            key: self.key.clone(),
            check: Check {
                params: self.params,
                cost,
                mode,
            },
        }
    }
}

fn random_limits(rng: &mut Rng) -> Vec<Limit> {
    (0..10)
        .map(|idx| {
            let algorithm = rng.pick(&Algorithm::ALL);
            let window_s = rng.pick(&[1, 2, 60, 3_600]);
            let limit = rng.pick(&[0, 1, 2, 3, 5, 10, 100]);
            let burst = (algorithm.has_burst() && rng.below(3) == 0)
                .then(|| 1 + rng.below(2 * limit.max(1)));
            let charge = if rng.below(4) == 0 {
                Charge::Always
            } else {
                Charge::IfAllowed
            };
            let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, burst)
                .and_then(|it| it.with_charge(charge))
                .expect("small limits");
            Limit {
                key: counter(&format!("c{idx}"), algorithm, window_s),
                params,
            }
        })
        .collect()
}

/// A burst: 1 to 3 requests at one moment, each stacking 1 to 4 limits,
/// no counter in two requests of the burst (so that the order a batch
/// decides them in changes no answer).
fn random_burst(rng: &mut Rng, limits: &[Limit]) -> Vec<Vec<KeyedCheck>> {
    let mut free: Vec<usize> = (0..limits.len()).collect();
    let mut burst = Vec::new();
    for _ in 0..1 + rng.below(3) {
        let mut checks = Vec::new();
        for _ in 0..1 + rng.below(4) {
            if free.is_empty() {
                break;
            }
            let limit = &limits[free.swap_remove(rng.below(free.len() as u64) as usize)];
            let capacity = limit.params.capacity();
            let cost = match rng.below(12) {
                0 => 0,
                1 => 2,
                2 => 5,
                3 => capacity,
                4 => capacity + 1,
                5 => rng.pick(&[(1 << 53) + 1, 1 << 63, u64::MAX]),
                _ => 1,
            };
            let mode = match rng.below(10) {
                0..=4 => Mode::Enforce,
                5 | 6 => Mode::Shadow,
                _ => Mode::Quota,
            };
            checks.push(limit.check(mode, cost));
        }
        if !checks.is_empty() {
            burst.push(checks);
        }
    }
    burst
}

/// Mostly small steps, sometimes across a second or a minute's edge, and
/// sometimes back (a replica whose clock lags the stored state).
fn step_clock(rng: &mut Rng, clock: &ManualClock) {
    let now = clock.now_us();
    clock.set(match rng.below(11) {
        0..=2 => now,
        3 => now + 1,
        4 => now + 999_999,
        5 => now + 1_000_000,
        6 => now + 2_000_001,
        7 => now + 61_000_000,
        8 => now - rng.below(1_500_000),
        _ => now + rng.below(3_000_000),
    });
}

/// The final state: one check-only request per counter, on every backend.
async fn compare_final(backends: &Backends, limits: &[Limit]) -> Result<(), String> {
    for limit in limits {
        for mode in [Mode::Enforce, Mode::Quota] {
            backends.step(&[vec![limit.check(mode, 0)]]).await?;
        }
    }
    Ok(())
}

fn cases() -> (u64, u64) {
    let read = |name: &str| std::env::var(name).ok().and_then(|it| it.parse().ok());
    (
        read("THROTTLEGATE_DIFF_SEED").unwrap_or(1),
        read("THROTTLEGATE_DIFF_CASES").unwrap_or(DEFAULT_CASES),
    )
}

/// A server whose slow log keeps every command, for [`batches_sent`].
fn logging_server() -> RedisServer {
    RedisServer::start_with(&["--slowlog-log-slower-than", "0"])
}

/// Calls of the batch function `server` saw since the last count.
async fn batches_sent(server: &RedisServer) -> usize {
    let mut conn = server.connection().await;
    let (entries, ()): (Vec<redis::Value>, ()) = redis::pipe()
        .cmd("SLOWLOG")
        .arg("GET")
        .arg(128)
        .cmd("SLOWLOG")
        .arg("RESET")
        .query_async(&mut conn)
        .await
        .expect("slowlog");
    entries
        .iter()
        .filter(|entry| {
            let redis::Value::Array(fields) = entry else {
                return false;
            };
            let Some(redis::Value::Array(args)) = fields.get(3) else {
                return false;
            };
            matches!(args.get(1), Some(redis::Value::BulkString(name))
                if name.starts_with(b"throttlegate_decide_batch_"))
        })
        .count()
}

#[tokio::test]
async fn random_request_sequences_get_one_answer_on_every_backend() {
    let server = RedisServer::start();
    let batching = logging_server();
    let cluster = Cluster::start(3, 0).await;
    let (first, n) = cases();
    let mut cross_slot = 0;
    let mut batches = 0;
    for seed in first..first + n {
        let mut rng = Rng(seed);
        let backends = Backends::new(&server, &batching, &cluster, &format!("s{seed}")).await;
        let limits = random_limits(&mut rng);
        for step in 0..STEPS {
            step_clock(&mut rng, &backends.clock);
            let burst = random_burst(&mut rng, &limits);
            cross_slot += burst
                .iter()
                .filter(|it| spans_slots(&backends.cluster, it))
                .count();
            if let Err(err) = backends.step(&burst).await {
                panic!("seed {seed}, step {step}: {err}");
            }
            batches += batches_sent(&batching).await;
        }
        if let Err(err) = compare_final(&backends, &limits).await {
            panic!("seed {seed}, final state: {err}");
        }
    }
    // The traces did reach the cluster's requests over several slots, and
    // the batch function.
    assert!(cross_slot as u64 >= n * STEPS as u64 / 4, "{cross_slot}");
    assert!(batches as u64 >= n * STEPS as u64 / 4, "{batches} batches");
}

fn spans_slots(cluster: &ClusterBackend, checks: &[KeyedCheck]) -> bool {
    let slots: Vec<Slot> = checks
        .iter()
        .map(|it| Slot::for_key(cluster.key_of(&it.key).as_bytes()))
        .collect();
    slots.iter().any(|it| *it != slots[0])
}

// === the cases the random traces found, spelled out ===

/// Runs `requests` in order at one moment on every backend, asserting
/// they agree; the memory backend's verdicts.
async fn agree(backends: &Backends, requests: &[Vec<KeyedCheck>]) -> Vec<Verdict> {
    let mut verdicts = Vec::new();
    for checks in requests {
        assert!(spans_slots(&backends.cluster, checks), "{checks:?}");
        match backends.step(std::slice::from_ref(checks)).await {
            Ok(mut it) => verdicts.append(&mut it),
            Err(err) => panic!("{err}"),
        }
    }
    verdicts
}

#[tokio::test]
async fn a_request_denied_in_one_slot_consumes_and_reports_alike_on_every_backend() {
    let server = RedisServer::start();
    let cluster = Cluster::start(3, 0).await;

    // A shadow and a quota limit beside an exhausted enforcing one: the
    // request is denied, and neither consumes.
    let backends = Backends::new(&server, &server, &cluster, "denied").await;
    let exhausted = Limit::new("e", Algorithm::FixedWindow, 0, 60, Charge::IfAllowed);
    for mode in [Mode::Shadow, Mode::Quota] {
        let other = Limit::new(
            &format!("{mode:?}"),
            Algorithm::FixedWindow,
            5,
            86_400,
            Charge::IfAllowed,
        );
        let request = vec![exhausted.check(Mode::Enforce, 1), other.check(mode, 1)];
        let verdicts = agree(&backends, &[request.clone(), request.clone(), request]).await;
        let last = &verdicts[2];
        assert!(!last.allowed);
        assert_eq!(last.outcomes[1].remaining, 5, "{mode:?} consumed nothing");
    }

    // Quota limits alone: one with room is enough, and it consumes.
    let full = Limit::new("q1", Algorithm::SlidingWindowLog, 0, 60, Charge::IfAllowed);
    let room = Limit::new("q2", Algorithm::TokenBucket, 5, 3_600, Charge::IfAllowed);
    let verdicts = agree(
        &backends,
        &[vec![full.check(Mode::Quota, 1), room.check(Mode::Quota, 1)]],
    )
    .await;
    assert!(verdicts[0].allowed);
    assert_eq!(verdicts[0].outcomes[1].remaining, 4);

    // Every algorithm refunded after a denial in another slot reports
    // what it has, and when it is full again (now: nothing taken).
    for algorithm in Algorithm::ALL {
        let limit = Limit::new(
            &format!("r{algorithm}"),
            algorithm,
            8,
            3_600,
            Charge::IfAllowed,
        );
        let request = vec![
            limit.check(Mode::Enforce, 1),
            exhausted.check(Mode::Enforce, 1),
        ];
        let verdicts = agree(&backends, &[request]).await;
        let outcome = verdicts[0].outcomes[0];
        assert_eq!((outcome.remaining, outcome.reset_us), (8, 0), "{algorithm}");
    }
    compare_final(&backends, &[exhausted, full, room])
        .await
        .unwrap();
}
