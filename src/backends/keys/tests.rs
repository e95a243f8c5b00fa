use std::sync::Arc;

use proptest::prelude::*;

use sha2::{Digest, Sha256};

use super::*;
use crate::algorithms::Algorithm;
use crate::backends::{KeyEntry, MAX_INLINE_BYTES};

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

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
                key: (*k).into(),
                value: v.clone(),
            })
            .collect(),
    }
}

fn value(text: &str) -> KeyValue {
    KeyValue::Value(text.into())
}

fn bytes_value(bytes: &[u8]) -> KeyValue {
    KeyValue::Value(bytes.into())
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
    // Bytes that are not UTF-8 are escaped; UTF-8 around them is kept.
    check(
        key(&[("k", bytes_value(b"a\xff\xc3\xbc%"))]),
        "tg:api:remote_address:sliding_window_log.60s:k=a%FFü%25",
    );
    // At the inline bound the bytes are kept; one more byte and the
    // value is its digest.
    let inline = "v".repeat(MAX_INLINE_BYTES);
    check(
        key(&[("k", value(&inline))]),
        &format!("tg:api:remote_address:sliding_window_log.60s:k={inline}"),
    );
    let long = "v".repeat(MAX_INLINE_BYTES + 1);
    check(
        key(&[(&long, value(&long))]),
        &format!(
            "tg:api:remote_address:sliding_window_log.60s:%#{digest}=%#{digest}",
            digest = sha256_hex(long.as_bytes())
        ),
    );
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
            let key = key_bytes(&entry[..split])?;
            let raw = &entry[split + 1..];
            let value = if entry.as_bytes()[split] == b'=' {
                KeyValue::Value(key_bytes(raw)?)
            } else {
                KeyValue::Shared(Arc::from(unescape(raw)?))
            };
            entries.push(KeyEntry { key, value });
        }
    }
    Some(from_parts((
        domain,
        rule,
        algorithm,
        window_s,
        is_override,
        entries,
    )))
}

/// A counter key's fields, in the order [`encode`] writes them.
type KeyParts = (String, String, Algorithm, u64, bool, Vec<KeyEntry>);

fn from_parts((domain, rule, algorithm, window_s, is_override, entries): KeyParts) -> CounterKey {
    CounterKey {
        domain: Arc::from(domain),
        rule: Arc::from(rule),
        algorithm,
        window_s,
        is_override,
        entries,
    }
}

fn unescape(text: &str) -> Option<String> {
    String::from_utf8(unescape_bytes(text)?).ok()
}

/// `%XX` back to the byte XX; `None` for anything [`encode`] never writes.
fn unescape_bytes(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(idx) = rest.find('%') {
        out.extend_from_slice(&rest.as_bytes()[..idx]);
        let code = rest.get(idx + 1..idx + 3)?;
        let byte = u8::from_str_radix(code, 16).ok()?;
        // Only the special characters and bytes that are not UTF-8 are
        // escaped, in upper case.
        let escaped = matches!(byte, b'%' | b':' | b'=' | b'~' | b'{' | b'}') || byte >= 0x80;
        if !escaped || code != format!("{byte:02X}") {
            return None;
        }
        out.push(byte);
        rest = &rest[idx + 3..];
    }
    out.extend_from_slice(rest.as_bytes());
    Some(out)
}

/// An entry key or value: `%#` and a digest, or escaped bytes.
fn key_bytes(text: &str) -> Option<KeyBytes> {
    if let Some(hex) = text.strip_prefix("%#") {
        let digest: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(hex.get(at..at + 2)?, 16).ok())
            .collect::<Option<_>>()?;
        let digest: [u8; 32] = digest.try_into().ok()?;
        let key = KeyBytes::from_digest(digest);
        return Some(key);
    }
    let bytes = unescape_bytes(text)?;
    // A long value is always written as its digest.
    (bytes.len() <= MAX_INLINE_BYTES).then(|| KeyBytes::new(&bytes))
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

/// Bytes built from pieces that could confuse an encoding, including
/// bytes that are not UTF-8 and what a digest is written as.
fn hostile_bytes() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        prop_oneof![
            Just(&b":"[..]),
            Just(&b"="[..]),
            Just(&b"%"[..]),
            Just(&b"%#"[..]),
            Just(&b"#"[..]),
            Just(&b"FF"[..]),
            Just(&b"ff"[..]),
            Just(&b"{"[..]),
            Just(&b"a"[..]),
            Just(&b"\xff"[..]),
            Just(&b"\xc3"[..]),
            Just(&b"\xbc"[..]),
            Just("ü".as_bytes()),
        ],
        0..5,
    )
    .prop_map(|parts| parts.concat())
}

/// Hostile bytes, sometimes padded to just below or just over the
/// inline bound, so that both sides of it are compared.
fn entry_bytes() -> impl Strategy<Value = Vec<u8>> {
    (
        hostile_bytes(),
        prop_oneof![Just(0usize), MAX_INLINE_BYTES - 2..MAX_INLINE_BYTES + 3],
    )
        .prop_map(|(mut bytes, len)| {
            if bytes.len() < len {
                bytes.resize(len, b'x');
            }
            bytes
        })
}

fn counter_key() -> impl Strategy<Value = CounterKey> {
    let entry = (entry_bytes(), entry_bytes(), hostile(), any::<bool>()).prop_map(
        |(key, value, pattern, shared)| KeyEntry {
            key: KeyBytes::new(&key),
            value: if shared {
                KeyValue::Shared(Arc::from(pattern))
            } else {
                KeyValue::Value(KeyBytes::new(&value))
            },
        },
    );
    (
        hostile(),
        hostile(),
        proptest::sample::select(Algorithm::ALL.to_vec()),
        prop_oneof![Just(1u64), Just(60), Just(3_600)],
        any::<bool>(),
        proptest::collection::vec(entry, 0..4),
    )
        .prop_map(from_parts)
}

#[test]
fn a_digest_never_equals_a_short_value() {
    let long = vec![b'v'; MAX_INLINE_BYTES + 1];
    let hex = sha256_hex(&long);
    let digest = Sha256::digest(&long);
    let encoded = encode("tg", &key(&[("k", bytes_value(&long))]));
    // Short values that spell the digest in every way we could think of.
    let look_alikes: Vec<Vec<u8>> = vec![
        format!("%#{hex}").into_bytes(),
        format!("#{hex}").into_bytes(),
        hex.clone().into_bytes(),
        hex.to_uppercase().into_bytes(),
        digest.to_vec(),
    ];
    for short in look_alikes {
        let other = encode("tg", &key(&[("k", bytes_value(&short))]));
        assert_ne!(encoded, other, "{short:?}");
    }
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
    fn a_digest_never_equals_an_escaped_short_value(
        short in hostile_bytes(),
        long in entry_bytes().prop_filter("long", |it| it.len() > MAX_INLINE_BYTES),
    ) {
        let left = encode("tg", &key(&[("k", bytes_value(&short))]));
        let right = encode("tg", &key(&[("k", bytes_value(&long))]));
        prop_assert_ne!(left, right);
    }

    #[test]
    fn keys_are_short_and_escape_bytes_that_are_not_utf8(key in counter_key()) {
        let text = encode("tg", &key);
        // Every byte that is not UTF-8 is written as `%XX`, so the key
        // is text; long entries are a fixed-size digest.
        let mut budget = "tg".len() + 3 + key.domain.len() * 3 + key.rule.len() * 3 + 64;
        for entry in &key.entries {
            budget += 2;
            budget += entry.key.inline().map_or(66, |it| it.len() * 3);
            budget += match &entry.value {
                KeyValue::Value(value) => value.inline().map_or(66, |it| it.len() * 3),
                KeyValue::Shared(pattern) => pattern.len() * 3,
            };
        }
        prop_assert!(text.len() <= budget, "{} > {}", text.len(), budget);
        prop_assert!(text.len() < 4 * (MAX_INLINE_BYTES * 3 + 2) + 200);
    }

    #[test]
    fn no_braces_from_user_bytes(key in counter_key()) {
        let text = encode("tg", &key);
        prop_assert!(!text.contains(['{', '}']), "{}", text);
    }

    #[test]
    fn tagged_keys_never_collide_across_modes(
        left in counter_key(),
        right in counter_key(),
        modes in (0..3usize, 0..3usize),
    ) {
        const MODES: [HashTag; 3] = [HashTag::None, HashTag::Domain, HashTag::Descriptor];
        let (lm, rm) = (MODES[modes.0], MODES[modes.1]);
        if left != right || lm != rm {
            prop_assert_ne!(
                KeyFormat::new("tg", lm).encode(&left),
                KeyFormat::new("tg", rm).encode(&right)
            );
        }
    }

    #[test]
    fn the_only_braces_are_the_service_tag(key in counter_key()) {
        for tag in [HashTag::Domain, HashTag::Descriptor] {
            let text = KeyFormat::new("tg", tag).encode(&key);
            let rest = text.strip_prefix("tg:{").expect("the tag follows the prefix");
            let close = rest.find('}').expect("the tag closes");
            let after = &rest[close + 1..];
            prop_assert!(!rest[..close].contains('{'), "{}", text);
            prop_assert!(!after.contains(['{', '}']), "{}", text);
            prop_assert!(after.starts_with(':'), "{}", text);
        }
    }

    #[test]
    fn one_descriptor_shares_its_tag(key in counter_key(), window_s in 1..100_000u64) {
        let mut other = key.clone();
        other.window_s = window_s;
        other.algorithm = Algorithm::TokenBucket;
        other.is_override = !key.is_override;
        other.rule = Arc::from("another.rule");
        let format = KeyFormat::new("tg", HashTag::Descriptor);
        let (left, right) = (format.encode(&key), format.encode(&other));
        prop_assert_eq!(tag_of(&left), tag_of(&right));
    }
}

/// The hash tag Redis Cluster hashes on: the first `{...}` if not empty.
fn tag_of(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open..].find('}')? + open;
    (close > open + 1).then(|| &key[open + 1..close])
}

#[test]
fn tagged_formats_are_pinned() {
    let key = key(&[("k", value("{v}:1"))]);
    assert_eq!(
        KeyFormat::new("tg", HashTag::Domain).encode(&key),
        "tg:{api}:remote_address:sliding_window_log.60s:k=%7Bv%7D%3A1"
    );
    assert_eq!(
        KeyFormat::new("tg", HashTag::Descriptor).encode(&key),
        "tg:{api:k=%7Bv%7D%3A1}:remote_address:sliding_window_log.60s"
    );
    assert_eq!(
        KeyFormat::new("tg", HashTag::None).encode(&key),
        encode("tg", &key)
    );
}

#[test]
fn descriptors_get_their_own_tags_and_domains_share_one() {
    let a = key(&[("ip", value("1"))]);
    let b = key(&[("ip", value("2"))]);
    let descriptor = KeyFormat::new("tg", HashTag::Descriptor);
    let domain = KeyFormat::new("tg", HashTag::Domain);
    assert_ne!(
        tag_of(&descriptor.encode(&a)),
        tag_of(&descriptor.encode(&b))
    );
    assert_eq!(tag_of(&domain.encode(&a)), Some("api"));
    assert_eq!(tag_of(&domain.encode(&a)), tag_of(&domain.encode(&b)));
    assert_ne!(domain.encode(&a), domain.encode(&b));
}
