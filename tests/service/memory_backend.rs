//! The in-memory backend: `algorithms::decide` semantics, atomicity under contention, expiry.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::support::keys::{check as keyed, counter_key};
use proptest::prelude::*;
use throttlegate::algorithms::{self, Algorithm, Check, Mode, State, Verdict};
use throttlegate::backends::memory::{DEFAULT_SHARDS, MemoryBackend};
use throttlegate::backends::{Backend, CounterKey, KeyedCheck};
use throttlegate::clock::ManualClock;

const T0: u64 = 1_700_000_000_000_000;
const SECOND: u64 = 1_000_000;

fn key(value: &str, algorithm: Algorithm, window_s: u64) -> CounterKey {
    counter_key(algorithm, window_s, &[("user", value)])
}

fn backend_at(now: u64) -> (Arc<MemoryBackend>, ManualClock) {
    let clock = ManualClock::new(now);
    (Arc::new(MemoryBackend::new(Arc::new(clock.clone()))), clock)
}

fn decide(backend: &MemoryBackend, checks: &[KeyedCheck]) -> Verdict {
    backend.decide_sync(checks).expect("memory never fails")
}

/// Remaining of `check`'s counter, read with a cost-0 check.
fn remaining(backend: &MemoryBackend, check: &KeyedCheck) -> u64 {
    let mut probe = check.clone();
    probe.check.cost = 0;
    decide(backend, &[probe]).outcomes[0].remaining
}

#[test]
fn a_million_distinct_keys_are_purged_once_their_windows_pass() {
    let (backend, clock) = backend_at(T0);
    let total = 1_000_000;
    let mut checks = Vec::with_capacity(1);
    for idx in 0..total {
        checks.clear();
        checks.push(keyed(
            key(&idx.to_string(), Algorithm::FixedWindow, 1),
            10,
            1,
        ));
        assert!(decide(&backend, &checks).allowed);
    }
    assert_eq!(backend.live_entries(), total);
    assert_eq!(backend.stored_entries(), total);

    // Keys touched half a window later outlive the first ones.
    let late: Vec<KeyedCheck> = (0..1_000)
        .map(|idx| {
            keyed(
                key(&format!("late{idx}"), Algorithm::SlidingWindowLog, 1),
                10,
                1,
            )
        })
        .collect();
    clock.advance(SECOND / 2);
    for check in &late {
        assert!(decide(&backend, std::slice::from_ref(check)).allowed);
    }

    // The fixed windows end at the next whole second.
    clock.set(T0 + SECOND);
    assert_eq!(backend.live_entries(), late.len());
    assert_eq!(backend.purge_expired(), total);
    assert_eq!(backend.stored_entries(), late.len());
    assert_eq!(backend.live_entries(), late.len());
    for check in &late {
        assert_eq!(remaining(&backend, check), 9, "a survivor kept its count");
    }

    clock.set(T0 + SECOND + SECOND / 2);
    assert_eq!(backend.purge_expired(), late.len());
    assert_eq!(backend.live_entries(), 0);
    assert_eq!(backend.stored_entries(), 0);
}

#[test]
fn memory_stays_bounded_without_a_sweeper() {
    let (backend, clock) = backend_at(T0);
    let per_window = 30_000;
    let rounds = 10;
    for round in 0..rounds {
        for idx in 0..per_window {
            let check = keyed(key(&format!("{round}-{idx}"), Algorithm::Gcra, 1), 5, 1);
            assert!(decide(&backend, &[check]).allowed);
        }
        clock.advance(SECOND);
        // Each shard sweeps itself whenever it doubles (and never below
        // 1024 entries), so it holds at most twice its live keys or 1024;
        // without sweeping, every round's keys would stay.
        let bound = 2 * per_window + DEFAULT_SHARDS * 1024;
        assert!(bound < rounds * per_window);
        let stored = backend.stored_entries();
        assert!(
            stored <= bound,
            "round {round}: {stored} entries held for {per_window} live"
        );
    }
}

#[test]
fn an_expired_entry_counts_as_absent_before_any_sweep() {
    for algorithm in Algorithm::ALL {
        let (backend, clock) = backend_at(T0);
        let check = keyed(key("a", algorithm, 10), 3, 3);
        assert!(decide(&backend, std::slice::from_ref(&check)).allowed);
        assert_eq!(remaining(&backend, &check), 0, "{algorithm}");
        // Twice the window: long enough for every algorithm, including the
        // sliding-window counter's weighted previous window.
        clock.advance(20 * SECOND);
        assert_eq!(backend.stored_entries(), 1, "{algorithm}");
        assert_eq!(backend.live_entries(), 0, "{algorithm}");
        let verdict = decide(&backend, std::slice::from_ref(&check));
        assert!(verdict.allowed, "{algorithm}");
        assert_eq!(verdict.outcomes[0].remaining, 0, "{algorithm}");
    }
}

#[test]
fn expiry_counts_from_the_stored_time_when_the_clock_went_back() {
    let (backend, clock) = backend_at(T0 + 10 * SECOND);
    let check = keyed(key("a", Algorithm::TokenBucket, 1), 3, 3);
    assert!(decide(&backend, std::slice::from_ref(&check)).allowed);
    // Asked from 10 s in the past: still empty, and still expiring one
    // refill after the stored time, not after the caller's.
    clock.set(T0);
    assert_eq!(remaining(&backend, &check), 0);
    clock.set(T0 + 10 * SECOND + SECOND / 2);
    assert_eq!(backend.live_entries(), 1);
    assert_eq!(backend.purge_expired(), 0);
    assert_eq!(remaining(&backend, &check), 1);
    clock.set(T0 + 11 * SECOND);
    assert_eq!(backend.purge_expired(), 1);
}

#[test]
fn cost_zero_checks_store_nothing() {
    let (backend, _clock) = backend_at(T0);
    for algorithm in Algorithm::ALL {
        let check = keyed(key("idle", algorithm, 60), 10, 0);
        let verdict = decide(&backend, &[check]);
        assert!(verdict.allowed);
        assert_eq!(verdict.outcomes[0].remaining, 10);
    }
    assert_eq!(backend.stored_entries(), 0);
}

#[test]
fn a_repeated_key_is_refused_and_changes_nothing() {
    let (backend, _clock) = backend_at(T0);
    let check = keyed(key("a", Algorithm::TokenBucket, 1), 5, 1);
    let err = backend
        .decide_sync(&[check.clone(), check.clone()])
        .unwrap_err();
    assert!(err.to_string().contains("repeated"), "{err}");
    assert_eq!(remaining(&backend, &check), 5);
}

#[test]
fn a_denied_request_consumes_nothing_for_every_pair_of_algorithms() {
    for first in Algorithm::ALL {
        for second in Algorithm::ALL {
            let (backend, _clock) = backend_at(T0);
            let a = keyed(key("a", first, 60), 5, 1);
            let b = keyed(key("b", second, 60), 1, 1);
            assert!(decide(&backend, std::slice::from_ref(&b)).allowed);
            let verdict = decide(&backend, &[a.clone(), b.clone()]);
            assert!(!verdict.allowed, "{first} + {second}");
            assert!(verdict.outcomes[0].has_room && !verdict.outcomes[0].consumed);
            assert_eq!(verdict.outcomes[0].remaining, 5, "{first} + {second}");
            assert!(!verdict.outcomes[1].has_room);
            assert_eq!(remaining(&backend, &a), 5, "{first} + {second}");
            assert_eq!(remaining(&backend, &b), 0, "{first} + {second}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_on_one_key_get_exactly_the_limit() {
    for algorithm in Algorithm::ALL {
        let (backend, _clock) = backend_at(T0);
        let limit = 1_000;
        let allowed = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let backend = backend.clone();
                let allowed = allowed.clone();
                tokio::spawn(async move {
                    let check = keyed(key("hot", algorithm, 60), limit, 1);
                    for _ in 0..40 {
                        let verdict = backend.decide(std::slice::from_ref(&check)).await.unwrap();
                        if verdict.allowed {
                            allowed.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(allowed.load(Ordering::Relaxed), limit, "{algorithm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_keys_of_one_request_are_consumed_together_under_contention() {
    let (backend, _clock) = backend_at(T0);
    // Many pairs, so that some share a shard and some do not.
    for pair in 0..8 {
        let a = keyed(
            key(&format!("a{pair}"), Algorithm::SlidingWindowLog, 60),
            500,
            1,
        );
        let b = keyed(key(&format!("b{pair}"), Algorithm::TokenBucket, 60), 300, 1);
        let both_allowed = Arc::new(AtomicU64::new(0));
        let b_allowed = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|task_idx| {
                let (backend, a, b) = (backend.clone(), a.clone(), b.clone());
                let (both_allowed, b_allowed) = (both_allowed.clone(), b_allowed.clone());
                tokio::spawn(async move {
                    for step in 0..20 {
                        // Half the requests race for B alone.
                        let (checks, counter) = if (task_idx + step) % 2 == 0 {
                            (vec![a.clone(), b.clone()], &both_allowed)
                        } else {
                            (vec![b.clone()], &b_allowed)
                        };
                        if backend.decide(&checks).await.unwrap().allowed {
                            counter.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        let both = both_allowed.load(Ordering::Relaxed);
        let b_only = b_allowed.load(Ordering::Relaxed);
        assert_eq!(both + b_only, 300, "pair {pair}: B is used up exactly");
        assert_eq!(
            remaining(&backend, &a),
            500 - both,
            "pair {pair}: A moved with B"
        );
        assert_eq!(remaining(&backend, &b), 0, "pair {pair}");
    }
}

#[test]
fn overlapping_requests_in_any_key_order_never_deadlock_and_stay_atomic() {
    // Few shards and keys listed in every order: requests overlap in
    // their shards all the time. Plain threads, so that a deadlock fails
    // the test by timeout instead of stalling an executor.
    let clock = ManualClock::new(T0);
    let backend = Arc::new(MemoryBackend::with_shards(Arc::new(clock), 4));
    let keys: Vec<KeyedCheck> = (0..6)
        .map(|idx| keyed(key(&format!("k{idx}"), Algorithm::ALL[idx % 5], 60), 150, 1))
        .collect();
    let (done, results) = std::sync::mpsc::channel();
    for thread_idx in 0..64u64 {
        let (backend, keys, done) = (backend.clone(), keys.clone(), done.clone());
        std::thread::spawn(move || {
            // A small LCG per thread: each request takes 1 to 4 distinct
            // keys in a scrambled order.
            let mut seed = thread_idx.wrapping_mul(6_364_136_223_846_793_005) | 1;
            let mut taken = [0u64; 6];
            for _ in 0..30 {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let mut order: Vec<usize> = (0..6).collect();
                order.rotate_left((seed >> 33) as usize % 6);
                if seed >> 40 & 1 == 1 {
                    order.reverse();
                }
                order.truncate(1 + (seed >> 45) as usize % 4);
                let checks: Vec<KeyedCheck> = order.iter().map(|&idx| keys[idx].clone()).collect();
                if decide(&backend, &checks).allowed {
                    for &idx in &order {
                        taken[idx] += 1;
                    }
                }
                std::thread::yield_now();
            }
            done.send(taken).unwrap();
        });
    }
    let mut taken = [0u64; 6];
    for _ in 0..64 {
        let per_thread = results
            .recv_timeout(Duration::from_secs(60))
            .expect("requests deadlocked");
        for idx in 0..6 {
            taken[idx] += per_thread[idx];
        }
    }
    assert!(taken.contains(&150), "no key ran out: nothing was denied");
    for (idx, check) in keys.iter().enumerate() {
        // Every key moved by exactly the allowed requests that named it.
        assert_eq!(remaining(&backend, check), 150 - taken[idx], "key {idx}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_purges_until_its_guard_is_dropped() {
    let (backend, clock) = backend_at(T0);
    let fill = |prefix: &str| {
        for idx in 0..100 {
            let check = keyed(
                key(&format!("{prefix}{idx}"), Algorithm::FixedWindow, 1),
                1,
                1,
            );
            assert!(decide(&backend, &[check]).allowed);
        }
    };
    let guard = backend.spawn_sweeper(Duration::from_millis(5));
    fill("first");
    assert_eq!(backend.stored_entries(), 100);
    clock.advance(SECOND);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while backend.stored_entries() > 0 {
        assert!(tokio::time::Instant::now() < deadline, "sweeper never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(guard.is_running());

    drop(guard);
    fill("second");
    clock.advance(SECOND);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        backend.stored_entries(),
        100,
        "a dropped guard stops the sweeper"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweeper_ends_with_its_backend() {
    let (backend, _clock) = backend_at(T0);
    let guard = backend.spawn_sweeper(Duration::from_millis(5));
    drop(backend);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while guard.is_running() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "sweeper outlived its backend"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// === the backend is `algorithms::decide` ===

fn arb_algorithm() -> impl Strategy<Value = Algorithm> {
    prop::sample::select(Algorithm::ALL.to_vec())
}

/// A trace of requests over three keys: (µs since the previous one, [(key
/// index, cost, mode)]).
type Trace = Vec<(u64, Vec<(usize, u64, Mode)>)>;

fn arb_trace() -> impl Strategy<Value = Trace> {
    let mode = prop::sample::select(vec![
        Mode::Enforce,
        Mode::Enforce,
        Mode::Shadow,
        Mode::Quota,
    ]);
    let request = prop::collection::btree_map(0..3usize, (0..4u64, mode), 1..=3).prop_map(|it| {
        it.into_iter()
            .map(|(idx, (cost, mode))| (idx, cost, mode))
            .collect()
    });
    prop::collection::vec((0..3 * SECOND, request), 1..48)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn every_decision_matches_the_reference(
        algorithms in prop::array::uniform3(arb_algorithm()),
        limits in prop::array::uniform3(0..6u64),
        trace in arb_trace(),
    ) {
        let (backend, clock) = backend_at(T0);
        let keys: Vec<CounterKey> = (0..3).map(|idx| key(&idx.to_string(), algorithms[idx], 2)).collect();
        let mut reference: Vec<Option<State>> = vec![None, None, None];
        let mut now = T0;
        for (delta, request) in trace {
            now += delta;
            clock.set(now);
            let checks: Vec<KeyedCheck> = request
                .iter()
                .map(|&(idx, cost, mode)| {
                    let mut it = keyed(keys[idx].clone(), limits[idx], cost);
                    it.check.mode = mode;
                    it
                })
                .collect();
            let plain: Vec<Check> = checks.iter().map(|it| it.check).collect();
            let mut states: Vec<Option<State>> =
                request.iter().map(|&(idx, _, _)| reference[idx].take()).collect();
            let expected = algorithms::decide(&plain, &mut states, now);
            for (&(idx, _, _), state) in request.iter().zip(states) {
                reference[idx] = state;
            }
            prop_assert_eq!(decide(&backend, &checks), expected);
        }
    }
}

/// Resident memory of this process, from /proc.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|it| it.starts_with("VmRSS:"))
        .expect("VmRSS");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|it| it.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// Bytes of resident memory per live counter, for three shapes of state.
/// The figures choose `--memory-max-counters`' default (README, "Memory
/// backend bound"); run alone, as it reads the whole process's RSS:
/// `cargo test --test service memory_backend::bytes_per_counter -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement: reads the process RSS, run alone"]
fn bytes_per_counter() {
    // Each backend is kept until the end, so that no measurement reuses
    // memory another one freed.
    let mut kept = Vec::new();
    let mut measure =
        |label: &str, keys: usize, value_len: usize, algorithm: Algorithm, hits: u64| {
            let (backend, clock) = backend_at(T0);
            let before = rss_bytes();
            for idx in 0..keys {
                let mut value = format!("{idx:08}");
                value.extend(std::iter::repeat_n(
                    'v',
                    value_len.saturating_sub(value.len()),
                ));
                let check = keyed(key(&value, algorithm, 3_600), 10_000, 1);
                for _ in 0..hits {
                    // Distinct timestamps: one log entry per hit.
                    clock.advance(1);
                    assert!(decide(&backend, std::slice::from_ref(&check)).allowed);
                }
            }
            let per_key = rss_bytes().saturating_sub(before) / keys as u64;
            println!("{label}: {per_key} bytes per counter ({keys} counters)");
            assert_eq!(backend.stored_entries(), keys);
            kept.push(backend);
            per_key
        };
    let small = measure(
        "fixed_window, 8-byte value",
        200_000,
        8,
        Algorithm::FixedWindow,
        1,
    );
    let big_key = measure(
        "sliding_window_log of 1, 1 KiB value",
        100_000,
        1_024,
        Algorithm::SlidingWindowLog,
        1,
    );
    let full_log = measure(
        "sliding_window_log of 10,000, 8-byte value",
        100,
        8,
        Algorithm::SlidingWindowLog,
        10_000,
    );
    assert!(small < big_key && big_key < full_log);
}
