//! What deciding counts: decisions by result, hits, backend errors and
//! per-value series.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::algorithms::Verdict;
use crate::backends;
use crate::clock::ManualClock;
use crate::decision::{Limiter, NearLimitRatio, Options, Request};
use crate::metrics::{Metrics, UNKNOWN_DOMAIN, UNKNOWN_RULE};
use crate::testing::decision::*;
use crate::testing::metrics_text::*;
use crate::testing::{self, FakeBackend};

fn limiter(yaml: &str, shadow_mode: bool) -> Limiter {
    yaml_limiter(yaml, shadow_mode, Metrics::new())
}

fn request(domain: &str, entries: &[(&str, &str)], hits_addend: u32) -> Request {
    request_in(domain, vec![desc(entries)], hits_addend)
}

/// Decides `request` `times` times, each answered.
async fn decide_times(limiter: &Limiter, request: &Request, times: usize) {
    for _ in 0..times {
        limiter.decide(request).await.unwrap();
    }
}

const TREE: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: tenant
    descriptors:
      - key: path
        value: /expensive
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 1}
";

#[tokio::test]
async fn decisions_are_counted_by_result_and_hits_by_cost() {
    let limiter = limiter(TREE, false);
    // 10 per minute: remaining 9..2 is ok, 1 and 0 are near the limit
    // (more than `NearLimitRatio::DEFAULT`, 0.8, used), then over.
    decide_times(&limiter, &request("api", &[("user", "a")], 1), 13).await;
    // A cost of 4 counts 4 hits, denied or not.
    decide_times(&limiter, &request("api", &[("user", "b")], 4), 1).await;
    let shadow = || request("api", &[("tenant", "acme"), ("path", "/expensive")], 1);
    for _ in 0..3 {
        let decision = limiter.decide(&shadow()).await.unwrap();
        assert_eq!(decision.overall, crate::decision::Code::Ok);
    }
    let text = limiter.metrics().encode();
    assert_decisions(
        &text,
        "api",
        "user",
        &[
            ("ok", 9.0),
            ("near_limit", 2.0),
            ("over_limit", 3.0),
            ("shadow", 0.0),
        ],
    );
    assert_eq!(
        sample(
            &text,
            "throttlegate_hits_total{domain=\"api\",rule=\"user\"}"
        ),
        Some(17.0),
        "{text}"
    );
    let rule = "tenant.path_/expensive";
    // The first passes with nothing left; the shadow rule lets the rest through.
    assert_decisions(
        &text,
        "api",
        rule,
        &[("near_limit", 1.0), ("shadow", 2.0), ("over_limit", 0.0)],
    );
    // Descriptor values never become labels by default.
    assert!(!text.contains("acme") && !text.contains("\"a\""), "{text}");
}

#[tokio::test]
async fn near_limit_ratio_sets_where_near_limit_begins() {
    let limiter = yaml_limiter_on(
        TREE,
        testing::memory_backend(&ManualClock::new(testing::T0)),
        Options {
            near_limit_ratio: NearLimitRatio::new(0.5).unwrap(),
            ..allow_options(false)
        },
    );
    // 10 per minute: remaining 9..5 is ok, 4..0 near the limit.
    decide_times(&limiter, &request("api", &[("user", "a")], 1), 10).await;
    let text = limiter.metrics().encode();
    assert_decisions(&text, "api", "user", &[("ok", 5.0), ("near_limit", 5.0)]);
}

#[tokio::test]
async fn global_shadow_mode_counts_would_be_denials_as_shadow() {
    let limiter = limiter(TREE, true);
    decide_times(&limiter, &request("api", &[("user", "a")], 1), 12).await;
    let text = limiter.metrics().encode();
    assert_decisions(
        &text,
        "api",
        "user",
        &[("shadow", 2.0), ("over_limit", 0.0)],
    );
}

#[tokio::test]
async fn detailed_metric_and_value_to_metric_label_shapes() {
    let yaml = "domain: api
descriptors:
  - key: tenant
    descriptors:
      - key: path
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 100}
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        value: G*
        value_to_metric: true
        descriptors:
          - key: subject
            rate_limit: {unit: minute, requests_per_unit: 100}
  - key: file
    value: a*
    rate_limit: {unit: minute, requests_per_unit: 100}
";
    let limiter = limiter(yaml, false);
    let cases: [(&[(&str, &str)], &str); 3] = [
        (&[("tenant", "acme"), ("path", "/x")], "tenant_acme.path_/x"),
        (
            &[("route", "api"), ("method", "GET"), ("subject", "123")],
            "route_api.method_GET.subject",
        ),
        // No opt-in: the wildcard's pattern, never the value.
        (&[("file", "abc")], "file_a*"),
    ];
    for (entries, _) in cases {
        limiter.decide(&request("api", entries, 1)).await.unwrap();
    }
    let text = limiter.metrics().encode();
    for (_, rule) in cases {
        assert_decisions(&text, "api", rule, &[("ok", 1.0)]);
    }
    assert!(!text.contains("123") && !text.contains("abc"), "{text}");
}

#[tokio::test]
async fn unknown_domains_share_one_series() {
    let limiter = limiter(TREE, false);
    for domain in ["nope1", "nope2", "nope3"] {
        decide_times(&limiter, &request(domain, &[("user", "a")], 1), 1).await;
    }
    let text = limiter.metrics().encode();
    assert_decisions(&text, UNKNOWN_DOMAIN, UNKNOWN_RULE, &[("ok", 3.0)]);
    assert!(!text.contains("nope"), "{text}");
}

#[tokio::test]
async fn backend_errors_are_counted_by_kind_and_calls_timed() {
    let answers = VecDeque::from([
        Err(backends::Error::Timeout(250)),
        Err(backends::Error::Unavailable("refused".to_owned())),
        Err(backends::Error::Unavailable("reset".to_owned())),
        Err(backends::Error::Protocol("bad reply".to_owned())),
        // A verdict without outcomes is a protocol error too.
        Ok(Verdict {
            allowed: true,
            outcomes: Vec::new(),
        }),
    ]);
    let limiter = yaml_limiter_on(
        TREE,
        Arc::new(FakeBackend::scripted(answers)),
        allow_options(false),
    );
    decide_times(&limiter, &request("api", &[("user", "a")], 1), 5).await;
    let text = limiter.metrics().encode();
    let errors = |kind: &str| {
        sample(
            &text,
            &format!("throttlegate_backend_errors_total{{backend=\"fake\",kind=\"{kind}\"}}"),
        )
    };
    assert_eq!(errors("timeout"), Some(1.0), "{text}");
    assert_eq!(errors("unavailable"), Some(2.0), "{text}");
    assert_eq!(errors("protocol"), Some(2.0), "{text}");
    assert_eq!(
        sample(
            &text,
            "throttlegate_backend_latency_seconds_count{backend=\"fake\"}"
        ),
        Some(5.0),
        "{text}"
    );
    // No decision was made: none is counted.
    assert_eq!(decisions(&text, "api", "user", "ok"), None, "{text}");
}

const PER_VALUE: &str = "domain: api
descriptors:
  - key: client
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 100}
";

#[tokio::test]
async fn a_value_with_one_decision_creates_one_series() {
    let limiter = limiter(PER_VALUE, false);
    decide_times(&limiter, &request("api", &[("client", "c1")], 1), 1).await;
    let text = limiter.metrics().encode();
    assert_eq!(
        series_with(&text, "throttlegate_decisions_total{", "client_c1"),
        ["throttlegate_decisions_total{domain=\"api\",rule=\"client_c1\",result=\"ok\"} 1"],
        "{text}"
    );
    assert_eq!(
        series_with(&text, "throttlegate_hits_total{", "client_c1").len(),
        1,
        "{text}"
    );
    // Rules named by the config keep all four results from the start.
    let limiter = yaml_limiter(TREE, false, Metrics::new());
    decide_times(&limiter, &request("api", &[("user", "u")], 1), 1).await;
    let text = limiter.metrics().encode();
    assert_eq!(
        series_with(&text, "throttlegate_decisions_total{", "rule=\"user\"").len(),
        4,
        "{text}"
    );
}

#[tokio::test]
async fn per_value_series_are_capped_per_rule_then_fold_into_overflow() {
    let limiter = yaml_limiter(PER_VALUE, false, Metrics::with_max_values_per_rule(3));
    for _ in 0..2 {
        for n in 0..10 {
            let value = format!("v{n}");
            limiter
                .decide(&request("api", &[("client", &value)], 1))
                .await
                .unwrap();
        }
    }
    let text = limiter.metrics().encode();
    let per_value = series_with(&text, "throttlegate_decisions_total{", "rule=\"client_v");
    assert_eq!(per_value.len(), 3, "{text}");
    // The first three values keep their series and all their decisions.
    for n in 0..3 {
        assert_decisions(&text, "api", &format!("client_v{n}"), &[("ok", 2.0)]);
    }
    assert_decisions(&text, "api", "client:_overflow", &[("ok", 14.0)]);
    assert_eq!(
        sample(
            &text,
            "throttlegate_metric_value_overflows_total{domain=\"api\",rule=\"client\"}"
        ),
        Some(14.0),
        "{text}"
    );
    assert!(!text.contains("client_v3"), "{text}");
}

/// A limiter over `TREE` whose backend (memory, behind a fake) answers
/// each decision after `delay`, answering through `options`.
fn slow_limiter(delay: std::time::Duration, options: Options) -> (Limiter, Arc<FakeBackend>) {
    let clock = ManualClock::new(testing::T0);
    let backend = Arc::new(FakeBackend::slow(testing::memory_backend(&clock), delay));
    let limiter = yaml_limiter_on(TREE, backend.clone(), options);
    (limiter, backend)
}

fn abandoned(text: &str, stage: &str) -> Option<f64> {
    sample(
        text,
        &format!(
            "throttlegate_abandoned_calls_total{{method=\"ShouldRateLimit\",stage=\"{stage}\"}}"
        ),
    )
}

#[tokio::test]
async fn a_decision_whose_caller_left_is_still_counted() {
    use std::time::Duration;
    let (limiter, backend) = slow_limiter(Duration::from_millis(50), allow_options(false));
    let req = request("api", &[("user", "a")], 3);
    // The caller gives up (its future dropped, as on a stream reset)
    // while the backend decides.
    let gave_up = tokio::time::timeout(Duration::from_millis(10), limiter.decide(&req)).await;
    assert!(gave_up.is_err(), "answered before the backend did");
    let text = limiter.metrics().encode();
    assert_eq!(abandoned(&text, "backend"), Some(1.0), "{text}");
    assert_eq!(decisions(&text, "api", "user", "ok"), None, "{text}");
    // The call finishes without its caller, and what it consumed counts.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let text = limiter.metrics().encode();
    assert_eq!(backend.calls(), 1);
    assert_eq!(decisions(&text, "api", "user", "ok"), Some(1.0), "{text}");
    assert_eq!(
        sample(
            &text,
            "throttlegate_hits_total{domain=\"api\",rule=\"user\"}"
        ),
        Some(3.0),
        "{text}"
    );
    // And the counter holds it: 10 per minute, 3 used, so 7 remain.
    let fast = yaml_limiter_on(TREE, backend.clone(), allow_options(false));
    let decision = fast
        .decide(&request("api", &[("user", "a")], 1))
        .await
        .unwrap();
    assert_eq!(decision.statuses[0].limit_remaining, 6);
}

#[tokio::test]
async fn a_deadline_too_close_for_the_backend_is_answered_at_once_through_the_failure_mode() {
    use std::time::{Duration, Instant};
    let (limiter, backend) = slow_limiter(Duration::ZERO, crate::testing::default_options());
    let caller = crate::decision::Caller {
        traced: None,
        method: crate::metrics::Method::ShouldRateLimit,
        deadline: Some(Instant::now() + Duration::from_micros(2500)),
    };
    let req = request("api", &[("user", "a")], 1);
    let started = Instant::now();
    let answer = limiter.decide_within(&req, caller).await;
    assert!(
        started.elapsed() < Duration::from_millis(1),
        "answered at once"
    );
    // `--failure-mode error`: UNAVAILABLE for the transport.
    match answer {
        Err(crate::decision::Error::Backend(backends::Error::Deadline)) => {}
        other => panic!("expected the failure mode's error, got {other:?}"),
    }
    assert_eq!(backend.calls(), 0, "the backend was never asked");
    let text = limiter.metrics().encode();
    assert_eq!(abandoned(&text, "deadline"), Some(1.0), "{text}");
    // Not a backend failure.
    assert_eq!(
        sample(
            &text,
            "throttlegate_backend_errors_total{backend=\"fake\",kind=\"timeout\"}"
        ),
        Some(0.0),
        "{text}"
    );
}

#[tokio::test]
async fn a_slow_backend_is_answered_through_the_failure_mode_before_the_deadline_then_counted() {
    use std::time::{Duration, Instant};
    let mut options = crate::testing::default_options();
    options.failure_mode = crate::decision::FailureMode::Deny;
    let (limiter, _backend) = slow_limiter(Duration::from_millis(60), options);
    let deadline = Instant::now() + Duration::from_millis(20);
    let caller = crate::decision::Caller {
        traced: None,
        method: crate::metrics::Method::ShouldRateLimit,
        deadline: Some(deadline),
    };
    let decision = limiter
        .decide_within(&request("api", &[("user", "a")], 1), caller)
        .await
        .expect("the failure mode answers");
    let answered = Instant::now();
    assert!(
        answered < deadline,
        "answered {:?} late",
        answered - deadline
    );
    assert!(
        deadline - answered < Duration::from_millis(5),
        "answered too early"
    );
    assert_eq!(decision.overall, crate::decision::Code::OverLimit);
    let text = limiter.metrics().encode();
    assert_eq!(abandoned(&text, "backend"), Some(1.0), "{text}");
    tokio::time::sleep(Duration::from_millis(120)).await;
    let text = limiter.metrics().encode();
    assert_eq!(decisions(&text, "api", "user", "ok"), Some(1.0), "{text}");
}
