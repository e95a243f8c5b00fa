//! The built binary under floods a client can send: its logs and its memory stay bounded.

mod support;

use std::io::Read;
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

const BIN: &str = env!("CARGO_BIN_EXE_throttlegate");

/// Kills the child if a test fails before it is stopped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Running {
    /// Stops the server with SIGTERM and returns everything it logged.
    fn stop(mut self) -> String {
        let pid = self.0.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(15);
        while self.0.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "still running 15 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut stderr = String::new();
        if let Some(mut pipe) = self.0.stderr.take() {
            let _ = pipe.read_to_string(&mut stderr);
        }
        // Plain text: stderr is a pipe, not a terminal.
        assert!(!stderr.contains('\u{1b}'), "colour codes in {stderr:?}");
        stderr
    }
}

fn free_addr() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).expect("write config");
    path.to_str().expect("utf-8 path").to_owned()
}

/// `serve` with `config` and `extra` flags on free ports, stderr captured.
async fn serve(
    config: &str,
    extra: &[&str],
) -> (Running, RateLimitServiceClient<Channel>, SocketAddr) {
    let grpc = free_addr();
    let http = free_addr();
    let mut command = Command::new(BIN);
    for (key, _) in std::env::vars() {
        if key.starts_with("THROTTLEGATE_") || key == "REDIS_URL" || key == "RUST_LOG" {
            command.env_remove(key);
        }
    }
    let child = command
        .args(["serve", "--config", config, "--watch-config", "off"])
        .args(["--drain-timeout-ms", "1000"])
        .args(["--grpc-addr", &grpc.to_string()])
        .args(["--http-addr", &http.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the binary");
    let mut child = Running(child);
    let deadline = Instant::now() + Duration::from_secs(20);
    let channel = loop {
        if let Some(exit) = child.0.try_wait().unwrap() {
            panic!("the server exited early: {exit}");
        }
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{grpc}")).unwrap();
        match endpoint.connect().await {
            Ok(channel) => break channel,
            Err(err) => {
                assert!(Instant::now() < deadline, "cannot connect to {grpc}: {err}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    (child, RateLimitServiceClient::new(channel), http)
}

/// A request of one descriptor per value, each `key=value`.
fn request(key: &str, values: impl IntoIterator<Item = String>) -> RateLimitRequest {
    support::request::one_descriptor_per_value("api", key, values)
}

/// The integer logged as `field=N` on `line`.
fn field(line: &str, field: &str) -> Option<u64> {
    let at = line.find(&format!("{field}="))? + field.len() + 1;
    let digits: String = line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[tokio::test]
async fn requests_that_can_never_pass_cannot_flood_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "blocked.yaml",
        "domain: api\ndescriptors:\n  - key: blocked\n    rate_limit: {unit: minute, requests_per_unit: 0}\n",
    );
    let (server, mut client, _) = serve(&config, &[]).await;
    const WARNING: &str = "this request can never pass";
    // 10 requests of 64 distinct counters each: 640 lines without a gate.
    for round in 0..10 {
        let res = client
            .should_rate_limit(request(
                "blocked",
                (0..64).map(|idx| format!("{round}-{idx}")),
            ))
            .await
            .expect("rpc")
            .into_inner();
        assert_eq!(res.overall_code, Code::OverLimit as i32);
    }
    // A second later the next one is let through, with the count.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    client
        .should_rate_limit(request("blocked", ["last".to_owned()]))
        .await
        .expect("rpc");
    // An open connection would hold the drain until its deadline.
    drop(client);
    let stderr = server.stop();
    let lines: Vec<&str> = stderr.lines().filter(|it| it.contains(WARNING)).collect();
    // At most two lines for the flood (it may straddle a second), then the
    // one after the pause.
    assert!(
        (2..=3).contains(&lines.len()),
        "{} lines:\n{stderr}",
        lines.len()
    );
    let suppressed: Vec<u64> = lines
        .iter()
        .map(|it| field(it, "suppressed").expect("a suppressed count"))
        .collect();
    assert!(*suppressed.last().unwrap() > 0, "{stderr}");
    // Every occurrence is either a line or counted on a later line.
    assert_eq!(
        lines.len() as u64 + suppressed.iter().sum::<u64>(),
        10 * 64 + 1,
        "{stderr}"
    );
}

/// Resident memory of `pid`, from /proc.
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kib: u64 = status
        .lines()
        .find(|it| it.starts_with("VmRSS:"))
        .and_then(|it| it.split_whitespace().nth(1))
        .and_then(|it| it.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// One metric's value from the Prometheus text of `http`.
fn metric(http: SocketAddr, name: &str) -> u64 {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(http).expect("connect to http");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut text = String::new();
    stream.read_to_string(&mut text).expect("read metrics");
    text.lines()
        .find(|it| it.starts_with(name))
        .and_then(|it| it.rsplit(' ').next())
        .and_then(|it| it.parse::<f64>().ok())
        .map(|it| it as u64)
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

#[tokio::test]
async fn a_flood_of_fresh_values_stays_within_the_memory_bound() {
    let dir = tempfile::tempdir().unwrap();
    let config = write(
        dir.path(),
        "ip.yaml",
        "domain: api\ndescriptors:\n  - key: ip\n    rate_limit: {unit: hour, requests_per_unit: 2}\n",
    );
    const BOUND: u64 = 500;
    let (server, mut client, http) = serve(
        &config,
        &[
            "--memory-max-counters",
            &BOUND.to_string(),
            "--failure-mode",
            "deny",
        ],
    )
    .await;
    // A known client, before the flood.
    let known = || request("ip", ["known".to_owned()]);
    let res = client
        .should_rate_limit(known())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(res.overall_code, Code::Ok as i32);
    let rss_before = rss_bytes(server.0.id());
    // 300 requests of 64 fresh values: 19,200 counters asked for.
    let mut denied = 0;
    for round in 0..300 {
        let res = client
            .should_rate_limit(request("ip", (0..64).map(|idx| format!("{round}.{idx}"))))
            .await
            .expect("always answered")
            .into_inner();
        if res.overall_code == Code::OverLimit as i32 {
            denied += 1;
        }
        if round % 50 == 0 {
            assert!(metric(http, "throttlegate_memory_counters") <= BOUND);
        }
    }
    // The first requests fit, the rest were refused under --failure-mode.
    assert!(denied >= 290, "{denied} denied");
    assert!(metric(http, "throttlegate_memory_counters") <= BOUND);
    assert!(
        metric(
            http,
            "throttlegate_backend_errors_total{backend=\"memory\",kind=\"full\"}"
        ) >= 290
    );
    // The existing counter keeps working: its second request passes, the
    // third is over its limit.
    let codes: Vec<i32> = [
        client
            .should_rate_limit(known())
            .await
            .unwrap()
            .into_inner(),
        client
            .should_rate_limit(known())
            .await
            .unwrap()
            .into_inner(),
    ]
    .iter()
    .map(|it| it.overall_code)
    .collect();
    assert_eq!(codes, [Code::Ok as i32, Code::OverLimit as i32]);
    // Generous: the bound holds memory, whatever the allocator keeps.
    let grown = rss_bytes(server.0.id()).saturating_sub(rss_before);
    assert!(grown < 64 << 20, "RSS grew by {grown} bytes");
    drop(client);
    let stderr = server.stop();
    let full_lines = stderr
        .lines()
        .filter(|it| it.contains("memory backend full"))
        .count();
    // One line a second at most; the flood takes a few seconds.
    assert!(
        (1..=30).contains(&full_lines),
        "{full_lines} lines:\n{stderr}"
    );
}
