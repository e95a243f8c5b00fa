//! YAML rate-limit config (envoyproxy/ratelimit's format plus extensions) loaded and validated into [`RuleSet`](crate::rules::RuleSet).
//!
//! Two layers: the file is parsed into a generic YAML tree (syntax errors
//! carry a line and column), then walked by hand into `rules` types. The
//! walk goes on after a problem so that one pass reports every problem of
//! every file; messages use envoyproxy/ratelimit's wording where it has one.
//!
//! Deliberate differences from envoyproxy/ratelimit, all stricter:
//! - keys are checked per level (a `unit` directly on a descriptor is an
//!   error, where envoyproxy silently ignores it);
//! - `*` makes a wildcard only in `value`; the pattern is matched against the
//!   entry's value, never across the key.

pub mod reload;

use std::collections::{BTreeMap, HashSet};
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_yaml_ng::{Mapping, Value};

use crate::algorithms::{Algorithm, LimitParams};
use crate::rules::{Domain, LevelIndex, Node, NodeLimits, RateLimit, RuleSet, Unit, ValueMatcher};

pub use crate::rules::DEFAULT_MAX_LOG_ENTRIES;

/// How to load a config. Deliberately no `Default`: callers say what they
/// want (it comes from the command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Merge files that name the same domain instead of refusing them.
    pub merge_domains: bool,
    /// Algorithm of limits where neither the limit nor its file names one.
    pub default_algorithm: Algorithm,
    /// Most requests per window of a sliding-window log (it keeps one
    /// entry per request): a limit over it that inherits the log uses the
    /// sliding-window counter, one that names the log is refused.
    pub max_log_entries: u32,
}

/// A validated config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub rules: RuleSet,
    /// Things worth an operator's attention that do not make the config
    /// invalid, each `<file>: <message>`; the caller logs or prints them.
    pub warnings: Vec<String>,
    /// The files read, in load order (empty for [`parse_str`]).
    pub files: Vec<PathBuf>,
}

/// Why a config was refused: every problem found, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub problems: Vec<Problem>,
}

/// One reason a config was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file as named to the loader.
    pub file: String,
    /// What is wrong (syntax errors include the line and column).
    pub message: String,
    /// Where in the YAML tree, such as `descriptors[0].rate_limit`; empty
    /// when the problem concerns the whole file.
    pub path: String,
    /// Line and column in the file: of the syntax error, or of the deepest
    /// part of `path` that exists (an unknown key points at the key, a
    /// missing one at the mapping that lacks it).
    pub location: Option<Location>,
}

/// A position in a file, both 1-based.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

/// `<file>: <message>`, exactly as envoyproxy/ratelimit words it where it
/// has a message for the case. The alternate form (`{:#}`), for people,
/// adds the position and the YAML path, as in
/// `a.yaml:5:5: config error, unknown key 'ratelimit' (at descriptors[0].ratelimit)`.
impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let (true, Some(location)) = (f.alternate(), self.location) {
            write!(f, ":{}:{}", location.line, location.column)?;
        }
        write!(f, ": {}", self.message)?;
        if f.alternate() && !self.path.is_empty() {
            write!(f, " (at {})", self.path)?;
        }
        Ok(())
    }
}

/// One problem per line; `{:#}` uses each problem's alternate form.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (idx, problem) in self.problems.iter().enumerate() {
            if idx > 0 {
                f.write_char('\n')?;
            }
            if f.alternate() {
                write!(f, "{problem:#}")?;
            } else {
                write!(f, "{problem}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

/// Loads `path`: a YAML file, or a directory whose `*.yaml`/`*.yml` files
/// are loaded in path order. In a directory, entries whose name starts with
/// `.` are skipped, files and directories alike, so a Kubernetes ConfigMap
/// mount (`..data` and its timestamped target) loads each file once.
/// Subdirectories are loaded too, as envoyproxy/ratelimit's runtime
/// directory is; symlinks to files are followed, symlinks to directories
/// are not (loops cannot happen). No files at all is a valid, empty config.
pub fn load(path: &Path, options: &LoadOptions) -> Result<Loaded, Error> {
    let mut files = Vec::new();
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => collect_dir(path, &mut files, &mut problems, &mut warnings),
        Ok(_) => files.push(path.to_path_buf()),
        Err(err) => problems.push(file_problem(
            &path.display().to_string(),
            format!("error reading config: {err}"),
        )),
    }
    let mut parsed = Vec::new();
    for file in &files {
        let name = file.display().to_string();
        match std::fs::read_to_string(file) {
            Ok(text) => parsed.push(parse_file(
                &name,
                &text,
                options,
                &mut problems,
                &mut warnings,
            )),
            Err(err) => problems.push(file_problem(
                &name,
                format!("error reading config file: {err}"),
            )),
        }
    }
    let rules = assemble(
        parsed.into_iter().flatten().collect(),
        options,
        &mut problems,
    );
    if problems.is_empty() {
        Ok(Loaded {
            rules,
            warnings,
            files,
        })
    } else {
        Err(Error { problems })
    }
}

/// Parses one file's text; `file_name` names it in messages.
pub fn parse_str(file_name: &str, yaml: &str, options: &LoadOptions) -> Result<Loaded, Error> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let parsed = parse_file(file_name, yaml, options, &mut problems, &mut warnings);
    let rules = assemble(parsed.into_iter().collect(), options, &mut problems);
    if problems.is_empty() {
        Ok(Loaded {
            rules,
            warnings,
            files: Vec::new(),
        })
    } else {
        Err(Error { problems })
    }
}

/// What `check-config` prints and `/rlconfig` shows: each domain (sorted by
/// name) with each rule path in config order, its limits and flags, e.g.
///
/// ```text
/// domain api (default algorithm sliding_window_log)
///   remote_address  10/second sliding_window_log
///   tenant.path_/expensive  10/minute sliding_window_log name=x replaces=premium  [shadow]
/// ```
pub fn summary(rules: &RuleSet) -> String {
    let mut out = String::new();
    if rules.domains.is_empty() {
        out.push_str("no domains configured\n");
        return out;
    }
    let mut names: Vec<&Arc<str>> = rules.domains.keys().collect();
    names.sort();
    for name in names {
        let domain = &rules.domains[name];
        let _ = writeln!(
            out,
            "domain {} (default algorithm {})",
            domain.name, domain.default_algorithm
        );
        if domain.children.is_empty() {
            out.push_str("  (no rules)\n");
        }
        for node in &domain.children {
            summarize_node(node, rules.max_log_entries, &mut out);
        }
    }
    out
}

fn summarize_node(node: &Node, max_log_entries: u32, out: &mut String) {
    let _ = write!(out, "  {}  ", node.path);
    match &node.limits {
        NodeLimits::None => out.push_str("(no limit)"),
        NodeLimits::Unlimited { name, replaces } => {
            out.push_str("unlimited");
            write_name_replaces(out, name.as_deref(), replaces);
        }
        NodeLimits::Limited(limits) => {
            for (idx, limit) in limits.iter().enumerate() {
                if idx > 0 {
                    out.push_str("; ");
                }
                let _ = write!(out, "{}/", limit.requests_per_unit);
                if limit.unit_multiplier > 1 {
                    let _ = write!(out, "{} {}s", limit.unit_multiplier, limit.unit.name());
                } else {
                    out.push_str(limit.unit.name());
                }
                let _ = write!(out, " {}", limit.algorithm());
                if limit.log_capped {
                    let _ = write!(
                        out,
                        " (not sliding_window_log: over --max-log-entries {max_log_entries})"
                    );
                }
                if limit.algorithm().has_burst() && limit.params.capacity() != limit.params.limit()
                {
                    let _ = write!(out, " burst={}", limit.params.capacity());
                }
                write_name_replaces(out, limit.name.as_deref(), &limit.replaces);
            }
        }
    }
    let flags: Vec<&str> = [
        (node.shadow_mode, "shadow"),
        (node.quota_mode, "quota"),
        (node.share_threshold, "share_threshold"),
        (node.detailed_metric, "detailed_metric"),
        (node.value_to_metric, "value_to_metric"),
    ]
    .into_iter()
    .filter_map(|(on, flag)| on.then_some(flag))
    .collect();
    if !flags.is_empty() {
        let _ = write!(out, "  [{}]", flags.join(", "));
    }
    out.push('\n');
    for child in &node.children {
        summarize_node(child, max_log_entries, out);
    }
}

fn write_name_replaces(out: &mut String, name: Option<&str>, replaces: &[Arc<str>]) {
    if let Some(name) = name {
        let _ = write!(out, " name={name}");
    }
    if !replaces.is_empty() {
        let names: Vec<&str> = replaces.iter().map(|it| &**it).collect();
        let _ = write!(out, " replaces={}", names.join(","));
    }
}

// === loading ===

fn collect_dir(
    dir: &Path,
    files: &mut Vec<PathBuf>,
    problems: &mut Vec<Problem>,
    warnings: &mut Vec<String>,
) {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(err) => {
            problems.push(file_problem(
                &dir.display().to_string(),
                format!("error reading config directory: {err}"),
            ));
            return;
        }
    };
    for path in config_entries(entries) {
        let Ok(link_meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if link_meta.is_dir() {
            collect_dir(&path, files, problems, warnings);
            continue;
        }
        match std::fs::metadata(&path) {
            Ok(meta) if meta.is_file() => files.push(path),
            Ok(_) => {}
            // A ConfigMap key being removed leaves its symlink dangling for
            // a moment after `..data` moves on; the file is gone, not broken.
            Err(_) if link_meta.is_symlink() => warnings.push(format!(
                "{}: skipping a symlink whose target does not exist",
                path.display()
            )),
            Err(err) => problems.push(file_problem(
                &path.display().to_string(),
                format!("error reading config file: {err}"),
            )),
        }
    }
}

/// One file's rules before domains are assembled.
struct FileRules {
    file: String,
    domain: Arc<str>,
    /// Where `domain` is written, for a duplicate-domain message.
    domain_location: Option<Location>,
    default_algorithm: Option<Algorithm>,
    nodes: Vec<Node>,
}

fn file_problem(file: &str, message: String) -> Problem {
    Problem {
        file: file.to_owned(),
        message,
        path: String::new(),
        location: None,
    }
}

/// Builds the rule set from parsed files, refusing duplicate domains unless
/// merging, and duplicate top-level descriptors when merging.
fn assemble(files: Vec<FileRules>, options: &LoadOptions, problems: &mut Vec<Problem>) -> RuleSet {
    let mut domains: BTreeMap<Arc<str>, (Domain, Option<Algorithm>, String)> = BTreeMap::new();
    for file in files {
        let Some((domain, file_default, first_file)) = domains.get_mut(&file.domain) else {
            let domain = Domain {
                name: file.domain.clone(),
                default_algorithm: file.default_algorithm.unwrap_or(options.default_algorithm),
                index: LevelIndex::default(),
                children: file.nodes,
            };
            domains.insert(file.domain, (domain, file.default_algorithm, file.file));
            continue;
        };
        if !options.merge_domains {
            problems.push(Problem {
                path: "domain".to_owned(),
                location: file.domain_location,
                ..file_problem(
                    &file.file,
                    format!("duplicate domain '{}' in config file", file.domain),
                )
            });
            continue;
        }
        match (*file_default, file.default_algorithm) {
            (Some(before), Some(now)) if before != now => problems.push(Problem {
                file: file.file.clone(),
                message: format!(
                    "default_algorithm '{now}' conflicts with '{before}' set for domain '{}' in {first_file}",
                    file.domain
                ),
                path: "default_algorithm".to_owned(),
                location: None,
            }),
            (None, Some(now)) => {
                *file_default = Some(now);
                domain.default_algorithm = now;
            }
            _ => {}
        }
        for node in file.nodes {
            let clash = domain
                .children
                .iter()
                .any(|it| it.key == node.key && it.value == node.value);
            if clash {
                problems.push(file_problem(
                    &file.file,
                    format!(
                        "duplicate descriptor composite key '{}.{}'",
                        file.domain, node.path
                    ),
                ));
            } else {
                domain.children.push(node);
            }
        }
    }
    let domains = domains
        .into_iter()
        .map(|(name, (domain, _, _))| {
            let domain = Domain::new(domain.name, domain.default_algorithm, domain.children);
            (name, domain)
        })
        .collect();
    RuleSet {
        domains,
        max_log_entries: options.max_log_entries,
    }
}

// === one file ===

const TOP_KEYS: &[&str] = &["domain", "descriptors", "default_algorithm"];
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
];
const REPLACES_KEYS: &[&str] = &["name"];

/// The state of one file's walk.
struct Walk<'a> {
    file: &'a str,
    domain: String,
    default_algorithm: Algorithm,
    max_log_entries: u32,
    problems: &'a mut Vec<Problem>,
    warnings: &'a mut Vec<String>,
}

fn parse_file(
    file: &str,
    text: &str,
    options: &LoadOptions,
    problems: &mut Vec<Problem>,
    warnings: &mut Vec<String>,
) -> Option<FileRules> {
    let mut root: Value = match serde_yaml_ng::from_str(text) {
        Ok(root) => root,
        Err(err) => {
            problems.push(Problem {
                location: err.location().map(|it| Location {
                    line: it.line(),
                    column: it.column(),
                }),
                ..file_problem(file, format!("error loading config file: {err}"))
            });
            return None;
        }
    };
    if let Err(err) = root.apply_merge() {
        problems.push(file_problem(
            file,
            format!("error loading config file: {err}"),
        ));
        return None;
    }
    let empty = Mapping::new();
    let top = match &root {
        // An empty file has no domain, as in envoyproxy/ratelimit.
        Value::Null => &empty,
        Value::Mapping(map) => map,
        _ => {
            problems.push(file_problem(
                file,
                "error loading config file: the top level must be a mapping".to_owned(),
            ));
            return None;
        }
    };
    let before = problems.len();
    let mut walk = Walk {
        file,
        domain: String::new(),
        default_algorithm: options.default_algorithm,
        max_log_entries: options.max_log_entries,
        problems,
        warnings,
    };
    walk.check_keys(top, TOP_KEYS, "", "the top level");
    let domain = walk.string(top, "domain", "").unwrap_or_default();
    if domain.is_empty() {
        walk.problem("", "config file cannot have empty domain".to_owned());
    }
    walk.domain = domain.clone();
    let file_default = walk.algorithm(top, "default_algorithm", "");
    if let Some(algorithm) = file_default {
        walk.default_algorithm = algorithm;
    }
    let nodes = walk.nodes(get(top, "descriptors"), "", "descriptors");
    if problems.len() != before {
        // Positions cost a re-parse each, paid only on the error path.
        for problem in &mut problems[before..] {
            if !problem.path.is_empty() {
                problem.location = position::locate(text, &problem.path);
            }
        }
        return None;
    }
    Some(FileRules {
        file: file.to_owned(),
        domain_location: position::locate(text, "domain"),
        domain: domain.into(),
        default_algorithm: file_default,
        nodes,
    })
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

/// A limit as written, before it joins its node.
enum LimitSpec {
    Unlimited {
        name: Option<Arc<str>>,
        replaces: Vec<Arc<str>>,
    },
    Limited(RateLimit),
}

impl Walk<'_> {
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

    /// One level of descriptors below the node at `parent` (its rule path).
    fn nodes(&mut self, list: Option<&Value>, parent: &str, path: &str) -> Vec<Node> {
        let mut nodes: Vec<Node> = Vec::new();
        let mut seen: HashSet<Arc<str>> = HashSet::new();
        for (map, item_path) in self.list(list, path) {
            let Some(node) = self.node(map, parent, &item_path) else {
                continue;
            };
            // The level-local part of the path is envoyproxy's composite key.
            let segment: Arc<str> = node.path[node.path.len() - segment_len(&node)..].into();
            if !seen.insert(segment) {
                let message = format!(
                    "duplicate descriptor composite key '{}.{}'",
                    self.domain, node.path
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
        // An empty value is no value, as in envoyproxy/ratelimit.
        let value = self.string(map, "value", path).unwrap_or_default();
        let segment = if value.is_empty() {
            key.clone()
        } else {
            format!("{key}_{value}")
        };
        let rule_path = if parent.is_empty() {
            segment.clone()
        } else {
            format!("{parent}.{segment}")
        };
        let value = if value.is_empty() {
            ValueMatcher::Any
        } else if value.contains('*') {
            ValueMatcher::Wildcard(value.into())
        } else {
            ValueMatcher::Exact(value.into())
        };

        let shadow_mode = self.flag(map, "shadow_mode", path);
        let quota_mode = self.flag(map, "quota_mode", path);
        let detailed_metric = self.flag(map, "detailed_metric", path);
        let value_to_metric = self.flag(map, "value_to_metric", path);
        let share_threshold = self.flag(map, "share_threshold", path);
        if share_threshold && !matches!(value, ValueMatcher::Wildcard(_)) {
            self.problem(
                &join(path, "share_threshold"),
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{segment}'"
                ),
            );
        }
        let composite = format!("{}.{rule_path}", self.domain);
        let limits = self.node_limits(map, path, &composite);
        let children = self.nodes(
            get(map, "descriptors"),
            &rule_path,
            &join(path, "descriptors"),
        );
        Some(Node {
            key: key.into(),
            value,
            limits,
            shadow_mode,
            quota_mode,
            share_threshold,
            detailed_metric,
            value_to_metric,
            path: rule_path.into(),
            index: LevelIndex::new(&children),
            children,
        })
    }

    fn node_limits(&mut self, map: &Mapping, path: &str, composite: &str) -> NodeLimits {
        let single = get(map, "rate_limit");
        let several = get(map, "rate_limits");
        let mut specs = Vec::new();
        match (single, several) {
            (Some(_), Some(_)) => {
                self.problem(
                    path,
                    format!("descriptor '{composite}' cannot have both rate_limit and rate_limits"),
                );
                return NodeLimits::None;
            }
            (Some(value), None) => {
                let limit_path = join(path, "rate_limit");
                if let Some(limit) = self.mapping(value, &limit_path) {
                    specs.extend(self.limit(limit, &limit_path, composite));
                }
            }
            (None, Some(value)) => {
                let list_path = join(path, "rate_limits");
                for (limit, limit_path) in self.list(Some(value), &list_path) {
                    specs.extend(self.limit(limit, &limit_path, composite));
                }
            }
            (None, None) => return NodeLimits::None,
        }
        let n_unlimited = specs
            .iter()
            .filter(|it| matches!(it, LimitSpec::Unlimited { .. }))
            .count();
        if n_unlimited > 0 && specs.len() > 1 {
            self.problem(
                &join(path, "rate_limits"),
                format!(
                    "descriptor '{composite}': an unlimited limit cannot be combined with other limits"
                ),
            );
            return NodeLimits::None;
        }
        let mut limits = Vec::with_capacity(specs.len());
        for spec in specs {
            match spec {
                LimitSpec::Unlimited { name, replaces } => {
                    return NodeLimits::Unlimited { name, replaces };
                }
                LimitSpec::Limited(limit) => limits.push(limit),
            }
        }
        for (idx, limit) in limits.iter().enumerate() {
            let clash = limits[..idx].iter().any(|earlier| {
                earlier.window_seconds() == limit.window_seconds()
                    && earlier.algorithm() == limit.algorithm()
            });
            if clash {
                self.problem(
                    &format!("{path}.rate_limits[{idx}]"),
                    format!(
                        "descriptor '{composite}': two limits with the same window ({}s) and algorithm ({}) would share one counter",
                        limit.window_seconds(),
                        limit.algorithm()
                    ),
                );
            }
        }
        if limits.is_empty() {
            NodeLimits::None
        } else {
            NodeLimits::Limited(limits)
        }
    }

    /// One `rate_limit` mapping; `None` when it is invalid (reported).
    fn limit(&mut self, map: &Mapping, path: &str, composite: &str) -> Option<LimitSpec> {
        let before = self.problems.len();
        self.check_keys(map, LIMIT_KEYS, path, "a rate_limit");
        let unlimited = self.flag(map, "unlimited", path);
        let unit_text = self.string(map, "unit", path);
        let unit = unit_text.as_deref().and_then(Unit::from_name);
        let requests_per_unit = self.integer(map, "requests_per_unit", path);
        let name = self
            .string(map, "name", path)
            .filter(|it| !it.is_empty())
            .map(Arc::<str>::from);
        let algorithm = self.algorithm(map, "algorithm", path);
        let burst = self.integer(map, "burst", path);
        let unit_multiplier = self.integer(map, "unit_multiplier", path);

        let mut replaces = Vec::new();
        let replaces_path = join(path, "replaces");
        for (entry, entry_path) in self.list(get(map, "replaces"), &replaces_path) {
            self.check_keys(entry, REPLACES_KEYS, &entry_path, "a replaces entry");
            let replaced = self.string(entry, "name", &entry_path).unwrap_or_default();
            if replaced.is_empty() {
                self.problem(
                    &entry_path,
                    "should not have an empty replaces entry".to_owned(),
                );
            } else if name.as_deref() == Some(replaced.as_str()) {
                self.problem(
                    &entry_path,
                    "replaces should not contain name of same descriptor".to_owned(),
                );
            } else {
                replaces.push(Arc::<str>::from(replaced));
            }
        }

        if unlimited {
            if unit.is_some() {
                self.problem(
                    &join(path, "unit"),
                    "should not specify rate limit unit when unlimited".to_owned(),
                );
            } else if let Some(text) = &unit_text {
                // envoyproxy/ratelimit accepts (and ignores) an invalid unit here.
                self.warn(format!(
                    "descriptor '{composite}': unit '{text}' is ignored on an unlimited limit"
                ));
            }
            for (field, present) in [
                ("algorithm", algorithm.is_some()),
                ("burst", burst.is_some()),
                ("unit_multiplier", unit_multiplier.is_some()),
            ] {
                if present {
                    self.problem(
                        &join(path, field),
                        format!("should not specify {field} when unlimited"),
                    );
                }
            }
            return (self.problems.len() == before)
                .then_some(LimitSpec::Unlimited { name, replaces });
        }

        let Some(unit) = unit else {
            self.problem(
                &join(path, "unit"),
                format!(
                    "invalid rate limit unit '{}'",
                    unit_text.unwrap_or_default()
                ),
            );
            return None;
        };
        let named = algorithm.is_some();
        let algorithm = algorithm.unwrap_or(self.default_algorithm);
        if let Some(burst) = burst {
            if burst < 1 {
                self.problem(
                    &join(path, "burst"),
                    format!("descriptor '{composite}': burst must be at least 1"),
                );
            } else if !algorithm.has_burst() {
                self.problem(
                    &join(path, "burst"),
                    format!(
                        "descriptor '{composite}': burst applies only to token_bucket and gcra, not {algorithm}"
                    ),
                );
            }
        }
        let unit_multiplier = unit_multiplier.unwrap_or(1);
        if unit_multiplier < 1 {
            self.problem(
                &join(path, "unit_multiplier"),
                format!("descriptor '{composite}': unit_multiplier must be at least 1"),
            );
        }
        if self.problems.len() != before {
            return None;
        }
        let requests_per_unit = requests_per_unit.unwrap_or_else(|| {
            // envoyproxy/ratelimit reads an absent number as 0, which blocks
            // everything: keep the meaning, but say so.
            self.warn(format!(
                "descriptor '{composite}': requests_per_unit is absent, so 0: every request is denied"
            ));
            0
        });
        let Some(window_us) = unit
            .seconds()
            .checked_mul(u64::from(unit_multiplier))
            .and_then(|it| it.checked_mul(1_000_000))
        else {
            self.problem(
                &join(path, "unit_multiplier"),
                format!("descriptor '{composite}': unit_multiplier {unit_multiplier} makes the window too long"),
            );
            return None;
        };
        // A sliding log keeps one entry per request of its window (in Redis,
        // one sorted-set member per unit of cost): its number bounds the
        // memory of every key.
        let cap = self.max_log_entries;
        let log_capped = algorithm == Algorithm::SlidingWindowLog && requests_per_unit > cap;
        if log_capped && named {
            self.problem(
                &join(path, "algorithm"),
                format!(
                    "descriptor '{composite}': sliding_window_log with {requests_per_unit} per window is over the cap of {cap} entries per key (--max-log-entries); use sliding_window_counter or gcra, or raise the cap"
                ),
            );
            return None;
        }
        let algorithm = if log_capped {
            Algorithm::SlidingWindowCounter
        } else {
            algorithm
        };
        let params = match LimitParams::new(
            algorithm,
            u64::from(requests_per_unit),
            window_us,
            burst.map(u64::from),
        ) {
            Ok(params) => params,
            Err(err) if log_capped => {
                self.problem(
                    path,
                    format!(
                        "descriptor '{composite}': {requests_per_unit} per window is over the sliding_window_log cap of {cap} entries per key (--max-log-entries), and {err}"
                    ),
                );
                return None;
            }
            Err(err) => {
                self.problem(path, format!("descriptor '{composite}': {err}"));
                return None;
            }
        };
        if log_capped {
            self.warn(format!(
                "descriptor '{composite}': {requests_per_unit} per window is over the sliding_window_log cap of {cap} entries per key (--max-log-entries): using sliding_window_counter; name an algorithm to choose another"
            ));
        }
        Some(LimitSpec::Limited(RateLimit {
            unit,
            unit_multiplier,
            requests_per_unit,
            name,
            replaces,
            params,
            log_capped,
        }))
    }
}

/// The last key of a YAML path, for messages.
fn last_segment(path: &str) -> &str {
    path.rsplit('.').next().unwrap_or(path)
}

/// Length of the node's own `key` or `key_value` at the end of its path.
fn segment_len(node: &Node) -> usize {
    match &node.value {
        ValueMatcher::Any => node.key.len(),
        ValueMatcher::Exact(value) | ValueMatcher::Wildcard(value) => {
            node.key.len() + 1 + value.len()
        }
    }
}

/// Finds where a YAML path is written, by re-reading the file with a
/// deserializer that fails on purpose at the path's deepest existing node:
/// serde_yaml_ng stamps an error with the position of the node being read,
/// and the generic tree has no positions of its own.
mod position {
    use std::fmt;

    use serde::de::{
        self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
    };

    use super::Location;

    #[derive(Debug, Clone, Copy)]
    enum Step<'p> {
        Key(&'p str),
        Index(usize),
    }

    /// Position of `path` (`a.b[2].c`), or of its deepest existing prefix.
    pub(super) fn locate(text: &str, path: &str) -> Option<Location> {
        let mut steps = Vec::new();
        for part in path.split('.') {
            let mut pieces = part.split('[');
            if let Some(key) = pieces.next().filter(|it| !it.is_empty()) {
                steps.push(Step::Key(key));
            }
            for index in pieces {
                steps.push(Step::Index(index.trim_end_matches(']').parse().ok()?));
            }
        }
        let deserializer = serde_yaml_ng::Deserializer::from_str(text);
        match (Seek { steps: &steps }).deserialize(deserializer) {
            Ok(()) => None,
            Err(err) => err.location().map(|it| Location {
                line: it.line(),
                column: it.column(),
            }),
        }
    }

    /// Always fails: at the target, or where the path stops existing.
    struct Seek<'s, 'p> {
        steps: &'s [Step<'p>],
    }

    impl<'de> DeserializeSeed<'de> for Seek<'_, '_> {
        type Value = ();

        fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
            deserializer.deserialize_any(SeekVisitor { steps: self.steps })
        }
    }

    struct SeekVisitor<'s, 'p> {
        steps: &'s [Step<'p>],
    }

    fn here<E: de::Error>() -> E {
        E::custom("here")
    }

    // Every `visit_*` left out fails with the node's position, which is the
    // answer when the path ends there or goes on below a scalar.
    impl<'de> Visitor<'de> for SeekVisitor<'_, '_> {
        type Value = ();

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("the node at the path")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let Some((Step::Key(wanted), rest)) = self.steps.split_first() else {
                return Err(here());
            };
            let at_key = rest.is_empty();
            while let Some(found) = map.next_key_seed(KeySeed { wanted, at_key })? {
                if found {
                    return map.next_value_seed(Seek { steps: rest });
                }
                map.next_value::<IgnoredAny>()?;
            }
            Err(here())
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let Some((Step::Index(index), rest)) = self.steps.split_first() else {
                return Err(here());
            };
            for _ in 0..*index {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Err(here());
                }
            }
            seq.next_element_seed(Seek { steps: rest })?;
            Err(here())
        }
    }

    /// Reads a mapping key: `true` if it is the wanted one; fails on it
    /// (at the key's position) when the key itself is the target.
    struct KeySeed<'p> {
        wanted: &'p str,
        at_key: bool,
    }

    impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
        type Value = bool;

        fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<bool, D::Error> {
            deserializer.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for KeySeed<'_> {
        type Value = bool;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a mapping key")
        }

        fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
            match (key == self.wanted, self.at_key) {
                (true, true) => Err(here()),
                (found, _) => Ok(found),
            }
        }

        fn visit_bool<E: de::Error>(self, _: bool) -> Result<bool, E> {
            Ok(false)
        }

        fn visit_i64<E: de::Error>(self, _: i64) -> Result<bool, E> {
            Ok(false)
        }

        fn visit_u64<E: de::Error>(self, _: u64) -> Result<bool, E> {
            Ok(false)
        }

        fn visit_f64<E: de::Error>(self, _: f64) -> Result<bool, E> {
            Ok(false)
        }

        fn visit_unit<E: de::Error>(self) -> Result<bool, E> {
            Ok(false)
        }
    }
}

/// The entries of a config directory that are loaded or descended into, in
/// path order: real directories and files named `*.yaml` or `*.yml`.
/// Dot-files and dot-directories are skipped (a Kubernetes ConfigMap's
/// `..data` and `..<timestamp>` among them). The reloader walks the same
/// list, so a change to any other file (a README beside the config) does
/// not reload.
pub(crate) fn config_entries(entries: std::fs::ReadDir) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|entry| {
            let path = entry.path();
            let hidden = path
                .file_name()
                .is_some_and(|name| name.to_string_lossy().starts_with('.'));
            // `file_type` does not follow symlinks: a symlink to a directory
            // is not descended into.
            let is_real_dir = entry.file_type().is_ok_and(|it| it.is_dir());
            !hidden && (is_real_dir || is_yaml_name(&path))
        })
        .map(|entry| entry.path())
        .collect();
    paths.sort();
    paths
}

/// Whether `path` is named like a config file (`*.yaml`, `*.yml`).
fn is_yaml_name(path: &Path) -> bool {
    path.extension()
        .is_some_and(|ext| ext == "yaml" || ext == "yml")
}
