//! Walking one file's YAML tree into rule nodes, reporting every problem on the way.
//!
//! Invariant: the walk never stops at a problem: each is reported with its
//! YAML path, and only what is valid becomes a node. `rate_limit` walks a
//! descriptor's limits; this file the top level, the descriptors and the
//! scalar fields.

mod rate_limit;

use std::collections::HashSet;
use std::sync::Arc;

use serde_yaml_ng::{Mapping, Value};

use super::{LoadOptions, Problem};
use crate::algorithms::{Algorithm, Charge};
use crate::rules::{Node, NodeFlags, NodeLimits, ValueMatcher, segment};

const TOP_KEYS: &[&str] = &[
    "domain",
    "descriptors",
    "default_algorithm",
    "default_charge",
    "bucket_key_order",
];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];
const LIMIT_KEYS: &[&str] = &[
    "unit",
    "requests_per_unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "burst",
    "unit_multiplier",
    "charge",
];
const REPLACES_KEYS: &[&str] = &["name"];

/// The state of one file's walk.
pub(super) struct Walk<'a> {
    file: &'a str,
    domain: String,
    default_algorithm: Algorithm,
    /// The file's `default_charge`, else [`Charge::IfAllowed`].
    default_charge: Charge,
    max_log_entries: u32,
    problems: &'a mut Vec<Problem>,
    warnings: &'a mut Vec<String>,
}

/// What one file's top level holds, as far as it is valid.
pub(super) struct TopLevel {
    pub(super) domain: String,
    /// The file's `default_algorithm`, if it names one.
    pub(super) default_algorithm: Option<Algorithm>,
    /// The file's `bucket_key_order`, if it has one.
    pub(super) bucket_key_order: Option<Vec<Arc<str>>>,
    pub(super) nodes: Vec<Node>,
}

/// A field, with YAML `null` (an empty value) treated as absent, as
/// envoyproxy/ratelimit's decoder does.
fn get<'v>(map: &'v Mapping, key: &str) -> Option<&'v Value> {
    map.get(key).filter(|it| !it.is_null())
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// A scalar as envoyproxy's decoder reads it into a string field.
fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(it) => Some(it.clone()),
        Value::Number(it) => Some(it.to_string()),
        Value::Bool(it) => Some(it.to_string()),
        _ => None,
    }
}

/// A short rendering of a value for messages.
fn show(value: &Value) -> String {
    scalar_text(value).unwrap_or_else(|| match value {
        Value::Null => "null".to_owned(),
        Value::Sequence(_) => "a list".to_owned(),
        Value::Mapping(_) => "a mapping".to_owned(),
        _ => "a tagged value".to_owned(),
    })
}

impl<'a> Walk<'a> {
    fn problem(&mut self, path: &str, message: String) {
        self.problems.push(Problem {
            file: self.file.to_owned(),
            message,
            path: path.to_owned(),
            location: None,
        });
    }

    fn warn(&mut self, message: String) {
        self.warnings.push(format!("{}: {message}", self.file));
    }

    fn check_keys(&mut self, map: &Mapping, allowed: &[&str], path: &str, level: &str) {
        for key in map.keys() {
            let Value::String(name) = key else {
                self.problem(
                    path,
                    format!("config error, key is not of type string: {}", show(key)),
                );
                continue;
            };
            if allowed.contains(&name.as_str()) {
                continue;
            }
            let known = [TOP_KEYS, DESCRIPTOR_KEYS, LIMIT_KEYS]
                .iter()
                .any(|keys| keys.contains(&name.as_str()));
            let message = if known {
                format!("config error, key '{name}' does not belong in {level}")
            } else {
                format!("config error, unknown key '{name}'")
            };
            self.problem(&join(path, name), message);
        }
    }

    fn string(&mut self, map: &Mapping, key: &str, path: &str) -> Option<String> {
        let value = get(map, key)?;
        let text = scalar_text(value);
        if text.is_none() {
            self.problem(
                &join(path, key),
                format!(
                    "config error, '{key}' must be a string, not {}",
                    show(value)
                ),
            );
        }
        text
    }

    fn flag(&mut self, map: &Mapping, key: &str, path: &str) -> bool {
        let Some(value) = get(map, key) else {
            return false;
        };
        // YAML 1.1 spellings too: envoyproxy's decoder accepts them.
        let parsed = match value {
            Value::Bool(it) => Some(*it),
            Value::String(it) => match it.as_str() {
                "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True"
                | "TRUE" => Some(true),
                "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False"
                | "FALSE" => Some(false),
                _ => None,
            },
            _ => None,
        };
        parsed.unwrap_or_else(|| {
            self.problem(
                &join(path, key),
                format!(
                    "config error, '{key}' must be a boolean, not {}",
                    show(value)
                ),
            );
            false
        })
    }

    fn integer(&mut self, map: &Mapping, key: &str, path: &str) -> Option<u32> {
        let value = get(map, key)?;
        let parsed = match value {
            Value::Number(it) => it.as_u64().and_then(|it| u32::try_from(it).ok()),
            _ => None,
        };
        if parsed.is_none() {
            self.problem(
                &join(path, key),
                format!(
                    "config error, '{key}' must be an integer from 0 to {}, not {}",
                    u32::MAX,
                    show(value)
                ),
            );
        }
        parsed
    }

    fn charge(&mut self, map: &Mapping, key: &str, path: &str) -> Option<Charge> {
        let name = self.string(map, key, path)?;
        let charge = Charge::from_name(&name.to_ascii_lowercase());
        if charge.is_none() {
            let names: Vec<&str> = Charge::ALL.iter().map(|it| it.name()).collect();
            self.problem(
                &join(path, key),
                format!(
                    "invalid charge '{name}' (expected one of {})",
                    names.join(", ")
                ),
            );
        }
        charge
    }

    fn algorithm(&mut self, map: &Mapping, key: &str, path: &str) -> Option<Algorithm> {
        let name = self.string(map, key, path)?;
        let algorithm = Algorithm::from_name(&name.to_ascii_lowercase());
        if algorithm.is_none() {
            let names: Vec<&str> = Algorithm::ALL.iter().map(|it| it.name()).collect();
            self.problem(
                &join(path, key),
                format!(
                    "invalid algorithm '{name}' (expected one of {})",
                    names.join(", ")
                ),
            );
        }
        algorithm
    }

    /// The list of mappings under `key`; each element with its YAML path.
    fn list<'v>(&mut self, value: Option<&'v Value>, path: &str) -> Vec<(&'v Mapping, String)> {
        let Some(value) = value else {
            return Vec::new();
        };
        let Value::Sequence(items) = value else {
            self.problem(
                path,
                format!("config error, '{}' must be a list", last_segment(path)),
            );
            return Vec::new();
        };
        let mut res = Vec::with_capacity(items.len());
        for (idx, item) in items.iter().enumerate() {
            let item_path = format!("{path}[{idx}]");
            match item {
                Value::Mapping(map) => res.push((map, item_path)),
                other => self.problem(
                    &item_path,
                    format!(
                        "config error, yaml file contains list of type other than map: {}",
                        show(other)
                    ),
                ),
            }
        }
        res
    }

    fn mapping<'v>(&mut self, value: &'v Value, path: &str) -> Option<&'v Mapping> {
        match value {
            Value::Mapping(map) => Some(map),
            other => {
                self.problem(
                    path,
                    format!(
                        "config error, '{}' must be a mapping, not {}",
                        last_segment(path),
                        show(other)
                    ),
                );
                None
            }
        }
    }

    pub(super) fn new(
        file: &'a str,
        options: &LoadOptions,
        problems: &'a mut Vec<Problem>,
        warnings: &'a mut Vec<String>,
    ) -> Walk<'a> {
        Walk {
            file,
            domain: String::new(),
            default_algorithm: options.default_algorithm,
            default_charge: Charge::IfAllowed,
            max_log_entries: options.max_log_entries,
            problems,
            warnings,
        }
    }

    /// The top-level mapping: the domain, its default algorithm, the tree.
    pub(super) fn top(mut self, top: &Mapping) -> TopLevel {
        self.check_keys(top, TOP_KEYS, "", "the top level");
        let domain = self.string(top, "domain", "").unwrap_or_default();
        if domain.is_empty() {
            self.problem("", "config file cannot have empty domain".to_owned());
        }
        self.domain = domain.clone();
        let default_algorithm = self.algorithm(top, "default_algorithm", "");
        if let Some(algorithm) = default_algorithm {
            self.default_algorithm = algorithm;
        }
        if let Some(charge) = self.charge(top, "default_charge", "") {
            self.default_charge = charge;
        }
        let bucket_key_order = self.bucket_key_order(get(top, "bucket_key_order"));
        let nodes = self.nodes(get(top, "descriptors"), "", "descriptors");
        TopLevel {
            domain,
            default_algorithm,
            bucket_key_order,
            nodes,
        }
    }

    /// The `bucket_key_order` list: keys, none empty, none twice.
    fn bucket_key_order(&mut self, value: Option<&Value>) -> Option<Vec<Arc<str>>> {
        const KEY: &str = "bucket_key_order";
        let value = value?;
        let Value::Sequence(items) = value else {
            self.problem(KEY, format!("config error, '{KEY}' must be a list"));
            return None;
        };
        let mut keys: Vec<Arc<str>> = Vec::with_capacity(items.len());
        for (idx, item) in items.iter().enumerate() {
            let path = format!("{KEY}[{idx}]");
            let Some(key) = scalar_text(item) else {
                self.problem(
                    &path,
                    format!(
                        "config error, '{KEY}' must list strings, not {}",
                        show(item)
                    ),
                );
                continue;
            };
            if key.is_empty() {
                self.problem(&path, format!("{KEY} has an empty key"));
            } else if keys.iter().any(|it| **it == *key) {
                self.problem(&path, format!("{KEY} names '{key}' twice"));
            } else {
                keys.push(key.into());
            }
        }
        Some(keys)
    }

    /// One level of descriptors below the node at `parent` (its rule path).
    fn nodes(&mut self, list: Option<&Value>, parent: &str, path: &str) -> Vec<Node> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut seen: HashSet<String> = HashSet::new();
        for (map, item_path) in self.list(list, path) {
            let Some(node) = self.node(map, parent, &item_path) else {
                continue;
            };
            // The level-local part of the path is envoyproxy's composite key.
            if !seen.insert(segment(node.key(), node.value())) {
                let message = format!(
                    "duplicate descriptor composite key '{}.{}'",
                    self.domain,
                    node.path()
                );
                self.problem(&item_path, message);
                continue;
            }
            nodes.push(node);
        }
        nodes
    }

    fn node(&mut self, map: &Mapping, parent: &str, path: &str) -> Option<Node> {
        self.check_keys(map, DESCRIPTOR_KEYS, path, "a descriptor");
        let key = self.string(map, "key", path).unwrap_or_default();
        if key.is_empty() {
            self.problem(path, "descriptor has empty key".to_owned());
            return None;
        }
        let value = ValueMatcher::from_config(&self.string(map, "value", path).unwrap_or_default());
        let node = Node::new(parent, key.into(), value, NodeLimits::None);
        let flags = self.node_flags(map, path, &node);
        let node = node.with_flags(flags);
        let composite = format!("{}.{}", self.domain, node.path());
        let node = node.with_limits(self.node_limits(map, path, &composite));
        let children = self.nodes(
            get(map, "descriptors"),
            node.path(),
            &join(path, "descriptors"),
        );
        Some(node.with_children(children))
    }

    /// The flags `map` sets on `node`; `share_threshold` on a node that is
    /// not a wildcard is reported.
    fn node_flags(&mut self, map: &Mapping, path: &str, node: &Node) -> NodeFlags {
        let flags = NodeFlags {
            shadow_mode: self.flag(map, "shadow_mode", path),
            quota_mode: self.flag(map, "quota_mode", path),
            detailed_metric: self.flag(map, "detailed_metric", path),
            value_to_metric: self.flag(map, "value_to_metric", path),
            share_threshold: self.flag(map, "share_threshold", path),
        };
        if flags.share_threshold && !matches!(node.value(), ValueMatcher::Wildcard(_)) {
            self.problem(
                &join(path, "share_threshold"),
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{}'",
                    segment(node.key(), node.value())
                ),
            );
        }
        flags
    }
}

/// The last key of a YAML path, for messages.
fn last_segment(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}
