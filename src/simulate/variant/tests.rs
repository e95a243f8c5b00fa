use super::*;
use crate::config;
use crate::decision::{Descriptor, Entry};

const YAML: &str = "domain: api
descriptors:
  - key: user
    descriptors:
      - key: plan
        value: gold
        rate_limit: {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20, name: gold}
  - key: open
    rate_limit: {unlimited: true}
  - key: bare
  - key: quiet
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 5}
";

fn rules() -> RuleSet {
    let options = config::LoadOptions {
        merge_domains: false,
        default_algorithm: Algorithm::SlidingWindowLog,
        max_log_entries: config::DEFAULT_MAX_LOG_ENTRIES,
        limits: config::ConfigLimits::STANDARD,
    };
    config::parse_str("api.yaml", YAML, &options).unwrap().rules
}

fn request(domain: &str, entries: &[(&str, &str)]) -> Request {
    let entries = entries.iter().map(|(key, value)| Entry {
        key: key.as_bytes().to_vec(),
        value: value.as_bytes().to_vec(),
    });
    Request {
        domain: domain.to_owned(),
        descriptors: vec![Descriptor {
            entries: entries.collect(),
            ..Descriptor::default()
        }],
        hits_addend: 1,
    }
}

fn check_refused(domain: &str, entries: &[(&str, &str)], expected: &str) {
    let rules = rules();
    let err = find(&rules, &request(domain, entries)).unwrap_err();
    assert_eq!(err.to_string(), expected);
}

#[test]
fn descriptors_that_reach_no_limit_are_refused_by_name() {
    check_refused(
        "web",
        &[("user", "a")],
        "unknown domain 'web' (the config has: api)",
    );
    check_refused(
        "api",
        &[("user", "a"), ("plan", "silver")],
        "descriptor user=a,plan=silver matches no rule in domain 'api'",
    );
    check_refused(
        "api",
        &[("open", "x")],
        "descriptor open=x reaches rule 'open', which is unlimited: nothing to simulate",
    );
    check_refused(
        "api",
        &[("user", "a")],
        "descriptor user=a reaches rule 'user', which has no rate_limit",
    );
}

#[test]
fn each_variant_changes_only_the_algorithm_of_the_reached_rule() {
    let rules = rules();
    let request = request("api", &[("user", "a"), ("plan", "gold")]);
    let reached = find(&rules, &request).unwrap();
    assert_eq!(
        reached.describe(&request),
        "domain api, descriptor user=a,plan=gold: 10/second burst 20 (token_bucket)"
    );
    let variants = variants(&rules, &reached, false).unwrap();
    let labels: Vec<&str> = variants.iter().map(|it| it.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "fixed_window",
            "sliding_window_counter",
            "sliding_window_log",
            "token_bucket",
            "gcra"
        ]
    );
    for (variant, algorithm) in variants.iter().zip(LANE_ORDER) {
        let found = find(&variant.rules, &request).unwrap();
        let limit = &found.limits[0];
        assert_eq!(limit.algorithm(), algorithm);
        assert_eq!(limit.requests_per_unit(), 10);
        assert_eq!(limit.name().map(|it| it.as_ref()), Some("gold"));
        let capacity = if algorithm.has_burst() { 20 } else { 10 };
        assert_eq!(limit.params().capacity(), capacity, "{algorithm}");
        assert_eq!(found.node.path().as_ref(), "user.plan_gold");
        // The rest of the tree is unchanged.
        let open = variant.rules.domain("api").unwrap().find(&[("open", "x")]);
        assert!(matches!(
            open.unwrap().rule().limits(),
            NodeLimits::Unlimited { .. }
        ));
    }
    let quiet = self::request("api", &[("quiet", "q")]);
    let shadow = find(&rules, &quiet).unwrap().describe(&quiet);
    assert_eq!(
        shadow,
        "domain api, descriptor quiet=q: 5/minute (sliding_window_log); shadow_mode: never denies"
    );
    let configured = super::variants(&rules, &reached, true).unwrap();
    assert_eq!(configured[0].label, "token_bucket");
    assert_eq!(configured[0].rules, rules);
}
