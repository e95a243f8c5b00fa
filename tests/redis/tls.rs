//! The built binary deciding on a redis-server that speaks TLS only, with
//! certificates made at run time: the CA it trusts, the client certificate
//! it presents, verification turned off, and TLS flags without `rediss://`.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::certs::{Ca, Files};
use crate::support::process::{Serve, ServiceProcess, command, http_get};
use crate::support::redis::RedisServer;
use crate::support::service::one_entry_request;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

/// A CA, its certificate in `dir`, and a server certificate from it for
/// 127.0.0.1.
fn redis_certs(dir: &Path) -> (Ca, std::path::PathBuf, Files) {
    let ca = Ca::new("redis test ca");
    let ca_file = ca.write(dir, "redis-ca.pem");
    let server = ca.server().write(dir, "redis-server");
    (ca, ca_file, server)
}

fn tls_redis(dir: &Path, auth_clients: bool) -> (Ca, std::path::PathBuf, RedisServer) {
    let (ca, ca_file, server) = redis_certs(dir);
    let redis = RedisServer::start_tls_with(&server.cert, &server.key, &ca_file, auth_clients);
    (ca, ca_file, redis)
}

/// The service on `redis` with `args`, a 500 ms Redis timeout.
async fn service(redis: &RedisServer, args: &[&str]) -> ServiceProcess {
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &redis.tls_url(), "--redis-timeout-ms", "500"])
        .args(args)
        .spawn();
    service.connect().await;
    service
}

/// Whether the service decides (and counts in `redis`): one call, then
/// the counter key is there; a refusal is UNAVAILABLE (`--failure-mode
/// error`).
async fn decides(service: &mut ServiceProcess, redis: &RedisServer) -> bool {
    let mut client = service.client().await;
    match client
        .should_rate_limit(one_entry_request("tls", "k", "v"))
        .await
    {
        Ok(response) => {
            assert_eq!(response.into_inner().overall_code, Code::Ok as i32);
            let keys = redis.keys("*").await;
            assert_eq!(keys.len(), 1, "one counter in redis: {keys:?}");
            true
        }
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            false
        }
    }
}

/// Waits for `/healthcheck` to answer `code` (the probe runs every second).
async fn wait_for_health(service: &ServiceProcess, code: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let response = http_get(service.http, "/healthcheck").await;
        if response.starts_with(&format!("HTTP/1.1 {code}")) {
            return;
        }
        assert!(Instant::now() < deadline, "health never {code}: {response}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn rediss_with_the_right_ca_decides_and_counts_in_redis() {
    let dir = tempfile::tempdir().unwrap();
    let (_, ca_file, redis) = tls_redis(dir.path(), false);
    let mut service = service(&redis, &["--redis-tls-ca", ca_file.to_str().unwrap()]).await;
    assert!(decides(&mut service, &redis).await, "{}", service.log());
    wait_for_health(&service, "200").await;
}

#[tokio::test]
async fn rediss_with_another_ca_is_not_served_and_health_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, redis) = tls_redis(dir.path(), false);
    let other = Ca::new("not redis's ca").write(dir.path(), "other-ca.pem");
    let mut service = service(&redis, &["--redis-tls-ca", other.to_str().unwrap()]).await;
    assert!(!decides(&mut service, &redis).await);
    wait_for_health(&service, "503").await;
}

#[tokio::test]
async fn a_redis_requiring_client_certificates_serves_only_with_one() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file, redis) = tls_redis(dir.path(), true);
    let ca_flag = ca_file.to_str().unwrap();

    let mut without = service(&redis, &["--redis-tls-ca", ca_flag]).await;
    assert!(!decides(&mut without, &redis).await);
    wait_for_health(&without, "503").await;

    let client = ca.client("throttlegate").write(dir.path(), "redis-client");
    let mut with = service(
        &redis,
        &[
            "--redis-tls-ca",
            ca_flag,
            "--redis-tls-cert",
            client.cert(),
            "--redis-tls-key",
            client.key(),
        ],
    )
    .await;
    assert!(decides(&mut with, &redis).await, "{}", with.log());
    wait_for_health(&with, "200").await;
}

#[tokio::test]
async fn a_certificate_for_another_host_is_served_only_without_hostname_verification() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("redis test ca");
    let ca_file = ca.write(dir.path(), "redis-ca.pem");
    let elsewhere = ca
        .server_named("redis.elsewhere")
        .write(dir.path(), "elsewhere");
    let redis = RedisServer::start_tls_with(&elsewhere.cert, &elsewhere.key, &ca_file, false);
    let ca_flag = ca_file.to_str().unwrap();

    let mut verified = service(&redis, &["--redis-tls-ca", ca_flag]).await;
    assert!(!decides(&mut verified, &redis).await);
    drop(verified);

    let mut skipped = service(
        &redis,
        &[
            "--redis-tls-ca",
            ca_flag,
            "--redis-tls-skip-hostname-verification",
        ],
    )
    .await;
    assert!(decides(&mut skipped, &redis).await, "{}", skipped.log());
    let log = skipped.log();
    assert!(
        log.contains("--redis-tls-skip-hostname-verification"),
        "{log}"
    );

    // Another CA's certificate is still refused: only the name is skipped.
    let other = Ca::new("not redis's ca").write(dir.path(), "other-ca.pem");
    let mut untrusted = service(
        &redis,
        &[
            "--redis-tls-ca",
            other.to_str().unwrap(),
            "--redis-tls-skip-hostname-verification",
        ],
    )
    .await;
    assert!(!decides(&mut untrusted, &redis).await);
}

#[tokio::test]
async fn insecure_tls_is_served_by_an_untrusted_certificate_and_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let (_, _, redis) = tls_redis(dir.path(), false);
    let mut service = service(&redis, &["--redis-tls-insecure"]).await;
    assert!(decides(&mut service, &redis).await, "{}", service.log());
    let log = service.log();
    assert!(
        log.contains("WARN") && log.contains("--redis-tls-insecure"),
        "{log}"
    );
}

#[tokio::test]
async fn redis_tls_flags_with_a_plain_url_or_half_a_client_certificate_stop_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, ca_file, _) = redis_certs(dir.path());
    let client = ca.client("throttlegate").write(dir.path(), "redis-client");
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let run = |args: &[&str]| {
        let output = command()
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(args)
            .output()
            .expect("run the binary");
        assert_eq!(output.status.code(), Some(2), "{args:?}");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let ca_flag = ca_file.to_str().unwrap();
    let stderr = run(&[
        "--redis-url",
        "redis://127.0.0.1:1/",
        "--redis-tls-ca",
        ca_flag,
    ]);
    assert!(
        stderr.contains("redis tls settings need a rediss:// url, not redis://127.0.0.1:1/"),
        "{stderr}"
    );
    let stderr = run(&[
        "--redis-url",
        "rediss://:secret@127.0.0.1:1/",
        "--redis-tls-cert",
        client.cert(),
    ]);
    assert!(
        stderr.contains("a redis client certificate and its key come together"),
        "{stderr}"
    );
    // A key file that is no key: named, never quoted, nor the password.
    let stderr = run(&[
        "--redis-url",
        "rediss://:secret@127.0.0.1:1/",
        "--redis-tls-cert",
        client.cert(),
        "--redis-tls-key",
        client.cert(),
    ]);
    assert!(
        stderr.contains(&format!(
            "redis tls: {}: no private key in it",
            client.cert()
        )),
        "{stderr}"
    );
    assert!(
        !stderr.contains("secret") && !stderr.contains("BEGIN"),
        "{stderr}"
    );
    let stderr = run(&[
        "--redis-cluster-nodes",
        "redis://127.0.0.1:1",
        "--redis-tls-ca",
        ca_flag,
    ]);
    assert!(
        stderr.contains("redis tls settings need rediss:// cluster nodes"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_cluster_over_tls_decides_with_the_right_ca_only() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("cluster ca");
    let ca_file = ca.write(dir.path(), "cluster-ca.pem");
    // The nodes present theirs to each other on the cluster bus too.
    let node = ca.node().write(dir.path(), "node");
    let cluster = support::cluster::Cluster::start_tls(3, &node.cert, &node.key, &ca_file).await;
    let seeds = cluster.seeds().join(",");
    let ca_flag = ca_file.to_str().unwrap();
    let start = |ca: &str| {
        Serve::yaml(CONFIG)
            .args(&[
                "--redis-cluster-nodes",
                &seeds,
                "--redis-tls-ca",
                ca,
                "--redis-timeout-ms",
                "1000",
            ])
            .spawn()
    };

    let mut trusted = start(ca_flag);
    let mut client = trusted.client().await;
    // Descriptors in many slots: every primary is reached over TLS.
    for value in 0..30 {
        let response = client
            .should_rate_limit(one_entry_request("tls", "k", &value.to_string()))
            .await
            .unwrap_or_else(|err| panic!("{err:?}\n{}", trusted.log()));
        assert_eq!(response.into_inner().overall_code, Code::Ok as i32);
    }
    let keys = cluster.keys("*").await;
    assert_eq!(keys.len(), 30, "{keys:?}");

    let other = Ca::new("not the cluster's ca").write(dir.path(), "other-ca.pem");
    let mut untrusted = start(other.to_str().unwrap());
    let status = untrusted
        .client()
        .await
        .should_rate_limit(one_entry_request("tls", "k", "x"))
        .await
        .expect_err("refused by the certificate check");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
}
