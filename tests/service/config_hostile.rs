//! Hostile config files: each is refused before it can take much memory or
//! time, with an error that names the file and the reason; and large but
//! valid configs still load.

use std::path::Path;

use throttlegate::config::{self, ConfigLimits, LoadOptions};
use throttlegate::rules::Match;

use crate::support::config::{load_options, write_file};

/// `config::load` of `path` refused, as one line per problem.
fn refused(path: &str, options: &LoadOptions) -> (config::Error, String) {
    let err = config::load(Path::new(path), options).expect_err("refused");
    let text = format!("{err:#}");
    (err, text)
}

fn small_limits(limits: ConfigLimits) -> LoadOptions {
    LoadOptions {
        limits,
        ..load_options()
    }
}

/// The classic "billion laughs": nine levels of ten aliases each. Its
/// aliases jump far more often than the document has events, which
/// serde_yaml_ng stops.
#[test]
fn a_billion_laughs_is_refused_by_the_repetition_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = "a0: &a0 [lol]\n".to_owned();
    for level in 1..10 {
        let prev = level - 1;
        yaml.push_str(&format!(
            "a{level}: &a{level} [{}]\n",
            vec![format!("*a{prev}"); 10].join(", ")
        ));
    }
    yaml.push_str("domain: d\n");
    let path = write_file(dir.path(), "laughs.yaml", &yaml);
    let (err, text) = refused(&path, &load_options());
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(err.problems[0].file, path);
    assert!(text.contains("repetition limit exceeded"), "{text}");
}

/// One anchor on a large list, repeated by many aliases: few jumps, so the
/// repetition limit lets it through, but its tree would hold ten million
/// nodes. Counted before the tree is built, and refused.
#[test]
fn one_large_anchor_repeated_by_many_aliases_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let items = vec!["x"; 2_000].join(",");
    let aliases = vec!["*big"; 5_000].join(",");
    let yaml = format!("domain: d\nbig: &big [{items}]\nmany: [{aliases}]\n");
    let path = write_file(dir.path(), "wide.yaml", &yaml);
    let (err, text) = refused(&path, &load_options());
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(err.problems[0].file, path);
    let budget = yaml.len() as u64 + config::ALIAS_NODE_ALLOWANCE;
    assert!(
        text.contains(&format!("expands to more than {budget} YAML nodes")),
        "{text}"
    );
}

/// Aliases used as configs use them (a shared limit, a merge key) load.
#[test]
fn modest_aliases_and_merge_keys_still_load() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: &limit {unit: second, requests_per_unit: 5}\n  - key: b\n    rate_limit: *limit\n  - key: c\n    rate_limit:\n      <<: *limit\n      requests_per_unit: 7\n";
    let path = write_file(dir.path(), "aliases.yaml", yaml);
    let loaded = config::load(Path::new(&path), &load_options()).expect("loads");
    assert_eq!(loaded.rules.domain("d").unwrap().children().len(), 3);
}

/// Thousands of levels of `[`: serde_yaml_ng stops at 128.
#[test]
fn deep_flow_nesting_is_refused_by_the_recursion_limit() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = format!(
        "domain: d\ndescriptors: {}{}\n",
        "[".repeat(10_000),
        "]".repeat(10_000)
    );
    let path = write_file(dir.path(), "deep.yaml", &yaml);
    let (err, text) = refused(&path, &load_options());
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(err.problems[0].file, path);
    assert!(text.contains("recursion limit exceeded"), "{text}");
}

/// Descriptors nested hundreds deep reach the same limit.
#[test]
fn deeply_nested_descriptors_are_refused_by_the_recursion_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = "domain: d\ndescriptors:\n".to_owned();
    for depth in 0..300 {
        let pad = "  ".repeat(depth * 2);
        yaml.push_str(&format!("{pad}  - key: k{depth}\n{pad}    descriptors:\n"));
    }
    let path = write_file(dir.path(), "nested.yaml", &yaml);
    let (err, text) = refused(&path, &load_options());
    assert_eq!(err.problems[0].file, path);
    assert!(text.contains("recursion limit exceeded"), "{text}");
}

/// A file over the size cap is refused unread past the cap: the standard
/// cap of 16 MiB, and a lowered one.
#[test]
fn a_file_over_the_size_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let standard = ConfigLimits::STANDARD.max_file_bytes;
    let huge_scalar = format!("domain: d\nx: {}\n", "a".repeat(standard as usize));
    let path = write_file(dir.path(), "huge.yaml", &huge_scalar);
    let (err, text) = refused(&path, &load_options());
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(
        text,
        format!(
            "{path}: error reading config file: larger than 16777216 bytes (--max-config-file-bytes)"
        )
    );
    let small = small_limits(ConfigLimits {
        max_file_bytes: 100,
        ..ConfigLimits::STANDARD
    });
    let path = write_file(
        dir.path(),
        "small.yaml",
        &format!("domain: d\n#{}\n", "x".repeat(100)),
    );
    let (_, text) = refused(&path, &small);
    assert!(
        text.ends_with("larger than 100 bytes (--max-config-file-bytes)"),
        "{text}"
    );
}

/// A path that never ends (a character device) is read only to the cap.
#[test]
fn an_endless_file_is_refused_at_the_cap() {
    let small = small_limits(ConfigLimits {
        max_file_bytes: 1 << 20,
        ..ConfigLimits::STANDARD
    });
    let (err, text) = refused("/dev/zero", &small);
    assert_eq!(err.problems[0].file, "/dev/zero");
    assert!(text.contains("larger than 1048576 bytes"), "{text}");
}

/// The files of a directory together over the cap: refused, naming the
/// directory, the cap, and the file that crossed it.
#[test]
fn a_directory_over_its_total_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["a", "b", "c"] {
        let yaml = format!("domain: {name}\n#{}\n", "x".repeat(400));
        write_file(dir.path(), &format!("{name}.yaml"), &yaml);
    }
    let limits = ConfigLimits {
        max_total_bytes: 1_000,
        ..ConfigLimits::STANDARD
    };
    let root = dir.path().to_str().unwrap();
    let (err, text) = refused(root, &small_limits(limits));
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(err.problems[0].file, root);
    assert_eq!(
        text,
        format!(
            "{root}: config files total more than 1000 bytes (--max-config-bytes), reached at {root}/c.yaml"
        )
    );
    let raised = ConfigLimits {
        max_total_bytes: 2_000,
        ..ConfigLimits::STANDARD
    };
    config::load(dir.path(), &small_limits(raised)).expect("within the raised cap");
}

fn flat_rules(count: usize) -> String {
    let mut yaml = String::from("domain: d\ndescriptors:\n");
    for idx in 0..count {
        yaml.push_str(&format!(
            "  - key: k{idx}\n    rate_limit: {{unit: second, requests_per_unit: 10}}\n"
        ));
    }
    yaml
}

/// More descriptors in a domain than the cap, counted at every depth and
/// across merged files.
#[test]
fn a_domain_over_the_descriptor_cap_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let limits = ConfigLimits {
        max_descriptors: 10,
        ..ConfigLimits::STANDARD
    };
    let path = write_file(dir.path(), "many.yaml", &flat_rules(11));
    let (err, text) = refused(&path, &small_limits(limits));
    assert_eq!(err.problems.len(), 1, "{text}");
    assert_eq!(
        text,
        format!("{path}: domain 'd' has 11 descriptors, more than 10 (--max-config-descriptors)")
    );
    let path = write_file(dir.path(), "ten.yaml", &flat_rules(10));
    config::load(Path::new(&path), &small_limits(limits)).expect("at the cap");

    // Nested: 4 top-level descriptors with 2 children each are 12.
    let mut nested = String::from("domain: n\ndescriptors:\n");
    for idx in 0..4 {
        nested.push_str(&format!("  - key: k{idx}\n    descriptors:\n      - key: a\n        rate_limit: {{unit: second, requests_per_unit: 1}}\n      - key: b\n        rate_limit: {{unit: second, requests_per_unit: 1}}\n"));
    }
    let path = write_file(dir.path(), "nested.yaml", &nested);
    let (_, text) = refused(&path, &small_limits(limits));
    assert!(text.contains("domain 'n' has 12 descriptors"), "{text}");

    // Merged: two files of 6 in one domain.
    let merged = tempfile::tempdir().unwrap();
    let six = flat_rules(6);
    write_file(merged.path(), "one.yaml", &six);
    write_file(merged.path(), "two.yaml", &six.replace("key: k", "key: j"));
    let merge = LoadOptions {
        merge_domains: true,
        ..small_limits(limits)
    };
    let (err, text) = refused(merged.path().to_str().unwrap(), &merge);
    assert!(err.problems[0].file.ends_with("one.yaml"), "{text}");
    assert!(text.contains("domain 'd' has 12 descriptors"), "{text}");
}

/// A file with 5,000 problems is refused with every one of them, the
/// first 10 with their line and column (each costs a re-read of the file,
/// so locating them all would take time quadratic in its size).
#[test]
fn thousands_of_problems_are_reported_and_the_first_ten_located() {
    let dir = tempfile::tempdir().unwrap();
    let mut yaml = String::from("domain: d\ndescriptors:\n");
    for idx in 0..5_000 {
        yaml.push_str(&format!("  - key: k{idx}\n    ratelimit: 1\n"));
    }
    let path = write_file(dir.path(), "bad.yaml", &yaml);
    let (err, _) = refused(&path, &load_options());
    assert_eq!(err.problems.len(), 5_000);
    assert_eq!(
        format!("{:#}", err.problems[9]),
        format!("{path}:22:5: config error, unknown key 'ratelimit' (at descriptors[9].ratelimit)")
    );
    assert!(err.problems[10..].iter().all(|it| it.location.is_none()));
    assert_eq!(
        format!("{:#}", err.problems[4_999]),
        format!("{path}: config error, unknown key 'ratelimit' (at descriptors[4999].ratelimit)")
    );
}

/// Hostile but valid: 10,000 rules in one domain load, and the last of
/// them matches.
#[test]
fn ten_thousand_rules_load_and_match() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(dir.path(), "big.yaml", &flat_rules(10_000));
    let loaded = config::load(Path::new(&path), &load_options()).expect("loads");
    let domain = loaded.rules.domain("d").unwrap();
    assert_eq!(domain.children().len(), 10_000);
    let found: Option<Match<'_>> = domain.find(&[(b"k9999".as_slice(), b"v".as_slice())]);
    assert_eq!(&**found.expect("matches").rule().path(), "k9999");
}
