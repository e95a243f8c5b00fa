//! What the request benches share: a limiter over a few rules on the memory backend, and wire requests for it.

use std::sync::Arc;

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use throttlegate::algorithms::Algorithm;
use throttlegate::backends::memory::MemoryBackend;
use throttlegate::clock::SystemClock;
use throttlegate::config::{self, LoadOptions};
use throttlegate::decision::{Decision, Limiter, Options, Request};
use throttlegate::metrics::Metrics;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;

/// The domain of [`RULES`].
pub const DOMAIN: &str = "bench";

/// A few rules of the kinds a deployment has: key-only, exact value, a
/// wildcard, nesting. The benchmarked descriptors are `tenant=acme,
/// user=<id>`: one fixed-window counter per user, with room for every
/// request of a run.
pub const RULES: &str = r#"
domain: bench
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: path
    value: "/files/*"
    rate_limit: {unit: minute, requests_per_unit: 600, algorithm: token_bucket}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 1000000000, algorithm: fixed_window}
      - key: path
        value: /expensive
        rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tenant
    descriptors:
      - key: user
        rate_limit: {unit: second, requests_per_unit: 10}
"#;

/// A limiter over [`RULES`] on a memory backend and the system clock, with
/// the options `serve` starts with (headers on, errors fail the call).
pub fn limiter() -> Limiter {
    let options = LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::SlidingWindowLog,
        max_log_entries: config::DEFAULT_MAX_LOG_ENTRIES,
        limits: config::ConfigLimits::STANDARD,
    };
    let rules = config::parse_str("bench.yaml", RULES, &options)
        .expect("bench rules are valid")
        .rules;
    let options = Options {
        // The memory backend has no local clock: nothing would be cached.
        over_limit_cache: 0,
        ..Default::default()
    };
    Limiter::new(
        Arc::new(ArcSwap::from_pointee(rules)),
        Arc::new(MemoryBackend::new(Arc::new(SystemClock))),
        options,
        Arc::new(Metrics::new()),
    )
}

/// `limiter`'s decision on `request`. The memory backend never waits, so
/// the future is ready at its first poll: no executor is measured.
pub fn decide(limiter: &Limiter, request: &Request) -> Decision {
    limiter
        .decide(request)
        .now_or_never()
        .expect("the memory backend never waits")
        .expect("a valid request")
}

/// A wire request of one `tenant=acme, user=<id>` descriptor per id.
pub fn wire_request(users: impl IntoIterator<Item = usize>) -> RateLimitRequest {
    let descriptors = users
        .into_iter()
        .map(|user| RateLimitDescriptor {
            entries: vec![
                entry("tenant", "acme"),
                entry("user", &format!("user-{user:06}")),
            ],
            limit: None,
            hits_addend: None,
        })
        .collect();
    RateLimitRequest {
        domain: DOMAIN.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

fn entry(key: &str, value: &str) -> Entry {
    Entry {
        key: key.into(),
        value: value.into(),
    }
}
