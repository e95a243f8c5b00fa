//! Cost of matching descriptors against many rules: wildcards (the index against trying every pattern in turn), exact values and keys.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use throttlegate::algorithms::Algorithm;
use throttlegate::config::{self, LoadOptions};
use throttlegate::rules::RuleSet;
use throttlegate::rules::wildcard::{WildcardIndex, glob_match};

const RULE_COUNTS: [usize; 3] = [1, 100, 10_000];

fn patterns(count: usize) -> Vec<Vec<u8>> {
    (0..count)
        .map(|n| format!("*mid{n}*end").into_bytes())
        .collect()
}

/// 1 KiB values a hostile client could send.
fn values() -> Vec<(&'static str, Vec<u8>)> {
    let fit = |mut value: Vec<u8>| {
        value.resize(1024, b'x');
        value
    };
    // Occurs in no pattern: one automaton pass, no candidate.
    let no_segment = fit(Vec::new());
    // Hundreds of `mid{n}` segments and `end`s inside, but not at the end:
    // hundreds of patterns become candidates, none matches (each rejected
    // by its suffix).
    let mut dense = Vec::new();
    let mut n = 0;
    while dense.len() < 1000 {
        dense.extend_from_slice(format!("mid{n}end").as_bytes());
        n += 37;
    }
    let dense = fit(dense);
    // Ends with `mid9999end`: contains `mid9`, `mid99`, `mid999` and
    // `mid9999`, so the first match is `*mid9*end`.
    let mut last = vec![b'x'; 1024 - b"mid9999end".len()];
    last.extend_from_slice(b"mid9999end");
    vec![
        ("no_segment", no_segment),
        ("dense_no_match", dense),
        ("ends_mid9999end", last),
    ]
}

/// One 1 KiB value against 1, 100 and 10,000 wildcard patterns of one level.
fn one_value(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_value_1KiB");
    for (name, value) in values() {
        for count in RULE_COUNTS {
            let patterns = patterns(count);
            let index = WildcardIndex::new(patterns.iter().map(Vec::as_slice));
            group.bench_with_input(
                BenchmarkId::new(format!("index/{name}"), count),
                &value,
                |b, value| b.iter(|| black_box(index.first_match(black_box(value)))),
            );
            group.bench_with_input(
                BenchmarkId::new(format!("scan/{name}"), count),
                &value,
                |b, value| {
                    b.iter(|| {
                        black_box(
                            patterns
                                .iter()
                                .position(|it| glob_match(it, black_box(value))),
                        )
                    })
                },
            );
        }
    }
    group.finish();
}

fn load(yaml: &str) -> RuleSet {
    let options = LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::FixedWindow,
        max_log_entries: config::DEFAULT_MAX_LOG_ENTRIES,
        limits: config::ConfigLimits::STANDARD,
    };
    config::parse_str("bench.yaml", yaml, &options)
        .expect("bench rules are valid")
        .rules
}

/// 32 nested levels, each with 313 wildcard rules (10,016 in all) and a
/// key-only node leading to the next level: a descriptor of 32 entries that
/// matches no wildcard walks all 32 levels.
fn deep_rules() -> RuleSet {
    fn level(yaml: &mut String, depth: usize, indent: usize) {
        let pad = " ".repeat(indent);
        for n in 0..313 {
            yaml.push_str(&format!(
                "{pad}- key: k{depth}\n{pad}  value: \"*mid{n}*end\"\n{pad}  rate_limit: {{unit: second, requests_per_unit: 1}}\n"
            ));
        }
        yaml.push_str(&format!(
            "{pad}- key: k{depth}\n{pad}  rate_limit: {{unit: second, requests_per_unit: 2}}\n"
        ));
        if depth + 1 < 32 {
            yaml.push_str(&format!("{pad}  descriptors:\n"));
            level(yaml, depth + 1, indent + 4);
        }
    }
    let mut yaml = String::from("domain: bench\ndescriptors:\n");
    level(&mut yaml, 0, 2);
    load(&yaml)
}

/// 10,000 wildcard rules on one level.
fn flat_rules() -> RuleSet {
    let mut yaml = String::from("domain: bench\ndescriptors:\n");
    for n in 0..10_000 {
        yaml.push_str(&format!(
            "  - key: k0\n    value: \"*mid{n}*end\"\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        ));
    }
    yaml.push_str("  - key: k0\n    rate_limit: {unit: second, requests_per_unit: 2}\n");
    load(&yaml)
}

/// The matching part of the largest requests: 64 descriptors of 32 entries
/// (the hostile `dense` value) against 10,000 wildcard rules.
fn whole_request(c: &mut Criterion) {
    let (_, dense) = values().swap_remove(1);
    let dense = String::from_utf8(dense).expect("ascii");
    let keys: Vec<String> = (0..32).map(|depth| format!("k{depth}")).collect();
    let mut group = c.benchmark_group("request_64_descriptors");
    // 64 × 32 entries of 1 KiB is 2 MiB of values, 32 times what a 64 KiB
    // message can carry; 32-byte values fill exactly one such message.
    let deep = deep_rules();
    for (name, rules, entries, value_len) in [
        ("deep_32_entries_1KiB", &deep, 32, 1024),
        ("deep_32_entries_32B", &deep, 32, 32),
        ("flat_1_entry_1KiB", &flat_rules(), 1, 1024),
    ] {
        let domain = rules.domain("bench").expect("domain bench");
        // Not ending in `end`, so no wildcard matches and every level is walked.
        let value = format!("{}x", &dense[..value_len - 1]);
        let descriptor: Vec<(&str, &str)> = keys[..entries]
            .iter()
            .map(|key| (key.as_str(), value.as_str()))
            .collect();
        assert_eq!(
            domain.find(&descriptor).map(|it| it.levels.len()),
            Some(entries),
            "every entry is matched"
        );
        group.bench_function(name, |b| {
            b.iter(|| {
                for _ in 0..64 {
                    black_box(domain.find(black_box(&descriptor)));
                }
            })
        });
    }
    group.finish();
}

/// `count` rules on one level, each an exact value of one key
/// (`k0=v{n}`) or, `key_only`, a key of its own (`k{n}`).
fn one_level_rules(count: usize, key_only: bool) -> RuleSet {
    let mut yaml = String::from("domain: bench\ndescriptors:\n");
    for n in 0..count {
        let rule = if key_only {
            format!("  - key: k{n}\n")
        } else {
            format!("  - key: k0\n    value: v{n}\n")
        };
        yaml.push_str(&rule);
        yaml.push_str("    rate_limit: {unit: second, requests_per_unit: 1}\n");
    }
    load(&yaml)
}

/// `Domain::find` of a one-entry descriptor among 1, 100 and 10,000
/// exact-value or key-only rules of one level: the rule is found by its key
/// (and value), so the time does not grow with the rules. The descriptor
/// names the last rule, the one a scan would reach last; `exact_value_miss`
/// matches none.
fn domain_find(c: &mut Criterion) {
    let mut group = c.benchmark_group("domain_find_one_level");
    for count in RULE_COUNTS {
        let last = count - 1;
        let exact = one_level_rules(count, false);
        let key_only = one_level_rules(count, true);
        for (name, rules, descriptor, found) in [
            (
                "exact_value",
                &exact,
                (String::from("k0"), format!("v{last}")),
                true,
            ),
            (
                "exact_value_miss",
                &exact,
                (String::from("k0"), String::from("none")),
                false,
            ),
            (
                "key_only",
                &key_only,
                (format!("k{last}"), String::from("client-123456")),
                true,
            ),
        ] {
            let domain = rules.domain("bench").expect("domain bench");
            let descriptor = [descriptor];
            assert_eq!(domain.find(&descriptor).is_some(), found, "{name}/{count}");
            group.bench_with_input(
                BenchmarkId::new(name, count),
                &descriptor,
                |b, descriptor| b.iter(|| black_box(domain.find(black_box(descriptor)))),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, one_value, whole_request, domain_find);
criterion_main!(benches);
