//! Cost of the pure decision (`algorithms::decide`) per algorithm: one check, and four stacked checks, with the state kept between decisions.

use std::hint::black_box;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, criterion_group, criterion_main};
use throttlegate::algorithms::{self, Algorithm, Check, LimitParams, Mode, State};

const SECOND: u64 = 1_000_000;

/// 1,000 per second with a decision every 10 ms: every decision passes and
/// consumes, and the state is steady (a sliding log holds 100 entries).
const LIMIT: u64 = 1_000;
const STEP_US: u64 = 10_000;

fn check(algorithm: Algorithm) -> Check {
    Check {
        params: LimitParams::new(algorithm, LIMIT, SECOND, None).expect("valid params"),
        cost: 1,
        mode: Mode::Enforce,
    }
}

/// Decides `checks` once per iteration, `STEP_US` after the previous one,
/// on states that persist as a backend would store them.
fn bench_checks(group: &mut BenchmarkGroup<'_, WallTime>, id: BenchmarkId, checks: &[Check]) {
    let mut states: Vec<Option<State>> = vec![None; checks.len()];
    let mut now = 1_700_000_000 * SECOND;
    // Past the first window, so the sliding states are full.
    for _ in 0..2 * SECOND / STEP_US {
        now += STEP_US;
        assert!(algorithms::decide(checks, &mut states, now).allowed);
    }
    group.bench_function(id, |b| {
        b.iter(|| {
            now += STEP_US;
            black_box(algorithms::decide(black_box(checks), &mut states, now))
        })
    });
    let verdict = algorithms::decide(checks, &mut states, now + STEP_US);
    assert!(verdict.allowed, "the measured decisions passed");
}

fn one_check(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide_one_check");
    for algorithm in Algorithm::ALL {
        bench_checks(
            &mut group,
            BenchmarkId::from_parameter(algorithm.name()),
            &[check(algorithm)],
        );
    }
    group.finish();
}

/// Four limits decided together, as a request's gathered limits are: four
/// of one algorithm, and four different ones (`mixed`).
fn four_checks(c: &mut Criterion) {
    let mut group = c.benchmark_group("decide_four_checks");
    for algorithm in Algorithm::ALL {
        let checks = [check(algorithm); 4];
        bench_checks(
            &mut group,
            BenchmarkId::from_parameter(algorithm.name()),
            &checks,
        );
    }
    let mixed = [
        check(Algorithm::SlidingWindowLog),
        check(Algorithm::TokenBucket),
        check(Algorithm::SlidingWindowCounter),
        check(Algorithm::FixedWindow),
    ];
    bench_checks(&mut group, BenchmarkId::from_parameter("mixed"), &mixed);
    group.finish();
}

criterion_group!(benches, one_check, four_checks);
criterion_main!(benches);
