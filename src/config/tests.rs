//! Rules loaded from YAML match descriptors as the file says: the matching
//! order of `rules`, seen through the config format.

use crate::rules::{Match, NodeLimits, RuleSet, ValueMatcher};
use crate::testing;

const RULES: &str = r#"
domain: test
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: k
    value: exact
    rate_limit: {unit: minute, requests_per_unit: 1, name: exact}
  - key: k
    value: pre*
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: k
    value: "*suf"
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: k
    value: a*z
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: k
    value: "*x*y*"
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 6}
  - key: order
    value: ab*
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: order
    value: a*
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: tenant
    descriptors:
      - key: path
        value: /expensive
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 10, replaces: [{name: exact}]}
      - key: path
        rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: acme
    descriptors:
      - key: user
        quota_mode: true
        rate_limit: {unit: day, requests_per_unit: 1000}
  - key: files
    value: /files/*
    share_threshold: true
    descriptors:
      - key: method
        rate_limit: {unit: second, requests_per_unit: 7}
  - key: health
    rate_limit: {unlimited: true, name: health, replaces: [{name: exact}]}
  - key: user
    rate_limits:
      - {unit: second, requests_per_unit: 10, algorithm: token_bucket, burst: 20}
      - {unit: minute, unit_multiplier: 5, requests_per_unit: 100, algorithm: gcra}
      - {unit: day, requests_per_unit: 10000}
  - key: parent
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: child
        rate_limit: {unit: second, requests_per_unit: 2}
"#;

fn rules() -> RuleSet {
    testing::rules_from("rules.yaml", RULES)
}

/// Renders a match as `<path> <limits> [flags]`, or `none`.
fn render(found: Option<Match<'_>>) -> String {
    let Some(found) = found else {
        return "none".to_owned();
    };
    let rule = found.rule();
    let mut out = format!("{} ", rule.path());
    match rule.limits() {
        NodeLimits::None => out.push_str("nolimit"),
        NodeLimits::Unlimited { name, replaces } => {
            out.push_str("unlimited");
            if let Some(name) = name {
                out.push_str(&format!(" name={name}"));
            }
            for replaced in replaces {
                out.push_str(&format!(" replaces={replaced}"));
            }
        }
        NodeLimits::Limited(limits) => {
            let parts: Vec<String> = limits
                .iter()
                .map(|limit| {
                    let mut part = format!(
                        "{}/{}s:{}:cap{}",
                        limit.requests_per_unit(),
                        limit.window_seconds(),
                        limit.algorithm(),
                        limit.params().capacity()
                    );
                    if let Some(name) = limit.name() {
                        part.push_str(&format!(":name={name}"));
                    }
                    for replaced in limit.replaces() {
                        part.push_str(&format!(":replaces={replaced}"));
                    }
                    part
                })
                .collect();
            out.push_str(&parts.join(","));
        }
    }
    if rule.shadow_mode() {
        out.push_str(" shadow");
    }
    if rule.quota_mode() {
        out.push_str(" quota");
    }
    for (idx, level) in found.levels.iter().enumerate() {
        if level.share_threshold() {
            out.push_str(&format!(" share@{idx}"));
        }
    }
    out
}

fn check(descriptor: &[(&str, &str)], expected: &str) {
    let rules = rules();
    let domain = rules.domain("test").expect("domain test");
    let found = domain.find(descriptor);
    if let Some(found) = &found {
        assert_eq!(found.levels.len(), descriptor.len(), "{descriptor:?}");
    }
    assert_eq!(render(found), expected, "descriptor {descriptor:?}");
}

#[test]
fn matching_table() {
    let sw = "sliding_window_log";
    let cases: Vec<(Vec<(&str, &str)>, String)> = vec![
        // key-only: any value
        (
            vec![("remote_address", "10.0.0.1")],
            format!("remote_address 10/1s:{sw}:cap10"),
        ),
        // exact beats wildcards and key-only
        (
            vec![("k", "exact")],
            format!("k_exact 1/60s:{sw}:cap1:name=exact"),
        ),
        // prefix, suffix, middle and multi-star wildcards
        (vec![("k", "prefix")], format!("k_pre* 2/60s:{sw}:cap2")),
        (vec![("k", "pre")], format!("k_pre* 2/60s:{sw}:cap2")),
        (vec![("k", "endsuf")], format!("k_*suf 3/60s:{sw}:cap3")),
        (vec![("k", "abcz")], format!("k_a*z 4/60s:{sw}:cap4")),
        (vec![("k", "az")], format!("k_a*z 4/60s:{sw}:cap4")),
        (vec![("k", "1x2y3")], format!("k_*x*y* 5/60s:{sw}:cap5")),
        (vec![("k", "xy")], format!("k_*x*y* 5/60s:{sw}:cap5")),
        // no wildcard matches: key-only
        (vec![("k", "yx")], format!("k 6/60s:{sw}:cap6")),
        (vec![("k", "")], format!("k 6/60s:{sw}:cap6")),
        // several wildcards match: the first in config order wins
        (vec![("k", "presuf")], format!("k_pre* 2/60s:{sw}:cap2")),
        (
            vec![("order", "abc")],
            format!("order_ab* 1/3600s:{sw}:cap1"),
        ),
        (vec![("order", "ac")], format!("order_a* 2/3600s:{sw}:cap2")),
        // no wildcard and no key-only node
        (vec![("order", "b")], "none".to_owned()),
        (vec![("unknown", "x")], "none".to_owned()),
        (vec![], "none".to_owned()),
        // nested, with shadow mode and replaces
        (
            vec![("tenant", "t1"), ("path", "/expensive")],
            format!("tenant.path_/expensive 10/60s:{sw}:cap10:replaces=exact shadow"),
        ),
        (
            vec![("tenant", "t1"), ("path", "/cheap")],
            format!("tenant.path 100/60s:{sw}:cap100"),
        ),
        // too short: the reached node has no limit
        (vec![("tenant", "t1")], "tenant nolimit".to_owned()),
        (vec![("tenant", "acme")], "tenant_acme nolimit".to_owned()),
        (
            vec![("tenant", "acme"), ("user", "u1")],
            format!("tenant_acme.user 1000/86400s:{sw}:cap1000 quota"),
        ),
        // no backtracking to the key-only `tenant` when tenant_acme has no `path`
        (
            vec![("tenant", "acme"), ("path", "/expensive")],
            "none".to_owned(),
        ),
        // too long
        (
            vec![("remote_address", "x"), ("more", "y")],
            "none".to_owned(),
        ),
        (
            vec![("parent", "p"), ("child", "c"), ("extra", "e")],
            "none".to_owned(),
        ),
        // a limit on an inner node applies at that depth only
        (vec![("parent", "p")], format!("parent 1/1s:{sw}:cap1")),
        (
            vec![("parent", "p"), ("child", "c")],
            format!("parent.child 2/1s:{sw}:cap2"),
        ),
        // share_threshold on the wildcard level is visible in the match
        (
            vec![("files", "/files/a.txt"), ("method", "GET")],
            format!("files_/files/*.method 7/1s:{sw}:cap7 share@0"),
        ),
        (
            vec![("files", "/other"), ("method", "GET")],
            "none".to_owned(),
        ),
        // unlimited keeps its name and replaces
        (
            vec![("health", "x")],
            "health unlimited name=health replaces=exact".to_owned(),
        ),
        // several limits on one node
        (
            vec![("user", "u1")],
            format!(
                "user 10/1s:token_bucket:cap20,100/300s:gcra:cap100,10000/86400s:{sw}:cap10000"
            ),
        ),
    ];
    for (descriptor, expected) in cases {
        check(&descriptor, &expected);
    }
}

#[test]
fn share_threshold_level_keeps_the_pattern() {
    let rules = rules();
    let domain = rules.domain("test").expect("domain test");
    let found = domain
        .find(&[("files", "/files/x"), ("method", "PUT")])
        .expect("matches");
    assert!(found.levels[0].share_threshold());
    assert_eq!(
        found.levels[0].value(),
        &ValueMatcher::Wildcard("/files/*".into())
    );
    assert_eq!(found.levels[1].value(), &ValueMatcher::Any);
}

/// 10,000 wildcard rules and a request of 64 descriptors of 1 KiB
/// values: every descriptor reaches the rule it should (the time this
/// takes is measured in `benches/matching.rs`, not asserted here).
#[test]
fn ten_thousand_wildcards_and_long_values() {
    let mut yaml = String::from("domain: big\ndescriptors:\n");
    for n in 0..10_000 {
        yaml.push_str(&format!(
            "  - key: k\n    value: \"*mid{n}*end\"\n    rate_limit: {{unit: second, requests_per_unit: 1}}\n"
        ));
    }
    yaml.push_str("  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n");
    let rules = testing::rules_from("big.yaml", &yaml);
    let domain = rules.domain("big").expect("domain big");
    let filler = "x".repeat(1100);
    for descriptor in 0..64 {
        // Even descriptors end with `end` and reach `*mid{n}*end` for
        // the smallest n whose `mid{n}` occurs; odd ones do not end with
        // `end` and fall through to the key-only rule.
        let n = descriptor * 150;
        let tail = if descriptor % 2 == 0 { "end" } else { "enx" };
        let value = format!("{filler}mid{n}{tail}");
        let value = &value[value.len() - 1024..];
        assert_eq!(value.len(), 1024);
        let found = domain.find(&[("k", value)]).expect("a rule");
        let expected = if descriptor % 2 == 0 {
            // `mid{n}` also contains `mid{m}` for each prefix m of n.
            let smallest = (1..=n.to_string().len())
                .map(|digits| n.to_string()[..digits].parse::<usize>().unwrap())
                .min()
                .unwrap();
            format!("k_*mid{smallest}*end")
        } else {
            "k".to_owned()
        };
        assert_eq!(&**found.rule().path(), expected, "descriptor {descriptor}");
    }
}

#[test]
fn entries_match_by_their_bytes() {
    let rules = rules();
    let domain = rules.domain("test").expect("domain test");
    let path =
        |entries: &[(&[u8], &[u8])]| domain.find(entries).map(|it| it.rule().path().to_string());
    let long = vec![b'x'; 70_000];
    type Entries<'a> = Vec<(&'a [u8], &'a [u8])>;
    let cases: Vec<(Entries<'_>, Option<&str>)> = vec![
        // An exact value matches only the same bytes.
        (vec![(b"k", b"exact")], Some("k_exact")),
        (vec![(b"k", b"exact\xff")], Some("k")),
        (vec![(b"k", b"exac")], Some("k")),
        // Wildcards match bytes, including bytes that are not UTF-8.
        (vec![(b"k", b"pre\xff")], Some("k_pre*")),
        (vec![(b"k", b"\xffsuf")], Some("k_*suf")),
        (vec![(b"k", b"\xff")], Some("k")),
        // Key-only matches any value, of any length.
        (
            vec![(b"remote_address", b"\xff\xfe")],
            Some("remote_address"),
        ),
        (vec![(b"remote_address", &long)], Some("remote_address")),
        (vec![(b"remote_address", b"")], Some("remote_address")),
        // A key that is not UTF-8 matches no rule key.
        (vec![(b"k\xff", b"exact")], None),
        (vec![(b"\xff", b"v")], None),
        (vec![(b"tenant", b"t"), (b"path\xff", b"/x")], None),
    ];
    for (entries, expected) in cases {
        assert_eq!(path(&entries).as_deref(), expected, "{entries:?}");
    }
}
