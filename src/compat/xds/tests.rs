use super::*;

fn translate(pairs: &[(&str, &str)]) -> (Vec<FlagValue>, Vec<String>) {
    let vars = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let mut flags = Vec::new();
    let mut problems = Vec::new();
    xds_flags(&vars, &mut flags, &mut problems);
    (flags, problems)
}

fn owned(pairs: &[(&'static str, &str)]) -> Vec<FlagValue> {
    pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
}

#[test]
fn envoy_gateways_variables_become_the_xds_flags() {
    let (flags, problems) = translate(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,bad,team=rl=x"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway"),
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "1m30s"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ]);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(
        flags,
        owned(&[
            ("config-xds-server", "envoy-gateway:18001"),
            ("config-xds-node-id", "envoy-ratelimit"),
            ("config-xds-node-metadata", "zone=a"),
            ("config-xds-node-metadata", "team=rl=x"),
            ("config-xds-force-start", "true"),
            ("config-xds-retry-interval-ms", "90000"),
            ("config-xds-tls", "true"),
            ("config-xds-tls-ca", "/certs/ca.crt"),
            ("config-xds-tls-cert", "/certs/tls.crt"),
            ("config-xds-tls-key", "/certs/tls.key"),
            ("config-xds-tls-server-name", "envoy-gateway"),
        ])
    );
}

#[test]
fn without_grpc_xds_sotw_nothing_is_translated() {
    assert_eq!(
        translate(&[
            ("CONFIG_TYPE", "FILE"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "eg:18001"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ]),
        (vec![], vec![])
    );
    // Their default server; TLS files only with USE_TLS.
    let (flags, _) = translate(&[
        ("CONFIG_TYPE", "grpc_xds_sotw"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/c.pem"),
    ]);
    assert_eq!(flags, owned(&[("config-xds-server", "localhost:18000")]));
}

#[test]
fn values_that_cannot_be_used_are_reported() {
    let (_, problems) = translate(&[
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "yes"),
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3 seconds"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "sure"),
    ]);
    assert_eq!(problems.len(), 3, "{problems:?}");
}

#[test]
fn go_durations_parse_to_milliseconds() {
    for (text, ms) in [
        ("3s", Some(3_000)),
        ("250ms", Some(250)),
        ("1.5s", Some(1_500)),
        ("1h2m", Some(3_720_000)),
        ("0", Some(0)),
        ("3", None),
        ("s", None),
        ("-1s", None),
        ("3d", None),
    ] {
        assert_eq!(go_duration_ms(text), ms, "{text}");
    }
}
