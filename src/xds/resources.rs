//! `RateLimitConfig` resources as the YAML trees the config loader walks:
//! one tree per resource, keys named as in a config file, so rules pushed
//! over xDS pass the same validation as files (`config::load_trees`).
//!
//! A proto3 field at its default value is absent on the wire, so it is left
//! out of the tree as an absent YAML key would be, with two exceptions that
//! keep envoyproxy/ratelimit's meaning: a limited policy always carries its
//! `unit` (UNKNOWN is refused as an invalid unit, as there) and its
//! `requests_per_unit` (0 is a limit of 0, not a missing number).

use prost::Message as _;
use serde_yaml_ng::{Mapping, Number, Value};

use crate::config::{self, ConfigLimits};
use crate::proto::xds::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

/// The type of every resource this client asks for.
pub const RATE_LIMIT_CONFIG_TYPE: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// The resources of one response, decoded into named trees; every resource
/// that cannot be decoded, or is over a size limit, is a problem (the whole
/// response is then refused).
pub fn trees(
    resources: &[prost_types::Any],
    limits: &ConfigLimits,
) -> Result<Vec<(String, Value)>, config::Error> {
    let mut problems = Vec::new();
    let mut trees = Vec::with_capacity(resources.len());
    let mut total: u64 = 0;
    for (idx, any) in resources.iter().enumerate() {
        let fallback = format!("resource {idx}");
        let size = any.value.len() as u64;
        total = total.saturating_add(size);
        if any.type_url != RATE_LIMIT_CONFIG_TYPE {
            problems.push(problem(
                &fallback,
                format!(
                    "resource of type '{}', expected '{RATE_LIMIT_CONFIG_TYPE}'",
                    any.type_url
                ),
            ));
            continue;
        }
        if size > limits.max_file_bytes {
            problems.push(problem(
                &fallback,
                format!(
                    "larger than {} bytes (--max-config-file-bytes)",
                    limits.max_file_bytes
                ),
            ));
            continue;
        }
        match RateLimitConfig::decode(any.value.as_slice()) {
            Ok(resource) => {
                let name = if resource.name.is_empty() {
                    fallback
                } else {
                    resource.name.clone()
                };
                trees.push((name, tree(&resource)));
            }
            Err(err) => problems.push(problem(
                &fallback,
                format!("cannot decode RateLimitConfig: {err}"),
            )),
        }
    }
    if total > limits.max_total_bytes {
        problems.push(problem(
            "response",
            format!(
                "resources total more than {} bytes (--max-config-bytes)",
                limits.max_total_bytes
            ),
        ));
    }
    if problems.is_empty() {
        Ok(trees)
    } else {
        Err(config::Error { problems })
    }
}

fn problem(name: &str, message: String) -> config::Problem {
    config::Problem {
        file: name.to_owned(),
        message,
        path: String::new(),
        location: None,
    }
}

/// One resource as a config file's top level.
pub fn tree(resource: &RateLimitConfig) -> Value {
    let mut top = Mapping::new();
    top.insert(text("domain"), text(&resource.domain));
    if !resource.descriptors.is_empty() {
        top.insert(text("descriptors"), descriptors(&resource.descriptors));
    }
    Value::Mapping(top)
}

fn text(it: &str) -> Value {
    Value::String(it.to_owned())
}

fn descriptors(list: &[RateLimitDescriptor]) -> Value {
    Value::Sequence(list.iter().map(descriptor).collect())
}

fn descriptor(it: &RateLimitDescriptor) -> Value {
    let mut map = Mapping::new();
    map.insert(text("key"), text(&it.key));
    if !it.value.is_empty() {
        map.insert(text("value"), text(&it.value));
    }
    if let Some(policy) = &it.rate_limit {
        map.insert(text("rate_limit"), rate_limit(policy));
    }
    if !it.descriptors.is_empty() {
        map.insert(text("descriptors"), descriptors(&it.descriptors));
    }
    for (key, on) in [
        ("shadow_mode", it.shadow_mode),
        ("detailed_metric", it.detailed_metric),
        ("quota_mode", it.quota_mode),
    ] {
        if on {
            map.insert(text(key), Value::Bool(true));
        }
    }
    if let Some(metadata) = &it.metadata {
        map.insert(text("metadata"), structure(metadata));
    }
    Value::Mapping(map)
}

fn rate_limit(it: &RateLimitPolicy) -> Value {
    let mut map = Mapping::new();
    let unit = RateLimitUnit::try_from(it.unit).ok();
    if it.unlimited {
        map.insert(text("unlimited"), Value::Bool(true));
        // UNKNOWN is the field's default: no unit was given.
        if let Some(unit) = unit.filter(|it| *it != RateLimitUnit::Unknown) {
            map.insert(text("unit"), text(unit.as_str_name()));
        }
        if it.requests_per_unit != 0 {
            map.insert(
                text("requests_per_unit"),
                Value::Number(Number::from(it.requests_per_unit)),
            );
        }
    } else {
        let unit = unit.map_or_else(|| it.unit.to_string(), |it| it.as_str_name().to_owned());
        map.insert(text("unit"), Value::String(unit));
        map.insert(
            text("requests_per_unit"),
            Value::Number(Number::from(it.requests_per_unit)),
        );
    }
    if !it.name.is_empty() {
        map.insert(text("name"), text(&it.name));
    }
    if !it.replaces.is_empty() {
        let replaces = it
            .replaces
            .iter()
            .map(|replace| {
                let mut entry = Mapping::new();
                entry.insert(text("name"), text(&replace.name));
                Value::Mapping(entry)
            })
            .collect();
        map.insert(text("replaces"), Value::Sequence(replaces));
    }
    Value::Mapping(map)
}

/// A `google.protobuf.Struct` as a YAML mapping (descriptor metadata).
fn structure(it: &prost_types::Struct) -> Value {
    Value::Mapping(
        it.fields
            .iter()
            .map(|(key, value)| (text(key), struct_value(value)))
            .collect(),
    )
}

fn struct_value(it: &prost_types::Value) -> Value {
    use prost_types::value::Kind;
    match &it.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(number)) => Value::Number(Number::from(*number)),
        Some(Kind::StringValue(it)) => text(it),
        Some(Kind::BoolValue(it)) => Value::Bool(*it),
        Some(Kind::StructValue(it)) => structure(it),
        Some(Kind::ListValue(list)) => {
            Value::Sequence(list.values.iter().map(struct_value).collect())
        }
    }
}

#[cfg(test)]
mod tests {
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
}
