use super::*;

fn mapped(name: &str, labels: &[(&str, &str)]) -> Option<Mapped> {
    Some(Mapped {
        name: name.to_owned(),
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        scale: 1.0,
        help: None,
    })
}

#[test]
fn envoy_gateway_mapping_gives_its_dashboard_names() {
    let mapping = Mapping::envoy_gateway();
    assert_eq!(
        mapping.map(
            "ratelimit.service.rate_limit.api.tenant_a.total_hits",
            StatKind::Counter
        ),
        mapped(
            "ratelimit_service_rate_limit_total_hits",
            &[("domain", "api"), ("key1", "tenant_a")]
        )
    );
    // Two levels and more: the regular expressions, key2 the second level.
    assert_eq!(
        mapping.map(
            "ratelimit.service.rate_limit.api.tenant_a.path_/x.y.over_limit",
            StatKind::Counter
        ),
        mapped(
            "ratelimit_service_rate_limit_over_limit",
            &[("domain", "api"), ("key1", "tenant_a"), ("key2", "path_/x")]
        )
    );
    assert_eq!(
        mapping.map(
            "ratelimit.service.call.should_rate_limit.redis_error",
            StatKind::Counter
        ),
        mapped(
            "ratelimit_service_should_rate_limit_error",
            &[("err_type", "redis_error")]
        )
    );
    assert_eq!(
        mapping.map(
            "ratelimit_server.ShouldRateLimit.response_time",
            StatKind::Observer
        ),
        mapped(
            "ratelimit_service_response_time_seconds",
            &[("grpc_method", "ShouldRateLimit")]
        )
    );
    assert_eq!(
        mapping.map("ratelimit.service.config_load_error", StatKind::Counter),
        mapped("ratelimit_service_config_load_error", &[])
    );
    // Counter-only mappings do not take a gauge; unmatched names are escaped.
    assert_eq!(
        mapping.map("ratelimit.service.config_load_error", StatKind::Gauge),
        mapped("ratelimit_service_config_load_error", &[])
    );
    assert_eq!(
        mapping.map("something.else-1", StatKind::Counter),
        mapped("something_else_1", &[])
    );
}

#[test]
fn globs_come_before_regular_expressions_and_drop_drops() {
    let mapping = Mapping::parse(
        r#"
mappings:
  - match: "a\\.(.*)"
    match_type: regex
    name: "from_regex"
    labels: { rest: "$1" }
  - match: "a.*"
    name: "from_glob_${1}_x"
    scale: 0.001
    help: "the glob"
  - match: "gone.*"
    action: drop
"#,
    )
    .expect("valid");
    let glob = mapping.map("a.b", StatKind::Observer).expect("mapped");
    assert_eq!(glob.name, "from_glob_b_x");
    assert_eq!(glob.scale, 0.001);
    assert_eq!(glob.help.as_deref(), Some("the glob"));
    assert_eq!(
        mapping.map("a.b.c", StatKind::Counter),
        mapped("from_regex", &[("rest", "b.c")])
    );
    assert_eq!(mapping.map("gone.x", StatKind::Counter), None);
}

#[test]
fn unsupported_features_are_refused_by_name() {
    for (text, says) in [
        ("defaults:\n  ttl: 1m\nmappings: []\n", "defaults"),
        (
            "mappings:\n  - match: a.*\n    name: x\n    buckets: [1, 2]\n",
            "buckets",
        ),
        (
            "mappings:\n  - match: a.*\n    name: x\n    timer_type: summary\n",
            "summary",
        ),
        (
            "mappings:\n  - match: a.*\n    name: x\n    match_type: other\n",
            "match_type",
        ),
        (
            "mappings:\n  - match: a.*\n    name: x\n    labels: { k: $2 }\n",
            "$1",
        ),
        (
            "mappings:\n  - match: a.*\n    name: x\n    labels: { k: $1b }\n",
            "${n}",
        ),
        ("mappings:\n  - match: a.*\n    name: 1x\n", "metric name"),
        (
            "mappings:\n  - match: a.*\n    name: x\n    labels: { bad-label: v }\n",
            "label name",
        ),
        ("mappings:\n  - match: a+b\n    name: x\n", "glob"),
        (
            "mappings:\n  - match: \"(\"\n    match_type: regex\n    name: x\n",
            "not usable",
        ),
        ("mappings:\n  - match: a.*\n", "needs a name"),
        (
            "mappings:\n  - match: a.*\n    name: x\n    scale: 0\n",
            "scale",
        ),
        ("not: [a mapping\n", "mapping file"),
    ] {
        let err = Mapping::parse(text).expect_err(text);
        assert!(err.contains(says), "{text}: {err}");
    }
}
