//! Config loading and validation: valid files load, each invalid fixture is refused with its exact message.

use std::path::{Path, PathBuf};

use crate::support::config::load_options as options;
use throttlegate::algorithms::Algorithm;
use throttlegate::config::{self, LoadOptions, Loaded};
use throttlegate::rules::{Limits, Node, NodeLimits, Unit};

const FIXTURES: &str = "tests/fixtures/config";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(FIXTURES)
        .join(name)
}

fn load_ok(path: &Path, options: &LoadOptions) -> Loaded {
    match config::load(path, options) {
        Ok(loaded) => loaded,
        Err(err) => panic!("{} should load:\n{err:#}", path.display()),
    }
}

/// Parses one fixture under its bare file name and returns the error text.
fn refusal(name: &str) -> String {
    let text = std::fs::read_to_string(fixture(name)).expect("fixture exists");
    match config::parse_str(name, &text, &options()) {
        Ok(loaded) => panic!("{name} should be refused, got {:?}", loaded.rules),
        Err(err) => err.to_string(),
    }
}

/// The limits of `node`, which must have some.
fn limits(node: &Node) -> &Limits {
    match node.limits() {
        NodeLimits::Limited(limits) => limits,
        other => panic!("{} has no limits: {other:?}", node.path()),
    }
}

fn check_refused(name: &str, message: &str) {
    assert_eq!(
        refusal(name),
        format!("{name}: {message}"),
        "fixture {name}"
    );
}

// === invalid files, one fixture each ===

#[test]
fn misspelled_key() {
    check_refused(
        "misspelled_key.yaml",
        "config error, unknown key 'ratelimit'",
    );
    check_refused(
        "misspelled_key2.yaml",
        "config error, unknown key 'requestsperunit'",
    );
}

#[test]
fn known_key_in_the_wrong_place() {
    check_refused(
        "misplaced_key.yaml",
        "config error, key 'unit' does not belong in a descriptor",
    );
}

#[test]
fn yaml_syntax_error_has_a_position() {
    check_refused(
        "bad_yaml.yaml",
        "error loading config file: found unexpected end of stream at line 2 column 1, while scanning a quoted scalar",
    );
}

#[test]
fn missing_domain() {
    check_refused("empty_domain.yaml", "config file cannot have empty domain");
    // An empty file has no domain either (a half-written file must not
    // silently drop a domain on reload).
    check_refused("empty_file.yaml", "config file cannot have empty domain");
}

#[test]
fn duplicate_domain() {
    let dir = fixture("duplicate_domain");
    let err = config::load(&dir, &options()).expect_err("duplicate domain");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: duplicate domain 'test-domain' in config file",
            dir.join("b.yaml").display()
        )
    );
}

#[test]
fn descriptor_without_key() {
    check_refused("empty_key.yaml", "descriptor has empty key");
}

#[test]
fn duplicate_siblings() {
    check_refused(
        "duplicate_key.yaml",
        "duplicate descriptor composite key 'test-domain.key1_value1'",
    );
    check_refused(
        "duplicate_nested_key.yaml",
        "duplicate descriptor composite key 'test-domain.tenant.path_/a*'",
    );
}

#[test]
fn bad_unit() {
    check_refused("bad_limit_unit.yaml", "invalid rate limit unit 'foo'");
    check_refused("missing_unit.yaml", "invalid rate limit unit ''");
}

#[test]
fn unlimited_with_unit() {
    check_refused(
        "unlimited_with_unit.yaml",
        "should not specify rate limit unit when unlimited",
    );
}

#[test]
fn bad_replaces() {
    check_refused(
        "replaces_empty.yaml",
        "should not have an empty replaces entry",
    );
    check_refused(
        "replaces_self.yaml",
        "replaces should not contain name of same descriptor",
    );
}

#[test]
fn share_threshold_without_wildcard() {
    check_refused(
        "share_threshold_without_wildcard.yaml",
        "share_threshold can only be used with wildcard values (containing '*'), but found key 'files_files/a'",
    );
}

#[test]
fn unknown_algorithm() {
    let expected = "(expected one of sliding_window_log, token_bucket, gcra, sliding_window_counter, fixed_window)";
    check_refused(
        "unknown_algorithm.yaml",
        &format!("invalid algorithm 'leaky_bucket' {expected}"),
    );
    check_refused(
        "unknown_default_algorithm.yaml",
        &format!("invalid algorithm 'fastest' {expected}"),
    );
}

#[test]
fn burst_below_one() {
    check_refused(
        "zero_burst.yaml",
        "descriptor 'test-domain.user': burst must be at least 1",
    );
}

#[test]
fn burst_on_an_algorithm_without_burst() {
    check_refused(
        "burst_without_bucket.yaml",
        "descriptor 'test-domain.user': burst applies only to token_bucket and gcra, not fixed_window",
    );
}

#[test]
fn burst_depends_on_the_effective_algorithm() {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5, burst: 9}\n";
    let err = config::parse_str("burst.yaml", yaml, &options()).expect_err("sliding log");
    assert_eq!(
        err.to_string(),
        "burst.yaml: descriptor 'd.k': burst applies only to token_bucket and gcra, not sliding_window_log"
    );
    let bucket = LoadOptions {
        default_algorithm: Algorithm::TokenBucket,
        ..options()
    };
    let loaded = config::parse_str("burst.yaml", yaml, &bucket).expect("token bucket default");
    let node = &loaded.rules.domain("d").expect("domain").children()[0];
    assert_eq!(limits(node)[0].params().capacity(), 9);
}

#[test]
fn unit_multiplier_below_one() {
    check_refused(
        "zero_unit_multiplier.yaml",
        "descriptor 'test-domain.user': unit_multiplier must be at least 1",
    );
}

#[test]
fn rate_limit_with_rate_limits() {
    check_refused(
        "rate_limit_and_rate_limits.yaml",
        "descriptor 'test-domain.user' cannot have both rate_limit and rate_limits",
    );
}

#[test]
fn limits_that_would_share_a_counter() {
    check_refused(
        "colliding_limits.yaml",
        "descriptor 'test-domain.user': two limits with the same window (60s) and algorithm (sliding_window_log) would share one counter",
    );
}

#[test]
fn limit_too_precise_for_exact_state() {
    check_refused(
        "too_precise.yaml",
        "descriptor 'test-domain.user': gcra with 4294967295 per 31536000s and capacity 4294967295 needs more than 53 bits of exact state; use a coarser unit or a smaller number",
    );
}

/// Spans no backend can decide (a script keeps times below 2^53 µs): a
/// window, or a bucket's refill, longer than 2^50 µs is refused with the
/// bound and what to change; the longest that fit load.
#[test]
fn a_span_past_what_every_backend_decides_is_refused() {
    check_refused(
        "window_too_long.yaml",
        "descriptor 'test-domain.user': a window of 9460800000s is longer than any backend can decide: at most 1125899906s (2^50 µs, about 35 years); use a shorter unit or a smaller unit_multiplier",
    );
    check_refused(
        "window_past_the_bound.yaml",
        "descriptor 'test-domain.user': a window of 1125964800s is longer than any backend can decide: at most 1125899906s (2^50 µs, about 35 years); use a shorter unit or a smaller unit_multiplier",
    );
    check_refused(
        "refill_too_long.yaml",
        "descriptor 'test-domain.user': gcra refilling a capacity of 36 at 1 per 31536000s takes 1135296000s, longer than any backend can decide: at most 1125899906s (2^50 µs, about 35 years); use a shorter unit, a smaller burst or a larger number",
    );
    let loaded = load_ok(&fixture("valid/longest_span.yaml"), &options());
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn non_string_key() {
    check_refused(
        "non_string_key.yaml",
        "config error, key is not of type string: 0.25",
    );
}

#[test]
fn non_map_list() {
    let name = "non_map_list.yaml";
    assert_eq!(
        refusal(name),
        format!(
            "{name}: config error, yaml file contains list of type other than map: a\n\
             {name}: config error, yaml file contains list of type other than map: b"
        )
    );
}

#[test]
fn every_problem_in_one_pass() {
    let name = "several_errors.yaml";
    assert_eq!(
        refusal(name),
        [
            "invalid rate limit unit 'fortnight'",
            "descriptor 'test-domain.b': burst must be at least 1",
            "duplicate descriptor composite key 'test-domain.b'",
            "descriptor has empty key",
        ]
        .map(|it| format!("{name}: {it}"))
        .join("\n")
    );
}

#[test]
fn alternate_form_names_the_yaml_path() {
    let text = std::fs::read_to_string(fixture("misspelled_key.yaml")).expect("fixture");
    let err = config::parse_str("misspelled_key.yaml", &text, &options()).expect_err("refused");
    assert_eq!(
        format!("{err:#}"),
        "misspelled_key.yaml:5:5: config error, unknown key 'ratelimit' (at descriptors[0].ratelimit)"
    );
    assert_eq!(err.problems[0].path, "descriptors[0].ratelimit");

    // Positions of semantic errors: the key itself, inside flow mappings
    // too, and the mapping that lacks a required key.
    let text = std::fs::read_to_string(fixture("several_errors.yaml")).expect("fixture");
    let err = config::parse_str("several_errors.yaml", &text, &options()).expect_err("refused");
    let positions: Vec<_> = err
        .problems
        .iter()
        .map(|it| it.location.map(|at| (at.line, at.column)))
        .collect();
    assert_eq!(
        positions,
        [Some((4, 18)), Some((6, 71)), Some((7, 5)), Some((8, 5))]
    );
    let text = std::fs::read_to_string(fixture("missing_unit.yaml")).expect("fixture");
    let err = config::parse_str("missing_unit.yaml", &text, &options()).expect_err("refused");
    assert_eq!(
        format!("{err:#}"),
        "missing_unit.yaml:5:7: invalid rate limit unit '' (at descriptors[0].rate_limit.unit)"
    );
}

#[test]
fn errors_across_files_are_all_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("a.yaml"), "domain: a\nbad: 1\n").expect("write");
    std::fs::write(dir.path().join("b.yaml"), "descriptors: []\n").expect("write");
    let err = config::load(dir.path(), &options()).expect_err("refused");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: config error, unknown key 'bad'\n{}: config file cannot have empty domain",
            dir.path().join("a.yaml").display(),
            dir.path().join("b.yaml").display()
        )
    );
}

#[test]
fn missing_path_is_an_error() {
    let path = fixture("does_not_exist.yaml");
    let err = config::load(&path, &options()).expect_err("missing");
    let message = err.to_string();
    assert!(
        message.starts_with(&format!("{}: error reading config: ", path.display())),
        "{message}"
    );
}

// === valid files ===

#[test]
fn envoy_style_basic_config_loads() {
    let loaded = load_ok(&fixture("valid/basic.yaml"), &options());
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let domain = loaded.rules.domain("test-domain").expect("domain");
    let found = domain
        .find(&[("key1", "value1"), ("subkey1", "subvalue1")])
        .expect("match");
    let limits = limits(found.rule());
    assert_eq!(
        (limits[0].requests_per_unit(), limits[0].unit()),
        (10, Unit::Second)
    );
    assert_eq!(&**found.rule().path(), "key1_value1.subkey1_subvalue1");
    // The whitelisted value reaches a node without limits.
    let found = domain.find(&[("key2", "value3")]).expect("match");
    assert_eq!(found.rule().limits(), &NodeLimits::None);
    let unlimited = domain.find(&[("key6", "x")]).expect("match");
    assert!(matches!(
        unlimited.rule().limits(),
        NodeLimits::Unlimited { .. }
    ));
    let key8 = domain.find(&[("key8", "x")]).expect("match").rule();
    assert!(key8.shadow_mode() && key8.quota_mode() && key8.value_to_metric());
}

#[test]
fn envoy_style_wildcard_config_loads() {
    let loaded = load_ok(&fixture("valid/wildcard.yaml"), &options());
    let domain = loaded.rules.domain("wildcards").expect("domain");
    let found = domain.find(&[("multiWild", "fooXbarYbaz")]).expect("match");
    assert_eq!(&**found.rule().path(), "multiWild_foo*bar*baz");
    assert!(found.rule().share_threshold());
    assert!(domain.find(&[("multiWild", "fooXbaz")]).is_none());
}

#[test]
fn example_config_loads_with_every_algorithm() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config.yaml");
    let loaded = load_ok(&path, &options());
    assert_eq!(loaded.files, vec![path]);
    let domain = loaded.rules.domain("api").expect("domain api");
    let mut algorithms = Vec::new();
    let mut stack: Vec<_> = domain.children().iter().collect();
    while let Some(node) = stack.pop() {
        if let NodeLimits::Limited(limits) = node.limits() {
            algorithms.extend(limits.iter().map(|it| it.algorithm()));
        }
        stack.extend(node.children().iter());
    }
    for algorithm in Algorithm::ALL {
        assert!(algorithms.contains(&algorithm), "{algorithm} missing");
    }
    let summary = config::summary(&loaded.rules);
    for line in [
        "domain api (default algorithm sliding_window_log, bucket_key_order tenant, path)",
        "  remote_address  10/second sliding_window_log",
        "  api_key  100/5 minutes token_bucket burst=20",
        "  path_/files/*  100/hour gcra burst=10  [share_threshold]",
        "  tenant.path_/expensive  10/minute sliding_window_log name=expensive replaces=premium  [shadow]",
        "  user  10/second token_bucket; 10000/day sliding_window_log; 100000/month sliding_window_counter  [value_to_metric]",
        "  llm_key  10000/minute token_bucket charge=always",
        "  health  unlimited",
        "  banned  0/year sliding_window_log",
    ] {
        assert!(
            summary.lines().any(|it| it == line),
            "missing {line:?} in\n{summary}"
        );
    }
}

#[test]
fn example_directory_loads_and_skips_dot_files() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/config.d");
    let loaded = load_ok(&dir, &options());
    let names: Vec<_> = loaded
        .files
        .iter()
        .map(|it| it.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["api.yaml", "edge.yaml", "internal.yml"]);
    let mut domains: Vec<_> = loaded.rules.domains().map(|it| &**it.name()).collect();
    domains.sort();
    assert_eq!(domains, ["api", "edge", "internal"]);
    assert_eq!(
        loaded.rules.domain("edge").unwrap().default_algorithm(),
        Algorithm::Gcra
    );
    let api = loaded.rules.domain("api").unwrap();
    assert!(api.find(&[("this_is_not_loaded", "x")]).is_none());
}

#[test]
fn kubernetes_configmap_layout_loads_each_file_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    let version = root.join("..2026_12_02_10_00_00.1");
    std::fs::create_dir(&version).expect("mkdir");
    std::fs::write(
        version.join("api.yaml"),
        "domain: api\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    )
    .expect("write");
    std::os::unix::fs::symlink("..2026_12_02_10_00_00.1", root.join("..data")).expect("symlink");
    std::os::unix::fs::symlink("..data/api.yaml", root.join("api.yaml")).expect("symlink");
    let loaded = load_ok(root, &options());
    assert_eq!(loaded.files, vec![root.join("api.yaml")]);
    assert!(loaded.rules.domain("api").is_some());

    // The atomic swap: a new version directory, `..data` repointed.
    let next = root.join("..2026_12_02_11_00_00.2");
    std::fs::create_dir(&next).expect("mkdir");
    std::fs::write(next.join("api.yaml"), "domain: api2\n").expect("write");
    std::fs::remove_file(root.join("..data")).expect("unlink");
    std::os::unix::fs::symlink("..2026_12_02_11_00_00.2", root.join("..data")).expect("symlink");
    let loaded = load_ok(root, &options());
    assert!(loaded.rules.domain("api2").is_some());
    assert!(loaded.rules.domain("api").is_none());

    // A key removed from the ConfigMap: its symlink dangles until kubelet
    // deletes it; the file is gone, so it is skipped with a warning.
    std::os::unix::fs::symlink("..data/gone.yaml", root.join("gone.yaml")).expect("symlink");
    let loaded = load_ok(root, &options());
    assert_eq!(loaded.files, vec![root.join("api.yaml")]);
    assert_eq!(
        loaded.warnings,
        [format!(
            "{}: skipping a symlink whose target does not exist",
            root.join("gone.yaml").display()
        )]
    );
}

#[test]
fn subdirectories_load_but_dot_directories_do_not() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("team")).expect("mkdir");
    std::fs::create_dir(dir.path().join(".git")).expect("mkdir");
    std::fs::write(dir.path().join("team/a.yml"), "domain: a\n").expect("write");
    std::fs::write(dir.path().join(".git/b.yaml"), "domain: b\n").expect("write");
    std::fs::write(dir.path().join("notes.txt"), "domain: c\n").expect("write");
    let loaded = load_ok(dir.path(), &options());
    assert_eq!(loaded.files, vec![dir.path().join("team/a.yml")]);
}

#[test]
fn empty_config_is_valid() {
    let dir = tempfile::tempdir().expect("tempdir");
    let loaded = load_ok(dir.path(), &options());
    assert_eq!(loaded.rules.domains().len(), 0);
    assert!(loaded.files.is_empty());
    assert_eq!(config::summary(&loaded.rules), "no domains configured\n");

    let loaded = config::parse_str("d.yaml", "domain: quiet\ndescriptors:\n", &options())
        .expect("no rules is fine");
    assert!(loaded.rules.domain("quiet").unwrap().children().is_empty());
}

#[test]
fn merged_domains() {
    let dir = fixture("merge_domain");
    let err = config::load(&dir, &options()).expect_err("not merged by default");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: duplicate domain 'test-domain' in config file",
            dir.join("key2.yaml").display()
        )
    );
    let merge = LoadOptions {
        merge_domains: true,
        ..options()
    };
    let loaded = load_ok(&dir, &merge);
    let domain = loaded.rules.domain("test-domain").expect("domain");
    assert!(domain.find(&[("key1", "value1")]).is_some());
    assert!(domain.find(&[("key2", "value2")]).is_some());
    // key2.yaml names a default algorithm; key1.yaml does not.
    assert_eq!(domain.default_algorithm(), Algorithm::FixedWindow);
}

#[test]
fn merged_domains_still_refuse_duplicate_keys() {
    let dir = fixture("merge_duplicate_key");
    let merge = LoadOptions {
        merge_domains: true,
        ..options()
    };
    let err = config::load(&dir, &merge).expect_err("duplicate key across files");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: duplicate descriptor composite key 'test-domain.key1_value1'",
            dir.join("two.yaml").display()
        )
    );
}

#[test]
fn default_algorithm_precedence() {
    let yaml = "domain: d\ndefault_algorithm: gcra\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5}\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 5, algorithm: FIXED_WINDOW}\n";
    let loaded = config::parse_str("d.yaml", yaml, &options()).expect("valid");
    let domain = loaded.rules.domain("d").unwrap();
    let algorithm_of =
        |key: &str| limits(domain.find(&[(key, "x")]).unwrap().rule())[0].algorithm();
    assert_eq!(algorithm_of("a"), Algorithm::Gcra);
    assert_eq!(algorithm_of("b"), Algorithm::FixedWindow);
    assert_eq!(domain.default_algorithm(), Algorithm::Gcra);

    let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 5}\n";
    let bucket = LoadOptions {
        default_algorithm: Algorithm::TokenBucket,
        ..options()
    };
    let loaded = config::parse_str("d.yaml", yaml, &bucket).expect("valid");
    assert_eq!(
        loaded.rules.domain("d").unwrap().default_algorithm(),
        Algorithm::TokenBucket
    );
}

#[test]
fn an_inherited_sliding_log_over_the_cap_becomes_a_counter() {
    let path = fixture("valid/log_over_cap.yaml");
    let loaded = load_ok(&path, &options());
    assert_eq!(
        loaded.warnings,
        [format!(
            "{}: descriptor 'capped.big': 20000 per window is over the sliding_window_log cap of 10000 entries per key (--max-log-entries): using sliding_window_counter; name an algorithm to choose another",
            path.display()
        )]
    );
    let domain = loaded.rules.domain("capped").unwrap();
    let algorithm_of = |key: &str| {
        let limit = &limits(domain.find(&[(key, "x")]).unwrap().rule())[0];
        (limit.algorithm(), limit.is_log_capped())
    };
    assert_eq!(algorithm_of("big"), (Algorithm::SlidingWindowCounter, true));
    assert_eq!(algorithm_of("at_cap"), (Algorithm::SlidingWindowLog, false));
    assert_eq!(algorithm_of("bucket"), (Algorithm::Gcra, false));
    let summary = config::summary(&loaded.rules);
    assert!(
        summary.lines().any(|it| it
            == "  big  20000/minute sliding_window_counter (not sliding_window_log: over --max-log-entries 10000)"),
        "{summary}"
    );
    assert!(
        summary
            .lines()
            .any(|it| it == "  at_cap  10000/minute sliding_window_log"),
        "{summary}"
    );

    // The cap comes from the options, and so does the inherited default.
    let raised = LoadOptions {
        max_log_entries: 20_000,
        ..options()
    };
    let loaded = load_ok(&path, &raised);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let lowered = LoadOptions {
        max_log_entries: 100,
        ..options()
    };
    let loaded = load_ok(&path, &lowered);
    assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
    let counter = LoadOptions {
        default_algorithm: Algorithm::TokenBucket,
        ..options()
    };
    assert!(load_ok(&path, &counter).warnings.is_empty());
    let file_default = "domain: d\ndefault_algorithm: sliding_window_log\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 10001}\n";
    let loaded = config::parse_str("d.yaml", file_default, &counter).expect("valid");
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
}

#[test]
fn a_named_sliding_log_over_the_cap_is_refused() {
    check_refused(
        "log_over_cap.yaml",
        "descriptor 'test-domain.user': sliding_window_log with 10001 per window is over the cap of 10000 entries per key (--max-log-entries); use sliding_window_counter or gcra, or raise the cap",
    );
    check_refused(
        "log_over_cap_inexact.yaml",
        "descriptor 'test-domain.user': 1000000 per window is over the sliding_window_log cap of 10000 entries per key (--max-log-entries), and sliding_window_counter with 1000000 per 31536000s and capacity 1000000 needs more than 53 bits of exact state; use a coarser unit or a smaller number",
    );
}

#[test]
fn absent_requests_per_unit_means_zero_with_a_warning() {
    let yaml = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n";
    let loaded = config::parse_str("d.yaml", yaml, &options()).expect("valid, as in envoyproxy");
    assert_eq!(
        loaded.warnings,
        ["d.yaml: descriptor 'd.k': requests_per_unit is absent, so 0: every request is denied"]
    );
    let node = &loaded.rules.domain("d").unwrap().children()[0];
    assert_eq!(limits(node)[0].params().capacity(), 0);
}

#[test]
fn scalars_are_read_as_envoyproxy_reads_them() {
    // Numbers as values, YAML 1.1 booleans, and merge keys.
    let yaml = r#"
domain: 42
descriptors:
  - key: status
    value: 503
    shadow_mode: yes
    rate_limit: &limit {unit: second, requests_per_unit: 5}
  - key: other
    quota_mode: "off"
    rate_limit:
      <<: *limit
      requests_per_unit: 7
"#;
    let loaded = config::parse_str("s.yaml", yaml, &options()).expect("valid");
    let domain = loaded.rules.domain("42").expect("numeric domain");
    let status = domain
        .find(&[("status", "503")])
        .expect("numeric value")
        .rule();
    assert!(status.shadow_mode());
    assert_eq!(&**status.path(), "status_503");
    let other = domain.find(&[("other", "x")]).expect("match").rule();
    assert!(!other.quota_mode());
    let limits = limits(other);
    assert_eq!(
        (limits[0].unit(), limits[0].requests_per_unit()),
        (Unit::Second, 7)
    );

    let err = config::parse_str(
        "t.yaml",
        "domain: d\ndescriptors:\n  - key: k\n    shadow_mode: maybe\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
        &options(),
    )
    .expect_err("bad scalars");
    assert_eq!(
        err.to_string(),
        "t.yaml: config error, 'shadow_mode' must be a boolean, not maybe\n\
         t.yaml: config error, 'requests_per_unit' must be an integer from 0 to 4294967295, not -1"
    );
}

#[test]
fn merged_files_must_agree_on_the_default_algorithm() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("a.yaml"),
        "domain: d\ndefault_algorithm: gcra\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: d\ndefault_algorithm: fixed_window\n",
    )
    .expect("write");
    let merge = LoadOptions {
        merge_domains: true,
        ..options()
    };
    let err = config::load(dir.path(), &merge).expect_err("conflict");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: default_algorithm 'fixed_window' conflicts with 'gcra' set for domain 'd' in {}",
            dir.path().join("b.yaml").display(),
            dir.path().join("a.yaml").display()
        )
    );
}

/// `charge: always` on a limit, `default_charge` for a whole file (a
/// limit's own `charge` wins), the summary showing it, and the refusals:
/// an unknown charge, a charge on an unlimited limit, a limit too large to
/// carry a whole capacity of debt exactly.
#[test]
fn charge_per_limit_and_default_charge_per_file() {
    use throttlegate::algorithms::Charge;
    let yaml = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 5, charge: always}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";
    let loaded = config::parse_str("d.yaml", yaml, &options()).expect("valid");
    let domain = loaded.rules.domain("d").unwrap();
    let charge_of = |domain: &throttlegate::rules::Domain, key: &str| {
        limits(domain.find(&[(key, "x")]).unwrap().rule())[0].charge()
    };
    assert_eq!(charge_of(domain, "a"), Charge::Always);
    assert_eq!(charge_of(domain, "b"), Charge::IfAllowed);
    let summary = config::summary(&loaded.rules);
    assert!(
        summary.contains("  a  5/minute sliding_window_log charge=always\n"),
        "{summary}"
    );
    assert!(
        summary.contains("  b  5/minute sliding_window_log\n"),
        "{summary}"
    );

    let yaml = "domain: d\ndefault_charge: always\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 5}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 5, charge: IF_ALLOWED}\n";
    let loaded = config::parse_str("d.yaml", yaml, &options()).expect("valid");
    let domain = loaded.rules.domain("d").unwrap();
    assert_eq!(charge_of(domain, "a"), Charge::Always);
    assert_eq!(charge_of(domain, "b"), Charge::IfAllowed);

    let refused = |yaml: &str| {
        config::parse_str("c.yaml", yaml, &options())
            .expect_err("refused")
            .to_string()
    };
    assert_eq!(
        refused(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 5, charge: later}\n"
        ),
        "c.yaml: invalid charge 'later' (expected one of if_allowed, always)"
    );
    assert_eq!(
        refused("domain: d\ndefault_charge: 3\ndescriptors: []\n"),
        "c.yaml: invalid charge '3' (expected one of if_allowed, always)"
    );
    assert_eq!(
        refused(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, charge: always}\n"
        ),
        "c.yaml: should not specify charge when unlimited"
    );
    // A token bucket of 7 per 2 s (scale 2,000,000) with a burst of 3e9:
    // capacity × scale (6e15) is below 2^53, twice it is not.
    let bucket = "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, unit_multiplier: 2, requests_per_unit: 7, algorithm: token_bucket, burst: 3000000000}\n";
    config::parse_str("c.yaml", bucket, &options()).expect("loads when charged if allowed");
    let message = refused(&bucket.replace("}\n", ", charge: always}\n"));
    assert!(
        message.starts_with("c.yaml: descriptor 'd.a': charge: always on token_bucket"),
        "{message}"
    );
}

/// `bucket_key_order` (the order of an RLQS bucket's keys as a
/// descriptor): read and shown by the summary; an empty key, a key named
/// twice and a value that is not a list refused with their messages;
/// merged files must agree on it.
#[test]
fn bucket_key_order_is_checked() {
    let yaml = "domain: d\nbucket_key_order: [tenant, path]\n";
    let loaded = config::parse_str("d.yaml", yaml, &options()).expect("valid");
    let domain = loaded.rules.domain("d").expect("domain");
    let keys: Vec<&str> = domain.bucket_key_order().iter().map(|it| &**it).collect();
    assert_eq!(keys, ["tenant", "path"]);
    assert!(
        config::summary(&loaded.rules).starts_with(
            "domain d (default algorithm sliding_window_log, bucket_key_order tenant, path)\n"
        ),
        "{}",
        config::summary(&loaded.rules)
    );
    for (yaml, message) in [
        (
            "domain: d\nbucket_key_order: [tenant, \"\"]\n",
            "d.yaml: bucket_key_order has an empty key",
        ),
        (
            "domain: d\nbucket_key_order: [tenant, path, tenant]\n",
            "d.yaml: bucket_key_order names 'tenant' twice",
        ),
        (
            "domain: d\nbucket_key_order: tenant\n",
            "d.yaml: config error, 'bucket_key_order' must be a list",
        ),
    ] {
        let err = config::parse_str("d.yaml", yaml, &options()).expect_err(yaml);
        assert_eq!(err.to_string(), message);
    }

    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("a.yaml"),
        "domain: d\nbucket_key_order: [a]\n",
    )
    .expect("write");
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: d\nbucket_key_order: [b, a]\n",
    )
    .expect("write");
    let merge = LoadOptions {
        merge_domains: true,
        ..options()
    };
    let err = config::load(dir.path(), &merge).expect_err("conflict");
    assert_eq!(
        err.to_string(),
        format!(
            "{}: bucket_key_order [b, a] conflicts with [a] set for domain 'd' in {}",
            dir.path().join("b.yaml").display(),
            dir.path().join("a.yaml").display()
        )
    );
}
