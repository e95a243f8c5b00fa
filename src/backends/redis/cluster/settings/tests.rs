use super::*;

#[test]
fn seeds_may_be_addresses_or_urls_and_passwords_are_redacted() {
    assert_eq!(node_url("10.0.0.1:7000"), "redis://10.0.0.1:7000");
    assert_eq!(node_url(" h:1 "), "redis://h:1");
    assert_eq!(node_url("rediss://u:pw@h:1"), "rediss://u:pw@h:1");
    let nodes = ["redis://u:secret@h:1".to_owned(), "h:2".to_owned()];
    assert_eq!(redact_nodes(&nodes), "redis://u:***@h:1,h:2");
}

#[test]
fn credentials_given_on_one_seed_apply_to_the_bare_ones() {
    let nodes = ["h:1".to_owned(), "rediss://:pw@h:2/#insecure".to_owned()];
    assert_eq!(
        seed_urls(&nodes),
        ["rediss://:pw@h:1", "rediss://:pw@h:2/#insecure"]
    );
    let plain = ["h:1".to_owned(), "redis://h:2".to_owned()];
    assert_eq!(seed_urls(&plain), ["redis://h:1", "redis://h:2"]);
}
