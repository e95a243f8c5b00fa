//! The binary started as Envoy Gateway starts its rate-limit service: the
//! environment of each of Envoy Gateway's generated Deployments
//! (`tests/fixtures/envoy-gateway/*.env`), variable for variable, with the
//! addresses and files pointed at servers of the test. Each gets its rules
//! over xDS (mutual TLS), decides over the gRPC port's TLS, answers the
//! plain-HTTP probe on `/healthcheck`, and sends what its environment asks
//! for: statistics for Prometheus, statsd lines, OpenTelemetry spans.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message as _;
use tokio::io::AsyncBufReadExt;

use crate::support;
use crate::support::certs::{Ca, client_config};
use crate::support::process::{ServiceProcess, free_addr, http_get, spawn_with_env};
use crate::support::redis::RedisServer;
use crate::support::xds::{AdsServer, ServerTls, per_minute};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const WITHIN: Duration = Duration::from_secs(20);
const POD_NAME: &str = "envoy-ratelimit-6f9c7d5b8-x2x7q";

/// A fixture's variables in order, `${NAME}` replaced from `values`.
fn environment(name: &str, values: &HashMap<&str, String>) -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/envoy-gateway")
        .join(format!("{name}.env"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|err| panic!("{path:?}: {err}"));
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.trim().is_empty())
        .map(|line| {
            let (key, value) = line.split_once('=').expect("NAME=value");
            let mut value = value.to_owned();
            for (name, with) in values {
                value = value.replace(&format!("${{{name}}}"), with);
            }
            assert!(!value.contains("${"), "{name}.env: {line}: no value for it");
            (key.to_owned(), value)
        })
        .collect()
}

/// A span received: its resource's attributes and its name.
type Span = (HashMap<String, String>, String);

/// Spans received.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Span>>>);

/// An OTLP/HTTP receiver (`POST /v1/traces`, protobuf).
async fn otlp_receiver(spans: Spans) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let spans = spans.clone();
            let service = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let spans = spans.clone();
                    async move {
                        let path_ok = request.uri().path() == "/v1/traces";
                        let body = request.into_body().collect().await?.to_bytes();
                        let export = ExportTraceServiceRequest::decode(body)
                            .ok()
                            .filter(|_| path_ok);
                        let status = if export.is_some() { 200 } else { 400 };
                        for resource_spans in export.map(|it| it.resource_spans).unwrap_or_default()
                        {
                            let resource: HashMap<String, String> = resource_spans
                                .resource
                                .map(|it| it.attributes)
                                .unwrap_or_default()
                                .into_iter()
                                .filter_map(|it| match it.value?.value? {
                                    Value::StringValue(text) => Some((it.key, text)),
                                    _ => None,
                                })
                                .collect();
                            for scope in resource_spans.scope_spans {
                                for span in scope.spans {
                                    spans.0.lock().unwrap().push((resource.clone(), span.name));
                                }
                            }
                        }
                        let mut response =
                            hyper::Response::new(http_body_util::Full::<bytes::Bytes>::from(
                                ExportTraceServiceResponse::default().encode_to_vec(),
                            ));
                        *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
                        Ok::<_, hyper::Error>(response)
                    }
                },
            );
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service),
            );
        }
    });
    addr
}

/// A statsd receiver over TCP: every line of every connection.
async fn statsd_receiver() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let received = lines.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let received = received.clone();
            tokio::spawn(async move {
                let mut reader = tokio::io::BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    received.lock().unwrap().push(line);
                }
            });
        }
    });
    (addr, lines)
}

async fn eventually<T>(
    what: &str,
    log: impl Fn() -> String,
    mut check: impl AsyncFnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + WITHIN;
    loop {
        if let Some(it) = check().await {
            return it;
        }
        assert!(
            Instant::now() < deadline,
            "{what} within {WITHIN:?}\n{}",
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts the binary with fixture `name`'s environment and checks what a
/// Deployment of that kind is for.
async fn runs_as_envoy_gateway_starts_it(name: &str) {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("envoy gateway ca");
    // One certificate serves the gRPC port and identifies the client to the
    // xDS server, as Envoy Gateway mounts it.
    ca.node().write(dir.path(), "tls");
    ca.write(dir.path(), "ca.crt");
    let certs = dir.path().display().to_string();
    let issued = ca.server();
    let ads = AdsServer::start(Some(ServerTls {
        cert: issued.cert.clone(),
        key: issued.key.clone(),
        client_ca: ca.pem(),
    }))
    .await;
    let spans = Spans::default();
    let otlp = otlp_receiver(spans.clone()).await;
    let (statsd, lines) = statsd_receiver().await;
    let prometheus = free_addr();
    let mapping =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("src/metrics/default_statsd_mapping.yaml");
    let mut values: HashMap<&str, String> = HashMap::from([
        ("DATA", "/data".to_owned()),
        ("XDS", ads.addr.to_string()),
        ("CERTS", certs.clone()),
        ("REDIS_CERTS", certs.clone()),
        ("PROMETHEUS", format!(":{}", prometheus.port())),
        ("MAPPER", mapping.display().to_string()),
        ("POD_NAME", POD_NAME.to_owned()),
        ("OTLP", otlp.to_string()),
        ("REDIS", String::new()),
    ]);
    let probe: Vec<(String, String)> = environment(name, &values);
    let var = |key: &str| {
        probe
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value.as_str())
    };
    let password = var("REDIS_AUTH").map(|it| it.to_owned());
    let mut redis_args = Vec::new();
    if let Some(password) = &password {
        redis_args.extend(["--requirepass".to_owned(), password.clone()]);
    }
    let redis_args: Vec<&str> = redis_args.iter().map(String::as_str).collect();
    let redis = if var("REDIS_TLS") == Some("true") {
        let server = ca.server().write(dir.path(), "redis");
        let ca_file = dir.path().join("ca.crt");
        RedisServer::start_tls_and(
            Path::new(server.cert()),
            Path::new(server.key()),
            &ca_file,
            true,
            &redis_args,
        )
    } else {
        RedisServer::start_with(&redis_args)
    };
    values.insert("REDIS", format!("127.0.0.1:{}", redis.port()));
    let mut env = environment(name, &values);
    let grpc = free_addr();
    let http = free_addr();
    // The ports Envoy Gateway leaves at their defaults, moved to free ones;
    // where the Deployment sends statsd to the default address (its sidecar),
    // the test's receiver; the Deployment trusts Redis through the image's
    // system roots, the test through its own CA.
    env.push(("GRPC_PORT".into(), grpc.port().to_string()));
    env.push(("PORT".into(), http.port().to_string()));
    if var("USE_STATSD") == Some("true") {
        env.push(("STATSD_HOST".into(), "127.0.0.1".into()));
        env.push(("STATSD_PORT".into(), statsd.port().to_string()));
    }
    if var("REDIS_TLS") == Some("true") {
        env.push(("REDIS_TLS_CACERT".into(), format!("{certs}/ca.crt")));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let service = spawn_with_env(&env, grpc, http);
    let log = || service.log();

    // Ready before any rule came (force start), on plain HTTP.
    eventually("a plain-HTTP /healthcheck answering 200", log, async || {
        let answer = tokio::time::timeout(Duration::from_secs(2), probe_health(http)).await;
        answer
            .ok()
            .flatten()
            .filter(|it| it.starts_with("HTTP/1.1 200"))
    })
    .await;
    let tls = client_config(&ca, None, &[b"h2"]);
    ads.push("v1", vec![per_minute("eg", "k", 1)]);
    ads.wait_for_ack("v1", WITHIN).await;
    let first = eventually("a decision from the rules sent over xDS", log, async || {
        support::tls::decide(grpc, tls.clone(), "eg").await.ok()
    })
    .await;
    assert_eq!(first.overall_code(), Code::Ok, "{}", log());
    for _ in 0..4 {
        let answer = support::tls::decide(grpc, tls.clone(), "eg").await.unwrap();
        assert_eq!(answer.overall_code(), Code::OverLimit, "{}", log());
    }

    if var("USE_PROMETHEUS") == Some("true") {
        let page = eventually(
            "envoyproxy/ratelimit's statistics for Prometheus",
            log,
            async || {
                let page = http_get(
                    SocketAddr::from(([127, 0, 0, 1], prometheus.port())),
                    "/metrics",
                )
                .await;
                page.contains("ratelimit_service_rate_limit_over_limit{")
                    .then_some(page)
            },
        )
        .await;
        let samples: BTreeMap<&str, &str> = page
            .lines()
            .filter(|it| !it.starts_with('#'))
            .filter_map(|it| it.rsplit_once(' '))
            .collect();
        let over = r#"ratelimit_service_rate_limit_over_limit{domain="eg",key1="k"}"#;
        let within = r#"ratelimit_service_rate_limit_within_limit{domain="eg",key1="k"}"#;
        assert_eq!(samples.get(over), Some(&"4"), "{page}");
        assert_eq!(samples.get(within), Some(&"1"), "{page}");
    } else {
        let refused = tokio::net::TcpStream::connect(("127.0.0.1", prometheus.port())).await;
        assert!(
            refused.is_err(),
            "a Prometheus port though USE_PROMETHEUS is not set"
        );
    }

    if var("USE_STATSD") == Some("true") {
        eventually("statsd lines of the decisions", log, async || {
            let lines = lines.lock().unwrap();
            lines
                .iter()
                .any(|it| it.starts_with("ratelimit.service.rate_limit.eg.k.over_limit:4|c"))
                .then_some(())
        })
        .await;
    }

    if var("TRACING_ENABLED") == Some("true") {
        // Sampled at TRACING_SAMPLING_RATE: enough calls that one is.
        for _ in 0..20 {
            let _ = support::tls::decide(grpc, tls.clone(), "eg").await;
        }
        let (resource, _) = eventually("a span of a decision", log, async || {
            spans.0.lock().unwrap().first().cloned()
        })
        .await;
        assert_eq!(
            resource.get("service.name").map(String::as_str),
            Some("envoy-ratelimit")
        );
        assert_eq!(
            resource.get("service.namespace").map(String::as_str),
            Some("envoy-gateway-system")
        );
        assert_eq!(
            resource.get("service.instance.id").map(String::as_str),
            Some(POD_NAME)
        );
    } else {
        assert!(spans.0.lock().unwrap().is_empty());
    }
    let log = service.stop().await;
    assert!(
        !log.contains("not supported"),
        "every variable of Envoy Gateway's is honoured or needs nothing: {log}"
    );
}

/// `GET /healthcheck` in plain HTTP, or nothing while the port is closed.
async fn probe_health(http: SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(http).await.ok()?;
    let request = "GET /healthcheck HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.ok()?;
    Some(String::from_utf8_lossy(&response).into_owned())
}

macro_rules! deployments {
    ($($test:ident: $fixture:literal,)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            runs_as_envoy_gateway_starts_it($fixture).await;
        }
    )*};
}

deployments! {
    default_deployment: "custom",
    without_prometheus: "disable-prometheus",
    with_tracing: "enable-tracing",
    with_tracing_sampled_over_another_port: "enable-tracing-custom",
    with_extra_variables: "extension-env",
    with_statsd_and_prometheus: "override-env",
    with_redis_over_tls_and_a_password: "redis-tls-settings",
    with_the_redis_url_from_a_secret: "redis-url-secret-ref",
}

/// `patch-deployment-containers.yaml` asks for Redis Sentinel with a plain
/// `host:port` where Sentinel needs `master,host:port,...`: the start is
/// refused, saying so, rather than served from an instance's memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_without_its_master_name_is_refused() {
    let values = HashMap::from([
        ("DATA", "/data".to_owned()),
        ("XDS", "127.0.0.1:9".to_owned()),
        ("CERTS", "/nonexistent".to_owned()),
        ("PROMETHEUS", format!(":{}", free_addr().port())),
        ("MAPPER", "/nonexistent".to_owned()),
        ("REDIS", "127.0.0.1:9".to_owned()),
    ]);
    let env = environment("patch-deployment-containers", &values);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut service: ServiceProcess = spawn_with_env(&env, free_addr(), free_addr());
    let (status, log) = service.exit(WITHIN).await;
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("REDIS_TYPE=sentinel"), "{log}");
}
