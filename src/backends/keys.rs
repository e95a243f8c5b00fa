//! The counter key format: `{prefix}:{domain}:{rule}:{algorithm}.{window}s[.override]:{entries}`.
//!
//! Every user-supplied string (domain, rule, entry keys and values) is
//! percent-escaped so that it never contains a separator, `%` or a brace:
//! the encoding is injective (two different [`CounterKey`]s never share a
//! Redis key, whatever their bytes) and user bytes never form a Redis
//! Cluster hash tag. Entries are joined by `:`; each is `key=value` for a
//! descriptor's own value and `key~pattern` for a `share_threshold`
//! wildcard's shared counter. Bytes that are not UTF-8 are escaped as `%XX`,
//! so the key is text. An entry key or value over
//! [`super::MAX_INLINE_BYTES`] is written as `%#` and its SHA-256 digest in
//! 64 hex digits: escaping never writes `%#`, so a digest never equals a
//! short value, and the encoding stays injective up to SHA-256 collisions.
//! The prefix is the operator's and is kept as is.
//!
//! A key's name is part of its stored layout (docs/redis.md, "Stored
//! layouts"): the algorithm it names says how its value is read, and every
//! version of the service that shares a Redis computes the same names. A
//! change of a state's layout that a running version would misread must
//! come with new names here (a layout tag in the limit segment), so that
//! versions never share a key they read differently; `format_is_pinned`
//! keeps the names from changing by accident.
//!
//! Invariant: two different counters never share a key, and only the
//! service writes a hash tag into one.

use std::fmt::Write;

use super::{CounterKey, KeyBytes, KeyValue};

/// Which counters the service puts in one Redis Cluster hash slot by
/// writing its own hash tag into their keys. Only the service writes a
/// tag: user bytes are escaped, so the first `{...}` of a key is always the
/// service's (or the operator's prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HashTag {
    /// No tag: every counter hashes on its whole key, so a request's
    /// counters spread over the cluster.
    #[default]
    None,
    /// `{domain}`: every counter of a domain in one slot, so every request
    /// is one script call (and one domain's load lands on one node).
    Domain,
    /// `{domain:entries}`: the limits of one descriptor share a slot, so a
    /// request is one call per distinct descriptor.
    Descriptor,
}

/// How counter keys are written: the operator's prefix and the hash tag.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KeyFormat {
    pub prefix: String,
    pub hash_tag: HashTag,
}

impl KeyFormat {
    pub fn new(prefix: impl Into<String>, hash_tag: HashTag) -> KeyFormat {
        KeyFormat {
            prefix: prefix.into(),
            hash_tag,
        }
    }

    /// The Redis key of `key`. Injective over every field, and over the
    /// three tag modes together (an untagged key never has `{` after the
    /// prefix; a domain tag closes right after the domain, a descriptor
    /// tag continues with `:`).
    pub fn encode(&self, key: &CounterKey) -> String {
        match self.hash_tag {
            HashTag::None => encode(&self.prefix, key),
            HashTag::Domain => encode_by_domain(&self.prefix, key, true),
            HashTag::Descriptor => encode_descriptor_tagged(&self.prefix, key),
        }
    }
}

/// Encodes `key` under `prefix`. Injective over every field.
pub fn encode(prefix: &str, key: &CounterKey) -> String {
    encode_by_domain(prefix, key, false)
}

/// `{prefix}:{domain}:{rule}:{algorithm}.{window}s[.override]:{entries}`,
/// with the domain written as the hash tag `{{domain}}` when `tagged`.
fn encode_by_domain(prefix: &str, key: &CounterKey, tagged: bool) -> String {
    let mut out = String::with_capacity(prefix.len() + 66);
    out.push_str(prefix);
    out.push(':');
    if tagged {
        out.push('{');
    }
    escape_into(&mut out, &key.domain);
    if tagged {
        out.push('}');
    }
    out.push(':');
    escape_into(&mut out, &key.rule);
    out.push(':');
    limit_into(&mut out, key);
    out.push(':');
    entries_into(&mut out, key);
    out
}

/// `{prefix}:{{domain}:{entries}}:{rule}:{algorithm}.{window}s[.override]`:
/// the tag holds what identifies the descriptor whatever its position in
/// the request and whichever of its rule or override counts it.
fn encode_descriptor_tagged(prefix: &str, key: &CounterKey) -> String {
    let mut out = String::with_capacity(prefix.len() + 66);
    out.push_str(prefix);
    out.push_str(":{");
    escape_into(&mut out, &key.domain);
    out.push(':');
    entries_into(&mut out, key);
    out.push_str("}:");
    escape_into(&mut out, &key.rule);
    out.push(':');
    limit_into(&mut out, key);
    out
}

/// `{algorithm}.{window}s[.override]`.
fn limit_into(out: &mut String, key: &CounterKey) {
    out.push_str(key.algorithm.name());
    out.push('.');
    out.push_str(itoa::Buffer::new().format(key.window_s));
    out.push('s');
    if key.is_override {
        out.push_str(".override");
    }
}

/// The entries joined by `:`, each `key=value` or `key~pattern`.
fn entries_into(out: &mut String, key: &CounterKey) {
    for (idx, entry) in key.entries.iter().enumerate() {
        if idx > 0 {
            out.push(':');
        }
        key_bytes_into(out, &entry.key);
        match &entry.value {
            KeyValue::Value(value) => {
                out.push('=');
                key_bytes_into(out, value);
            }
            KeyValue::Shared(pattern) => {
                out.push('~');
                escape_into(out, pattern);
            }
        }
    }
}

/// Appends an entry key or value: its escaped bytes, or `%#` and the hex
/// digest of a long one.
fn key_bytes_into(out: &mut String, bytes: &KeyBytes) {
    if let Some(digest) = bytes.digest() {
        out.push_str("%#");
        for byte in digest {
            let _ = write!(out, "{byte:02x}");
        }
        return;
    }
    let raw = bytes.inline().unwrap_or_default();
    // Most entries are ASCII with nothing to escape: copied whole, without
    // a pass per UTF-8 chunk and per escaped character.
    if raw.iter().all(|&byte| byte.is_ascii() && !escaped(byte))
        && let Ok(text) = std::str::from_utf8(raw)
    {
        out.push_str(text);
        return;
    }
    for chunk in raw.utf8_chunks() {
        escape_into(out, chunk.valid());
        for byte in chunk.invalid() {
            let _ = write!(out, "%{byte:02X}");
        }
    }
}

/// Appends `text` with `%`, the separators `:` `=` `~` and the hash-tag
/// braces `{` `}` percent-escaped; every other character is kept.
///
/// Copies the runs between escaped characters whole: they are all ASCII,
/// so every split falls on a character boundary.
fn escape_into(out: &mut String, text: &str) {
    let mut rest = text;
    while let Some(at) = rest.bytes().position(escaped) {
        out.push_str(&rest[..at]);
        out.push_str(match rest.as_bytes()[at] {
            b'%' => "%25",
            b':' => "%3A",
            b'=' => "%3D",
            b'~' => "%7E",
            b'{' => "%7B",
            _ => "%7D",
        });
        rest = &rest[at + 1..];
    }
    out.push_str(rest);
}

/// Whether [`escape_into`] escapes this byte.
fn escaped(byte: u8) -> bool {
    matches!(byte, b'%' | b':' | b'=' | b'~' | b'{' | b'}')
}

#[cfg(test)]
mod tests;
