use super::*;

fn settings(nodes: &[&str], master: &str) -> SentinelSettings {
    SentinelSettings {
        nodes: nodes.iter().map(|it| (*it).to_owned()).collect(),
        master: master.to_owned(),
        password: None,
    }
}

#[test]
fn sentinel_addresses_need_a_host_and_a_port() {
    assert_eq!(
        parse_node("10.0.0.1:26379").unwrap(),
        ("10.0.0.1".into(), 26379)
    );
    assert_eq!(parse_node(" s1:5 ").unwrap(), ("s1".into(), 5));
    assert_eq!(parse_node("[::1]:26379").unwrap(), ("::1".into(), 26379));
    for bad in ["s1", ":26379", "s1:", "s1:port", "s1:70000"] {
        let err = parse_node(bad).unwrap_err().to_string();
        assert!(err.contains("expected host:port"), "{bad}: {err}");
    }
}

#[test]
fn settings_that_cannot_work_are_refused() {
    let timeout = Duration::from_secs(1);
    let url = "redis://:pw@ignored:1/2";
    assert!(Sentinel::new(&settings(&["s:1"], "m"), url, &RedisTls::default(), timeout).is_ok());
    let cases = [
        (settings(&[], "m"), url, "no redis sentinel nodes"),
        (settings(&["s:1"], ""), url, "master name is empty"),
        (settings(&["s"], "m"), url, "expected host:port"),
        (
            settings(&["s:1"], "m"),
            "redis+unix:///tmp/r.sock",
            "redis+unix",
        ),
        (settings(&["s:1"], "m"), "nope://x", "invalid redis url"),
    ];
    for (settings, url, message) in cases {
        let Err(err) = Sentinel::new(&settings, url, &RedisTls::default(), timeout) else {
            panic!("{settings:?} {url} accepted");
        };
        assert!(err.to_string().contains(message), "{err}");
    }
}

#[test]
fn the_sentinel_password_is_not_shown() {
    let mut it = settings(&["s:1"], "m");
    it.password = Some("secret".into());
    assert!(!format!("{it:?}").contains("secret"));
}
