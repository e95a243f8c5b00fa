//! The counter key format: `{prefix}:{domain}:{rule}:{algorithm}.{window}s[.override]:{entries}`.
//!
//! Every user-supplied string (domain, rule, entry keys and values) is
//! percent-escaped so that it never contains a separator, `%` or a brace:
//! the encoding is injective (two different [`CounterKey`]s never share a
//! Redis key, whatever their bytes) and user bytes never form a Redis
//! Cluster hash tag. Entries are joined by `:`; each is `key=value` for a
//! descriptor's own value and `key~pattern` for a `share_threshold`
//! wildcard's shared counter. The prefix is the operator's and is kept as is.

use std::fmt::Write;

use super::{CounterKey, KeyValue};

/// Encodes `key` under `prefix`. Injective over every field.
pub fn encode(prefix: &str, key: &CounterKey) -> String {
    let mut out = String::with_capacity(prefix.len() + 64);
    out.push_str(prefix);
    out.push(':');
    escape_into(&mut out, &key.domain);
    out.push(':');
    escape_into(&mut out, &key.rule);
    out.push(':');
    out.push_str(key.algorithm.name());
    // Writing into a String cannot fail.
    let _ = write!(out, ".{}s", key.window_s);
    if key.is_override {
        out.push_str(".override");
    }
    out.push(':');
    for (idx, entry) in key.entries.iter().enumerate() {
        if idx > 0 {
            out.push(':');
        }
        escape_into(&mut out, &entry.key);
        match &entry.value {
            KeyValue::Value(value) => {
                out.push('=');
                escape_into(&mut out, value);
            }
            KeyValue::Shared(pattern) => {
                out.push('~');
                escape_into(&mut out, pattern);
            }
        }
    }
    out
}

/// Appends `text` with `%`, the separators `:` `=` `~` and the hash-tag
/// braces `{` `}` percent-escaped; every other character is kept.
fn escape_into(out: &mut String, text: &str) {
    for ch in text.chars() {
        match ch {
            '%' => out.push_str("%25"),
            ':' => out.push_str("%3A"),
            '=' => out.push_str("%3D"),
            '~' => out.push_str("%7E"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            _ => out.push(ch),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::algorithms::Algorithm;
    use crate::backends::KeyEntry;

    fn key(entries: &[(&str, KeyValue)]) -> CounterKey {
        CounterKey {
            domain: Arc::from("api"),
            rule: Arc::from("remote_address"),
            algorithm: Algorithm::SlidingWindowLog,
            window_s: 60,
            is_override: false,
            entries: entries
                .iter()
                .map(|(k, v)| KeyEntry {
                    key: Arc::from(*k),
                    value: v.clone(),
                })
                .collect(),
        }
    }

    fn value(text: &str) -> KeyValue {
        KeyValue::Value(text.to_owned())
    }

    fn check(key: CounterKey, expected: &str) {
        assert_eq!(encode("tg", &key), expected);
    }

    #[test]
    fn format_is_pinned() {
        check(
            key(&[("remote_address", value("10.0.0.1"))]),
            "tg:api:remote_address:sliding_window_log.60s:remote_address=10.0.0.1",
        );
        check(
            key(&[
                ("tenant", value("acme")),
                ("path", KeyValue::Shared(Arc::from("/files/*"))),
            ]),
            "tg:api:remote_address:sliding_window_log.60s:tenant=acme:path~/files/*",
        );
        check(
            key(&[("a:b", value("c")), ("e", value(""))]),
            "tg:api:remote_address:sliding_window_log.60s:a%3Ab=c:e=",
        );
        check(
            key(&[("k", value("{tag}%=~_ü"))]),
            "tg:api:remote_address:sliding_window_log.60s:k=%7Btag%7D%25%3D%7E_ü",
        );
        check(key(&[]), "tg:api:remote_address:sliding_window_log.60s:");
        let mut other = key(&[("k", value("v"))]);
        other.algorithm = Algorithm::TokenBucket;
        other.window_s = 3_600;
        other.is_override = true;
        other.domain = Arc::from("d:{x}");
        other.rule = Arc::from("tenant.path_/expensive");
        check(
            other,
            "tg:d%3A%7Bx%7D:tenant.path_/expensive:token_bucket.3600s.override:k=v",
        );
    }

    #[test]
    fn look_alike_descriptors_get_different_keys() {
        let pairs = [
            (key(&[("a:b", value("c"))]), key(&[("a", value("b:c"))])),
            (
                key(&[("a", value("b")), ("c", value("d"))]),
                key(&[("a", value("b:c=d"))]),
            ),
            (
                key(&[("a", value("*"))]),
                key(&[("a", KeyValue::Shared(Arc::from("*")))]),
            ),
            (key(&[("a", value(""))]), key(&[("a=", value(""))])),
            (key(&[("", value(""))]), key(&[])),
            (key(&[("a", value("%3A"))]), key(&[("a", value(":"))])),
        ];
        for (left, right) in pairs {
            assert_ne!(
                encode("tg", &left),
                encode("tg", &right),
                "{left:?} vs {right:?}"
            );
        }
    }

    #[test]
    fn user_bytes_never_form_a_hash_tag() {
        let it = encode("tg", &key(&[("{a}", value("{b}"))]));
        assert!(!it.contains('{') && !it.contains('}'), "{it}");
    }

    /// The inverse of [`encode`] for a known prefix: its existence is the
    /// proof of injectivity the property test relies on.
    fn decode(prefix: &str, text: &str) -> Option<CounterKey> {
        let rest = text.strip_prefix(prefix)?.strip_prefix(':')?;
        let mut parts = rest.splitn(4, ':');
        let domain = unescape(parts.next()?)?;
        let rule = unescape(parts.next()?)?;
        let algorithm_part = parts.next()?;
        let entries_part = parts.next()?;
        let (algorithm_part, is_override) = match algorithm_part.strip_suffix(".override") {
            Some(it) => (it, true),
            None => (algorithm_part, false),
        };
        let (name, window) = algorithm_part.split_once('.')?;
        let window_s = window.strip_suffix('s')?.parse().ok()?;
        let algorithm = Algorithm::from_name(name)?;
        let mut entries = Vec::new();
        if !entries_part.is_empty() {
            for entry in entries_part.split(':') {
                let split = entry.find(['=', '~'])?;
                let key = unescape(&entry[..split])?;
                let raw = unescape(&entry[split + 1..])?;
                let value = if entry.as_bytes()[split] == b'=' {
                    KeyValue::Value(raw)
                } else {
                    KeyValue::Shared(Arc::from(raw))
                };
                entries.push(KeyEntry {
                    key: Arc::from(key),
                    value,
                });
            }
        }
        Some(CounterKey {
            domain: Arc::from(domain),
            rule: Arc::from(rule),
            algorithm,
            window_s,
            is_override,
            entries,
        })
    }

    fn unescape(text: &str) -> Option<String> {
        let mut out = String::new();
        let mut rest = text;
        while let Some(idx) = rest.find('%') {
            out.push_str(&rest[..idx]);
            let code = rest.get(idx + 1..idx + 3)?;
            out.push(match code {
                "25" => '%',
                "3A" => ':',
                "3D" => '=',
                "7E" => '~',
                "7B" => '{',
                "7D" => '}',
                _ => return None,
            });
            rest = &rest[idx + 3..];
        }
        out.push_str(rest);
        Some(out)
    }

    /// Strings built from the characters that could confuse an encoding.
    fn hostile() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just(":"),
                Just("="),
                Just("~"),
                Just("%"),
                Just("3A"),
                Just("{"),
                Just("}"),
                Just("_"),
                Just("."),
                Just("a"),
                Just("b"),
                Just("ü"),
                Just("*"),
            ],
            0..5,
        )
        .prop_map(|parts| parts.concat())
    }

    fn counter_key() -> impl Strategy<Value = CounterKey> {
        let entry =
            (hostile(), hostile(), any::<bool>()).prop_map(|(key, value, shared)| KeyEntry {
                key: Arc::from(key),
                value: if shared {
                    KeyValue::Shared(Arc::from(value))
                } else {
                    KeyValue::Value(value)
                },
            });
        (
            hostile(),
            hostile(),
            proptest::sample::select(Algorithm::ALL.to_vec()),
            prop_oneof![Just(1u64), Just(60), Just(3_600)],
            any::<bool>(),
            proptest::collection::vec(entry, 0..4),
        )
            .prop_map(
                |(domain, rule, algorithm, window_s, is_override, entries)| CounterKey {
                    domain: Arc::from(domain),
                    rule: Arc::from(rule),
                    algorithm,
                    window_s,
                    is_override,
                    entries,
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2_000))]

        #[test]
        fn encoding_round_trips(key in counter_key()) {
            let text = encode("tg:{x}", &key);
            prop_assert_eq!(decode("tg:{x}", &text), Some(key));
        }

        #[test]
        fn different_keys_never_collide(left in counter_key(), right in counter_key()) {
            if left != right {
                prop_assert_ne!(encode("tg", &left), encode("tg", &right));
            }
        }

        #[test]
        fn no_braces_from_user_bytes(key in counter_key()) {
            let text = encode("tg", &key);
            prop_assert!(!text.contains(['{', '}']), "{}", text);
        }
    }
}
