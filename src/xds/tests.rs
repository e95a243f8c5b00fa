use super::*;

#[test]
fn the_backoff_doubles_up_to_its_cap_and_resets() {
    let mut backoff = Backoff::new(Duration::from_secs(3));
    let waits: Vec<Duration> = (0..8).map(|_| backoff.next()).collect();
    for (wait, base) in waits.iter().zip([3, 6, 12, 24, 48, 60, 60, 60]) {
        let base = Duration::from_secs(base);
        assert!(*wait >= base && *wait <= base + base / 2, "{waits:?}");
    }
    backoff.reset();
    assert!(backoff.next() <= Duration::from_millis(4_500));
}

#[test]
fn a_long_message_is_cut_on_a_character() {
    let long = "é".repeat(MAX_NACK_MESSAGE);
    let cut = capped(long);
    assert!(cut.len() <= MAX_NACK_MESSAGE + 3);
    assert!(cut.ends_with("..."));
    assert_eq!(capped("short".to_owned()), "short");
}

#[test]
fn the_node_carries_its_id_and_metadata() {
    let settings = XdsSettings {
        server: XdsServerAddress::parse("eg:18001").unwrap(),
        node_id: "envoy-ratelimit".into(),
        node_metadata: vec![("zone".into(), "a".into())],
        tls: None,
        retry_interval: Duration::from_secs(3),
    };
    let node = settings.node();
    assert_eq!(node.id, "envoy-ratelimit");
    let fields = node.metadata.unwrap().fields;
    assert_eq!(
        fields["zone"].kind,
        Some(prost_types::value::Kind::StringValue("a".into()))
    );
}
