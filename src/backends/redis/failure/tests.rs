use super::*;

#[test]
fn passwords_are_redacted() {
    assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
    assert_eq!(redact("redis://:secret@h"), "redis://:***@h");
    assert_eq!(redact("redis://h:6379"), "redis://h:6379");
}
