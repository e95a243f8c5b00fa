use super::*;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN: &str = "00f067aa0ba902b7";

fn parent() -> Option<Parent> {
    Some(Parent {
        trace_id: 0x4bf92f3577b34da6a3ce929d0e0e4736,
        span_id: 0x00f067aa0ba902b7,
    })
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.insert(*name, value.parse().unwrap());
    }
    map
}

#[test]
fn traceparent_gives_the_parent_and_its_sampled_flag() {
    let cases = [
        (format!("00-{TRACE}-{SPAN}-01"), Some(true)),
        (format!("00-{TRACE}-{SPAN}-00"), Some(false)),
        (format!("00-{TRACE}-{SPAN}-03"), Some(true)),
        (format!("01-{TRACE}-{SPAN}-01-later"), Some(true)),
    ];
    for (value, sampled) in cases {
        let found = traceparent(&value).unwrap_or_else(|| panic!("{value}"));
        assert_eq!(found.parent, parent(), "{value}");
        assert_eq!(found.sampled, sampled, "{value}");
    }
}

#[test]
fn bad_traceparents_are_ignored() {
    for value in [
        String::new(),
        format!("ff-{TRACE}-{SPAN}-01"),
        format!("00-{TRACE}-{SPAN}-01-extra"),
        format!("00-{}-{SPAN}-01", "0".repeat(32)),
        format!("00-{TRACE}-{}-01", "0".repeat(16)),
        format!("00-{}-{SPAN}-01", TRACE.to_uppercase()),
        format!("00-{TRACE}-{SPAN}"),
        format!("00-{}-{SPAN}-01", &TRACE[..30]),
    ] {
        assert_eq!(traceparent(&value), None, "{value}");
    }
}

#[test]
fn b3_single_header_forms() {
    let with = |sampled| Incoming {
        parent: parent(),
        sampled,
    };
    assert_eq!(b3_single(&format!("{TRACE}-{SPAN}")), Some(with(None)));
    assert_eq!(
        b3_single(&format!("{TRACE}-{SPAN}-1")),
        Some(with(Some(true)))
    );
    assert_eq!(
        b3_single(&format!("{TRACE}-{SPAN}-d-05e3ac9a4f6e3b90")),
        Some(with(Some(true)))
    );
    assert_eq!(
        b3_single(&format!("{TRACE}-{SPAN}-0")),
        Some(with(Some(false)))
    );
    let short = b3_single(&format!("a3ce929d0e0e4736-{SPAN}-1")).unwrap();
    assert_eq!(short.parent.unwrap().trace_id, 0xa3ce929d0e0e4736);
    assert_eq!(
        b3_single("0"),
        Some(Incoming {
            parent: None,
            sampled: Some(false)
        })
    );
    for bad in ["", "x", &format!("{TRACE}-{SPAN}-2"), TRACE] {
        assert_eq!(b3_single(bad), None, "{bad}");
    }
}

#[test]
fn b3_multi_headers_and_the_order_of_formats() {
    let found = incoming(&headers(&[
        ("x-b3-traceid", TRACE),
        ("x-b3-spanid", SPAN),
        ("x-b3-sampled", "1"),
    ]));
    assert_eq!(found.parent, parent());
    assert_eq!(found.sampled, Some(true));
    let debug = incoming(&headers(&[
        ("x-b3-traceid", TRACE),
        ("x-b3-spanid", SPAN),
        ("x-b3-flags", "1"),
    ]));
    assert_eq!(debug.sampled, Some(true));
    // A trace id without a span id is no parent.
    assert_eq!(
        incoming(&headers(&[("x-b3-traceid", TRACE)])),
        Incoming::default()
    );
    // traceparent wins over b3, and a bad traceparent falls through.
    let other = "0af7651916cd43dd8448eb211c80319c";
    let both = incoming(&headers(&[
        ("traceparent", &format!("00-{other}-{SPAN}-00")),
        ("b3", &format!("{TRACE}-{SPAN}-1")),
    ]));
    assert_eq!(
        both.parent.unwrap().trace_id,
        u128::from_str_radix(other, 16).unwrap()
    );
    let fallback = incoming(&headers(&[
        ("traceparent", "garbage"),
        ("b3", &format!("{TRACE}-{SPAN}-1")),
    ]));
    assert_eq!(fallback.parent, parent());
    assert_eq!(incoming(&HeaderMap::new()), Incoming::default());
}
