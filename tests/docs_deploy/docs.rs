//! The repository's documentation holds: ARCHITECTURE.md's code map names
//! every module folder and top-level file of `src/` and no path that is
//! gone, every link and every repository path a doc names resolves, the
//! flags in docs/configuration.md are the binary's own `--help`, every
//! shell block marked runnable runs, and the README's first calls answer as
//! it shows.
//!
//! `THROTTLEGATE_BLESS=1 cargo test --test docs_deploy docs::` rewrites the flags block of
//! docs/configuration.md from the binary instead of comparing it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::support;
use pulldown_cmark::{CodeBlockKind, Event, Options, Parser, Tag, TagEnd};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir` (relative to the repository), recursively.
fn files_under(dir: &str) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let relative = path.strip_prefix(root).unwrap();
                out.push(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    let root = repo();
    let mut out = Vec::new();
    walk(&root, &root.join(dir), &mut out);
    out.sort();
    out
}

/// The Markdown files of the repository a reader meets: the top-level ones
/// and everything under docs/ and deploy/.
fn markdown_files() -> Vec<String> {
    let mut files: Vec<String> = [
        "README.md",
        "CONTRIBUTING.md",
        "ARCHITECTURE.md",
        "CHANGELOG.md",
    ]
    .into_iter()
    .filter(|f| repo().join(f).exists())
    .map(String::from)
    .collect();
    for dir in ["docs", "deploy"] {
        files.extend(files_under(dir).into_iter().filter(|f| f.ends_with(".md")));
    }
    files
}

/// One entry of ARCHITECTURE.md's code map: a `### ` heading naming one or
/// more paths (a folder written with a trailing `/`), and its text.
struct CodeMapEntry {
    heading: String,
    /// The paths the heading names, as written.
    named: Vec<String>,
    /// The file names the text gives (`batch.rs`, `fuzzing/tests.rs`),
    /// relative to what the heading names.
    files: Vec<String>,
    text: String,
}

/// The inline code spans of `text` (what lies between pairs of backticks).
fn code_spans(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(String::from)
        .collect()
}

/// Whether `span` is a file named relative to an entry's heading: no
/// spaces, no path from the repository's root, a source or data extension.
fn is_relative_file(span: &str) -> bool {
    !span.contains(char::is_whitespace)
        && !looks_like_repo_path(span)
        && [".rs", ".lua", ".yaml"]
            .iter()
            .any(|ext| span.ends_with(ext))
}

/// The entries of the "Code Map" section of ARCHITECTURE.md.
fn code_map() -> Vec<CodeMapEntry> {
    let text = read(&repo().join("ARCHITECTURE.md"));
    let section = text
        .split("\n## Code Map\n")
        .nth(1)
        .expect("ARCHITECTURE.md has a '## Code Map' section");
    let section = section.split("\n## ").next().unwrap();
    section
        .split("\n### ")
        .skip(1)
        .map(|entry| {
            let (heading, body) = entry.split_once('\n').unwrap_or((entry, ""));
            CodeMapEntry {
                heading: heading.to_string(),
                named: code_spans(heading),
                files: code_spans(body)
                    .into_iter()
                    .filter(|span| is_relative_file(span))
                    .collect(),
                text: body.to_string(),
            }
        })
        .collect()
}

/// What the code map must name: every top-level file of `src/`, every
/// folder under `src/` that holds production files itself (unit tests are
/// part of the module they test), and the folders and files around `src/`
/// that hold code. A folder may instead be mapped by its parent's entry
/// ([`mapped_by_parent`]).
fn mappable_paths() -> BTreeSet<String> {
    const OUTSIDE_SRC: [&str; 8] = [
        "build.rs",
        "lua/",
        "proto/",
        "bench/",
        "benches/",
        "examples/",
        "fuzz/",
        "tests/",
    ];
    let mut paths: BTreeSet<String> = OUTSIDE_SRC.iter().map(|it| it.to_string()).collect();
    for file in files_under("src") {
        let (folder, name) = file.rsplit_once('/').unwrap();
        if folder.split('/').any(|part| part == "tests") || name == "tests.rs" {
            continue;
        }
        if folder == "src" {
            paths.insert(file);
        } else {
            paths.insert(format!("{folder}/"));
        }
    }
    paths
}

/// Whether a folder no heading names is mapped by the entry of the
/// folder above it, which names the folder (`cluster/`) or each of its
/// files (`share/fields.rs`).
fn mapped_by_parent(folder: &str, entries: &[CodeMapEntry]) -> bool {
    let folder = folder.trim_end_matches('/');
    let Some((parent, own)) = folder.rsplit_once('/') else {
        return false;
    };
    let files: Vec<String> = files_under(folder)
        .into_iter()
        .filter_map(|file| {
            let name = file.strip_prefix(&format!("{folder}/"))?.to_string();
            (!name.contains('/') && name != "tests.rs").then(|| format!("{own}/{name}"))
        })
        .collect();
    entries
        .iter()
        .filter(|entry| entry.named.contains(&format!("{parent}/")))
        .any(|entry| {
            entry.text.contains(&format!("`{own}/`"))
                || files.iter().all(|file| entry.files.contains(file))
        })
}

#[test]
fn architecture_maps_every_source_folder_and_names_no_path_that_is_gone() {
    let root = repo();
    let entries = code_map();
    let named: BTreeSet<String> = entries.iter().flat_map(|e| e.named.clone()).collect();
    let missing: Vec<String> = mappable_paths()
        .difference(&named)
        .filter(|path| !mapped_by_parent(path, &entries))
        .cloned()
        .collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's code map has no entry naming {missing:?}: name each \
         in a `### ` heading (a folder with a trailing `/`)"
    );
    let mut problems = Vec::new();
    for entry in &entries {
        if entry.named.is_empty() {
            problems.push(format!("`### {}` names no path", entry.heading));
        }
        if !entry.text.to_lowercase().contains("invariant") {
            problems.push(format!("`### {}` states no invariant", entry.heading));
        }
        for path in &entry.named {
            let target = root.join(path.trim_end_matches('/'));
            let exists = if path.ends_with('/') {
                target.is_dir()
            } else {
                target.is_file()
            };
            if !exists {
                problems.push(format!(
                    "`### {}` names `{path}`, which is gone",
                    entry.heading
                ));
            }
        }
        // A file the text names lies in a folder the heading names, or
        // beside a file it names.
        let bases: Vec<PathBuf> = entry
            .named
            .iter()
            .map(|path| {
                let path = root.join(path.trim_end_matches('/'));
                if path.is_dir() {
                    path
                } else {
                    path.parent().unwrap().to_path_buf()
                }
            })
            .collect();
        for file in &entry.files {
            if !bases.iter().any(|base| base.join(file).is_file()) {
                problems.push(format!(
                    "`### {}` names `{file}`, found in none of its paths",
                    entry.heading
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's code map:\n{}",
        problems.join("\n")
    );
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-`
/// and `_` dropped, spaces as `-`.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// One Markdown file read for what the checks need.
struct Doc {
    anchors: BTreeSet<String>,
    /// Link targets, as written.
    links: Vec<String>,
    /// Inline code spans, outside code blocks.
    code_spans: Vec<String>,
    /// The text of each `sh` block preceded by `<!-- runnable -->`.
    runnable: Vec<String>,
    /// Every fenced code block, in order.
    blocks: Vec<Block>,
}

/// A fenced code block and the HTML comment right before it, if any.
#[derive(Clone)]
struct Block {
    /// The comment's text, trimmed (`runnable` for `<!-- runnable -->`).
    mark: Option<String>,
    /// The info string (`sh`, `json`, `text`).
    info: String,
    text: String,
}

fn parse(text: &str) -> Doc {
    let mut doc = Doc {
        anchors: BTreeSet::new(),
        links: Vec::new(),
        code_spans: Vec::new(),
        runnable: Vec::new(),
        blocks: Vec::new(),
    };
    let mut heading: Option<String> = None;
    let mut block: Option<Block> = None;
    let mut mark: Option<String> = None;
    let mut seen = std::collections::BTreeMap::<String, usize>::new();
    for event in Parser::new_ext(text, Options::ENABLE_TABLES) {
        match event {
            Event::Start(Tag::Heading { .. }) => {
                heading = Some(String::new());
            }
            Event::End(TagEnd::Heading(_)) => {
                let base = anchor(&heading.take().unwrap_or_default());
                let n = seen.entry(base.clone()).or_insert(0);
                let name = if *n == 0 {
                    base.clone()
                } else {
                    format!("{base}-{n}")
                };
                *n += 1;
                doc.anchors.insert(name);
            }
            Event::Start(Tag::Link { dest_url, .. })
            | Event::Start(Tag::Image { dest_url, .. }) => {
                doc.links.push(dest_url.to_string());
            }
            Event::Start(Tag::CodeBlock(kind)) => {
                let info = match &kind {
                    CodeBlockKind::Fenced(info) => info.to_string(),
                    CodeBlockKind::Indented => String::new(),
                };
                block = Some(Block {
                    mark: mark.take(),
                    info,
                    text: String::new(),
                });
            }
            Event::End(TagEnd::CodeBlock) => {
                let block = block.take().expect("a code block ends after it starts");
                if block.mark.as_deref() == Some("runnable") && block.info.starts_with("sh") {
                    doc.runnable.push(block.text.clone());
                }
                doc.blocks.push(block);
            }
            Event::Start(Tag::Paragraph) => mark = None,
            Event::Html(html) | Event::InlineHtml(html) => {
                if let Some(comment) = html
                    .trim()
                    .strip_prefix("<!--")
                    .and_then(|it| it.strip_suffix("-->"))
                {
                    mark = Some(comment.trim().to_string());
                }
            }
            Event::Text(t) => {
                if let Some(block) = block.as_mut() {
                    block.text.push_str(&t);
                } else if let Some(h) = heading.as_mut() {
                    h.push_str(&t);
                }
            }
            Event::Code(code) => {
                if let Some(h) = heading.as_mut() {
                    h.push_str(&code);
                }
                doc.code_spans.push(code.to_string());
            }
            _ => {}
        }
    }
    doc
}

/// The top-level folders and files a repository path in a doc may start with.
fn looks_like_repo_path(span: &str) -> bool {
    const ROOTS: [&str; 12] = [
        "src/",
        "lua/",
        "docs/",
        "deploy/",
        "bench/",
        "benches/",
        "tests/",
        "examples/",
        "proto/",
        "fuzz/",
        ".ci/",
        "README.md",
    ];
    !span.contains(char::is_whitespace)
        && !span.contains(['*', '<', '>', '{', '$', ':', '…'])
        && ROOTS.iter().any(|r| span.starts_with(r))
        && !span.ends_with('/')
        || span == "ARCHITECTURE.md"
        || span == "CHANGELOG.md"
}

/// Whether git ignores `path`: what a script writes (results, logs) may be
/// named without existing.
fn ignored(path: &str) -> bool {
    Command::new("git")
        .args(["check-ignore", "-q", "--no-index", path])
        .current_dir(repo())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn every_link_and_repository_path_in_the_docs_resolves() {
    let root = repo();
    let mut problems = Vec::new();
    for file in markdown_files() {
        let doc = parse(&read(&root.join(&file)));
        let dir = root.join(&file).parent().unwrap().to_path_buf();
        for link in &doc.links {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, fragment) = match link.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (link.as_str(), None),
            };
            let target = if path.is_empty() {
                root.join(&file)
            } else {
                dir.join(path)
            };
            if !target.exists() {
                problems.push(format!("{file}: link to {link}: no such file"));
                continue;
            }
            if let Some(fragment) = fragment
                && target.extension().is_some_and(|e| e == "md")
                && !parse(&read(&target)).anchors.contains(fragment)
            {
                problems.push(format!("{file}: link to {link}: no such heading"));
            }
        }
        for span in &doc.code_spans {
            if looks_like_repo_path(span) && !root.join(span).exists() && !ignored(span) {
                problems.push(format!("{file}: names `{span}`, which does not exist"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

const FLAGS_BEGIN: &str =
    "<!-- flags: generated from `throttlegate serve --help` by tests/docs_deploy/docs.rs -->\n";
const FLAGS_END: &str = "<!-- end of flags -->\n";

/// The flags section as the binary describes it.
fn flags_from_binary() -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_throttlegate"))
        .args(["serve", "--help"])
        .output()
        .expect("run throttlegate serve --help");
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    let options = help
        .split("Options:\n")
        .nth(1)
        .expect("--help has an Options section");
    format!("```text\n{}```\n", options)
}

#[test]
fn the_flags_reference_is_the_binarys_own_help() {
    let path = repo().join("docs/configuration.md");
    let text = read(&path);
    let start = text
        .find(FLAGS_BEGIN)
        .expect("docs/configuration.md has the flags marker")
        + FLAGS_BEGIN.len();
    let end = start
        + text[start..]
            .find(FLAGS_END)
            .expect("docs/configuration.md has the end-of-flags marker");
    let fresh = flags_from_binary();
    if std::env::var_os("THROTTLEGATE_BLESS").is_some() {
        let updated = format!("{}{}{}", &text[..start], fresh, &text[end..]);
        std::fs::write(&path, updated).unwrap();
        return;
    }
    assert!(
        text[start..end] == fresh,
        "docs/configuration.md's flags differ from `throttlegate serve --help`; \
         run `THROTTLEGATE_BLESS=1 cargo test --test docs_deploy docs::` to rewrite them"
    );
}

#[test]
fn every_runnable_shell_block_runs() {
    let root = repo();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_throttlegate"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut ran = 0;
    let mut failures = Vec::new();
    for file in markdown_files() {
        for block in parse(&read(&root.join(&file))).runnable {
            let scratch = tempfile::tempdir().unwrap();
            let out = Command::new("bash")
                .args(["-euo", "pipefail", "-c", &block])
                .current_dir(&root)
                .env("PATH", &path)
                .env("TMPDIR", scratch.path())
                .output()
                .expect("run bash");
            ran += 1;
            if !out.status.success() {
                failures.push(format!(
                    "{file}:\n{block}\nexit {:?}\nstdout:\n{}\nstderr:\n{}",
                    out.status.code(),
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        }
    }
    assert!(ran > 0, "no doc has a block marked <!-- runnable -->");
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn anchors_follow_githubs_rule() {
    assert_eq!(anchor("Try it with Envoy"), "try-it-with-envoy");
    assert_eq!(
        anchor("`bench/h2load.sh`: builds side by side"),
        "benchh2loadsh-builds-side-by-side"
    );
    let doc = parse("# A\n## Same\n## Same\n");
    assert!(doc.anchors.contains("same") && doc.anchors.contains("same-1"));
}

/// The mark of an `sh` block run while `throttlegate serve --config
/// examples/config.yaml` listens on the default ports; its output must be
/// the code block right after it.
const SERVED: &str = "runnable against examples/config.yaml";
/// The mark of a grpcurl command checked without grpcurl; its answer must be
/// the JSON block right after it.
const GRPCURL: &str = "checked over gRPC against examples/config.yaml";

/// A fresh `serve` of examples/config.yaml on free ports, once it answers
/// gRPC.
async fn serve_the_example() -> support::process::ServiceProcess {
    let mut service = support::process::Serve::config(repo().join("examples/config.yaml")).spawn();
    service.connect().await;
    service
}

/// A doc's block as run against `service`: the default ports the docs name
/// (`localhost:8081`, `localhost:8080`) become the service's.
fn at_ports(block: &str, service: &support::process::ServiceProcess) -> String {
    block
        .replace("localhost:8081", &service.grpc.to_string())
        .replace("localhost:8080", &service.http.to_string())
}

/// Every block marked `mark` in the docs: its file, the block, and the
/// block right after it (the output it shows). README.md must have one.
fn marked(mark: &str) -> Vec<(String, Block, Option<Block>)> {
    let mut found = Vec::new();
    for file in markdown_files() {
        let blocks = parse(&read(&repo().join(&file))).blocks;
        for (i, block) in blocks.iter().enumerate() {
            if block.mark.as_deref() == Some(mark) {
                found.push((file.clone(), block.clone(), blocks.get(i + 1).cloned()));
            }
        }
    }
    assert!(
        found.iter().any(|(file, ..)| file == "README.md"),
        "README.md has no block marked <!-- {mark} -->"
    );
    found
}

/// Each block marked [`SERVED`] (the README's `throttlegate check` calls
/// and its curl calls on `/json`) runs under bash, with the built binary
/// first on `PATH`, against a fresh service, and prints exactly the block
/// after it (the README's OK with 9 left, then OVER_LIMIT: the two calls
/// fall within the limit's second, each starting in milliseconds).
#[tokio::test]
async fn calls_on_the_example_config_print_what_the_docs_show() {
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_throttlegate"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    for (file, block, shown) in marked(SERVED) {
        assert!(
            block.info.starts_with("sh")
                && (block.text.contains("localhost:8080") || block.text.contains("localhost:8081")),
            "{file}: a block marked <!-- {SERVED} --> is an sh block calling localhost:8080 or :8081"
        );
        let shown = shown.unwrap_or_else(|| panic!("{file}: no output after\n{}", block.text));
        let service = serve_the_example().await;
        let out = Command::new("bash")
            .args(["-euo", "pipefail", "-c", &at_ports(&block.text, &service)])
            .current_dir(repo())
            .env("PATH", &path)
            .output()
            .expect("run bash");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.trim_end() == shown.text.trim_end(),
            "{file}:\n{}\nexit {:?}; printed:\n{stdout}\nthe doc shows:\n{}\nstderr:\n{}\nservice log:\n{}",
            block.text,
            out.status.code(),
            shown.text,
            String::from_utf8_lossy(&out.stderr),
            service.log()
        );
    }
}

/// What `grpcurl -plaintext -d '<json>' localhost:8081 <method>` asks: the
/// payload, which must be a RateLimitRequest in proto3 JSON, and the method.
fn grpcurl_call(command: &str) -> (serde_json::Value, String) {
    let command = command.replace("\\\n", " ");
    assert!(
        command.trim_start().starts_with("grpcurl -plaintext -d '"),
        "not a grpcurl call with a -d payload: {command}"
    );
    let (_, rest) = command.split_once("-d '").unwrap();
    let (payload, rest) = rest.split_once('\'').expect("the payload's closing quote");
    let words: Vec<&str> = rest.split_whitespace().collect();
    assert_eq!(
        words.len(),
        2,
        "an address and a method after the payload: {rest}"
    );
    assert_eq!(words[0], "localhost:8081", "the README's default gRPC port");
    let payload = serde_json::from_str(payload).expect("the payload is JSON");
    (payload, words[1].to_string())
}

/// A RateLimitRequest from its proto3 JSON, refusing any field this reading
/// does not send (so a README example never asks for more than is checked).
fn rate_limit_request(
    json: &serde_json::Value,
) -> throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest {
    use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
    use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    let fields = |value: &serde_json::Value, allowed: &[&str]| {
        let object = value.as_object().expect("a JSON object");
        for key in object.keys() {
            assert!(
                allowed.contains(&key.as_str()),
                "field {key} is not checked"
            );
        }
        object.clone()
    };
    let request = fields(json, &["domain", "descriptors", "hitsAddend"]);
    let text = |value: Option<&serde_json::Value>| {
        value
            .map(|it| it.as_str().expect("a string").to_string())
            .unwrap_or_default()
    };
    let descriptors = request["descriptors"].as_array().expect("descriptors");
    throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: text(request.get("domain")),
        hits_addend: request.get("hitsAddend").map_or(0, |it| {
            u32::try_from(it.as_u64().expect("a number")).expect("a uint32")
        }),
        descriptors: descriptors
            .iter()
            .map(|descriptor| RateLimitDescriptor {
                entries: fields(descriptor, &["entries"])["entries"]
                    .as_array()
                    .expect("entries")
                    .iter()
                    .map(|entry| {
                        let entry = fields(entry, &["key", "value"]);
                        Entry {
                            key: text(entry.get("key")).into_bytes(),
                            value: text(entry.get("value")).into_bytes(),
                        }
                    })
                    .collect(),
                limit: None,
                hits_addend: None,
            })
            .collect(),
    }
}

/// The proto3 JSON of an answer, as grpcurl prints it: fields at their
/// default value left out, enums by name, a duration as `"<seconds>s"`.
fn proto3_json(
    response: &throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse,
) -> serde_json::Value {
    use serde_json::{Map, Value, json};
    use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
        Code, rate_limit::Unit,
    };
    let code = |code: i32| Code::try_from(code).expect("a known code").as_str_name();
    let headers = |headers: &[throttlegate::proto::envoy::config::core::v3::HeaderValue]| {
        headers
            .iter()
            .map(|h| json!({"key": h.key, "value": h.value}))
            .collect::<Vec<_>>()
    };
    let mut out = Map::new();
    out.insert("overallCode".into(), json!(code(response.overall_code)));
    let statuses: Vec<Value> = response
        .statuses
        .iter()
        .map(|status| {
            let mut it = Map::new();
            it.insert("code".into(), json!(code(status.code)));
            if let Some(limit) = &status.current_limit {
                let mut l = Map::new();
                if !limit.name.is_empty() {
                    l.insert("name".into(), json!(limit.name));
                }
                l.insert("requestsPerUnit".into(), json!(limit.requests_per_unit));
                let unit = Unit::try_from(limit.unit).expect("a known unit");
                l.insert("unit".into(), json!(unit.as_str_name()));
                it.insert("currentLimit".into(), Value::Object(l));
            }
            if status.limit_remaining != 0 {
                it.insert("limitRemaining".into(), json!(status.limit_remaining));
            }
            if let Some(d) = &status.duration_until_reset {
                let text = if d.nanos == 0 {
                    format!("{}s", d.seconds)
                } else {
                    format!("{}.{:09}s", d.seconds, d.nanos)
                };
                it.insert("durationUntilReset".into(), json!(text));
            }
            Value::Object(it)
        })
        .collect();
    if !statuses.is_empty() {
        out.insert("statuses".into(), Value::Array(statuses));
    }
    for (name, list) in [
        ("responseHeadersToAdd", &response.response_headers_to_add),
        ("requestHeadersToAdd", &response.request_headers_to_add),
    ] {
        if !list.is_empty() {
            out.insert(name.into(), Value::Array(headers(list)));
        }
    }
    Value::Object(out)
}

/// grpcurl is a Go binary that neither Debian nor PyPI packages, so each
/// grpcurl block marked [`GRPCURL`] is checked without it: its `-d` payload
/// is read as a RateLimitRequest, sent with tonic to the method it names on a
/// fresh service, and the answer, written as proto3 JSON like grpcurl
/// prints it, must equal the JSON block after it. What is not checked:
/// grpcurl's own flags and its reflection (tests/service/reflection.rs covers the
/// reflection service it uses).
#[tokio::test]
async fn grpcurl_calls_on_the_example_config_answer_what_the_docs_show() {
    for (file, block, shown) in marked(GRPCURL) {
        let (payload, method) = grpcurl_call(&block.text);
        assert_eq!(
            method, "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            "{file}: the only method this test sends"
        );
        let shown = shown
            .filter(|it| it.info == "json")
            .unwrap_or_else(|| panic!("{file}: no JSON answer after\n{}", block.text));
        let shown: serde_json::Value =
            serde_json::from_str(&shown.text).expect("the answer shown is JSON");
        let mut service = serve_the_example().await;
        let answer = service
            .client()
            .await
            .should_rate_limit(rate_limit_request(&payload))
            .await
            .expect("ShouldRateLimit answers")
            .into_inner();
        assert_eq!(proto3_json(&answer), shown, "{file}: {}", block.text);
    }
}
