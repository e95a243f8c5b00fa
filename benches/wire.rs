//! Cost of the wire mapping around a decision: prost decode of a request, `from_wire`, `to_wire`, prost encode of the response.

mod support;

use std::hint::black_box;

use criterion::{BatchSize, BenchmarkId, Criterion, criterion_group, criterion_main};
use prost::Message;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::transport::wire::{from_wire, to_wire};

/// Descriptors per request, each of two entries (`tenant=acme`, `user=<id>`).
const DESCRIPTORS: [usize; 2] = [1, 16];

/// A request's protobuf body without the gRPC frame: what tonic hands prost.
fn decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire_decode_request");
    for count in DESCRIPTORS {
        let body = support::wire_request(0..count).encode_to_vec();
        group.bench_with_input(BenchmarkId::from_parameter(count), &body, |b, body| {
            b.iter(|| black_box(RateLimitRequest::decode(black_box(body.as_slice())).unwrap()))
        });
    }
    group.finish();
}

/// The prost request to the limiter's; the request is cloned outside the
/// timing (`from_wire` takes it by value, as the service does).
fn request_from_wire(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire_from_wire");
    for count in DESCRIPTORS {
        let request = support::wire_request(0..count);
        group.bench_with_input(
            BenchmarkId::from_parameter(count),
            &request,
            |b, request| {
                b.iter_batched(
                    || request.clone(),
                    |it| black_box(from_wire(it)),
                    BatchSize::SmallInput,
                )
            },
        );
    }
    group.finish();
}

/// A real decision (one limit and the RateLimit-* headers per descriptor)
/// to the prost response; cloned outside the timing.
fn decision_to_wire(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire_to_wire");
    for count in DESCRIPTORS {
        let decision = decision(count);
        group.bench_with_input(
            BenchmarkId::from_parameter(count),
            &decision,
            |b, decision| {
                b.iter_batched(
                    || decision.clone(),
                    |it| black_box(to_wire(it)),
                    BatchSize::SmallInput,
                )
            },
        );
    }
    group.finish();
}

/// The prost response to bytes, into a buffer kept between iterations as
/// tonic's encoder keeps its own.
fn encode(c: &mut Criterion) {
    let mut group = c.benchmark_group("wire_encode_response");
    for count in DESCRIPTORS {
        let response = to_wire(decision(count));
        let mut buffer = Vec::with_capacity(response.encoded_len());
        group.bench_with_input(
            BenchmarkId::from_parameter(count),
            &response,
            |b, response| {
                b.iter(|| {
                    buffer.clear();
                    black_box(response).encode(&mut buffer).unwrap();
                    black_box(buffer.len())
                })
            },
        );
    }
    group.finish();
}

fn decision(count: usize) -> throttlegate::decision::Decision {
    let limiter = support::limiter();
    let decision = support::decide(&limiter, &from_wire(support::wire_request(0..count)));
    assert_eq!(decision.statuses.len(), count);
    assert!(!decision.headers.is_empty(), "the headers are part of it");
    decision
}

criterion_group!(benches, decode, request_from_wire, decision_to_wire, encode);
criterion_main!(benches);
