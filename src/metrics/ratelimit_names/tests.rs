use super::*;
use crate::metrics::MetricRule;
use std::sync::Arc;

#[test]
fn sanitize_follows_envoyproxy_ratelimit() {
    assert_eq!(sanitize("d.key_a:b|c"), "d.key_a_b_c");
    assert_eq!(
        sanitize("d.remote_address_10.0.0.1.path_/x"),
        "d.remote_address_10_0_0_1.path_/x"
    );
    assert_eq!(sanitize("d.v_1.2.3"), "d.v_1.2.3");
    assert_eq!(sanitize("d.v_1234.5.6.7"), "d.v_1234_5_6_7");
}

#[test]
fn hits_per_outcome_become_the_rule_statistics() {
    let metrics = Metrics::new();
    let rule = MetricRule::Path(Arc::from("tenant_a.path"));
    metrics.record("api", &rule, MetricResult::Ok, 2, 0);
    metrics.record("api", &rule, MetricResult::NearLimit, 3, 0);
    metrics.record("api", &rule, MetricResult::OverLimit, 5, 0);
    metrics.record("api", &rule, MetricResult::Shadow, 7, 0);
    metrics.record_decision(UNKNOWN_DOMAIN, "_unknown", MetricResult::Ok, 1);
    let stats = metrics.ratelimit_stats();
    let get = |name: &str| stats.counters.iter().find(|it| it.0 == name).map(|it| it.1);
    let key = "ratelimit.service.rate_limit.api.tenant_a.path";
    assert_eq!(get(&format!("{key}.total_hits")), Some(17));
    assert_eq!(get(&format!("{key}.within_limit")), Some(5));
    assert_eq!(get(&format!("{key}.near_limit")), Some(3));
    assert_eq!(get(&format!("{key}.over_limit")), Some(12));
    assert_eq!(get(&format!("{key}.shadow_mode")), Some(7));
    assert!(
        stats.counters.iter().all(|it| !it.0.contains("_unknown")),
        "{stats:?}"
    );
    assert_eq!(get(CONFIG_LOAD_SUCCESS), Some(0));
    metrics.record_reload(true);
    metrics.record_reload(false);
    let stats = metrics.ratelimit_stats();
    let get = |name: &str| stats.counters.iter().find(|it| it.0 == name).map(|it| it.1);
    assert_eq!(get(CONFIG_LOAD_SUCCESS), Some(1));
    assert_eq!(get(CONFIG_LOAD_ERROR), Some(1));
}

#[test]
fn response_time_reads_the_decision_latency_in_milliseconds() {
    let metrics = Metrics::new();
    metrics.observe_decision_latency(
        crate::metrics::Method::ShouldRateLimit,
        std::time::Duration::from_micros(700),
    );
    metrics.observe_decision_latency(
        crate::metrics::Method::ShouldRateLimit,
        std::time::Duration::from_millis(30),
    );
    let stats = metrics.ratelimit_stats();
    let time = &stats.response_time;
    assert_eq!(time.count, 2);
    assert!((time.sum_ms - 30.7).abs() < 1e-6, "{time:?}");
    let at = |edge: f64| {
        time.buckets
            .iter()
            .find(|it| (it.0 - edge).abs() < 1e-9)
            .map(|it| it.1)
    };
    assert_eq!(at(0.5), Some(0));
    assert_eq!(at(1.0), Some(1));
    assert_eq!(at(25.0), Some(1));
    assert_eq!(at(50.0), Some(2));
    assert_eq!(time.buckets.last().map(|it| it.1), Some(2));
    let delta = time.delta_since(&ResponseTime::default());
    assert_eq!(delta, vec![(1.0, 1), (50.0, 1)]);
    assert!(time.delta_since(time).is_empty());
}
