//! Reading config files and directories, and assembling their rules into one rule set.

use std::collections::{BTreeMap, HashSet};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_yaml_ng::{Mapping, Value};

use super::limits;
use super::position::{self, Location};
use super::walk::Walk;
use super::{Error, LoadOptions, Loaded, Problem};
use crate::algorithms::Algorithm;
use crate::rules::{Domain, Node, RuleSet, ValueMatcher};

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
    let mut total: u64 = 0;
    for file in &files {
        let name = file.display().to_string();
        match read_capped(file, options.limits.max_file_bytes) {
            Ok(text) => {
                total = total.saturating_add(text.len() as u64);
                if total > options.limits.max_total_bytes {
                    problems.push(file_problem(
                        &path.display().to_string(),
                        format!(
                            "config files total more than {} bytes (--max-config-bytes), reached at {name}",
                            options.limits.max_total_bytes
                        ),
                    ));
                    break;
                }
                parsed.push(parse_file(
                    &name,
                    &text,
                    options,
                    &mut problems,
                    &mut warnings,
                ));
            }
            Err(message) => problems.push(file_problem(&name, message)),
        }
    }
    let rules = assemble(
        parsed.into_iter().flatten().collect(),
        options,
        &mut problems,
    );
    outcome(rules, warnings, files, problems)
}

/// Parses one file's text; `file_name` names it in messages.
pub fn parse_str(file_name: &str, yaml: &str, options: &LoadOptions) -> Result<Loaded, Error> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let parsed = parse_file(file_name, yaml, options, &mut problems, &mut warnings);
    let rules = assemble(parsed.into_iter().collect(), options, &mut problems);
    outcome(rules, warnings, Vec::new(), problems)
}

/// Loads rules from YAML trees built by the caller rather than parsed from
/// text (the rules a management server sends, `crate::xds` builds them),
/// each named for messages, through the same walk and assembly as files:
/// the same validation, the same messages (without line and column).
pub fn load_trees(trees: Vec<(String, Value)>, options: &LoadOptions) -> Result<Loaded, Error> {
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    let mut parsed = Vec::with_capacity(trees.len());
    for (name, root) in trees {
        let Some(top) = top_mapping(&name, root, &mut problems) else {
            continue;
        };
        let before = problems.len();
        let walked = Walk::new(&name, options, &mut problems, &mut warnings).top(&top);
        if problems.len() == before {
            parsed.push(FileRules {
                domain: walked.domain.into(),
                domain_location: None,
                file: name,
                default_algorithm: walked.default_algorithm,
                bucket_key_order: walked.bucket_key_order,
                nodes: walked.nodes,
            });
        }
    }
    let rules = assemble(parsed, options, &mut problems);
    outcome(rules, warnings, Vec::new(), problems)
}

/// The text of `file`, read no further than `max_bytes` (a special file
/// such as a pipe or `/dev/zero` never ends); the message says why not.
fn read_capped(file: &Path, max_bytes: u64) -> Result<String, String> {
    let mut bytes = Vec::new();
    std::fs::File::open(file)
        .and_then(|it| it.take(max_bytes.saturating_add(1)).read_to_end(&mut bytes))
        .map_err(|err| format!("error reading config file: {err}"))?;
    if bytes.len() as u64 > max_bytes {
        return Err(format!(
            "error reading config file: larger than {max_bytes} bytes (--max-config-file-bytes)"
        ));
    }
    String::from_utf8(bytes)
        .map_err(|_| "error reading config file: stream did not contain valid UTF-8".to_owned())
}

/// The config loaded, or refused whole if anything was wrong.
fn outcome(
    rules: RuleSet,
    warnings: Vec<String>,
    files: Vec<PathBuf>,
    problems: Vec<Problem>,
) -> Result<Loaded, Error> {
    if !problems.is_empty() {
        return Err(Error { problems });
    }
    Ok(Loaded {
        rules,
        warnings,
        files,
    })
}

/// Adds the config files below `dir` to `files`, in path order, reading
/// real subdirectories in place.
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
    bucket_key_order: Option<Vec<Arc<str>>>,
    nodes: Vec<Node>,
}

/// A problem with a whole file (no YAML path, no position).
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
    let mut domains: BTreeMap<Arc<str>, DomainRules> = BTreeMap::new();
    for file in files {
        match domains.get_mut(&file.domain) {
            None => {
                let domain = DomainRules {
                    default_algorithm: file.default_algorithm,
                    bucket_key_order: file.bucket_key_order,
                    first_file: file.file,
                    seen: file.nodes.iter().map(top_segment).collect(),
                    nodes: file.nodes,
                };
                domains.insert(file.domain, domain);
            }
            Some(_) if !options.merge_domains => problems.push(Problem {
                path: "domain".to_owned(),
                location: file.domain_location,
                ..file_problem(
                    &file.file,
                    format!("duplicate domain '{}' in config file", file.domain),
                )
            }),
            Some(domain) => domain.merge(file, problems),
        }
    }
    let max = options.limits.max_descriptors;
    for (name, domain) in &domains {
        let count: usize = domain.nodes.iter().map(count_nodes).sum();
        if count > max {
            problems.push(file_problem(
                &domain.first_file,
                format!(
                    "domain '{name}' has {count} descriptors, more than {max} (--max-config-descriptors)"
                ),
            ));
        }
    }
    let domains = domains.into_iter().map(|(name, domain)| {
        let default_algorithm = domain
            .default_algorithm
            .unwrap_or(options.default_algorithm);
        Domain::new(name, default_algorithm, domain.nodes)
            .with_bucket_key_order(domain.bucket_key_order.unwrap_or_default())
    });
    RuleSet::new(domains, options.max_log_entries)
}

/// `node` and every descriptor below it.
fn count_nodes(node: &Node) -> usize {
    1 + node.children().iter().map(count_nodes).sum::<usize>()
}

/// What makes two top-level descriptors of a domain the same: key and value.
fn top_segment(node: &Node) -> (String, u8, String) {
    let (kind, value) = match node.value() {
        ValueMatcher::Any => (0, ""),
        ValueMatcher::Exact(value) => (1, &**value),
        ValueMatcher::Wildcard(value) => (2, &**value),
    };
    (node.key().to_owned(), kind, value.to_owned())
}

/// One domain's rules while files are assembled.
struct DomainRules {
    /// As named by a file; the first file that names one sets it.
    default_algorithm: Option<Algorithm>,
    /// As named by a file; the first file that names one sets it.
    bucket_key_order: Option<Vec<Arc<str>>>,
    /// The file that first named the domain, for messages.
    first_file: String,
    /// The composite keys of `nodes`, so merging a file costs no pass
    /// over the descriptors already here.
    seen: HashSet<(String, u8, String)>,
    nodes: Vec<Node>,
}

impl DomainRules {
    /// Adds `file`'s rules (same domain) to these, refusing a conflicting
    /// default algorithm and top-level descriptors that are already here.
    fn merge(&mut self, file: FileRules, problems: &mut Vec<Problem>) {
        match (self.default_algorithm, file.default_algorithm) {
            (Some(before), Some(now)) if before != now => problems.push(Problem {
                path: "default_algorithm".to_owned(),
                ..file_problem(
                    &file.file,
                    format!(
                        "default_algorithm '{now}' conflicts with '{before}' set for domain '{}' in {}",
                        file.domain, self.first_file
                    ),
                )
            }),
            (None, Some(now)) => self.default_algorithm = Some(now),
            _ => {}
        }
        match (&self.bucket_key_order, file.bucket_key_order) {
            (Some(before), Some(now)) if *before != now => problems.push(Problem {
                path: "bucket_key_order".to_owned(),
                ..file_problem(
                    &file.file,
                    format!(
                        "bucket_key_order [{}] conflicts with [{}] set for domain '{}' in {}",
                        now.join(", "),
                        before.join(", "),
                        file.domain,
                        self.first_file
                    ),
                )
            }),
            (None, Some(now)) => self.bucket_key_order = Some(now),
            _ => {}
        }
        for node in file.nodes {
            if !self.seen.insert(top_segment(&node)) {
                problems.push(file_problem(
                    &file.file,
                    format!(
                        "duplicate descriptor composite key '{}.{}'",
                        file.domain,
                        node.path()
                    ),
                ));
            } else {
                self.nodes.push(node);
            }
        }
    }
}

/// Parses and walks one file; `None` when it has problems (each reported,
/// with its position).
fn parse_file(
    file: &str,
    text: &str,
    options: &LoadOptions,
    problems: &mut Vec<Problem>,
    warnings: &mut Vec<String>,
) -> Option<FileRules> {
    let top = parse_top(file, text, problems)?;
    let before = problems.len();
    let walked = Walk::new(file, options, problems, warnings).top(&top);
    if problems.len() != before {
        // Positions cost a re-parse each, paid only on the error path, and
        // only for the first problems: a file with thousands of them would
        // otherwise take time quadratic in its size.
        let located = problems.len().min(before + MAX_LOCATED);
        for problem in &mut problems[before..located] {
            if !problem.path.is_empty() {
                problem.location = position::locate(text, &problem.path);
            }
        }
        return None;
    }
    Some(FileRules {
        file: file.to_owned(),
        domain_location: position::locate(text, "domain"),
        domain: walked.domain.into(),
        default_algorithm: walked.default_algorithm,
        bucket_key_order: walked.bucket_key_order,
        nodes: walked.nodes,
    })
}

/// Problems of one file given a line and column; the others keep their
/// YAML path.
const MAX_LOCATED: usize = 10;

/// The file's top-level mapping, merge keys (`<<`) applied; `None` when
/// it is not YAML or not a mapping, or it expands to too many nodes
/// (reported).
fn parse_top(file: &str, text: &str, problems: &mut Vec<Problem>) -> Option<Mapping> {
    if let Err(err) = limits::check_nodes(text) {
        problems.push(file_problem(
            file,
            format!("error loading config file: {err}"),
        ));
        return None;
    }
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
    top_mapping(file, root, problems)
}

/// The top-level mapping of a document; `None` (reported) when it is not one.
fn top_mapping(file: &str, root: Value, problems: &mut Vec<Problem>) -> Option<Mapping> {
    match root {
        // An empty file has no domain, as in envoyproxy/ratelimit.
        Value::Null => Some(Mapping::new()),
        Value::Mapping(map) => Some(map),
        _ => {
            problems.push(file_problem(
                file,
                "error loading config file: the top level must be a mapping".to_owned(),
            ));
            None
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
