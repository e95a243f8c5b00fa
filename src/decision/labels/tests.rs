//! Escaped bytes and the `rule` label shapes.

use super::*;
use crate::rules::{NodeFlags, Unit};
use crate::testing::decision::*;
use crate::testing::default_options as options;
use crate::testing::rules::*;

#[test]
fn printable_escapes_what_is_not_text() {
    let cases: [(&[u8], &str); 7] = [
        (b"plain", "plain"),
        ("ü".as_bytes(), "ü"),
        (b"\xff", "\\xff"),
        (b"a\xc3", "a\\xc3"),
        (b"\\xff", "\\\\xff"),
        (b"tab\t", "tab\\x09"),
        ("\u{85}".as_bytes(), "\\u{85}"),
    ];
    for (bytes, expected) in cases {
        assert_eq!(printable(bytes), expected, "{bytes:?}");
    }
}

#[tokio::test]
async fn metric_labels_show_bytes_escaped() {
    let detailed = key_node("path", vec![limit(5, Unit::Hour)]).with_flags(NodeFlags {
        detailed_metric: true,
        ..NodeFlags::default()
    });
    let fixture = fixture(rules(vec![detailed]), options());
    let request = req(vec![desc(&[(
        b"path".as_slice(),
        b"/a\xff\\b\n".as_slice(),
    )])]);
    fixture.limiter.decide(&request).await.unwrap();
    let long = vec![b'v'; 1_000];
    let request = req(vec![desc(&[(b"path".as_slice(), long.as_slice())])]);
    fixture.limiter.decide(&request).await.unwrap();
    let text = fixture.limiter.metrics().encode();
    // The label holds `\xff`, `\\` and `\x0a` as text; the exposition
    // escapes each backslash once more.
    let expected = r#"rule="path_/a\\xff\\\\b\\x0a""#;
    assert!(text.contains(expected), "{expected}\n{text}");
    // A long value is its digest.
    let expected = format!("rule=\"path_{}\"", bytes_label(&long));
    assert!(expected.contains("sha256:"), "{expected}");
    assert!(text.contains(&expected), "{expected}\n{text}");
    assert!(!text.contains("vvvv"), "{text}");
}
