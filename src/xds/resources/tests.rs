use super::*;
use crate::proto::xds::ratelimit::config::ratelimit::v3::RateLimitReplace;

fn options() -> config::LoadOptions {
    crate::testing::load_options()
}

fn any(resource: &RateLimitConfig) -> prost_types::Any {
    prost_types::Any {
        type_url: RATE_LIMIT_CONFIG_TYPE.to_owned(),
        value: resource.encode_to_vec(),
    }
}

fn policy(unit: RateLimitUnit, requests_per_unit: u32) -> Option<RateLimitPolicy> {
    Some(RateLimitPolicy {
        unit: unit as i32,
        requests_per_unit,
        ..RateLimitPolicy::default()
    })
}

fn load(resources: &[RateLimitConfig]) -> Result<config::Loaded, config::Error> {
    let options = options();
    let anys: Vec<_> = resources.iter().map(any).collect();
    config::load_trees(trees(&anys, &options.limits)?, &options)
}

#[test]
fn a_resource_loads_as_the_same_yaml_does() {
    let resource = RateLimitConfig {
        name: "api".into(),
        domain: "api".into(),
        descriptors: vec![RateLimitDescriptor {
            key: "user".into(),
            rate_limit: policy(RateLimitUnit::Minute, 10),
            descriptors: vec![RateLimitDescriptor {
                key: "path".into(),
                value: "/login".into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: RateLimitUnit::Week as i32,
                    requests_per_unit: 3,
                    name: "login".into(),
                    replaces: vec![RateLimitReplace { name: "x".into() }],
                    ..RateLimitPolicy::default()
                }),
                shadow_mode: true,
                ..RateLimitDescriptor::default()
            }],
            ..RateLimitDescriptor::default()
        }],
    };
    let yaml = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n    descriptors:\n      - key: path\n        value: /login\n        shadow_mode: true\n        rate_limit: {unit: week, requests_per_unit: 3, name: login, replaces: [{name: x}]}\n";
    let from_file = config::parse_str("api.yaml", yaml, &options()).unwrap();
    assert_eq!(load(&[resource]).unwrap().rules, from_file.rules);
}

#[test]
fn problems_are_the_loaders_and_name_the_resource() {
    let bad = RateLimitConfig {
        name: "edge".into(),
        domain: "edge".into(),
        descriptors: vec![
            RateLimitDescriptor {
                key: "a".into(),
                rate_limit: policy(RateLimitUnit::Unknown, 5),
                ..RateLimitDescriptor::default()
            },
            RateLimitDescriptor {
                key: "b".into(),
                rate_limit: Some(RateLimitPolicy {
                    unit: RateLimitUnit::Second as i32,
                    unlimited: true,
                    ..RateLimitPolicy::default()
                }),
                ..RateLimitDescriptor::default()
            },
        ],
    };
    let err = load(&[bad]).unwrap_err();
    let text = err.to_string();
    assert_eq!(
        text,
        "edge: invalid rate limit unit 'UNKNOWN'\nedge: should not specify rate limit unit when unlimited",
    );
    let twice = RateLimitConfig {
        name: "again".into(),
        domain: "api".into(),
        descriptors: vec![],
    };
    let first = RateLimitConfig {
        name: "api".into(),
        ..twice.clone()
    };
    let err = load(&[first, twice]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "again: duplicate domain 'api' in config file"
    );
}

#[test]
fn an_unlimited_policy_without_a_unit_is_valid() {
    let resource = RateLimitConfig {
        name: "d".into(),
        domain: "d".into(),
        descriptors: vec![RateLimitDescriptor {
            key: "k".into(),
            rate_limit: Some(RateLimitPolicy {
                unlimited: true,
                ..RateLimitPolicy::default()
            }),
            ..RateLimitDescriptor::default()
        }],
    };
    let loaded = load(&[resource]).unwrap();
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn undecodable_oversized_and_foreign_resources_are_refused() {
    let mut garbage = any(&RateLimitConfig::default());
    garbage.value = vec![0xff, 0xff, 0xff];
    let foreign = prost_types::Any {
        type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
        value: Vec::new(),
    };
    let big = any(&RateLimitConfig {
        name: "big".into(),
        domain: "x".repeat(2_000),
        descriptors: vec![],
    });
    let limits = ConfigLimits {
        max_file_bytes: 1_000,
        ..ConfigLimits::STANDARD
    };
    let err = trees(&[garbage, foreign, big], &limits).unwrap_err();
    let text = err.to_string();
    assert_eq!(err.problems.len(), 3, "{text}");
    assert!(
        text.contains("resource 0: cannot decode RateLimitConfig"),
        "{text}"
    );
    assert!(
        text.contains(
            "resource 1: resource of type 'type.googleapis.com/envoy.config.cluster.v3.Cluster'"
        ),
        "{text}"
    );
    assert!(
        text.contains("resource 2: larger than 1000 bytes (--max-config-file-bytes)"),
        "{text}"
    );
}
