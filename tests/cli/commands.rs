//! The built binary: `check-config` and `serve`, exit codes and signals.

use std::net::SocketAddr;
use std::process::Output;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::config::write_file as write;
use crate::support::process::{Serve, ServiceProcess, command, free_addr, http_get};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

const GOOD: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2, name: per_user}\n";
const BAD: &str = "domain: api\ndescriptors:\n  - key: user\n    ratelimit: {unit: minute, requests_per_unit: 2}\n";

fn run(args: &[&str]) -> Output {
    command().args(args).output().expect("run the binary")
}

#[test]
fn check_config_prints_the_summary_of_a_good_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "good.yaml", GOOD);
    let out = run(&["check-config", &path]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(stdout.contains("domain api"), "{stdout}");
    assert!(stdout.contains("user"), "{stdout}");
    assert!(stdout.contains("2/minute"), "{stdout}");
}

/// `print-lua` prints exactly the code the Redis backend sends (what
/// bench/redis-script.sh loads to measure it).
#[test]
fn print_lua_prints_the_code_the_redis_backend_sends() {
    use throttlegate::backends::redis::script;
    let library = script::library();
    let names = format!(
        "{}\n{}\n{}\n{}\n",
        library.name, library.decide, library.decide_batch, library.refund
    );
    let cases = [
        ("library", library.source.as_str()),
        ("names", names.as_str()),
        ("decide", script::DECIDE_LUA),
        ("decide-batch", script::DECIDE_BATCH_LUA),
        ("refund", script::REFUND_LUA),
    ];
    for (what, expected) in cases {
        let out = run(&["print-lua", what]);
        assert!(out.status.success(), "{what}: {out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), expected, "{what}");
    }
    let out = run(&["print-lua", "everything"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn check_config_names_the_file_and_the_reason_of_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.yaml", BAD);
    let out = run(&["check-config", &path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    // `<file>: <message>`, the file possibly followed by `:line:column`.
    let (file, message) = stderr.split_once(": ").expect("file: message");
    assert!(
        file == path || file.starts_with(&format!("{path}:")),
        "{stderr}"
    );
    assert!(
        message.starts_with("config error, unknown key 'ratelimit'"),
        "{stderr}"
    );
}

#[test]
fn serve_with_a_bad_config_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "bad.yaml", BAD);
    let grpc = free_addr().to_string();
    for args in [
        vec!["serve", "--config", &path, "--grpc-addr", &grpc],
        // `serve` is the default subcommand.
        vec!["--config", &path, "--grpc-addr", &grpc],
    ] {
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("unknown key 'ratelimit'"), "{stderr}");
    }
    // A missing file too, through the environment variable.
    let out = command()
        .env("THROTTLEGATE_CONFIG", dir.path().join("missing.yaml"))
        .args(["--grpc-addr", &grpc])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

#[test]
fn a_port_in_use_stops_the_start_with_exit_2_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "good.yaml", GOOD);
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http = taken.local_addr().unwrap().to_string();
    let grpc = free_addr();
    let out = run(&[
        "serve",
        "--config",
        &path,
        "--grpc-addr",
        &grpc.to_string(),
        "--http-addr",
        &http,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot listen on {http}")),
        "{stderr}"
    );
}

#[test]
fn serve_refuses_incomplete_redis_flags_with_exit_2() {
    let grpc = free_addr().to_string();
    let out = run(&[
        "serve",
        "--grpc-addr",
        &grpc,
        "--redis-sentinel-master",
        "mymaster",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "--redis-sentinel-master and --redis-sentinel-password need --redis-sentinel-nodes"
        ),
        "{stderr}"
    );
}

#[tokio::test]
async fn serve_answers_then_stops_cleanly_on_sigterm() {
    serve_answers_then_stops_cleanly_on("TERM").await;
}

#[tokio::test]
async fn serve_stops_cleanly_on_sigint() {
    serve_answers_then_stops_cleanly_on("INT").await;
}

async fn serve_answers_then_stops_cleanly_on(signal: &str) {
    let mut server = Serve::yaml(GOOD).spawn();

    let mut client = server.client().await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(overall_code(&mut client).await);
    }
    assert_eq!(
        codes,
        vec![Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );

    let health = http_get(server.http, "/healthcheck").await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.ends_with("\r\n\r\nOK\n"), "{health}");
    let rlconfig = http_get(server.http, "/rlconfig").await;
    assert!(rlconfig.contains("domain api"), "{rlconfig}");

    server.signal(signal);
    let stderr = clean_exit(&mut server, Duration::from_secs(15)).await;
    assert!(stderr.contains(&format!("SIG{signal}")), "{stderr}");
}

fn alice() -> RateLimitRequest {
    support::service::one_entry_request("api", "user", "alice")
}

/// The overall code of a decision for alice.
async fn overall_code(client: &mut RateLimitServiceClient<tonic::transport::Channel>) -> i32 {
    let res = client
        .should_rate_limit(alice())
        .await
        .expect("rpc")
        .into_inner();
    res.overall_code
}

#[tokio::test]
async fn two_instances_on_one_redis_share_the_limit() {
    let redis = support::redis::RedisServer::start();
    // 2 per minute for alice, whichever instance she reaches.
    let url = redis.url();
    let flags = ["--redis-url", &url, "--redis-key-prefix", "clitest"];
    let mut first = Serve::yaml(GOOD).args(&flags).spawn();
    let mut second = Serve::yaml(GOOD).args(&flags).spawn();
    let mut first_client = first.client().await;
    let mut second_client = second.client().await;
    let mut codes = Vec::new();
    for use_first in [true, false, true] {
        let client = if use_first {
            &mut first_client
        } else {
            &mut second_client
        };
        codes.push(overall_code(client).await);
    }
    assert_eq!(
        codes,
        vec![Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
}

/// `--redis-expiry-grace-ms` reaches the script: a key's TTL is its
/// window plus the grace (nothing set it before).
#[tokio::test]
async fn the_redis_expiry_grace_extends_key_ttls() {
    let redis = support::redis::RedisServer::start();
    let url = redis.url();
    let flags = [
        "--redis-url",
        &url,
        "--redis-key-prefix",
        "grace",
        "--redis-expiry-grace-ms",
        "30000",
    ];
    let mut server = Serve::yaml(GOOD).args(&flags).spawn();
    let mut client = server.client().await;
    assert_eq!(overall_code(&mut client).await, Code::Ok as i32);
    let keys = redis.keys_with_ttl("grace:*").await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let ttl = keys[0].1;
    // One minute of window plus 30 s of grace.
    assert!((85_000..=90_000).contains(&ttl), "pttl {ttl}");
}

/// `check-config` refuses a window no backend can decide, naming the
/// rule, the bound and what to change (the Redis script refused it on
/// every request while the file loaded).
#[test]
fn check_config_refuses_a_window_no_backend_decides() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: year, unit_multiplier: 300, requests_per_unit: 10}\n";
    let path = write(dir.path(), "long.yaml", yaml);
    let out = run(&["check-config", &path]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{out:?}");
    assert!(
        stderr.contains("descriptor 'api.user': a window of 9460800000s is longer than any backend can decide: at most 1125899906s"),
        "{stderr}"
    );
    assert!(stderr.contains("use a shorter unit"), "{stderr}");
}

#[test]
fn check_config_says_where_the_sliding_log_cap_applies() {
    let dir = tempfile::tempdir().unwrap();
    let yaml = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600}\n";
    let path = write(dir.path(), "big.yaml", yaml);
    // Under the default cap: the sliding log, no warning.
    let out = run(&["check-config", &path]);
    assert!(out.status.success(), "{out:?}");
    assert!(out.stderr.is_empty(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout
            .lines()
            .any(|it| it == "  user  600/minute sliding_window_log"),
        "{stdout}"
    );
    // Over a lowered cap, by flag or environment: the counter, said twice.
    let by_env = command()
        .env("THROTTLEGATE_MAX_LOG_ENTRIES", "500")
        .args(["check-config", &path])
        .output()
        .unwrap();
    for out in [
        run(&["check-config", &path, "--max-log-entries", "500"]),
        by_env,
    ] {
        assert!(out.status.success(), "{out:?}");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stdout.lines().any(|it| it
                == "  user  600/minute sliding_window_counter (not sliding_window_log: over --max-log-entries 500)"),
            "{stdout}"
        );
        assert_eq!(
            stderr.trim_end(),
            format!(
                "warning: {path}: descriptor 'api.user': 600 per window is over the sliding_window_log cap of 500 entries per key (--max-log-entries): using sliding_window_counter; name an algorithm to choose another"
            )
        );
    }
    // Naming the log over the cap is refused.
    let named = write(
        dir.path(),
        "named.yaml",
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 600, algorithm: sliding_window_log}\n",
    );
    let out = run(&["check-config", &named, "--max-log-entries", "500"]);
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("sliding_window_log with 600 per window is over the cap of 500 entries per key (--max-log-entries); use sliding_window_counter or gcra, or raise the cap"),
        "{stderr}"
    );
}

// === graceful shutdown and signals ===

/// Longest any step may take before a test gives up: a guard against a
/// hang, far above what a loaded machine needs.
const HANG: Duration = Duration::from_secs(60);

/// Logged when a signal starts the shutdown delay.
const DELAYING: &str = "not serving; closing the listeners after the delay";
/// Logged when SIGHUP starts a reload.
const RELOADING: &str = "SIGHUP: reloading the config";

/// `serve` of `yaml` with `extra` flags, not watching its config, logging
/// reloads.
fn logged(yaml: &str, extra: &[&str]) -> ServiceProcess {
    Serve::yaml(yaml)
        .args(&["--watch-config", "off"])
        .args(extra)
        .rust_log("info,throttlegate::config::reload=debug")
        .spawn()
}

/// Waits for the exit, for at most `within`: status 0. The whole log.
async fn clean_exit(server: &mut ServiceProcess, within: Duration) -> String {
    let (status, log) = server.exit(within).await;
    assert_eq!(status.code(), Some(0), "{log}");
    log
}

/// Reads from `stream` until what was read ends with `end`.
fn read_until(stream: &mut std::net::TcpStream, end: &str) -> String {
    use std::io::Read;
    let mut read = Vec::new();
    let mut buf = [0; 512];
    while !read.ends_with(end.as_bytes()) {
        let n = stream.read(&mut buf).expect("read http response");
        assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&read));
        read.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&read).into_owned()
}

async fn watch_health(
    channel: tonic::transport::Channel,
) -> tonic::Streaming<tonic_health::pb::HealthCheckResponse> {
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    health
        .watch(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("watch health")
        .into_inner()
}

#[tokio::test]
async fn sigterm_with_an_open_watch_and_a_half_sent_body_exits_0_within_the_drain_timeout() {
    use std::io::Write;
    use tonic_health::pb::health_check_response::ServingStatus;

    let drain = Duration::from_millis(3000);
    let drain_ms = drain.as_millis().to_string();
    let mut server = logged(GOOD, &["--drain-timeout-ms", &drain_ms]);
    let channel = server.connect().await;
    let mut watch = watch_health(channel).await;
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);
    let watching = tokio::spawn(async move {
        let mut statuses = Vec::new();
        loop {
            match watch.message().await {
                Ok(Some(it)) => statuses.push(it.status()),
                Ok(None) => return (statuses, None),
                Err(status) => return (statuses, Some(status)),
            }
        }
    });
    // One whole request on the connection, then a body that never ends.
    let mut stream = std::net::TcpStream::connect(server.http).unwrap();
    stream.set_read_timeout(Some(HANG)).unwrap();
    write!(stream, "GET /healthcheck HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let response = read_until(&mut stream, "\r\n\r\nOK\n");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    // The server answers 100 Continue once the handler reads the body: the
    // request is then in flight for sure.
    write!(
        stream,
        "POST /json HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n\r\n"
    )
    .unwrap();
    let response = read_until(&mut stream, "\r\n\r\n");
    assert!(response.starts_with("HTTP/1.1 100"), "{response}");
    write!(stream, "{{\"domain\":").unwrap();

    let signalled = Instant::now();
    server.signal("TERM");
    let log = clean_exit(&mut server, HANG).await;
    let took = signalled.elapsed();
    // Twice the drain timeout would be each server draining in turn.
    let bound = drain + Duration::from_millis(2500);
    assert!(
        took < bound,
        "exited {took:?} after SIGTERM, over {bound:?}\n{log}"
    );
    assert!(
        log.contains("http requests still running at the drain deadline"),
        "{log}"
    );
    let (statuses, end) = watching.await.unwrap();
    assert_eq!(statuses, [ServingStatus::NotServing], "{end:?}");
    let end = end.expect("the watch is ended with a status");
    assert_eq!(end.code(), tonic::Code::Unavailable, "{end:?}");
    assert!(end.message().contains("shutting down"), "{end:?}");
    drop(stream);
}

#[tokio::test]
async fn during_the_shutdown_delay_health_is_not_serving_and_requests_are_answered() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    // Long enough for every check below on a loaded machine.
    let mut server = logged(
        GOOD,
        &["--shutdown-delay-ms", "6000", "--drain-timeout-ms", "1000"],
    );
    let channel = server.connect().await;
    let mut health = HealthClient::new(channel);
    let check = |service: &str| HealthCheckRequest {
        service: service.to_owned(),
    };
    let before = health.check(check("")).await.unwrap().into_inner();
    assert_eq!(before.status(), ServingStatus::Serving);
    let healthcheck = http_get(server.http, "/healthcheck").await;
    assert!(healthcheck.starts_with("HTTP/1.1 200"), "{healthcheck}");

    server.signal("TERM");
    server.wait_for_log(DELAYING, HANG).await;
    for service in support::service::HEALTH_SERVICES {
        let res = health.check(check(service)).await.unwrap().into_inner();
        assert_eq!(res.status(), ServingStatus::NotServing, "{service:?}");
    }
    // New connections are still accepted, and answered.
    let healthcheck = http_get(server.http, "/healthcheck").await;
    assert!(healthcheck.starts_with("HTTP/1.1 503"), "{healthcheck}");
    assert!(healthcheck.ends_with("shutting down\n"), "{healthcheck}");
    let fresh = server.connect().await;
    let res = RateLimitServiceClient::new(fresh)
        .should_rate_limit(alice())
        .await
        .expect("answered during the delay")
        .into_inner();
    assert_eq!(res.overall_code, Code::Ok as i32);
    assert!(server.is_running(), "exited during the delay");

    clean_exit(&mut server, HANG).await;
}

#[tokio::test]
async fn a_second_signal_cuts_the_shutdown_delay_short() {
    // Far longer than the test waits for the exit.
    let mut server = logged(GOOD, &["--shutdown-delay-ms", "600000"]);
    server.wait_for_log("serving", HANG).await;
    server.signal("TERM");
    server.wait_for_log(DELAYING, HANG).await;
    server.signal("INT");
    let log = clean_exit(&mut server, HANG).await;
    assert!(
        log.contains("SIGINT again: closing the listeners now"),
        "{log}"
    );
}

/// A config of `rules` descriptors (about 70 bytes each) that takes a
/// while to load.
fn big_config(rules: usize) -> String {
    let mut yaml = "domain: api\ndescriptors:\n".to_owned();
    yaml.push_str("  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n");
    for idx in 0..rules {
        yaml.push_str(&format!(
            "  - key: filler_{idx}\n    rate_limit: {{unit: minute, requests_per_unit: 10}}\n"
        ));
    }
    yaml
}

/// Enough rules that the load takes over a second of CPU (debug build).
const BIG: usize = 30_000;

/// Nothing listens on `addr` yet: the server is still starting.
fn still_starting(addr: SocketAddr) -> bool {
    std::net::TcpStream::connect(addr).is_err()
}

#[tokio::test]
async fn sighup_during_a_slow_start_up_does_not_end_the_process() {
    let mut server = logged(&big_config(BIG), &[]);
    server.wait_for_log("loading the config", HANG).await;
    server.signal("HUP");
    assert!(still_starting(server.grpc), "the load ended too soon");

    let mut client = server.client().await;
    assert_eq!(overall_code(&mut client).await, Code::Ok as i32);
    // The SIGHUP is acted on once serving.
    server.wait_for_log(RELOADING, HANG).await;
    server.signal("TERM");
    clean_exit(&mut server, HANG).await;
}

#[tokio::test]
async fn sigterm_during_a_slow_start_up_exits_0() {
    let mut server = logged(&big_config(BIG), &[]);
    server.wait_for_log("loading the config", HANG).await;
    server.signal("TERM");
    assert!(still_starting(server.grpc), "the load ended too soon");
    let log = clean_exit(&mut server, HANG).await;
    assert!(log.contains("SIGTERM during start-up"), "{log}");
    // Not waited for.
    assert!(!log.contains("config loaded"), "{log}");
}

#[tokio::test]
async fn sigterm_during_a_reload_does_not_wait_for_it() {
    let mut server = logged(&big_config(BIG), &["--drain-timeout-ms", "200"]);
    server.wait_for_log("serving", HANG).await;
    server.signal("HUP");
    server.wait_for_log(RELOADING, HANG).await;
    server.signal("TERM");
    let log = clean_exit(&mut server, HANG).await;
    // The reload, as long as the start-up load, never got to its end.
    assert!(!log.contains("config reloaded"), "{log}");
}

#[tokio::test]
async fn near_limit_ratio_sets_when_a_decision_is_near_its_limit() {
    const TEN: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
    let series = |result: &str| {
        format!("throttlegate_decisions_total{{domain=\"api\",rule=\"user\",result=\"{result}\"}}")
    };
    // More than half of 10 used from the 6th request on.
    let mut half = Serve::yaml(TEN)
        .args(&["--near-limit-ratio", "0.5"])
        .spawn();
    let mut client = half.client().await;
    for _ in 0..7 {
        assert_eq!(overall_code(&mut client).await, Code::Ok as i32);
    }
    assert_eq!(half.metric(&series("ok")).await, 5.0);
    assert_eq!(half.metric(&series("near_limit")).await, 2.0);

    // The default, 0.8: near from the 9th on.
    let mut default = Serve::yaml(TEN).spawn();
    let mut client = default.client().await;
    for _ in 0..9 {
        assert_eq!(overall_code(&mut client).await, Code::Ok as i32);
    }
    assert_eq!(default.metric(&series("ok")).await, 8.0);
    assert_eq!(default.metric(&series("near_limit")).await, 1.0);
}

#[test]
fn a_near_limit_ratio_outside_0_to_1_is_refused() {
    let grpc = free_addr().to_string();
    for ratio in ["1.5", "-0.1", "NaN", "most"] {
        let flag = format!("--near-limit-ratio={ratio}");
        let out = run(&["serve", "--grpc-addr", &grpc, &flag]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{ratio}: {stderr}");
        assert!(
            stderr.contains("is not a number from 0 to 1"),
            "{ratio}: {stderr}"
        );
    }
}

// === check ===

/// `check` against `service` with `args` after `--addr`.
fn check(addr: &str, args: &[&str]) -> Output {
    let mut all = vec!["check", "--addr", addr];
    all.extend_from_slice(args);
    run(&all)
}

/// `POST /json` with `body`; the response's body.
async fn post_json(addr: SocketAddr, body: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "POST /json HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("a response within 10 s")
        .expect("read the response");
    let response = String::from_utf8(response).expect("utf-8");
    let (head, body) = response.split_once("\r\n\r\n").expect("head and body");
    assert!(head.starts_with("HTTP/1.1 200"), "{response}");
    body.to_owned()
}

fn stdout_json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|err| panic!("stdout is not JSON ({err}): {out:?}"))
}

/// `check` prints the answer in the proto3 JSON `/json` writes, exit code
/// 0 for OK and 3 for OVER_LIMIT, and `--hits` is the request's cost.
#[tokio::test]
async fn check_asks_a_running_service_and_prints_its_answer() {
    let mut service = Serve::yaml(GOOD).spawn();
    service.connect().await;
    let addr = service.grpc.to_string();

    let ok = check(&addr, &["--domain", "api", "--descriptor", "user=alice"]);
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
    let answer = stdout_json(&ok);
    assert_eq!(answer["overallCode"], "OK", "{answer}");
    assert_eq!(answer["statuses"][0]["limitRemaining"], 1, "{answer}");
    assert_eq!(
        answer["statuses"][0]["currentLimit"],
        serde_json::json!({"requestsPerUnit": 2, "unit": "MINUTE", "name": "per_user"})
    );

    let over = check(
        &addr,
        &[
            "--domain",
            "api",
            "--descriptor",
            "user=alice",
            "--hits",
            "2",
        ],
    );
    assert_eq!(over.status.code(), Some(3), "{over:?}");
    assert_eq!(stdout_json(&over)["overallCode"], "OVER_LIMIT");
    // The denied request consumed nothing: one is still left.
    let last = check(&addr, &["--domain", "api", "--descriptor", "user=alice"]);
    assert_eq!(last.status.code(), Some(0), "{last:?}");
    assert!(stdout_json(&last)["statuses"][0]["limitRemaining"].is_null());

    // Two descriptors, two statuses, in order; an unknown domain's answer
    // is byte for byte what `/json` writes for the same request.
    let two = check(
        &addr,
        &[
            "--domain",
            "other",
            "--descriptor",
            "a=1",
            "--descriptor",
            "b=2,c=3",
        ],
    );
    assert_eq!(two.status.code(), Some(0), "{two:?}");
    let body = r#"{"domain":"other","descriptors":[{"entries":[{"key":"a","value":"1"}]},{"entries":[{"key":"b","value":"2"},{"key":"c","value":"3"}]}]}"#;
    let json = post_json(service.http, body).await;
    assert_eq!(
        String::from_utf8_lossy(&two.stdout).trim_end(),
        json.trim_end()
    );
    assert_eq!(
        json.trim_end(),
        r#"{"overallCode":"OK","statuses":[{"code":"OK"},{"code":"OK"}]}"#
    );
}

/// A value holding `,` and `=` reaches the service whole through the
/// escapes: it matches the rule written for it.
#[tokio::test]
async fn check_descriptor_escapes_carry_commas_and_equals_signs() {
    let yaml = "domain: api\ndescriptors:\n  - key: path\n    value: \"a,b=c\"\n    rate_limit: {unit: hour, requests_per_unit: 7}\n";
    let mut service = Serve::yaml(yaml).spawn();
    service.connect().await;
    let addr = service.grpc.to_string();
    let matched = check(&addr, &["--domain", "api", "--descriptor", r"path=a\,b=c"]);
    assert_eq!(matched.status.code(), Some(0), "{matched:?}");
    let answer = stdout_json(&matched);
    assert_eq!(answer["statuses"][0]["limitRemaining"], 6, "{answer}");
    // Unescaped, the comma starts a second entry `b=c`: no rule matches.
    let split = check(&addr, &["--domain", "api", "--descriptor", "path=a,b=c"]);
    assert_eq!(split.status.code(), Some(0), "{split:?}");
    assert!(stdout_json(&split)["statuses"][0]["currentLimit"].is_null());
}

#[test]
fn check_without_a_service_or_with_bad_arguments_says_why() {
    let addr = free_addr().to_string();
    let out = check(&addr, &["--domain", "api", "--descriptor", "k=v"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with(&format!("error: cannot connect to {addr}")),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "{out:?}");

    for (args, reason) in [
        (
            &["--domain", "api", "--descriptor", "novalue"][..],
            "not key=value",
        ),
        (
            &["--domain", "api", "--descriptor", r"k=a\b"][..],
            "escapes only",
        ),
        (&["--domain", "api"][..], "--descriptor"),
        (
            &["--domain", "api", "--descriptor", "k=v", "--cert", "c.pem"][..],
            "--key",
        ),
    ] {
        let out = check(&addr, args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(reason), "{args:?}: {stderr}");
    }
}

/// Over TLS: the CA to trust, a client certificate for mutual TLS, and the
/// server name to verify; each missing or wrong piece is a clear failure
/// (exit code 1), never an answer.
#[tokio::test]
async fn check_speaks_tls_and_mutual_tls() {
    use crate::support::certs::Ca;
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("check ca");
    let ca_file = ca.write(dir.path(), "ca.pem");
    let ca_file = ca_file.to_str().unwrap();
    let server = ca.server_named("rl.internal").write(dir.path(), "server");
    let client_ca = Ca::new("check client ca");
    let client_ca_file = client_ca.write(dir.path(), "client-ca.pem");
    let client = client_ca.client("envoy").write(dir.path(), "client");
    let service = Serve::yaml(GOOD)
        .args(&[
            "--tls-cert",
            server.cert(),
            "--tls-key",
            server.key(),
            "--tls-client-ca",
            client_ca_file.to_str().unwrap(),
        ])
        .spawn();
    service
        .wait_for_log("serving", Duration::from_secs(20))
        .await;
    let addr = service.grpc.to_string();
    let ask = ["--domain", "api", "--descriptor", "user=bob"];
    let with = |extra: &[&str]| {
        let mut args = ask.to_vec();
        args.extend_from_slice(extra);
        check(&addr, &args)
    };
    let identity = ["--cert", client.cert(), "--key", client.key()];
    let name = ["--server-name", "rl.internal"];

    let ok = with(&[&["--ca-cert", ca_file][..], &identity, &name].concat());
    assert_eq!(ok.status.code(), Some(0), "{ok:?}");
    assert_eq!(stdout_json(&ok)["statuses"][0]["limitRemaining"], 1);

    let failures: [(&str, Vec<&str>); 4] = [
        ("plain text", vec![]),
        (
            "no client certificate",
            [&["--ca-cert", ca_file][..], &name].concat(),
        ),
        (
            "the address as the server name",
            [&["--ca-cert", ca_file][..], &identity].concat(),
        ),
        (
            "the public roots only",
            [&["--tls"][..], &identity, &name].concat(),
        ),
    ];
    for (what, extra) in failures {
        let out = with(&extra);
        assert_eq!(out.status.code(), Some(1), "{what}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error: "), "{what}: {stderr}");
        assert!(out.stdout.is_empty(), "{what}: {out:?}");
    }
    // None of the refused calls was decided.
    let again = with(&[&["--ca-cert", ca_file][..], &identity, &name].concat());
    assert_eq!(again.status.code(), Some(0), "{again:?}");
    assert!(stdout_json(&again)["statuses"][0]["limitRemaining"].is_null());
    let https = check(
        &format!("https://{addr}"),
        &[&ask[..], &["--ca-cert", ca_file], &identity, &name].concat(),
    );
    assert_eq!(https.status.code(), Some(3), "{https:?}");
}
