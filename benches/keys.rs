//! Cost of naming a counter: building its `CounterKey` from descriptor bytes, and encoding the Redis key with and without a hash tag.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use throttlegate::algorithms::Algorithm;
use throttlegate::backends::keys::{HashTag, KeyFormat};
use throttlegate::backends::{CounterKey, KeyBytes, KeyEntry, KeyValue, MAX_INLINE_BYTES};

/// A typical value, the longest kept as is (256 bytes, escaped when
/// encoded), and one past it (kept as its SHA-256 digest).
fn values() -> [(&'static str, Vec<u8>); 3] {
    let mut long = b"client-".to_vec();
    long.resize(MAX_INLINE_BYTES, b'v');
    let mut digested = long.clone();
    digested.resize(1024, b'v');
    [
        ("short", b"client-123456".to_vec()),
        ("256B", long),
        ("1KiB", digested),
    ]
}

/// A rule's counter key for `entries` (key, value), as the plan builds it
/// from a matched descriptor: each key and value made a `KeyBytes` (a long
/// one hashed), domain and rule names shared.
fn counter_key(domain: &Arc<str>, rule: &Arc<str>, entries: &[(&[u8], &[u8])]) -> CounterKey {
    CounterKey {
        domain: domain.clone(),
        rule: rule.clone(),
        algorithm: Algorithm::SlidingWindowLog,
        window_s: 60,
        is_override: false,
        entries: entries
            .iter()
            .map(|(key, value)| KeyEntry {
                key: KeyBytes::new(key),
                value: KeyValue::Value(KeyBytes::new(value)),
            })
            .collect(),
    }
}

fn entries<'a>(keys: &'a [String], value: &'a [u8]) -> Vec<(&'a [u8], &'a [u8])> {
    keys.iter().map(|key| (key.as_bytes(), value)).collect()
}

/// Entry keys `k0`.. of a descriptor of `count` entries.
fn entry_keys(count: usize) -> Vec<String> {
    (0..count).map(|idx| format!("k{idx}")).collect()
}

fn build(c: &mut Criterion) {
    let mut group = c.benchmark_group("counter_key_build");
    let domain: Arc<str> = Arc::from("api");
    let rule: Arc<str> = Arc::from("tenant.user");
    for count in [1, 4] {
        let keys = entry_keys(count);
        for (name, value) in values() {
            let entries = entries(&keys, &value);
            group.bench_function(BenchmarkId::new(format!("{count}_entries"), name), |b| {
                b.iter(|| black_box(counter_key(&domain, &rule, black_box(&entries))))
            });
        }
    }
    group.finish();
}

fn encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("redis_key_encode");
    let domain: Arc<str> = Arc::from("api");
    let rule: Arc<str> = Arc::from("tenant.user");
    let formats = [
        ("no_tag", KeyFormat::new("throttlegate", HashTag::None)),
        (
            "domain_tag",
            KeyFormat::new("throttlegate", HashTag::Domain),
        ),
        (
            "descriptor_tag",
            KeyFormat::new("throttlegate", HashTag::Descriptor),
        ),
    ];
    for count in [1, 4] {
        let keys = entry_keys(count);
        for (value_name, value) in values().into_iter().take(2) {
            let key = counter_key(&domain, &rule, &entries(&keys, &value));
            for (format_name, format) in &formats {
                let id = BenchmarkId::new(format!("{count}_entries_{value_name}"), format_name);
                group.bench_function(id, |b| b.iter(|| black_box(format.encode(black_box(&key)))));
            }
        }
    }
    group.finish();
}

criterion_group!(benches, build, encode);
criterion_main!(benches);
