//! The repository's documentation holds: ARCHITECTURE.md names every source
//! file, every link and every repository path a doc names resolves, the
//! flags in docs/configuration.md are the binary's own `--help`, and every
//! shell block marked runnable runs.
//!
//! `THROTTLEGATE_BLESS=1 cargo test --test docs` rewrites the flags block of
//! docs/configuration.md from the binary instead of comparing it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

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
    let mut files: Vec<String> = ["README.md", "ARCHITECTURE.md", "CHANGELOG.md"]
        .into_iter()
        .filter(|f| repo().join(f).exists())
        .map(String::from)
        .collect();
    for dir in ["docs", "deploy"] {
        files.extend(files_under(dir).into_iter().filter(|f| f.ends_with(".md")));
    }
    files
}

/// The paths the "File index" section of ARCHITECTURE.md gives a line.
fn indexed_files() -> BTreeSet<String> {
    let text = read(&repo().join("ARCHITECTURE.md"));
    let section = text
        .split("\n## File index\n")
        .nth(1)
        .expect("ARCHITECTURE.md has a '## File index' section");
    let section = section.split("\n## ").next().unwrap();
    let mut paths = BTreeSet::new();
    for line in section.lines().filter(|l| l.starts_with("- `")) {
        let names = line.split("`: ").next().unwrap();
        for (i, part) in names.split('`').enumerate() {
            if i % 2 == 1 {
                paths.insert(part.to_string());
            }
        }
    }
    paths
}

#[test]
fn architecture_names_every_source_file_and_no_file_that_is_gone() {
    let indexed = indexed_files();
    let mut sources = vec!["build.rs".to_string()];
    for dir in [
        "src",
        "lua",
        "proto",
        "benches",
        "bench",
        "examples",
        "fuzz/fuzz_targets",
        "tests/support",
    ] {
        sources.extend(files_under(dir));
    }
    let missing: Vec<&String> = sources.iter().filter(|f| !indexed.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md's File index has no line for {missing:?}: add one \
         (\"- `path`: what it is\")"
    );
    let gone: Vec<&String> = indexed
        .iter()
        .filter(|f| !repo().join(f.as_str()).exists())
        .collect();
    assert!(
        gone.is_empty(),
        "ARCHITECTURE.md's File index names files that do not exist: {gone:?}"
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
}

fn parse(text: &str) -> Doc {
    let mut doc = Doc {
        anchors: BTreeSet::new(),
        links: Vec::new(),
        code_spans: Vec::new(),
        runnable: Vec::new(),
    };
    let mut heading: Option<String> = None;
    let mut block: Option<(bool, String)> = None;
    let mut marked = false;
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
                let shell = matches!(&kind, CodeBlockKind::Fenced(info) if info.starts_with("sh"));
                block = Some((marked && shell, String::new()));
                marked = false;
            }
            Event::End(TagEnd::CodeBlock) => {
                if let Some((true, text)) = block.take() {
                    doc.runnable.push(text);
                }
            }
            Event::Html(html) | Event::InlineHtml(html) if html.trim() == "<!-- runnable -->" => {
                marked = true;
            }
            Event::Text(t) => {
                if let Some((_, text)) = block.as_mut() {
                    text.push_str(&t);
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
    "<!-- flags: generated from `throttlegate serve --help` by tests/docs.rs -->\n";
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
         run `THROTTLEGATE_BLESS=1 cargo test --test docs` to rewrite them"
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
