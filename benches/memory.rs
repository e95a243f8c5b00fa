//! Cost of one decision in the in-memory backend: a hot key, many keys, a stacked request.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode};
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::{CounterKey, KeyEntry, KeyValue, KeyedCheck};
use throttlegate::clock::SystemClock;

const SECOND: u64 = 1_000_000;

fn keyed(value: &str, algorithm: Algorithm, limit: u64, window_s: u64) -> KeyedCheck {
    let params = LimitParams::new(algorithm, limit, window_s * SECOND, None).unwrap();
    KeyedCheck {
        key: CounterKey {
            domain: "bench".into(),
            rule: "remote_address".into(),
            algorithm,
            window_s,
            is_override: false,
            entries: vec![KeyEntry {
                key: "remote_address".into(),
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

fn backend() -> MemoryBackend {
    MemoryBackend::new(Arc::new(SystemClock))
}

/// One key every request hits: the cost of a decision without contention.
fn hot_key(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_key");
    for algorithm in Algorithm::ALL {
        let backend = backend();
        let check = [keyed("10.0.0.1", algorithm, 1_000_000, 1)];
        group.bench_function(algorithm.name(), |b| {
            b.iter(|| black_box(backend.decide_sync(black_box(&check)).unwrap()))
        });
    }
    group.finish();
}

/// 100,000 distinct keys in turn: hashing, cache misses and inserts.
fn many_keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("many_keys");
    for algorithm in [Algorithm::FixedWindow, Algorithm::Gcra] {
        let backend = backend();
        let checks: Vec<[KeyedCheck; 1]> = (0..100_000)
            .map(|idx| [keyed(&format!("10.{idx}"), algorithm, 100, 60)])
            .collect();
        let mut next = 0;
        group.bench_function(algorithm.name(), |b| {
            b.iter(|| {
                next = (next + 1) % checks.len();
                black_box(backend.decide_sync(&checks[next]).unwrap())
            })
        });
    }
    group.finish();
}

/// Three limits of one request, decided atomically across their shards.
fn stacked(c: &mut Criterion) {
    let backend = backend();
    let checks = [
        keyed("a", Algorithm::TokenBucket, 1_000_000, 1),
        keyed("b", Algorithm::SlidingWindowCounter, 1_000_000, 60),
        keyed("c", Algorithm::FixedWindow, 1_000_000_000, 3_600),
    ];
    c.bench_function("stacked_three_limits", |b| {
        b.iter(|| black_box(backend.decide_sync(black_box(&checks)).unwrap()))
    });
}

criterion_group!(benches, hot_key, many_keys, stacked);
criterion_main!(benches);
