//! TLS and mutual TLS on both ports of the built binary, with certificates
//! made at run time: who is served, who is refused at the handshake, the
//! handshake under the connection deadline and off the accept loop,
//! certificate reloads, and start-up errors.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use crate::support;
use crate::support::certs::{Ca, Files, client_config};
use crate::support::process::{Serve, ServiceProcess, command};
use crate::support::tls::{decide, https_get, https_json, plain_get, sample};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const CONFIG: &str = "domain: tls\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";

const H2: &[&[u8]] = &[b"h2"];
const HTTP1: &[&[u8]] = &[b"http/1.1"];

/// A CA and a server certificate from it, written into `dir`.
fn server_files(dir: &Path) -> (Ca, Files) {
    let ca = Ca::new("throttlegate test ca");
    let files = ca.server().write(dir, "server");
    (ca, files)
}

/// The service with TLS from `files` plus `extra` flags, once it serves.
async fn serve_tls(files: &Files, extra: &[&str]) -> ServiceProcess {
    let service = Serve::yaml(CONFIG)
        .args(&["--tls-cert", files.cert(), "--tls-key", files.key()])
        .args(extra)
        .spawn();
    service
        .wait_for_log("serving", Duration::from_secs(20))
        .await;
    service
}

fn is_ok(response: &Result<String, String>) -> bool {
    response
        .as_ref()
        .is_ok_and(|it| it.starts_with("HTTP/1.1 200"))
}

#[tokio::test]
async fn grpc_over_tls_decides_for_a_client_trusting_the_ca_and_refuses_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let service = serve_tls(&files, &[]).await;

    let response = decide(service.grpc, client_config(&ca, None, H2), "tls")
        .await
        .expect("decided over TLS");
    assert_eq!(response.overall_code, Code::Ok as i32);
    assert_eq!(response.statuses[0].limit_remaining, 99);

    // The same over a client that sends no ALPN at all.
    let response = decide(service.grpc, client_config(&ca, None, &[]), "tls")
        .await
        .expect("decided over TLS without ALPN");
    assert_eq!(response.statuses[0].limit_remaining, 98);

    // A client trusting another CA refuses the server.
    let other = Ca::new("another ca");
    let refused = decide(service.grpc, client_config(&other, None, H2), "tls").await;
    assert!(refused.is_err(), "{refused:?}");

    // Plain text on the TLS port gets no answer.
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", service.grpc))
        .unwrap()
        .timeout(Duration::from_secs(5))
        .connect()
        .await;
    if let Ok(channel) = plain {
        let call = RateLimitServiceClient::new(channel)
            .should_rate_limit(support::service::one_entry_request("tls", "k", "v"))
            .await;
        assert!(call.is_err(), "a plain-text call was answered: {call:?}");
    }
    // Nothing was decided for the refused clients.
    let response = decide(service.grpc, client_config(&ca, None, H2), "tls")
        .await
        .expect("decided");
    assert_eq!(response.statuses[0].limit_remaining, 97);
}

#[tokio::test]
async fn http_over_tls_serves_health_and_json_and_refuses_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let service = serve_tls(&files, &[]).await;
    let config = client_config(&ca, None, HTTP1);

    let health = https_get(service.http, config.clone(), "/healthcheck").await;
    assert!(is_ok(&health), "{health:?}");
    let json = https_json(service.http, config.clone(), "tls").await;
    assert!(is_ok(&json), "{json:?}");
    assert!(json.unwrap().contains(r#""overallCode":"OK""#));

    let plain = plain_get(service.http, "/healthcheck").await;
    assert!(
        !plain.as_ref().is_ok_and(|it| it.contains("HTTP/1.1")),
        "plain text was answered over HTTP: {plain:?}"
    );
    // Without ALPN the HTTP port serves all the same.
    let no_alpn = https_get(service.http, client_config(&ca, None, &[]), "/healthcheck").await;
    assert!(is_ok(&no_alpn), "{no_alpn:?}");

    // Both refusals were counted, per listener.
    let _ = decide(service.grpc, client_config(&Ca::new("x"), None, H2), "tls").await;
    let metrics = https_get(service.http, config, "/metrics").await.unwrap();
    let failed = |listener: &str| {
        sample(
            &metrics,
            &format!("throttlegate_tls_handshake_errors_total{{listener=\"{listener}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(failed("http") >= 1.0, "{metrics}");
    assert!(failed("grpc") >= 1.0, "{metrics}");
}

#[tokio::test]
async fn mutual_tls_serves_only_clients_with_a_certificate_from_the_client_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let client_ca = Ca::new("client ca");
    let client_ca_file = client_ca.write(dir.path(), "client-ca.pem");
    let service = serve_tls(
        &files,
        &["--tls-client-ca", client_ca_file.to_str().unwrap()],
    )
    .await;
    let good = client_ca.client("envoy.internal");
    let stranger = Ca::new("stranger ca").client("envoy.internal");

    // gRPC: no certificate, a certificate from another CA, the right one.
    let none = decide(service.grpc, client_config(&ca, None, H2), "tls").await;
    assert!(
        none.is_err(),
        "served without a client certificate: {none:?}"
    );
    let wrong = decide(service.grpc, client_config(&ca, Some(&stranger), H2), "tls").await;
    assert!(
        wrong.is_err(),
        "served with another CA's certificate: {wrong:?}"
    );
    let right = decide(service.grpc, client_config(&ca, Some(&good), H2), "tls")
        .await
        .expect("served with the right certificate");
    assert_eq!(right.overall_code, Code::Ok as i32);
    // Only the accepted client's request counted.
    assert_eq!(right.statuses[0].limit_remaining, 99);

    // HTTP: the same three.
    let none = https_get(
        service.http,
        client_config(&ca, None, HTTP1),
        "/healthcheck",
    )
    .await;
    assert!(!is_ok(&none), "{none:?}");
    let wrong = https_get(
        service.http,
        client_config(&ca, Some(&stranger), HTTP1),
        "/healthcheck",
    )
    .await;
    assert!(!is_ok(&wrong), "{wrong:?}");
    let right = https_json(service.http, client_config(&ca, Some(&good), HTTP1), "tls").await;
    assert!(is_ok(&right), "{right:?}");
}

#[tokio::test]
async fn a_required_client_name_refuses_certificates_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let client_ca = Ca::new("client ca");
    let client_ca_file = client_ca.write(dir.path(), "client-ca.pem");
    let service = serve_tls(
        &files,
        &[
            "--tls-client-ca",
            client_ca_file.to_str().unwrap(),
            "--tls-client-san",
            "envoy.internal",
        ],
    )
    .await;
    let named = client_ca.client("envoy.internal");
    let other = client_ca.client("someone.else");
    decide(service.grpc, client_config(&ca, Some(&named), H2), "tls")
        .await
        .expect("the named client is served");
    let refused = decide(service.grpc, client_config(&ca, Some(&other), H2), "tls").await;
    assert!(refused.is_err(), "{refused:?}");
}

#[tokio::test]
async fn a_client_that_never_finishes_the_handshake_is_dropped_at_the_deadline_without_holding_up_others()
 {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let service = serve_tls(
        &files,
        &[
            "--grpc-handshake-timeout-ms",
            "3000",
            "--http-header-timeout-ms",
            "3000",
        ],
    )
    .await;
    for addr in [service.grpc, service.http] {
        // TCP only: no ClientHello ever.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let opened = Instant::now();
        // Meanwhile another client is served at once: the silent one's
        // handshake does not hold the accept loop.
        if addr == service.grpc {
            decide(addr, client_config(&ca, None, H2), "tls")
                .await
                .expect("served beside a silent client");
        } else {
            let health = https_get(addr, client_config(&ca, None, HTTP1), "/healthcheck").await;
            assert!(is_ok(&health), "{health:?}");
        }
        // ...while the silent one is still open: it did not have to end
        // (at its deadline) for the other to be served.
        let mut buf = [0u8; 64];
        let still_open = silent.try_read(&mut buf);
        assert!(
            matches!(&still_open, Err(err) if err.kind() == std::io::ErrorKind::WouldBlock),
            "the silent connection ended before the other client was served: {still_open:?}"
        );
        let read = tokio::time::timeout(Duration::from_secs(15), silent.read(&mut buf))
            .await
            .expect("the silent connection is closed by the server");
        assert!(
            matches!(read, Ok(0) | Err(_)),
            "the server sent bytes to a silent client: {read:?}"
        );
        assert!(
            opened.elapsed() >= Duration::from_millis(2900),
            "closed before its deadline: {:?}",
            opened.elapsed()
        );
    }
}

/// Replaces the certificate and key files (each renamed over the old one).
fn replace(files: &Files, with: &Files) {
    std::fs::copy(&with.key, files.key.with_extension("key.new")).unwrap();
    std::fs::copy(&with.cert, files.cert.with_extension("crt.new")).unwrap();
    std::fs::rename(files.key.with_extension("key.new"), &files.key).unwrap();
    std::fs::rename(files.cert.with_extension("crt.new"), &files.cert).unwrap();
}

/// Calls until `config` is served, for at most 15 s.
async fn wait_until_served(addr: std::net::SocketAddr, config: Arc<rustls::ClientConfig>) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match decide(addr, config.clone(), "tls").await {
            Ok(_) => return,
            Err(err) => assert!(Instant::now() < deadline, "never served: {err}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn replaced_certificate_files_are_used_by_new_connections_and_bad_ones_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (old_ca, files) = server_files(dir.path());
    let service = serve_tls(&files, &[]).await;
    let new_ca = Ca::new("the new ca");
    let staging = tempfile::tempdir().unwrap();
    let new_files = new_ca.server().write(staging.path(), "next-server");
    let trusts_new = client_config(&new_ca, None, H2);
    let refused = decide(service.grpc, trusts_new.clone(), "tls").await;
    assert!(
        refused.is_err(),
        "the new CA is not in use yet: {refused:?}"
    );

    replace(&files, &new_files);
    wait_until_served(service.grpc, trusts_new.clone()).await;
    let https = client_config(&new_ca, None, HTTP1);
    let health = https_get(service.http, https.clone(), "/healthcheck").await;
    assert!(is_ok(&health), "the HTTP port reloaded too: {health:?}");
    let old = decide(service.grpc, client_config(&old_ca, None, H2), "tls").await;
    assert!(
        old.is_err(),
        "the old certificate is no longer served: {old:?}"
    );

    // A file that fails to parse keeps the certificate in force, and says so.
    let metrics = https_get(service.http, https.clone(), "/metrics")
        .await
        .unwrap();
    let errors = |text: &str| sample(text, "throttlegate_tls_reloads_total{result=\"error\"}");
    let before = errors(&metrics).expect("the series exists");
    std::fs::write(
        &files.cert,
        "-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA!!\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let metrics = https_get(service.http, https.clone(), "/metrics")
            .await
            .unwrap();
        if errors(&metrics).unwrap() > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the refused reload was not counted"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    decide(service.grpc, trusts_new, "tls")
        .await
        .expect("the last good certificate still serves");
    let log = service.log();
    assert!(log.contains("tls files refused"), "{log}");
    assert!(log.contains("server.crt: malformed PEM"), "{log}");
    assert!(
        !log.contains("bm90IGEgY2VydA"),
        "the file's contents were logged: {log}"
    );
    let ok = sample(&metrics, "throttlegate_tls_reloads_total{result=\"ok\"}");
    assert!(ok.unwrap_or(0.0) >= 1.0, "{metrics}");
}

/// `serve` with `args`: it must exit with code 2 and print `message`.
async fn refused_at_start(args: &[&str], message: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    let output = command()
        .arg("serve")
        .arg("--config")
        .arg(&config)
        .args(["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(args)
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(message), "{args:?}: {stderr}");
}

#[tokio::test]
async fn incomplete_or_unreadable_tls_settings_stop_the_start_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let (_, files) = server_files(dir.path());
    refused_at_start(&["--tls-cert", files.cert()], "--tls-cert needs --tls-key").await;
    refused_at_start(&["--tls-key", files.key()], "--tls-key needs --tls-cert").await;
    refused_at_start(
        &["--tls-client-ca", files.cert()],
        "--tls-client-ca and --tls-client-san need --tls-cert and --tls-key",
    )
    .await;
    let missing = dir.path().join("missing.pem");
    refused_at_start(
        &[
            "--tls-cert",
            missing.to_str().unwrap(),
            "--tls-key",
            files.key(),
        ],
        &format!("tls: cannot read {}", missing.display()),
    )
    .await;
    // A key file holding a certificate: named, and nothing of it quoted.
    refused_at_start(
        &["--tls-cert", files.cert(), "--tls-key", files.cert()],
        &format!("tls: {}: no private key in it", files.cert()),
    )
    .await;
    // envoyproxy/ratelimit's TLS variables that cannot be honoured.
    let output = command()
        .env("GRPC_CLIENT_TLS_SAN", "envoy.internal")
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--http-addr",
            "127.0.0.1:0",
        ])
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("GRPC_CLIENT_TLS_SAN set without GRPC_SERVER_USE_TLS=true"),
        "{stderr}"
    );
}

/// The service started from envoyproxy/ratelimit's variables alone: the
/// rules of `CONFIG` in `dir`, TLS with `files` (`GRPC_SERVER_USE_TLS`), and
/// `extra` variables; serving once it says so.
async fn serve_envoyproxy_tls(
    dir: &std::path::Path,
    files: &Files,
    extra: &[(&str, &str)],
) -> (ServiceProcess, std::net::SocketAddr, std::net::SocketAddr) {
    std::fs::write(dir.join("config.yaml"), CONFIG).unwrap();
    let grpc = support::process::free_addr();
    let http = support::process::free_addr();
    let (grpc_port, http_port) = (grpc.port().to_string(), http.port().to_string());
    let mut vars = vec![
        ("GRPC_HOST", "127.0.0.1"),
        ("GRPC_PORT", grpc_port.as_str()),
        ("HOST", "127.0.0.1"),
        ("PORT", http_port.as_str()),
        ("RUNTIME_ROOT", dir.to_str().unwrap()),
        ("RUNTIME_SUBDIRECTORY", "."),
        ("RUNTIME_APPDIRECTORY", "."),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", files.cert()),
        ("GRPC_SERVER_TLS_KEY", files.key()),
    ];
    vars.extend_from_slice(extra);
    let service = support::process::spawn_with_env(&vars, grpc, http);
    service
        .wait_for_log("serving", Duration::from_secs(20))
        .await;
    (service, grpc, http)
}

#[tokio::test]
async fn envoyproxy_tls_variables_turn_on_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let client_ca = Ca::new("client ca");
    let client_ca_file = client_ca.write(dir.path(), "client-ca.pem");
    let client_ca_path = client_ca_file.to_str().unwrap();
    let (_service, grpc, _) = serve_envoyproxy_tls(
        dir.path(),
        &files,
        &[("GRPC_CLIENT_TLS_CACERT", client_ca_path)],
    )
    .await;
    let good = client_ca.client("envoy.internal");
    decide(grpc, client_config(&ca, Some(&good), H2), "tls")
        .await
        .expect("served with a client certificate");
    let none = decide(grpc, client_config(&ca, None, H2), "tls").await;
    assert!(none.is_err(), "{none:?}");
}

/// Envoy Gateway's Deployment: TLS on the gRPC port from envoyproxy/ratelimit's
/// variables, its readiness probe in plain HTTP on `/healthcheck`, and a
/// `GRPC_SERVER_TLS_CA_CERT` that envoyproxy/ratelimit does not read (client
/// certificates are checked only with `GRPC_CLIENT_TLS_CACERT`).
#[tokio::test]
async fn envoyproxy_server_tls_keeps_the_http_port_plain_as_envoy_gateway_probes_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ca, files) = server_files(dir.path());
    let ca_path = files.cert();
    let (_service, grpc, http) =
        serve_envoyproxy_tls(dir.path(), &files, &[("GRPC_SERVER_TLS_CA_CERT", ca_path)]).await;
    let health = plain_get(http, "/healthcheck").await;
    assert!(
        health
            .as_ref()
            .is_ok_and(|it| it.starts_with("HTTP/1.1 200")),
        "{health:?}"
    );
    decide(grpc, client_config(&ca, None, H2), "tls")
        .await
        .expect("gRPC over TLS, no client certificate asked for");
    let https = https_get(http, client_config(&ca, None, HTTP1), "/healthcheck").await;
    assert!(
        https.is_err(),
        "TLS was answered on the HTTP port: {https:?}"
    );
}
