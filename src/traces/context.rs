//! The caller's trace context, read from its request headers: W3C
//! `traceparent`, then B3 as one `b3` header, then B3 as `x-b3-*` headers
//! (Envoy sends whichever its tracer is configured for). A header that
//! does not parse is ignored, as if absent: the decision starts a trace of
//! its own rather than fail.

use http::HeaderMap;

/// What the caller's headers say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Incoming {
    /// The caller's trace id and span id (the parent of ours).
    pub parent: Option<Parent>,
    /// The caller's sampling decision; `None`: ours to make.
    pub sampled: Option<bool>,
}

/// A remote parent span.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parent {
    pub trace_id: u128,
    pub span_id: u64,
}

/// The trace context in `headers`, by the first propagation format
/// present that parses.
pub fn incoming(headers: &HeaderMap) -> Incoming {
    let text = |name: &str| headers.get(name).and_then(|it| it.to_str().ok());
    if let Some(found) = text("traceparent").and_then(traceparent) {
        return found;
    }
    if let Some(found) = text("b3").and_then(b3_single) {
        return found;
    }
    b3_multi(
        text("x-b3-traceid"),
        text("x-b3-spanid"),
        text("x-b3-sampled"),
        text("x-b3-flags"),
    )
    .unwrap_or_default()
}

/// `version-traceid-spanid-flags`, lowercase hex (W3C Trace Context).
/// Version `ff` and all-zero ids are invalid; a later version may append
/// fields, which are ignored.
pub fn traceparent(value: &str) -> Option<Incoming> {
    let value = value.trim();
    let mut parts = value.split('-');
    let version = parts.next()?;
    let (trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || !is_lower_hex(version) || version == "ff" {
        return None;
    }
    if version == "00" && parts.next().is_some() {
        return None;
    }
    if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    if ![trace, span, flags].iter().all(|it| is_lower_hex(it)) {
        return None;
    }
    let parent = parent(trace, span)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some(Incoming {
        parent: Some(parent),
        sampled: Some(flags & 1 == 1),
    })
}

/// `b3: traceid-spanid[-sampled[-parentspanid]]`, or a sampling decision
/// alone (`0`, `1`, `d`). A 64-bit trace id is the low half of ours.
pub fn b3_single(value: &str) -> Option<Incoming> {
    let value = value.trim();
    if let Some(sampled) = b3_sampling(value) {
        return Some(Incoming {
            parent: None,
            sampled: Some(sampled),
        });
    }
    let mut parts = value.split('-');
    let (trace, span) = (parts.next()?, parts.next()?);
    let sampled = match parts.next() {
        None => None,
        Some(state) => Some(b3_sampling(state)?),
    };
    if let Some(parent_span) = parts.next()
        && (parent_span.len() != 16 || !is_hex(parent_span))
    {
        return None;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Incoming {
        parent: Some(b3_ids(trace, span)?),
        sampled,
    })
}

/// `x-b3-traceid`, `x-b3-spanid`, `x-b3-sampled` (`1`/`0`, or
/// `true`/`false` from older tracers), `x-b3-flags: 1` (debug: sampled).
pub fn b3_multi(
    trace: Option<&str>,
    span: Option<&str>,
    sampled: Option<&str>,
    flags: Option<&str>,
) -> Option<Incoming> {
    let sampled = if flags.map(str::trim) == Some("1") {
        Some(true)
    } else {
        match sampled.map(str::trim) {
            None => None,
            Some("1" | "true" | "True") => Some(true),
            Some("0" | "false" | "False") => Some(false),
            Some(_) => return None,
        }
    };
    let parent = match (trace, span) {
        (Some(trace), Some(span)) => Some(b3_ids(trace.trim(), span.trim())?),
        (None, None) => None,
        _ => return None,
    };
    if parent.is_none() && sampled.is_none() {
        return None;
    }
    Some(Incoming { parent, sampled })
}

fn b3_sampling(state: &str) -> Option<bool> {
    match state {
        "1" | "d" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

/// B3 ids: a trace id of 16 or 32 hex digits, a span id of 16 (either
/// case, as tracers write them).
fn b3_ids(trace: &str, span: &str) -> Option<Parent> {
    if !matches!(trace.len(), 16 | 32) || span.len() != 16 || !is_hex(trace) || !is_hex(span) {
        return None;
    }
    parent(trace, span)
}

fn parent(trace: &str, span: &str) -> Option<Parent> {
    let trace_id = u128::from_str_radix(trace, 16).ok()?;
    let span_id = u64::from_str_radix(span, 16).ok()?;
    (trace_id != 0 && span_id != 0).then_some(Parent { trace_id, span_id })
}

fn is_hex(text: &str) -> bool {
    text.bytes().all(|it| it.is_ascii_hexdigit())
}

fn is_lower_hex(text: &str) -> bool {
    text.bytes()
        .all(|it| it.is_ascii_digit() || (b'a'..=b'f').contains(&it))
}

#[cfg(test)]
mod tests {
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
}
