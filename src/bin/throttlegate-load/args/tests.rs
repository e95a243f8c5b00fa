use super::*;

fn check_duration(text: &str, expected: Option<Duration>) {
    assert_eq!(parse_duration(text).ok(), expected, "{text}");
}

#[test]
fn durations_parse_with_their_units() {
    check_duration("10s", Some(Duration::from_secs(10)));
    check_duration("10", Some(Duration::from_secs(10)));
    check_duration("1.5s", Some(Duration::from_millis(1500)));
    check_duration("500ms", Some(Duration::from_millis(500)));
    check_duration("250us", Some(Duration::from_micros(250)));
    check_duration("2m", Some(Duration::from_secs(120)));
    check_duration("1h", Some(Duration::from_secs(3600)));
    check_duration("0s", Some(Duration::ZERO));
}

#[test]
fn bad_durations_are_refused() {
    for text in ["", "s", "10x", "-1s", "1.2.3s", "ten seconds", "1e999s"] {
        check_duration(text, None);
    }
}

#[test]
fn pids_take_an_optional_label() {
    assert_eq!(parse_pid("1234"), Ok(("pid1234".to_owned(), 1234)));
    assert_eq!(parse_pid("service=42"), Ok(("service".to_owned(), 42)));
    assert!(parse_pid("=42").is_err());
    assert!(parse_pid("redis=x").is_err());
    assert!(parse_pid("-3").is_err());
}

#[test]
fn entries_need_a_key() {
    assert_eq!(
        parse_entry("method=GET"),
        Ok(("method".to_owned(), "GET".to_owned()))
    );
    assert_eq!(parse_entry("a=b=c"), Ok(("a".to_owned(), "b=c".to_owned())));
    assert!(parse_entry("=GET").is_err());
    assert!(parse_entry("method").is_err());
}

#[test]
fn shares_rates_and_intervals_are_checked() {
    assert_eq!(parse_share("0"), Ok(0.0));
    assert_eq!(parse_share("0.25"), Ok(0.25));
    assert_eq!(parse_share("1"), Ok(1.0));
    for bad in ["-0.1", "1.01", "NaN", "half", ""] {
        assert!(parse_share(bad).is_err(), "{bad}");
    }
    assert_eq!(parse_rate("2500"), Ok(2500.0));
    assert_eq!(parse_rate("0.5"), Ok(0.5));
    for bad in ["0", "-5", "inf", "NaN", "1e8", "fast"] {
        assert!(parse_rate(bad).is_err(), "{bad}");
    }
    assert_eq!(parse_interval("30s"), Ok(Duration::from_secs(30)));
    assert!(parse_interval("0s").is_err());
    assert!(parse_interval("500us").is_err());
}

#[test]
fn hot_keys_must_be_at_least_one() {
    let parse = |extra: &[&str]| Args::try_parse_from(["throttlegate-load"].iter().chain(extra));
    assert!(parse(&["--hot-keys", "0"]).is_err());
    let args = parse(&[
        "--distribution",
        "hot-and-fresh",
        "--hot-keys",
        "3",
        "--hot-share",
        "0.5",
    ])
    .unwrap();
    assert_eq!(args.distribution, Distribution::HotAndFresh);
    assert_eq!((args.hot_keys, args.hot_share), (3, 0.5));
}

#[test]
fn the_request_budget_defaults_only_without_a_duration() {
    let args =
        |extra: &[&str]| Args::try_parse_from(["throttlegate-load"].iter().chain(extra)).unwrap();
    assert_eq!(args(&[]).request_budget(), Some(100_000));
    assert_eq!(args(&["--duration", "1s"]).request_budget(), None);
    assert_eq!(args(&["--requests", "7"]).request_budget(), Some(7));
    assert_eq!(
        args(&["--distinct-values", "9"]).keys,
        9,
        "the old flag name still works"
    );
}
