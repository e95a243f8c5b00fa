//! statsd_exporter's mapping file (the subset envoyproxy/ratelimit's and
//! Envoy Gateway's mappings use): which Prometheus name and labels a statsd
//! statistic is served under on the envoyproxy/ratelimit-compatible
//! endpoint.
//!
//! A mapping file is `mappings:`, a list of entries with `match` (a glob
//! where `*` stands for any run of characters without a dot, or with
//! `match_type: regex` a regular expression, unanchored), `name`, `labels`
//! (values may use `$1`..`$n` and `${n}`, the glob's stars or the
//! expression's groups), `match_metric_type` (`counter`, `gauge`,
//! `observer` or `timer`), `timer_type`/`observer_type` (`histogram` only:
//! timers are served as histograms), `scale`, `action` (`map` or `drop`)
//! and `help`. Globs are tried first, in file order, then regular
//! expressions, in file order, as statsd_exporter does; the first that
//! matches the name and the statistic's type wins. A name nothing matches
//! is served with every character outside `[a-zA-Z0-9_:]` as `_`. Anything
//! else in the file (`defaults`, `buckets`, `quantiles`, `ttl`, summaries,
//! other match types) is refused when the file is loaded, naming it.

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde::Deserialize;

/// Envoy Gateway's mapping (`statsd_conf.yaml`, which it mounts at
/// `PROMETHEUS_MAPPER_YAML`): the one used when none is given.
pub const DEFAULT_MAPPING: &str = include_str!("default_statsd_mapping.yaml");

/// The kind of statistic a name is sent as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatKind {
    Counter,
    Gauge,
    /// A timer (`|ms`): an observation.
    Observer,
}

/// Where one statistic is served: its Prometheus name and labels, and
/// the factor its observations are scaled by.
#[derive(Debug, Clone, PartialEq)]
pub struct Mapped {
    pub name: String,
    /// Sorted by label name.
    pub labels: Vec<(String, String)>,
    pub scale: f64,
    pub help: Option<String>,
}

/// A loaded mapping file.
#[derive(Debug)]
pub struct Mapping {
    /// Globs first, then regular expressions, each in file order.
    rules: Vec<Rule>,
}

#[derive(Debug)]
struct Rule {
    regex: Regex,
    name: String,
    labels: Vec<(String, String)>,
    kind: Option<StatKind>,
    scale: f64,
    drop: bool,
    help: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    mappings: Vec<MappingEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MappingEntry {
    #[serde(rename = "match")]
    pattern: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    match_type: Option<String>,
    #[serde(default)]
    match_metric_type: Option<String>,
    #[serde(default)]
    timer_type: Option<String>,
    #[serde(default)]
    observer_type: Option<String>,
    #[serde(default)]
    scale: Option<f64>,
    #[serde(default)]
    action: Option<String>,
    #[serde(default)]
    help: Option<String>,
}

impl Mapping {
    /// [`DEFAULT_MAPPING`].
    pub fn envoy_gateway() -> Mapping {
        Mapping::parse(DEFAULT_MAPPING).expect("the built-in mapping is valid")
    }

    /// The mapping file at `path`.
    pub fn load(path: &Path) -> Result<Mapping, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|err| format!("{}: cannot read the mapping file: {err}", path.display()))?;
        Mapping::parse(&text).map_err(|err| format!("{}: {err}", path.display()))
    }

    /// A mapping from the text of its file.
    pub fn parse(text: &str) -> Result<Mapping, String> {
        let file: File = serde_yaml_ng::from_str(text).map_err(|err| {
            format!(
                "not a mapping file this service can use (unsupported features are refused): {err}"
            )
        })?;
        let mut globs = Vec::new();
        let mut regexes = Vec::new();
        for (idx, entry) in file.mappings.into_iter().enumerate() {
            let at = format!("mapping {} ({:?})", idx + 1, entry.pattern);
            let (rule, is_glob) = rule(entry).map_err(|err| format!("{at}: {err}"))?;
            if is_glob {
                globs.push(rule);
            } else {
                regexes.push(rule);
            }
        }
        globs.extend(regexes);
        Ok(Mapping { rules: globs })
    }

    /// Where the statistic `name` of kind `kind` is served; `None` when a
    /// `drop` mapping matches it.
    pub fn map(&self, name: &str, kind: StatKind) -> Option<Mapped> {
        for rule in &self.rules {
            if rule.kind.is_some_and(|it| it != kind) {
                continue;
            }
            let Some(captures) = rule.regex.captures(name) else {
                continue;
            };
            if rule.drop {
                return None;
            }
            let expand = |template: &str| {
                let mut out = String::new();
                captures.expand(template, &mut out);
                out
            };
            let mut labels: Vec<(String, String)> = rule
                .labels
                .iter()
                .map(|(label, value)| (label.clone(), expand(value)))
                .collect();
            labels.sort();
            return Some(Mapped {
                name: expand(&rule.name),
                labels,
                scale: rule.scale,
                help: rule.help.clone(),
            });
        }
        Some(Mapped {
            name: escape_name(name),
            labels: Vec::new(),
            scale: 1.0,
            help: None,
        })
    }
}

/// One entry as a rule, and whether it is a glob.
fn rule(entry: MappingEntry) -> Result<(Rule, bool), String> {
    let is_glob = match entry.match_type.as_deref() {
        None | Some("" | "glob") => true,
        Some("regex") => false,
        Some(other) => {
            return Err(format!(
                "match_type {other:?} is not supported (glob, regex)"
            ));
        }
    };
    let kind = match entry.match_metric_type.as_deref() {
        None | Some("") => None,
        Some("counter") => Some(StatKind::Counter),
        Some("gauge") => Some(StatKind::Gauge),
        Some("observer" | "timer") => Some(StatKind::Observer),
        Some(other) => {
            return Err(format!(
                "match_metric_type {other:?} is not supported (counter, gauge, observer, timer)"
            ));
        }
    };
    for (field, value) in [
        ("timer_type", &entry.timer_type),
        ("observer_type", &entry.observer_type),
    ] {
        match value.as_deref() {
            None | Some("" | "histogram") => {}
            Some(other) => {
                return Err(format!(
                    "{field} {other:?} is not supported: timers are served as histograms"
                ));
            }
        }
    }
    let drop = match entry.action.as_deref() {
        None | Some("" | "map") => false,
        Some("drop") => true,
        Some(other) => return Err(format!("action {other:?} is not supported (map, drop)")),
    };
    let scale = entry.scale.unwrap_or(1.0);
    if !scale.is_finite() || scale <= 0.0 {
        return Err(format!("scale {scale} is not a positive number"));
    }
    let source = if is_glob {
        glob_regex(&entry.pattern)?
    } else {
        entry.pattern.clone()
    };
    let regex = Regex::new(&source).map_err(|err| format!("match is not usable: {err}"))?;
    let name = match entry.name {
        Some(name) if !name.is_empty() => name,
        _ if drop => String::new(),
        _ => return Err("a mapping needs a name".to_owned()),
    };
    if !drop {
        check_template(&name, "name", &regex)?;
        if !valid_name(&strip_references(&name)) {
            return Err(format!("name {name:?} is not a Prometheus metric name"));
        }
    }
    for (label, value) in &entry.labels {
        if !valid_name(label) || label.contains(':') || label.starts_with("__") {
            return Err(format!("label {label:?} is not a Prometheus label name"));
        }
        check_template(value, "label value", &regex)?;
    }
    let rule = Rule {
        regex,
        name,
        labels: entry.labels.into_iter().collect(),
        kind,
        scale,
        drop,
        help: entry.help,
    };
    Ok((rule, is_glob))
}

/// A glob as an anchored regular expression: `*` is `([^.]*)`, anything
/// else literal. Only letters, digits, `_`, `-`, `.`, `:` and `*` may
/// appear, as in statsd_exporter's globs.
fn glob_regex(glob: &str) -> Result<String, String> {
    if glob.is_empty() {
        return Err("an empty match".to_owned());
    }
    let mut out = String::from("^");
    for ch in glob.chars() {
        match ch {
            '*' => out.push_str("([^.]*)"),
            ch if ch.is_ascii_alphanumeric() || matches!(ch, '_' | '-' | '.' | ':') => {
                out.push_str(&regex::escape(ch.encode_utf8(&mut [0; 4])));
            }
            other => {
                return Err(format!(
                    "{other:?} in a glob match is not supported (a regex match may use it)"
                ));
            }
        }
    }
    out.push('$');
    Ok(out)
}

/// Refuses a `$` reference to a group the match does not have, and a `$`
/// not followed by a group number or `{number}` (`$$` is a dollar).
fn check_template(template: &str, what: &str, regex: &Regex) -> Result<(), String> {
    let groups = regex.captures_len() - 1;
    let mut chars = template.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch != '$' {
            continue;
        }
        let braced = chars.peek() == Some(&'{');
        if chars.peek() == Some(&'$') {
            chars.next();
            continue;
        }
        if braced {
            chars.next();
        }
        let mut digits = String::new();
        while let Some(d) = chars.peek().filter(|it| it.is_ascii_digit()) {
            digits.push(*d);
            chars.next();
        }
        if braced && chars.next() != Some('}') {
            return Err(format!(
                "{what} {template:?}: a reference must be ${{number}}"
            ));
        }
        if !braced
            && chars
                .peek()
                .is_some_and(|it| it.is_alphanumeric() || *it == '_')
        {
            return Err(format!(
                "{what} {template:?}: write ${{n}} when a reference is followed by a letter, digit or _"
            ));
        }
        match digits.parse::<usize>() {
            Ok(n) if (1..=groups).contains(&n) => {}
            _ => {
                return Err(format!(
                    "{what} {template:?}: references go from $1 to ${groups}"
                ));
            }
        }
    }
    Ok(())
}

/// `template` with every `$n`/`${n}` reference removed, to check the rest
/// of a name.
fn strip_references(template: &str) -> String {
    let mut out = String::new();
    let mut chars = template.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch != '$' {
            out.push(ch);
            continue;
        }
        out.push('x');
        if chars.peek() == Some(&'{') {
            for it in chars.by_ref() {
                if it == '}' {
                    break;
                }
            }
        } else {
            while chars
                .next_if(|it| it.is_ascii_digit() || *it == '$')
                .is_some()
            {}
        }
    }
    out
}

/// A Prometheus metric (or label) name: `[a-zA-Z_:][a-zA-Z0-9_:]*`.
fn valid_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|it| it.is_ascii_alphabetic() || it == '_' || it == ':')
        && chars.all(|it| it.is_ascii_alphanumeric() || it == '_' || it == ':')
}

/// A statistic name as statsd_exporter serves one no mapping matches.
fn escape_name(name: &str) -> String {
    let mut out: String = name
        .chars()
        .map(|it| {
            if it.is_ascii_alphanumeric() || it == '_' || it == ':' {
                it
            } else {
                '_'
            }
        })
        .collect();
    if out.starts_with(|it: char| it.is_ascii_digit()) {
        out.insert(0, '_');
    }
    out
}

#[cfg(test)]
mod tests;
