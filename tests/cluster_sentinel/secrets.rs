//! Secrets never leave the process: Redis and Sentinel passwords given in
//! URLs or flags, and the private keys of TLS certificates (the servers'
//! and Redis's client certificate), appear in no log line (at the most verbose level), no gRPC
//! answer or status message, no HTTP page (`/healthcheck`, `/metrics`,
//! `/rlconfig`, `/json`) and no start-up error, whether Redis answers,
//! refuses the password or goes away.
//!
//! Each test runs the real binary with `RUST_LOG=trace`, collects every
//! output of the run, then looks for the secret in all of it. So that a
//! test cannot pass by having logged nothing, each also checks that the
//! place the secret was given for (the Redis address) does appear.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

use crate::support;
use crate::support::certs::{Ca, client_config};
use crate::support::cluster::Cluster;
use crate::support::process::{
    Serve, ServiceProcess, command, free_addr, http_get, spawn_with_env,
};
use crate::support::redis::RedisServer;
use crate::support::request::{descriptor, request};
use crate::support::sentinel::{MASTER_NAME, Passwords, SentinelSetup};

/// Distinctive enough that no other text contains it by chance.
const PASSWORD: &str = "pw-Q7x2Kc9Lm4Zt";
const OTHER_PASSWORD: &str = "pw-Vb8Nw3Rj6Hs1";
const SENTINEL_PASSWORD: &str = "spw-Tz5Gd2Fx9Ka4";

const CONFIG: &str = "\
domain: secrets
descriptors:
  - key: client
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 2}
";

/// Every output of one run, each with where it came from.
#[derive(Default)]
struct Outputs(Vec<(String, String)>);

impl Outputs {
    fn add(&mut self, source: impl Into<String>, text: impl Into<String>) {
        self.0.push((source.into(), text.into()));
    }

    /// Fails naming the output and the line that holds `secret`.
    fn assert_free_of(&self, secret: &str) {
        for (source, text) in &self.0 {
            if let Some(line) = text.lines().find(|line| line.contains(secret)) {
                panic!("the secret appears in {source}: {line}");
            }
        }
    }

    /// Fails unless some output mentions `text`: the run did produce the
    /// lines the secret could have leaked into.
    fn assert_mentions(&self, text: &str) {
        assert!(
            self.0.iter().any(|(_, it)| it.contains(text)),
            "no output mentions {text}; outputs:\n{}",
            self.0
                .iter()
                .map(|(source, text)| format!("== {source}\n{text}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// `POST path` with a JSON body over HTTP/1.1; the whole response.
async fn http_post(addr: SocketAddr, path: &str, body: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to http");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(body.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("http response within 10 s")
        .expect("read http response");
    String::from_utf8_lossy(&response).into_owned()
}

/// Asks for decisions over gRPC and `/json`, and reads every page and the
/// health of each service; all of it goes into `out`, labelled `stage`.
async fn exercise(server: &mut ServiceProcess, stage: &str, out: &mut Outputs) {
    let mut client = server.client().await;
    for n in 0..3 {
        let answer = client
            .should_rate_limit(request("secrets", vec![descriptor(&[("client", "alice")])]))
            .await;
        let text = match answer {
            Ok(response) => format!("{:?}", response.into_inner()),
            Err(status) => format!("{status:?}"),
        };
        out.add(format!("{stage}: gRPC answer {n}"), text);
    }
    let body =
        r#"{"domain":"secrets","descriptors":[{"entries":[{"key":"client","value":"bob"}]}]}"#;
    out.add(
        format!("{stage}: POST /json"),
        http_post(server.http, "/json", body).await,
    );
    for path in ["/healthcheck", "/metrics", "/rlconfig"] {
        out.add(
            format!("{stage}: GET {path}"),
            http_get(server.http, path).await,
        );
    }
    let mut health = HealthClient::new(server.connect().await);
    for service in ["", "ratelimit"] {
        let answer = health
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await;
        out.add(
            format!("{stage}: grpc health {service:?}"),
            format!("{answer:?}"),
        );
    }
}

/// Stops the service and adds its whole log to `out`.
async fn stop(server: ServiceProcess, out: &mut Outputs) {
    let log = server.stop().await;
    out.add("the service's log", log);
}

#[tokio::test]
async fn a_redis_password_never_appears_while_redis_answers_nor_after_it_goes_away() {
    let redis = RedisServer::start_with(&["--requirepass", PASSWORD]);
    let url = redis.url();
    assert!(
        url.contains(PASSWORD),
        "the URL carries the password: {url}"
    );
    let mut server = Serve::yaml(CONFIG)
        .args(&["--redis-url", &url, "--redis-timeout-ms", "300"])
        .rust_log("trace")
        .spawn();
    let mut out = Outputs::default();
    exercise(&mut server, "Redis up", &mut out).await;
    // Decided by Redis: two allowed, then over the limit.
    out.assert_mentions("OverLimit");

    let port = redis.port();
    drop(redis);
    exercise(&mut server, "Redis gone", &mut out).await;
    // Reconnection attempts are logged; give them time to happen.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    exercise(&mut server, "Redis still gone", &mut out).await;
    stop(server, &mut out).await;

    out.assert_mentions(&format!("127.0.0.1:{port}"));
    out.assert_free_of(PASSWORD);
}

#[tokio::test]
async fn a_wrong_redis_password_is_not_echoed_when_redis_refuses_it() {
    let redis = RedisServer::start_with(&["--requirepass", PASSWORD]);
    let url = format!("redis://:{OTHER_PASSWORD}@127.0.0.1:{}/", redis.port());
    let mut server = Serve::yaml(CONFIG)
        .args(&["--redis-url", &url, "--redis-timeout-ms", "300"])
        .rust_log("trace")
        .spawn();
    let mut out = Outputs::default();
    exercise(&mut server, "password refused", &mut out).await;
    stop(server, &mut out).await;

    // Nothing was decided, and the log says why.
    out.assert_mentions("Unavailable");
    out.assert_mentions(&format!("127.0.0.1:{}", redis.port()));
    out.assert_free_of(OTHER_PASSWORD);
    out.assert_free_of(PASSWORD);
}

#[tokio::test]
async fn sentinel_and_master_passwords_never_appear() {
    let setup = SentinelSetup::start_with(Passwords {
        redis: Some(PASSWORD.to_owned()),
        sentinel: Some(SENTINEL_PASSWORD.to_owned()),
    })
    .await;
    let nodes = setup.nodes().join(",");
    let url = format!("redis://:{PASSWORD}@{MASTER_NAME}/");
    let mut server = Serve::yaml(CONFIG)
        .args(&[
            "--redis-sentinel-nodes",
            &nodes,
            "--redis-sentinel-master",
            MASTER_NAME,
            "--redis-sentinel-password",
            SENTINEL_PASSWORD,
            "--redis-url",
            &url,
            "--redis-timeout-ms",
            "500",
        ])
        .rust_log("trace")
        .spawn();
    let mut out = Outputs::default();
    exercise(&mut server, "through Sentinel", &mut out).await;
    out.assert_mentions("OverLimit");
    drop(setup);
    exercise(&mut server, "everything gone", &mut out).await;
    stop(server, &mut out).await;

    out.assert_mentions(MASTER_NAME);
    out.assert_free_of(PASSWORD);
    out.assert_free_of(SENTINEL_PASSWORD);
}

#[tokio::test]
async fn cluster_seed_passwords_never_appear() {
    let cluster = Cluster::start_with(3, 0, Some(PASSWORD)).await;
    let seeds: Vec<String> = cluster
        .seeds()
        .iter()
        .map(|seed| format!("redis://:{PASSWORD}@{seed}"))
        .collect();
    let seeds = seeds.join(",");
    let mut server = Serve::yaml(CONFIG)
        .args(&["--redis-cluster-nodes", &seeds, "--redis-timeout-ms", "500"])
        .rust_log("trace")
        .spawn();
    let mut out = Outputs::default();
    exercise(&mut server, "cluster up", &mut out).await;
    out.assert_mentions("OverLimit");
    let first = cluster.seeds()[0].clone();
    drop(cluster);
    exercise(&mut server, "cluster gone", &mut out).await;
    stop(server, &mut out).await;

    out.assert_mentions(&first);
    out.assert_free_of(PASSWORD);
}

/// Runs the binary with `args` and returns its exit code and everything it
/// printed, for a start-up that must fail.
async fn refused(args: &[&str]) -> (Option<i32>, String) {
    let mut child = command();
    child
        .arg("serve")
        .args(["--grpc-addr", &free_addr().to_string()])
        .args(["--http-addr", &free_addr().to_string()])
        .args(args)
        .env("RUST_LOG", "trace");
    // Refused before it binds anything: it exits at once.
    let output = tokio::task::spawn_blocking(move || child.output())
        .await
        .expect("join")
        .expect("run the binary");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.code(), text)
}

#[tokio::test]
async fn start_up_errors_name_the_redis_address_without_its_password() {
    // Each case, and what its error must say: proof that it is the error
    // about the Redis flags, not some other refusal.
    let cases: Vec<(Vec<String>, &str)> = vec![
        // A port out of range: the URL does not parse.
        (
            vec![
                "--redis-url".into(),
                format!("redis://:{PASSWORD}@127.0.0.1:99999/"),
            ],
            "127.0.0.1:99999",
        ),
        // A scheme the client does not know.
        (
            vec![
                "--redis-url".into(),
                format!("bogus://:{PASSWORD}@127.0.0.1:6380/"),
            ],
            "127.0.0.1:6380",
        ),
        // A URL and cluster seeds together.
        (
            vec![
                "--redis-url".into(),
                format!("redis://:{PASSWORD}@127.0.0.1:6380/"),
                "--redis-cluster-nodes".into(),
                format!("redis://:{PASSWORD}@127.0.0.1:6381"),
            ],
            "--redis-cluster-nodes",
        ),
        // A cluster seed that does not parse.
        (
            vec![
                "--redis-cluster-nodes".into(),
                format!("redis://:{PASSWORD}@127.0.0.1:notaport"),
            ],
            "127.0.0.1:notaport",
        ),
    ];
    for (args, says) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, text) = refused(&args).await;
        assert_eq!(code, Some(2), "{args:?} should be refused:\n{text}");
        assert!(text.contains(says), "the error says {says:?}: {text}");
        assert!(
            !text.contains(PASSWORD),
            "{args:?}: the password is echoed:\n{text}"
        );
    }
}

#[tokio::test]
async fn envoyproxy_redis_auth_from_the_environment_never_appears() {
    let redis = RedisServer::start_with(&["--requirepass", PASSWORD]);
    let grpc = free_addr();
    let http = free_addr();
    let dir = tempfile::tempdir().expect("temporary directory");
    let config_dir = dir.path().join("ratelimit").join("config");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::write(config_dir.join("secrets.yaml"), CONFIG).unwrap();
    let redis_url = format!("127.0.0.1:{}", redis.port());
    let grpc_port = grpc.port().to_string();
    let http_port = http.port().to_string();
    let root = dir.path().display().to_string();
    let mut server = spawn_with_env(
        &[
            ("RUNTIME_ROOT", &root),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("GRPC_PORT", &grpc_port),
            ("PORT", &http_port),
            ("REDIS_URL", &redis_url),
            ("REDIS_AUTH", PASSWORD),
            ("RUST_LOG", "trace"),
        ],
        grpc,
        http,
    );
    let mut out = Outputs::default();
    exercise(&mut server, "configured by environment", &mut out).await;
    out.assert_mentions("OverLimit");
    drop(redis);
    exercise(&mut server, "Redis gone", &mut out).await;
    stop(server, &mut out).await;

    out.assert_mentions(&redis_url);
    out.assert_free_of(PASSWORD);
}

/// The lines of a PEM private key between its BEGIN and END lines: the
/// secret itself.
fn key_lines(pem: &str) -> Vec<String> {
    let lines: Vec<String> = pem
        .lines()
        .filter(|line| !line.starts_with("-----") && !line.trim().is_empty())
        .map(str::to_owned)
        .collect();
    assert!(!lines.is_empty(), "a PEM key has a body: {pem}");
    lines
}

#[tokio::test]
async fn tls_private_keys_never_appear_in_handshakes_reloads_or_redis_failures() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let ca = Ca::new("secrets test ca");
    let ca_file = ca.write(dir.path(), "ca.pem");
    let server_cert = ca.server();
    let server_files = server_cert.write(dir.path(), "server");
    let redis_side = ca.server().write(dir.path(), "redis-server");
    let redis_client = ca.client("throttlegate");
    let redis_client_files = redis_client.write(dir.path(), "redis-client");
    let redis = RedisServer::start_tls_and(
        &redis_side.cert,
        &redis_side.key,
        &ca_file,
        true,
        &["--requirepass", PASSWORD],
    );
    let url = format!("rediss://:{PASSWORD}@127.0.0.1:{}/", redis.port());
    let ca_flag = ca_file.to_str().expect("utf-8 path");
    let server = Serve::yaml(CONFIG)
        .args(&[
            "--tls-cert",
            server_files.cert(),
            "--tls-key",
            server_files.key(),
            "--tls-client-ca",
            ca_flag,
            "--redis-url",
            &url,
            "--redis-tls-ca",
            ca_flag,
            "--redis-tls-cert",
            redis_client_files.cert(),
            "--redis-tls-key",
            redis_client_files.key(),
            "--redis-timeout-ms",
            "500",
        ])
        .rust_log("trace")
        .spawn();
    server
        .wait_for_log("serving", Duration::from_secs(20))
        .await;
    let mut out = Outputs::default();
    let envoy = client_config(&ca, Some(&ca.client("envoy")), &[b"h2"]);
    let anonymous = client_config(&ca, None, &[b"h2"]);
    let stranger = Ca::new("another ca");
    let stranger = client_config(&stranger, Some(&stranger.client("envoy")), &[b"h2"]);
    let http = client_config(&ca, Some(&ca.client("prometheus")), &[b"http/1.1"]);
    let exercise_tls = async |stage: &str, out: &mut Outputs| {
        for n in 0..3 {
            let answer = support::tls::decide(server.grpc, envoy.clone(), "secrets").await;
            out.add(format!("{stage}: gRPC answer {n}"), format!("{answer:?}"));
        }
        for (name, config) in [("no certificate", &anonymous), ("another CA", &stranger)] {
            let answer = support::tls::decide(server.grpc, config.clone(), "secrets").await;
            assert!(answer.is_err(), "{name}: served: {answer:?}");
            out.add(
                format!("{stage}: refused client, {name}"),
                format!("{answer:?}"),
            );
        }
        for path in ["/healthcheck", "/metrics", "/rlconfig"] {
            let page = support::tls::https_get(server.http, http.clone(), path).await;
            out.add(format!("{stage}: GET {path}"), format!("{page:?}"));
        }
        let json = support::tls::https_json(server.http, http.clone(), "secrets").await;
        out.add(format!("{stage}: POST /json"), format!("{json:?}"));
    };
    exercise_tls("TLS everywhere", &mut out).await;
    out.assert_mentions("OverLimit");

    // A key file replaced by a malformed one holding secret-looking text:
    // refused, and nothing of it quoted.
    let garbage = "-----BEGIN PRIVATE KEY-----\nTUFMRk9STUVELUtFWS1TRUNSRVQtbWFya2VyLTc3MjE=\n-----END PRIVATE KEY-----\n";
    std::fs::write(&server_files.key, garbage).expect("rewrite the key");
    server
        .wait_for_log("tls files refused", Duration::from_secs(10))
        .await;
    exercise_tls("after a refused key", &mut out).await;

    drop(redis);
    exercise_tls("Redis gone", &mut out).await;
    let log = server.stop().await;
    out.add("the service's log", log);

    out.assert_mentions("tls handshake failed");
    out.assert_mentions(server_files.key());
    for line in key_lines(&server_cert.key)
        .into_iter()
        .chain(key_lines(&redis_client.key))
        .chain(key_lines(garbage))
    {
        out.assert_free_of(&line);
    }
    out.assert_free_of(PASSWORD);
}

#[tokio::test]
async fn a_malformed_key_at_start_up_is_named_not_quoted() {
    let dir = tempfile::tempdir().expect("temporary directory");
    let ca = Ca::new("secrets test ca");
    let files = ca.server().write(dir.path(), "server");
    let body = "U0VDUkVULUtFWS1NQVRFUklBTC1tYXJrZXItNDQxOQ==";
    std::fs::write(
        &files.key,
        format!("-----BEGIN PRIVATE KEY-----\n{body}\n-----END PRIVATE KEY-----\n"),
    )
    .expect("write the key");
    for flag in ["--tls-key", "--redis-tls-key"] {
        let mut args = vec!["--tls-cert", files.cert(), "--tls-key", files.key()];
        if flag == "--redis-tls-key" {
            args = vec![
                "--redis-url",
                "rediss://127.0.0.1:6390/",
                "--redis-tls-cert",
                files.cert(),
                "--redis-tls-key",
                files.key(),
            ];
        }
        let (code, text) = refused(&args).await;
        assert_eq!(code, Some(2), "{flag}: should be refused:\n{text}");
        assert!(
            text.contains(files.key()),
            "{flag}: the file is named: {text}"
        );
        assert!(!text.contains(body), "{flag}: the key is quoted:\n{text}");
    }
}
