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
mod tests;
