//! Cost of a whole in-process decision: `Limiter::decide` on the memory backend, 1, 4 and 16 descriptors, one hot request and many keys.

mod support;

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use throttlegate::decision::{Code, Limiter, Request};
use throttlegate::transport::wire::from_wire;

const DESCRIPTORS: [usize; 3] = [1, 4, 16];

/// Distinct users the many-keys requests go through, whatever their size.
const MANY_USERS: usize = 100_000;

/// The same request every time: its counters stay in cache.
fn hot_request(c: &mut Criterion) {
    let mut group = c.benchmark_group("limiter_hot");
    for count in DESCRIPTORS {
        let limiter = support::limiter();
        let request = from_wire(support::wire_request(0..count));
        check_allowed(&limiter, &request, count);
        group.bench_with_input(
            BenchmarkId::from_parameter(count),
            &request,
            |b, request| b.iter(|| black_box(support::decide(&limiter, black_box(request)))),
        );
    }
    group.finish();
}

/// Requests in turn over 100,000 users (each descriptor a different user):
/// hashing, cache misses, inserts.
fn many_keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("limiter_many_keys");
    for count in DESCRIPTORS {
        let limiter = support::limiter();
        let requests: Vec<Request> = (0..MANY_USERS / count)
            .map(|idx| from_wire(support::wire_request(idx * count..(idx + 1) * count)))
            .collect();
        check_allowed(&limiter, &requests[0], count);
        let mut next = 0;
        group.bench_function(BenchmarkId::from_parameter(count), |b| {
            b.iter(|| {
                next = (next + 1) % requests.len();
                black_box(support::decide(&limiter, &requests[next]))
            })
        });
    }
    group.finish();
}

/// The request reaches a limit per descriptor and passes: the benchmark
/// measures the path it claims to.
fn check_allowed(limiter: &Limiter, request: &Request, count: usize) {
    let decision = support::decide(limiter, request);
    assert_eq!(decision.overall, Code::Ok);
    assert_eq!(decision.statuses.len(), count);
    assert!(
        decision
            .statuses
            .iter()
            .all(|it| it.current_limit.is_some()),
        "every descriptor is limited"
    );
}

criterion_group!(benches, hot_request, many_keys);
criterion_main!(benches);
