//! Resident memory per key of the memory backend, per algorithm: each case filled with 1,000,000 distinct keys in a fresh child process.
//!
//! `cargo bench --bench memory_per_key` runs this file's `main` with
//! `--bench`: it starts itself again once per case (`--case NAME`) and
//! prints what each child measured. A child reads its resident set from
//! `/proc/self/statm` before building the backend and after filling it, so
//! no case sees memory another one freed and the allocator kept. Built
//! without `--bench` (as `cargo test --benches` runs it) it only checks
//! that each case runs, on 1,000 keys.

use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode};
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::backends::{CounterKey, KeyEntry, KeyValue, KeyedCheck};
use throttlegate::clock::ManualClock;

/// The service's allocator: what it retains per key is what the service's is.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const KEYS: usize = 1_000_000;
const SMOKE_KEYS: usize = 1_000;
const T0: u64 = 1_700_000_000_000_000;

/// A case: an algorithm and the decisions each key takes.
struct Case {
    name: &'static str,
    algorithm: Algorithm,
    /// Each at its own microsecond: a sliding log keeps one entry per hit.
    hits_per_key: u64,
}

const CASES: [Case; 6] = [
    Case {
        name: "fixed_window",
        algorithm: Algorithm::FixedWindow,
        hits_per_key: 1,
    },
    Case {
        name: "sliding_window_counter",
        algorithm: Algorithm::SlidingWindowCounter,
        hits_per_key: 1,
    },
    Case {
        name: "token_bucket",
        algorithm: Algorithm::TokenBucket,
        hits_per_key: 1,
    },
    Case {
        name: "gcra",
        algorithm: Algorithm::Gcra,
        hits_per_key: 1,
    },
    Case {
        name: "sliding_window_log",
        algorithm: Algorithm::SlidingWindowLog,
        hits_per_key: 1,
    },
    Case {
        name: "sliding_window_log_10_entries",
        algorithm: Algorithm::SlidingWindowLog,
        hits_per_key: 10,
    },
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let keys = if args.iter().any(|it| it == "--bench") {
        KEYS
    } else {
        SMOKE_KEYS
    };
    match args.iter().position(|it| it == "--case") {
        Some(idx) => {
            let name = args.get(idx + 1).map(String::as_str).unwrap_or_default();
            let keys = args
                .get(idx + 2)
                .and_then(|it| it.parse().ok())
                .unwrap_or(keys);
            match CASES.iter().find(|it| it.name == name) {
                Some(case) => run_case(case, keys),
                None => {
                    eprintln!("unknown case '{name}'");
                    std::process::exit(2);
                }
            }
        }
        None => run_all(keys),
    }
}

/// Each case in a child process of its own, one line each.
fn run_all(keys: usize) {
    let exe = std::env::current_exe().expect("the bench's own path");
    println!(
        "memory per key, {keys} distinct keys per case (one descriptor entry, values client-NNNNNN)"
    );
    println!(
        "{:<32} {:>12} {:>12} {:>14} {:>8}",
        "case", "rss before", "rss after", "bytes per key", "fill s"
    );
    for case in &CASES {
        let output = Command::new(&exe)
            .args(["--case", case.name, &keys.to_string()])
            .output()
            .expect("the bench starts itself");
        if !output.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&output.stderr));
            panic!("case {} failed: {}", case.name, output.status);
        }
        print!("{}", String::from_utf8_lossy(&output.stdout));
    }
}

/// Fills a fresh backend with `keys` keys, each decided `hits_per_key`
/// times, and prints the growth of the resident set per key.
fn run_case(case: &Case, keys: usize) {
    let page = page_size();
    let before = resident_pages() * page;
    let started = Instant::now();
    let clock = ManualClock::new(T0);
    let backend = MemoryBackend::new(Arc::new(clock.clone()));
    // One domain and rule name for every key, as the rules share theirs.
    let names = (Arc::from("bench"), Arc::from("client"));
    let mut check = [keyed(case.algorithm, &names, 0)];
    for idx in 0..keys {
        check[0] = keyed(case.algorithm, &names, idx);
        for _ in 0..case.hits_per_key {
            clock.advance(1);
            let verdict = backend.decide_sync(&check).expect("memory never fails");
            assert!(verdict.allowed, "every hit passes");
        }
    }
    let fill_s = started.elapsed().as_secs_f64();
    let after = resident_pages() * page;
    assert_eq!(backend.stored_entries(), keys, "every key is held");
    assert_eq!(backend.live_entries(), keys, "none has expired");
    let per_key = after.saturating_sub(before) as f64 / keys as f64;
    println!(
        "{:<32} {:>10} kB {:>9} kB {:>14.0} {:>8.1}",
        case.name,
        before / 1024,
        after / 1024,
        per_key,
        fill_s
    );
    drop(backend);
}

/// A check on `client-NNNNNN` with room for every hit: 1,000 per hour,
/// so no key expires during the fill. `names`: the domain and the rule.
fn keyed(algorithm: Algorithm, names: &(Arc<str>, Arc<str>), idx: usize) -> KeyedCheck {
    let window_s = 3_600;
    let params =
        LimitParams::new(algorithm, 1_000, window_s * 1_000_000, None).expect("valid params");
    KeyedCheck {
        key: CounterKey {
            domain: names.0.clone(),
            rule: names.1.clone(),
            algorithm,
            window_s,
            is_override: false,
            entries: vec![KeyEntry {
                key: "client".into(),
                value: KeyValue::Value(format!("client-{idx:06}").into()),
            }],
        },
        check: Check {
            params,
            cost: 1,
            mode: Mode::Enforce,
        },
    }
}

/// Resident pages: the second field of `/proc/self/statm`.
fn resident_pages() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    statm
        .split_whitespace()
        .nth(1)
        .and_then(|it| it.parse().ok())
        .expect("resident pages in statm")
}

/// The page size statm counts in, from the kernel's own report of the
/// process's first mapping (`KernelPageSize` in `/proc/self/smaps`).
fn page_size() -> u64 {
    let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
    smaps
        .lines()
        .find_map(|line| line.strip_prefix("KernelPageSize:"))
        .and_then(|rest| rest.trim().strip_suffix("kB"))
        .and_then(|kib| kib.trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .expect("KernelPageSize in smaps")
}
