use super::*;

#[test]
fn addresses_parse_with_or_without_a_scheme() {
    let target = |host: &str, port| XdsServerAddress {
        host: host.to_owned(),
        port,
    };
    assert_eq!(
        XdsServerAddress::parse("envoy-gateway:18001"),
        Ok(target("envoy-gateway", 18001))
    );
    assert_eq!(
        XdsServerAddress::parse("https://eg.local:443/"),
        Ok(target("eg.local", 443))
    );
    assert_eq!(
        XdsServerAddress::parse("[::1]:18000"),
        Ok(target("::1", 18000))
    );
    assert_eq!(target("::1", 1).uri(), "http://[::1]:1");
    for bad in ["envoy-gateway", "host:port", ":1", "http://h:1/path"] {
        assert!(XdsServerAddress::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_key_without_its_certificate_is_refused() {
    let tls = XdsTls {
        key: Some(PathBuf::from("/k.pem")),
        ..XdsTls::default()
    };
    assert!(
        client_config(&tls)
            .unwrap_err()
            .contains("needs its certificate")
    );
}
