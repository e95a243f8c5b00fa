use super::*;

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[test]
fn descriptors_split_at_unescaped_commas_and_first_equals() {
    let cases: &[(&str, &[(&str, &str)])] = &[
        ("k=v", &[("k", "v")]),
        ("a=1,b=2", &[("a", "1"), ("b", "2")]),
        ("path=/a=b", &[("path", "/a=b")]),
        ("k=", &[("k", "")]),
        (r"k=a\,b", &[("k", "a,b")]),
        (r"k\=x=v", &[("k=x", "v")]),
        (r"k=a\\,b=c", &[("k", r"a\"), ("b", "c")]),
        ("k=é,ü=ß", &[("k", "é"), ("ü", "ß")]),
    ];
    for (text, expected) in cases {
        assert_eq!(parse_descriptor(text), Ok(pairs(expected)), "{text}");
    }
}

#[test]
fn bad_descriptors_are_refused_with_the_reason() {
    for (text, reason) in [
        ("", "not key=value"),
        ("k", "not key=value"),
        ("a=1,", "not key=value"),
        ("=v", "empty key"),
        (r"k=a\b", "escapes only"),
        ("k=a\\", "escapes only"),
    ] {
        let err = parse_descriptor(text).unwrap_err();
        assert!(err.contains(reason), "{text}: {err}");
    }
}

#[test]
fn addresses_with_and_without_a_scheme() {
    assert_eq!(
        split_scheme("localhost:8081").unwrap(),
        ("localhost:8081".into(), false)
    );
    assert_eq!(
        split_scheme("https://rl.internal:443/").unwrap(),
        ("rl.internal:443".into(), true)
    );
    assert_eq!(
        split_scheme("http://[::1]:8081").unwrap(),
        ("[::1]:8081".into(), false)
    );
    assert!(split_scheme("unix:///run/rl.sock").is_err());
    assert!(split_scheme("http://a:1/path").is_err());
    assert_eq!(host_of("[::1]:8081"), "::1");
    assert_eq!(host_of("rl.internal:443"), "rl.internal");
}
