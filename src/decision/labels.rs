//! Request bytes as text for logs and metric labels, and the `rule` label
//! of a descriptor's decision.

use std::borrow::Cow;
use std::fmt::Write;

use crate::backends::KeyBytes;
use crate::metrics::MetricRule;
use crate::rules::{Node, ValueMatcher};

use super::Entry;

/// Request bytes as text for logs and metric labels: UTF-8 as is, every
/// byte that is not UTF-8 and every control character as `\xNN` (or
/// `\u{NNNN}`), and `\` as `\\`, so no two byte strings look alike; never
/// raw bytes.
pub fn printable(bytes: &[u8]) -> Cow<'_, str> {
    if let Ok(text) = std::str::from_utf8(bytes)
        && !text.chars().any(|ch| ch == '\\' || ch.is_control())
    {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(bytes.len() + 8);
    // Writing into a String cannot fail.
    for chunk in bytes.utf8_chunks() {
        for ch in chunk.valid().chars() {
            match ch {
                '\\' => out.push_str("\\\\"),
                _ if ch.is_ascii_control() => {
                    let _ = write!(out, "\\x{:02x}", u32::from(ch));
                }
                _ if ch.is_control() => {
                    let _ = write!(out, "{}", ch.escape_unicode());
                }
                _ => out.push(ch),
            }
        }
        for byte in chunk.invalid() {
            let _ = write!(out, "\\x{byte:02x}");
        }
    }
    Cow::Owned(out)
}

/// Request bytes as a short label for logs and metrics: [`printable`], or
/// `sha256:<hex>` for bytes a counter key holds as their digest.
pub fn bytes_label(bytes: &[u8]) -> String {
    match KeyBytes::new(bytes).digest() {
        Some(digest) => {
            let mut out = String::with_capacity(7 + 64);
            out.push_str("sha256:");
            for byte in digest {
                // Writing into a String cannot fail.
                let _ = write!(out, "{byte:02x}");
            }
            out
        }
        None => printable(bytes).into_owned(),
    }
}

/// The `rule` label of a descriptor that reached `levels`: the rule's path,
/// unless the rule has `detailed_metric` (every level with its value, as
/// envoyproxy/ratelimit) or some level has `value_to_metric` (that level
/// with its value, even where the config names none or a wildcard).
pub(super) fn metric_rule(levels: &[&Node], entries: &[Entry]) -> MetricRule {
    let Some(rule) = levels.last() else {
        return MetricRule::Override;
    };
    let detailed = rule.detailed_metric();
    if !detailed && !levels.iter().any(|it| it.value_to_metric()) {
        return MetricRule::Path(rule.path().clone());
    }
    let mut label = String::new();
    for (level, entry) in levels.iter().zip(entries) {
        if !label.is_empty() {
            label.push('.');
        }
        label.push_str(level.key());
        if detailed || level.value_to_metric() {
            // Escaped, and a long value as its digest: a label stays short
            // and printable whatever the request sends.
            label.push('_');
            label.push_str(&bytes_label(&entry.value));
        } else if let ValueMatcher::Exact(value) | ValueMatcher::Wildcard(value) = level.value() {
            label.push('_');
            label.push_str(value);
        }
    }
    MetricRule::Values {
        rule: rule.path().clone(),
        label,
    }
}

#[cfg(test)]
mod tests;
