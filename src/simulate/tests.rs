use super::*;

fn event(at_us: u64, cost: u32, allowed: bool) -> Event {
    Event {
        at_us,
        cost,
        allowed,
        remaining: 0,
    }
}

#[test]
fn most_in_window_counts_allowed_units_in_any_window_long_span() {
    let events = [
        event(0, 1, true),
        event(100, 2, true),
        event(500, 5, false),
        event(999, 1, true),
        // 1000 is a window after 0: 0 no longer counts.
        event(1_000, 1, true),
        event(2_500, 1, true),
    ];
    // (0, 1000] once 0 drops out: 2 + 1 + 1.
    assert_eq!(most_in_window(&events, 1_000), 4);
    assert_eq!(most_in_window(&events, 10_000), 6);
    assert_eq!(most_in_window(&events, 1), 2);
    assert_eq!(most_in_window(&[], 1_000), 0);
}

#[test]
fn durations_in_seconds() {
    assert_eq!(parse_seconds("10").unwrap(), 10_000_000);
    assert_eq!(parse_seconds("2.5").unwrap(), 2_500_000);
    assert_eq!(parse_seconds("0.000001").unwrap(), 1);
    for bad in [
        "0",
        "0.0",
        "",
        "-1",
        "1e3",
        "1.2345678",
        "x",
        "99999999999999999",
    ] {
        let err = parse_seconds(bad).unwrap_err().to_string();
        assert!(err.starts_with(&format!("--duration '{bad}'")), "{err}");
    }
    assert_eq!(seconds(2_500_000), "2.5");
    assert_eq!(seconds(60_000_000), "60");
}

#[test]
fn descriptors_are_key_value_pairs() {
    let request = request("api", &["user=alice".to_owned(), "path=/a=b".to_owned()]);
    let entries = &request.unwrap().descriptors[0].entries;
    assert_eq!(entries[1].key, b"path");
    assert_eq!(entries[1].value, b"/a=b");
    for bad in ["user", "=alice"] {
        let err = super::request("api", &[bad.to_owned()]).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("--descriptor '{bad}' is not key=value")
        );
    }
    assert!(super::request("api", &[]).is_err());
    assert!(super::request("", &["a=b".to_owned()]).is_err());
}
