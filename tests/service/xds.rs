//! Rules over xDS: the built binary subscribed to a management server
//! speaking the real protos (`support::xds`): rules that arrive decide
//! requests, an update changes decisions under traffic, a bad update is
//! NACKed with the loader's reason while the last good rules stay, a
//! restarted server is re-subscribed to, `--config-xds-force-start`
//! serves before the first config, and mutual TLS to the server.

use std::time::{Duration, Instant};

use crate::support;
use crate::support::certs::Ca;
use crate::support::process::{Serve, ServiceProcess, http_get};
use crate::support::request::{descriptor, request};
use crate::support::xds::{AdsServer, ServerTls, per_minute};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use throttlegate::proto::xds::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};
use throttlegate::xds::RATE_LIMIT_CONFIG_TYPE;
use tonic::transport::Channel;

const WITHIN: Duration = Duration::from_secs(10);

/// `serve` subscribed to `server` as node `test-node`, retrying quickly.
fn subscribed(server: &AdsServer, extra: &[&str]) -> ServiceProcess {
    let addr = server.addr.to_string();
    let mut args = vec![
        "--config-xds-server",
        &addr,
        "--config-xds-node-id",
        "test-node",
        "--config-xds-retry-interval-ms",
        "100",
    ];
    args.extend_from_slice(extra);
    Serve::without_config(&args).spawn()
}

/// The overall code of one request in `domain` with `key=value`.
async fn decide(
    client: &mut RateLimitServiceClient<Channel>,
    domain: &str,
    key: &str,
    value: &str,
) -> Result<Code, tonic::Status> {
    let answer = client
        .should_rate_limit(request(domain, vec![descriptor(&[(key, value)])]))
        .await?;
    Ok(answer.into_inner().overall_code())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_from_the_server_decide_and_each_version_is_acked() {
    let server = AdsServer::start(None).await;
    server.push("1", vec![per_minute("api", "user", 2)]);
    let mut service = subscribed(&server, &[]);
    let mut client = service.client().await;
    for expected in [Code::Ok, Code::Ok, Code::OverLimit] {
        assert_eq!(
            decide(&mut client, "api", "user", "alice").await.unwrap(),
            expected
        );
    }
    let subscription = &server.requests()[0];
    assert_eq!(subscription.type_url, RATE_LIMIT_CONFIG_TYPE);
    assert_eq!(subscription.version_info, "");
    assert!(
        subscription.resource_names.is_empty(),
        "a wildcard subscription"
    );
    assert_eq!(subscription.node.as_ref().unwrap().id, "test-node");
    server.wait_for_ack("1", WITHIN).await;
    assert_eq!(
        service
            .metric("throttlegate_config_reloads_total{result=\"ok\"}")
            .await,
        1.0
    );
    // A domain the server removes is unknown from its next version on.
    server.push("2", vec![per_minute("other", "user", 0)]);
    server.wait_for_ack("2", WITHIN).await;
    assert_eq!(
        decide(&mut client, "api", "user", "alice").await.unwrap(),
        Code::Ok
    );
    assert_eq!(
        decide(&mut client, "other", "user", "alice").await.unwrap(),
        Code::OverLimit
    );
    let rlconfig = http_get(service.http, "/rlconfig").await;
    assert!(
        rlconfig.contains(&format!("source: xds://{} (node test-node)", server.addr)),
        "{rlconfig}"
    );
    service.stop().await;
}

/// `domain` with `key=value` denied always (0 per minute) or never
/// (unlimited).
fn switch(domain: &str, denied: bool) -> RateLimitConfig {
    RateLimitConfig {
        name: domain.to_owned(),
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            key: "k".to_owned(),
            value: "v".to_owned(),
            rate_limit: Some(if denied {
                RateLimitPolicy {
                    unit: RateLimitUnit::Minute as i32,
                    requests_per_unit: 0,
                    ..RateLimitPolicy::default()
                }
            } else {
                RateLimitPolicy {
                    unlimited: true,
                    ..RateLimitPolicy::default()
                }
            }),
            ..RateLimitDescriptor::default()
        }],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_under_traffic_changes_decisions_without_an_error() {
    let server = AdsServer::start(None).await;
    server.push("1", vec![switch("edge", true)]);
    let mut service = subscribed(&server, &[]);
    let channel = service.connect().await;
    // Four callers, each sending one request after another.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut callers = Vec::new();
    for _ in 0..4 {
        let mut client = RateLimitServiceClient::new(channel.clone());
        let stop = stop.clone();
        callers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                answers.push(
                    decide(&mut client, "edge", "k", "v")
                        .await
                        .map_err(|it| it.to_string()),
                );
            }
            answers
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.push("2", vec![switch("edge", false)]);
    server.wait_for_ack("2", WITHIN).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for caller in callers {
        let answers = caller.await.unwrap();
        total += answers.len();
        let answers: Vec<Code> = answers
            .into_iter()
            .map(|it| it.expect("every request decided"))
            .collect();
        // Denied until the update, then allowed: one switch, never back.
        let switched = answers
            .iter()
            .position(|it| *it == Code::Ok)
            .expect("allowed after the update");
        assert!(switched > 0, "denied before the update");
        assert!(
            answers[switched..].iter().all(|it| *it == Code::Ok),
            "{answers:?}"
        );
        assert!(
            answers[..switched].iter().all(|it| *it == Code::OverLimit),
            "{answers:?}"
        );
    }
    assert!(total > 20, "traffic ran: {total} requests");
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_update_is_nacked_with_the_reason_and_the_last_good_rules_stay() {
    let server = AdsServer::start(None).await;
    server.push("1", vec![per_minute("api", "user", 1)]);
    let mut service = subscribed(&server, &[]);
    let mut client = service.client().await;
    server.wait_for_ack("1", WITHIN).await;
    let mut bad = per_minute("edge", "user", 5);
    bad.descriptors[0].rate_limit.as_mut().unwrap().unit = RateLimitUnit::Unknown as i32;
    let duplicate = RateLimitConfig {
        name: "api-again".to_owned(),
        ..per_minute("api", "path", 5)
    };
    server.push("2", vec![per_minute("api", "user", 5), bad, duplicate]);
    let nack = server
        .wait_for(WITHIN, |it| it.error_detail.is_some())
        .await;
    assert_eq!(
        nack.version_info, "1",
        "a NACK carries the version in force"
    );
    assert_eq!(Some(nack.response_nonce.clone()), server.nonce_of("2"));
    let detail = nack.error_detail.unwrap();
    assert_eq!(detail.code, 3, "INVALID_ARGUMENT");
    assert_eq!(
        detail.message,
        "edge: invalid rate limit unit 'UNKNOWN'\napi-again: duplicate domain 'api' in config file"
    );
    // Still one per minute, from version 1.
    assert_eq!(
        decide(&mut client, "api", "user", "bob").await.unwrap(),
        Code::Ok
    );
    assert_eq!(
        decide(&mut client, "api", "user", "bob").await.unwrap(),
        Code::OverLimit
    );
    assert_eq!(
        service
            .metric("throttlegate_config_reloads_total{result=\"error\"}")
            .await,
        1.0
    );
    let rlconfig = http_get(service.http, "/rlconfig").await;
    assert!(rlconfig.contains("last reload refused"), "{rlconfig}");
    assert!(
        rlconfig.contains("invalid rate limit unit 'UNKNOWN'"),
        "{rlconfig}"
    );
    // The next good version is taken.
    server.push("3", vec![per_minute("api", "user", 3)]);
    server.wait_for_ack("3", WITHIN).await;
    assert_eq!(
        decide(&mut client, "api", "user", "bob").await.unwrap(),
        Code::Ok
    );
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_is_subscribed_to_again() {
    let server = AdsServer::start(None).await;
    let addr = server.addr;
    server.push("1", vec![per_minute("api", "user", 0)]);
    let mut service = subscribed(&server, &[]);
    let mut client = service.client().await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    server.stop().await;
    // While it is away the rules in force stay.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    let restarted = AdsServer::start_on(addr, None).await;
    // A new server may count versions from 1 again, with other content.
    restarted.push("1", vec![per_minute("api", "user", 100)]);
    let subscription = restarted
        .wait_for(WITHIN, |it| it.response_nonce.is_empty())
        .await;
    assert_eq!(
        subscription.version_info, "",
        "a new stream subscribes afresh"
    );
    assert_eq!(subscription.node.unwrap().id, "test-node");
    restarted.wait_for_ack("1", WITHIN).await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::Ok
    );
    let log = service.stop().await;
    assert!(log.contains("xDS: the stream failed"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_force_start_nothing_is_served_before_the_first_config() {
    let server = AdsServer::start(None).await;
    let mut service = subscribed(&server, &[]);
    server.wait_for(WITHIN, |_| true).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        tokio::net::TcpStream::connect(service.http).await.is_err(),
        "health is not up"
    );
    assert!(
        tokio::net::TcpStream::connect(service.grpc).await.is_err(),
        "grpc is not up"
    );
    // A refused config is no first config either.
    server.push("1", vec![RateLimitConfig::default()]);
    server
        .wait_for(WITHIN, |it| it.error_detail.is_some())
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        tokio::net::TcpStream::connect(service.grpc).await.is_err(),
        "grpc is not up"
    );
    server.push("2", vec![per_minute("api", "user", 0)]);
    let mut client = service.client().await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_start_serves_healthy_and_answers_through_the_failure_mode_until_rules_arrive() {
    let server = AdsServer::start(None).await;
    let mut service = subscribed(&server, &["--config-xds-force-start"]);
    let mut client = service.client().await;
    let refused = decide(&mut client, "api", "user", "a").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert_eq!(refused.message(), "no rate-limit config received yet");
    let health = http_get(service.http, "/healthcheck").await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    server.push("1", vec![per_minute("api", "user", 0)]);
    server.wait_for_ack("1", WITHIN).await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    // An empty state of the world is a config too: every domain unknown.
    server.push("2", vec![]);
    server.wait_for_ack("2", WITHIN).await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::Ok
    );
    service.stop().await;

    // --failure-mode deny answers OVER_LIMIT before the first config.
    let quiet = AdsServer::start(None).await;
    let mut service = subscribed(
        &quiet,
        &["--config-xds-force-start", "--failure-mode", "deny"],
    );
    let mut client = service.client().await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_arrive_over_mutual_tls_and_not_without_a_client_certificate() {
    let ca = Ca::new("xds ca");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = ca.write(dir.path(), "ca.crt");
    let client_files = ca.client("envoy-ratelimit").write(dir.path(), "client");
    let issued = ca.server();
    let tls = || ServerTls {
        cert: issued.cert.clone(),
        key: issued.key.clone(),
        client_ca: ca.pem(),
    };
    let server = AdsServer::start(Some(tls())).await;
    server.push("1", vec![per_minute("api", "user", 0)]);
    let ca_path = ca_file.to_str().unwrap();
    let mut service = subscribed(
        &server,
        &[
            "--config-xds-tls",
            "--config-xds-tls-ca",
            ca_path,
            "--config-xds-tls-cert",
            client_files.cert(),
            "--config-xds-tls-key",
            client_files.key(),
            "--config-xds-tls-server-name",
            "localhost",
        ],
    );
    let mut client = service.client().await;
    assert_eq!(
        decide(&mut client, "api", "user", "a").await.unwrap(),
        Code::OverLimit
    );
    server.wait_for_ack("1", WITHIN).await;
    service.stop().await;

    // Without a client certificate the server refuses the handshake: no
    // rules ever arrive, and the failure is logged.
    let other = AdsServer::start(Some(tls())).await;
    other.push("1", vec![per_minute("api", "user", 0)]);
    let mut service = subscribed(
        &other,
        &[
            "--config-xds-force-start",
            "--config-xds-tls",
            "--config-xds-tls-ca",
            ca_path,
        ],
    );
    let mut client = service.client().await;
    let started = Instant::now();
    service
        .wait_for_log("the rules in force stay", WITHIN)
        .await;
    assert!(other.requests().is_empty(), "{:?}", other.requests());
    let refused = decide(&mut client, "api", "user", "a").await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable);
    assert!(started.elapsed() < WITHIN);
    service.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flags_that_cannot_work_stop_the_start() {
    let server = AdsServer::start(None).await;
    for (args, message) in [
        (
            vec!["--config-xds-tls-ca", "/ca.pem"],
            "--config-xds-tls-* need --config-xds-tls",
        ),
        (
            vec![
                "--config-xds-tls",
                "--config-xds-tls-ca",
                "/nonexistent/ca.pem",
            ],
            "xds: cannot read /nonexistent/ca.pem",
        ),
    ] {
        let mut service = subscribed(&server, &args);
        let (status, log) = service.exit(WITHIN).await;
        assert_eq!(status.code(), Some(2), "{log}");
        assert!(log.contains(message), "{log}");
    }
}

/// Envoy Gateway's generated Deployment (its `testdata/deployments/default.yaml`),
/// variable for variable, with the addresses pointed at test servers: the
/// xDS server (mutual TLS, one certificate for both sides as Envoy Gateway
/// mounts it) and Redis, and `GRPC_PORT`/`PORT` added for free ports. The
/// rules come over xDS and decide a call made over the gRPC port's TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_gateways_default_deployment_gets_its_rules_over_xds() {
    let ca = Ca::new("envoy gateway ca");
    let dir = tempfile::tempdir().unwrap();
    let ca_file = ca.write(dir.path(), "ca.crt");
    // Envoy Gateway's one certificate serves the gRPC port and identifies
    // the client to its xDS server.
    let node = ca.node();
    let files = node.write(dir.path(), "tls");
    let issued = ca.server();
    let server = AdsServer::start(Some(ServerTls {
        cert: issued.cert.clone(),
        key: issued.key.clone(),
        client_ca: ca.pem(),
    }))
    .await;
    let redis = support::redis::RedisServer::start();
    let grpc = support::process::free_addr();
    let http = support::process::free_addr();
    let xds_url = server.addr.to_string();
    let redis_url = format!("127.0.0.1:{}", redis.port());
    let grpc_port = grpc.port().to_string();
    let http_port = http.port().to_string();
    let ca_path = ca_file.to_str().unwrap();
    let env = [
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("RUNTIME_IGNOREDOTFILES", "true"),
        ("RUNTIME_WATCH_ROOT", "false"),
        ("LOG_LEVEL", "info"),
        ("USE_STATSD", "false"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", &xds_url),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", files.cert()),
        ("GRPC_SERVER_TLS_KEY", files.key()),
        ("GRPC_SERVER_TLS_CA_CERT", ca_path),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", files.cert()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", files.key()),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", ca_path),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", &redis_url),
        ("USE_PROMETHEUS", "true"),
        ("PROMETHEUS_ADDR", ":19001"),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
        ("GRPC_PORT", &grpc_port),
        ("PORT", &http_port),
    ];
    let service = support::process::spawn_with_env(&env, grpc, http);
    let config = support::certs::client_config(&ca, None, &[b"h2"]);
    // Serving before the first config (force start): no decision yet.
    let deadline = Instant::now() + WITHIN;
    let refused = loop {
        match support::tls::decide(grpc, config.clone(), "eg").await {
            Err(err) if err.contains("Unavailable") => break err,
            other => assert!(Instant::now() < deadline, "{other:?}\n{}", service.log()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        refused.contains("no rate-limit config received yet"),
        "{refused}"
    );
    server.push("v1", vec![per_minute("eg", "k", 0)]);
    let ack = server.wait_for_ack("v1", WITHIN).await;
    assert_eq!(ack.node.unwrap_or_default().id, "", "the node is sent once");
    assert_eq!(
        server.requests()[0].node.as_ref().unwrap().id,
        "envoy-ratelimit"
    );
    let answer = support::tls::decide(grpc, config.clone(), "eg")
        .await
        .unwrap();
    assert_eq!(answer.overall_code(), Code::OverLimit, "{}", service.log());
    let log = service.stop().await;
    assert!(
        !log.contains("/data/ratelimit/config"),
        "no file config: {log}"
    );
}
