use super::*;
use crate::algorithms::{Algorithm, LimitParams, Mode};
use crate::backends::KeyEntry;
use crate::clock::ManualClock;

fn key(value: String) -> CounterKey {
    CounterKey {
        domain: "d".into(),
        rule: "k".into(),
        algorithm: Algorithm::FixedWindow,
        window_s: 60,
        is_override: false,
        entries: vec![KeyEntry {
            key: "k".into(),
            value: KeyValue::Value(value.into()),
        }],
    }
}

#[test]
fn keys_spread_evenly_over_the_shards() {
    let backend = MemoryBackend::new(Arc::new(ManualClock::new(0)));
    let mut per_shard = vec![0usize; DEFAULT_SHARDS];
    let total = 64_000;
    for idx in 0..total {
        let hash = backend.hasher.hash_one(key(format!("10.0.{idx}")));
        per_shard[backend.shard_index(hash)] += 1;
    }
    let mean = total / DEFAULT_SHARDS;
    for (shard, count) in per_shard.iter().enumerate() {
        assert!(
            *count > mean * 8 / 10 && *count < mean * 12 / 10,
            "shard {shard} holds {count} of {total}"
        );
    }
}

fn check(value: &str, window_s: u64) -> KeyedCheck {
    let params = LimitParams::new(Algorithm::FixedWindow, 5, window_s * 1_000_000, None).unwrap();
    KeyedCheck {
        key: CounterKey {
            window_s,
            ..key(value.to_owned())
        },
        check: Check {
            params,
            cost: 1,
            mode: Mode::Enforce,
        },
    }
}

#[test]
fn a_full_backend_refuses_new_keys_and_serves_existing_ones() {
    let clock = ManualClock::new(0);
    let backend = MemoryBackend::with_shards(Arc::new(clock.clone()), 4).with_max_counters(3);
    for value in ["a", "b", "c"] {
        assert!(backend.decide_sync(&[check(value, 60)]).unwrap().allowed);
    }
    let res = backend.decide_sync(&[check("d", 60)]);
    assert!(matches!(res, Err(Error::Full(3))), "{res:?}");
    // A request with an existing key and a new one is refused whole:
    // the existing counter is untouched.
    let res = backend.decide_sync(&[check("a", 60), check("e", 60)]);
    assert!(matches!(res, Err(Error::Full(3))), "{res:?}");
    let verdict = backend.decide_sync(&[check("a", 60)]).unwrap();
    assert!(verdict.allowed);
    assert_eq!(verdict.outcomes[0].remaining, 3, "only this request took");
    assert_eq!(backend.stored_entries(), 3);
    assert_eq!(backend.len.load(Ordering::Relaxed), 3);
}

#[test]
fn expired_counters_make_room_for_new_ones() {
    let clock = ManualClock::new(0);
    let backend = MemoryBackend::with_shards(Arc::new(clock.clone()), 4).with_max_counters(2);
    assert!(backend.decide_sync(&[check("short", 1)]).unwrap().allowed);
    assert!(
        backend
            .decide_sync(&[check("long", 3_600)])
            .unwrap()
            .allowed
    );
    assert!(matches!(
        backend.decide_sync(&[check("new", 60)]),
        Err(Error::Full(2))
    ));
    // `short` has expired but is still stored: a full table sweeps.
    clock.advance(2_000_000);
    assert!(backend.decide_sync(&[check("new", 60)]).unwrap().allowed);
    assert_eq!(backend.stored_entries(), 2);
    // Full again; a second sweep within a second is not tried.
    assert!(matches!(
        backend.decide_sync(&[check("other", 60)]),
        Err(Error::Full(2))
    ));
    // The background sweep (or purge) frees room too.
    clock.advance(61_000_000);
    assert_eq!(backend.purge_expired(), 1);
    assert_eq!(backend.len.load(Ordering::Relaxed), 1);
    assert!(backend.decide_sync(&[check("other", 60)]).unwrap().allowed);
}

#[test]
fn a_long_key_counts_once_per_kib() {
    let clock = ManualClock::new(0);
    let backend = MemoryBackend::with_shards(Arc::new(clock.clone()), 4).with_max_counters(8);
    // A value over 256 bytes is held as its 32-byte digest, so the
    // longest key is many entries of 256 bytes: 20 of them, 5 KiB.
    let mut long = check("x", 60);
    long.key.entries = (0..20)
        .map(|idx| KeyEntry {
            key: format!("k{idx:03}").as_str().into(),
            value: KeyValue::Value("v".repeat(252).as_str().into()),
        })
        .collect();
    assert_eq!(weight(&long.key), 6);
    // One long value alone weighs no more than a short one.
    assert_eq!(weight(&check(&"x".repeat(5 * 1024), 60).key), 1);
    assert!(backend.decide_sync(&[long]).unwrap().allowed);
    assert!(backend.decide_sync(&[check("a", 60)]).unwrap().allowed);
    assert!(backend.decide_sync(&[check("b", 60)]).unwrap().allowed);
    assert!(matches!(
        backend.decide_sync(&[check("c", 60)]),
        Err(Error::Full(8))
    ));
    // Its expiry gives all of its weight back.
    clock.advance(61_000_000);
    assert_eq!(backend.purge_expired(), 3);
    assert_eq!(backend.len.load(Ordering::Relaxed), 0);
}

#[test]
fn the_count_follows_entries_through_fresh_states_and_sweeps() {
    let clock = ManualClock::new(0);
    let backend = MemoryBackend::with_shards(Arc::new(clock.clone()), 2).with_max_counters(10_000);
    for idx in 0..3_000 {
        let mut it = check(&idx.to_string(), 1);
        // Cost 0 on every third: a fresh state is not stored.
        if idx % 3 == 0 {
            it.check.cost = 0;
        }
        backend.decide_sync(&[it]).unwrap();
        if idx % 1_000 == 999 {
            clock.advance(2_000_000);
        }
    }
    assert_eq!(
        backend.len.load(Ordering::Relaxed),
        backend.stored_entries()
    );
    clock.advance(2_000_000);
    backend.purge_expired();
    assert_eq!(backend.len.load(Ordering::Relaxed), 0);
    assert_eq!(backend.stored_entries(), 0);
}

#[test]
fn shard_counts_round_up_to_a_power_of_two() {
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(0));
    for (asked, got) in [(0, 1), (1, 1), (3, 4), (64, 64), (100, 128)] {
        let backend = MemoryBackend::with_shards(clock.clone(), asked);
        assert_eq!(backend.shards.len(), got);
        // Every key maps to an existing shard, and a request works.
        let params = LimitParams::new(Algorithm::FixedWindow, 1, 60_000_000, None).unwrap();
        let checks: Vec<KeyedCheck> = (0..5)
            .map(|idx| KeyedCheck {
                key: key(idx.to_string()),
                check: Check {
                    params,
                    cost: 1,
                    mode: Mode::Enforce,
                },
            })
            .collect();
        assert!(backend.decide_sync(&checks).unwrap().allowed);
        assert!(!backend.decide_sync(&checks).unwrap().allowed);
        assert_eq!(backend.stored_entries(), 5);
    }
}
