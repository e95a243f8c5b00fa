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
mod tests;
