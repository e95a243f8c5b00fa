use super::*;

fn settings(endpoint: &str, protocol: OtlpProtocol) -> TraceSettings {
    TraceSettings {
        endpoint: endpoint.to_owned(),
        protocol,
        sampling_rate: 1.0,
        service_name: "s".into(),
        service_namespace: None,
        service_instance_id: None,
    }
}

#[test]
fn endpoints_read_as_otel_exporter_otlp_endpoint() {
    let cases = [
        (
            "http://c:4318",
            OtlpProtocol::Http,
            "http://c:4318/v1/traces",
        ),
        ("c:4318/", OtlpProtocol::Http, "http://c:4318/v1/traces"),
        ("http://c:4317", OtlpProtocol::Grpc, "http://c:4317"),
        (
            "127.0.0.1:4317",
            OtlpProtocol::Grpc,
            "http://127.0.0.1:4317",
        ),
    ];
    for (given, protocol, expected) in cases {
        assert_eq!(
            endpoint(&settings(given, protocol)).unwrap(),
            expected,
            "{given}"
        );
    }
    for bad in ["https://c:4318", "grpc://c:4317", "", "http://"] {
        assert!(
            endpoint(&settings(bad, OtlpProtocol::Http)).is_err(),
            "{bad}"
        );
    }
}

#[test]
fn a_random_instance_id_is_a_version_4_uuid() {
    let id = random_uuid();
    assert_eq!(id.len(), 36, "{id}");
    assert_eq!(&id[14..15], "4", "{id}");
    assert_ne!(id, random_uuid());
}
