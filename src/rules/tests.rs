use super::*;

fn node(parent: &str, key: &str, value: &str) -> Node {
    Node::new(
        parent,
        key.into(),
        ValueMatcher::from_config(value),
        NodeLimits::None,
    )
}

/// The path of the rule `entries` reach, or `None`.
fn reached(domain: &Domain, entries: &[(&str, &str)]) -> Option<String> {
    domain.find(entries).map(|it| it.rule().path().to_string())
}

#[test]
fn constructors_build_the_index_and_paths() {
    let tenant = node("", "tenant", "").with_children(vec![
        node("tenant", "path", "/a*"),
        node("tenant", "path", ""),
    ]);
    let domain = Domain::new(
        "d".into(),
        Algorithm::SlidingWindowLog,
        vec![
            node("", "k", "exact"),
            node("", "k", "pre*"),
            node("", "k", "p*"),
            node("", "k", ""),
            tenant,
            node("", "acme", "x").with_children(vec![node("acme_x", "user", "")]),
        ],
    );
    type Case<'a> = (Vec<(&'a str, &'a str)>, Option<&'a str>);
    let cases: Vec<Case<'_>> = vec![
        (vec![("k", "exact")], Some("k_exact")),
        (vec![("k", "prefix")], Some("k_pre*")),
        (vec![("k", "px")], Some("k_p*")),
        (vec![("k", "other")], Some("k")),
        (
            vec![("tenant", "t"), ("path", "/ab")],
            Some("tenant.path_/a*"),
        ),
        (vec![("tenant", "t"), ("path", "/b")], Some("tenant.path")),
        (vec![("acme", "x"), ("user", "u")], Some("acme_x.user")),
        (vec![("acme", "y"), ("user", "u")], None),
        (vec![("k", "exact"), ("more", "m")], None),
        (vec![], None),
    ];
    for (entries, expected) in cases {
        assert_eq!(
            reached(&domain, &entries).as_deref(),
            expected,
            "{entries:?}"
        );
    }
    assert_eq!(domain.children().len(), 6);
    assert_eq!(domain.children()[4].children().len(), 2);
}

#[test]
fn replacing_children_rebuilds_the_index() {
    let parent = node("", "p", "").with_children(vec![node("p", "old", "")]);
    let parent = parent.with_children(vec![node("p", "new", "")]);
    let domain = Domain::new("d".into(), Algorithm::FixedWindow, vec![parent]);
    assert_eq!(reached(&domain, &[("p", "1"), ("old", "2")]), None);
    assert_eq!(
        reached(&domain, &[("p", "1"), ("new", "2")]).as_deref(),
        Some("p.new")
    );
}

#[test]
fn a_rule_set_finds_each_domain_by_its_name() {
    let rules = RuleSet::new(
        [
            Domain::new("a".into(), Algorithm::Gcra, Vec::new()),
            Domain::new("b".into(), Algorithm::TokenBucket, Vec::new()),
        ],
        7,
    );
    assert_eq!(rules.domains().len(), 2);
    assert_eq!(
        rules.domain("a").map(|it| it.default_algorithm()),
        Some(Algorithm::Gcra)
    );
    assert_eq!(rules.domain("c"), None);
    assert_eq!(rules.max_log_entries(), 7);
}

#[test]
fn share_threshold_is_kept_only_on_a_wildcard() {
    let flags = NodeFlags {
        shadow_mode: true,
        share_threshold: true,
        ..NodeFlags::default()
    };
    let wildcard = node("", "k", "a*").with_flags(flags);
    assert_eq!(wildcard.flags(), flags);
    for value in ["", "exact"] {
        let other = node("", "k", value).with_flags(flags);
        assert!(!other.share_threshold(), "{value:?}");
        assert!(other.shadow_mode(), "{value:?}");
    }
}
