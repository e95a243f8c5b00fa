//! envoyproxy/ratelimit's statistics from the built binary, both ways
//! Envoy Gateway collects them: its Prometheus endpoint under the names
//! Envoy Gateway's mapping gives (as its Deployments since v1.2 configure
//! it), and statsd lines over TCP (as up to v1.1, to a statsd_exporter
//! sidecar) or UDP. Every name the mapping expects appears, with its
//! domain and keys, and the counts add up to the requests sent; a statsd
//! receiver that is absent or stalls costs no decision.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::support::process::{Serve, ServiceProcess, free_addr, http_get};
use crate::support::request::{descriptor, request};
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tokio::io::AsyncBufReadExt;

/// One rule per thing a dashboard reads: a key of one level (over and
/// near its limit), a shadow rule, and a key of two levels.
const CONFIG: &str = "\
domain: api
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: tenant2
    value: shadowed
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: client
    descriptors:
      - key: path
        rate_limit: {unit: hour, requests_per_unit: 5}
";

/// How long statistics may take to show up (flushes every 50 ms).
const WITHIN: Duration = Duration::from_secs(20);

/// What [`send_traffic`] sends, as `(domain, key1, key2)` → the statistics
/// envoyproxy/ratelimit would count: `[total_hits, over_limit,
/// near_limit, within_limit, shadow_mode]`.
fn expected() -> BTreeMap<(&'static str, &'static str, Option<&'static str>), [u64; 5]> {
    BTreeMap::from([
        // 12 hits of 1 on a limit of 10, then one of 3 on another tenant:
        // 2 over; the 9th and 10th are near (more than 80 % used).
        (("api", "tenant", None), [15, 2, 2, 13, 0]),
        // 4 on a shadow limit of 2: the second is near; 2 over, let pass.
        (("api", "tenant2_shadowed", None), [4, 2, 1, 2, 2]),
        // 6 on a limit of 5: the fifth is near, the sixth over.
        (("api", "client", Some("path")), [6, 1, 1, 5, 0]),
    ])
}

/// Sends the requests [`expected`] counts, plus one to an unknown domain
/// and one matching no rule (neither counted by envoyproxy/ratelimit);
/// returns the number of calls.
async fn send_traffic(service: &mut ServiceProcess) -> u64 {
    let mut client = service.client().await;
    let mut calls = 0;
    let mut ask = async |request: RateLimitRequest| {
        calls += 1;
        client
            .should_rate_limit(request)
            .await
            .expect("decided")
            .into_inner()
            .overall_code
    };
    let one = |entries: &[(&str, &str)]| request("api", vec![descriptor(entries)]);
    let mut over = 0;
    for _ in 0..12 {
        if ask(one(&[("tenant", "a")])).await == Code::OverLimit as i32 {
            over += 1;
        }
    }
    assert_eq!(over, 2, "the 11th and 12th are denied");
    let mut heavy = one(&[("tenant", "b")]);
    heavy.hits_addend = 3;
    assert_eq!(ask(heavy).await, Code::Ok as i32);
    for _ in 0..4 {
        assert_eq!(ask(one(&[("tenant2", "shadowed")])).await, Code::Ok as i32);
    }
    for idx in 0..6 {
        let code = ask(one(&[("client", "x"), ("path", "/p")])).await;
        let want = if idx < 5 { Code::Ok } else { Code::OverLimit };
        assert_eq!(code, want as i32, "request {idx}");
    }
    assert_eq!(
        ask(request("elsewhere", vec![descriptor(&[("tenant", "a")])])).await,
        Code::Ok as i32
    );
    assert_eq!(ask(one(&[("nothing", "matches")])).await, Code::Ok as i32);
    calls
}

const STATS: [&str; 5] = [
    "total_hits",
    "over_limit",
    "near_limit",
    "within_limit",
    "shadow_mode",
];

/// One sample of a scrape: `name{labels} value`, labels sorted.
fn samples(page: &str) -> BTreeMap<String, f64> {
    page.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

fn body(response: &str) -> &str {
    response
        .split_once("\r\n\r\n")
        .map_or(response, |(_, body)| body)
}

#[tokio::test]
async fn prometheus_endpoint_serves_envoy_gateway_names() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(&config, CONFIG).unwrap();
    // As Envoy Gateway mounts it: the mapping file it ships.
    let mapping = dir.path().join("conf.yaml");
    std::fs::write(
        &mapping,
        throttlegate::metrics::statsd_mapping::DEFAULT_MAPPING,
    )
    .unwrap();
    let prometheus = free_addr();
    let mut service = Serve::config(&config)
        .args(&["--watch-config", "off"])
        .env("USE_STATSD", "false")
        .env("USE_PROMETHEUS", "true")
        .env(
            "PROMETHEUS_ADDR",
            &format!("127.0.0.1:{}", prometheus.port()),
        )
        .env("PROMETHEUS_MAPPER_YAML", mapping.to_str().unwrap())
        .spawn();
    let calls = send_traffic(&mut service).await;
    // A refused reload: config_load_error.
    std::fs::write(&config, "domain: api\ndescriptors: [oops\n").unwrap();
    service.signal("HUP");
    let deadline = Instant::now() + WITHIN;
    let page = loop {
        let response = http_get(prometheus, "/metrics").await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(
            response.contains("content-type: text/plain; version=0.0.4"),
            "{response}"
        );
        let page = body(&response).to_owned();
        if page.contains("ratelimit_service_config_load_error 1") {
            break page;
        }
        assert!(Instant::now() < deadline, "no refused reload in\n{page}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let got = samples(&page);
    for ((domain, key1, key2), values) in expected() {
        let labels = match key2 {
            None => format!("domain=\"{domain}\",key1=\"{key1}\""),
            Some(key2) => format!("domain=\"{domain}\",key1=\"{key1}\",key2=\"{key2}\""),
        };
        for (stat, value) in STATS.iter().zip(values) {
            let series = format!("ratelimit_service_rate_limit_{stat}{{{labels}}}");
            assert_eq!(got.get(&series), Some(&(value as f64)), "{series}\n{page}");
        }
    }
    let within: f64 = got
        .iter()
        .filter(|(name, _)| name.starts_with("ratelimit_service_rate_limit_total_hits{"))
        .map(|(_, value)| value)
        .sum();
    assert_eq!(within, 25.0, "every hit of a configured domain");
    assert!(!page.contains("elsewhere"), "{page}");
    assert!(!page.contains("nothing"), "{page}");
    for (series, value) in [
        ("ratelimit_service_config_load_success", 1.0),
        ("ratelimit_service_config_load_error", 1.0),
        (
            "ratelimit_service_should_rate_limit_error{err_type=\"redis_error\"}",
            0.0,
        ),
        (
            "ratelimit_service_total_requests{grpc_method=\"ShouldRateLimit\"}",
            calls as f64,
        ),
        (
            "ratelimit_service_response_time_seconds_count{grpc_method=\"ShouldRateLimit\"}",
            calls as f64,
        ),
        (
            "ratelimit_service_response_time_seconds_bucket{grpc_method=\"ShouldRateLimit\",le=\"+Inf\"}",
            calls as f64,
        ),
    ] {
        assert_eq!(got.get(series), Some(&value), "{series}\n{page}");
    }
    assert!(page.contains("# TYPE ratelimit_service_response_time_seconds histogram"));
    // Our own /metrics stays as it is, on the HTTP port.
    let ours = http_get(service.http, "/metrics").await;
    assert!(ours.contains("throttlegate_decisions_total"), "{ours}");
    assert!(!ours.contains("ratelimit_service_"), "{ours}");
    // Another path on the endpoint is not the page.
    assert!(
        http_get(prometheus, "/other")
            .await
            .starts_with("HTTP/1.1 404")
    );
}

#[tokio::test]
async fn an_unusable_mapping_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let mapping = dir.path().join("conf.yaml");
    std::fs::write(
        &mapping,
        "mappings:\n  - match: a.*\n    name: x\n    timer_type: summary\n",
    )
    .unwrap();
    let mut service = Serve::yaml(CONFIG)
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", &free_addr().to_string())
        .env("PROMETHEUS_MAPPER_YAML", mapping.to_str().unwrap())
        .spawn();
    let (status, log) = service.exit(WITHIN).await;
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(log.contains("--ratelimit-prometheus-mapping"), "{log}");
    assert!(log.contains("summary"), "{log}");
}

/// Sums statsd counter lines by name (tags left on the name as sent).
#[derive(Default)]
struct Received {
    counters: BTreeMap<String, u64>,
    timers: u64,
    lines: Vec<String>,
}

impl Received {
    fn add(&mut self, line: &str) {
        self.lines.push(line.to_owned());
        let Some((name, rest)) = line.split_once(':') else {
            return;
        };
        let mut parts = rest.split('|');
        let value = parts.next().unwrap_or("");
        match parts.next() {
            Some("c") => {
                *self.counters.entry(name.to_owned()).or_default() +=
                    value.parse::<u64>().expect("a whole count");
            }
            Some("ms") => {
                let rate = parts
                    .find_map(|it| it.strip_prefix('@'))
                    .map_or(1.0, |it| it.parse::<f64>().expect("a sample rate"));
                self.timers += (1.0 / rate).round() as u64;
            }
            other => panic!("unexpected statsd type {other:?} in {line}"),
        }
    }

    /// Whether every expected statistic and the request counts arrived.
    fn complete(&self, tags: &str, dog: bool, calls: u64) -> bool {
        let name = |base: &str| {
            if dog {
                base.to_owned()
            } else {
                format!("{base}{tags}")
            }
        };
        let counts = expected()
            .into_iter()
            .all(|((domain, key1, key2), values)| {
                let key = key2.map_or(key1.to_owned(), |key2| format!("{key1}.{key2}"));
                STATS.iter().zip(values).all(|(stat, value)| {
                    let base = format!("ratelimit.service.rate_limit.{domain}.{key}.{stat}");
                    self.counters.get(&name(&base)).copied().unwrap_or(0) == value
                })
            });
        counts
            && self
                .counters
                .get(&name("ratelimit_server.ShouldRateLimit.total_requests"))
                == Some(&calls)
            && self.timers == calls
            && self
                .counters
                .get(&name("ratelimit.service.config_load_success"))
                == Some(&1)
    }
}

/// A TCP statsd receiver: every line of every connection.
async fn tcp_receiver() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut lines = tokio::io::BufReader::new(stream).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let _ = tx.send(line);
                }
            });
        }
    });
    (addr, rx)
}

/// A UDP statsd receiver: every line of every datagram.
async fn udp_receiver() -> (SocketAddr, tokio::sync::mpsc::UnboundedReceiver<String>) {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = socket.local_addr().unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok(len) = socket.recv(&mut buf).await {
            for line in String::from_utf8_lossy(&buf[..len]).lines() {
                let _ = tx.send(line.to_owned());
            }
        }
    });
    (addr, rx)
}

/// Collects lines until [`Received::complete`], or fails after [`WITHIN`].
async fn receive_all(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
    tags: &str,
    dog: bool,
    calls: u64,
) -> Received {
    let mut received = Received::default();
    let deadline = tokio::time::Instant::now() + WITHIN;
    while !received.complete(tags, dog, calls) {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(line)) => received.add(&line),
            _ => panic!(
                "statistics incomplete after {WITHIN:?}: {:#?}",
                received.lines
            ),
        }
    }
    received
}

#[tokio::test]
async fn statsd_over_tcp_as_envoyproxy_ratelimit_sends_it() {
    let (addr, mut rx) = tcp_receiver().await;
    let mut service = Serve::yaml(CONFIG)
        .env("USE_STATSD", "true")
        .env("STATSD_HOST", "127.0.0.1")
        .env("STATSD_PORT", &addr.port().to_string())
        .env("STATS_FLUSH_INTERVAL", "50ms")
        .env("EXTRA_TAGS", "env:test")
        .spawn();
    let calls = send_traffic(&mut service).await;
    let received = receive_all(&mut rx, ".__env=test", false, calls).await;
    // Exactly what was counted: nothing more arrives once complete, and
    // nothing for the unknown domain or the descriptor without a rule.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut received = received;
    while let Ok(line) = rx.try_recv() {
        received.add(&line);
    }
    assert!(received.complete(".__env=test", false, calls));
    assert!(
        received
            .lines
            .iter()
            .all(|it| it.contains(".__env=test:") && !it.contains("elsewhere")),
        "{:#?}",
        received.lines
    );
}

#[tokio::test]
async fn statsd_over_udp_with_dogstatsd_tags() {
    let (addr, mut rx) = udp_receiver().await;
    let mut service = Serve::yaml(CONFIG)
        .args(&[
            "--statsd-addr",
            &addr.to_string(),
            "--statsd-protocol",
            "udp",
            "--statsd-flush-interval-ms",
            "50",
            "--statsd-tag",
            "env:test",
            "--statsd-tag-format",
            "dogstatsd",
        ])
        .spawn();
    let calls = send_traffic(&mut service).await;
    let received = receive_all(&mut rx, "", true, calls).await;
    assert!(
        received.lines.iter().all(|it| it.ends_with("|#env:test")),
        "{:#?}",
        received.lines
    );
}

/// A rule whose statistics are per value, so that traffic makes many lines.
const PER_VALUE: &str = "\
domain: api
descriptors:
  - key: user
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 1000}
";

/// Sends `count` requests of distinct users, 16 at a time, each due within
/// a deadline far above a decision's time: every one must be decided.
async fn decide_many(service: &mut ServiceProcess, count: usize) {
    let channel = service.connect().await;
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..16 {
        let mut client =
            throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient::new(channel.clone());
        tasks.spawn(async move {
            for idx in (worker..count).step_by(16) {
                let value = format!("user-{idx:06}-{}", "x".repeat(40));
                let descriptors: Vec<RateLimitDescriptor> =
                    vec![descriptor(&[("user", value.as_str())])];
                let mut call = tonic::Request::new(request("api", descriptors));
                call.set_timeout(Duration::from_secs(2));
                let answer = client.should_rate_limit(call).await.expect("decided");
                assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a worker");
    }
}

/// Waits until `/metrics` shows dropped statsd lines.
async fn wait_for_drops(service: &ServiceProcess) {
    let deadline = Instant::now() + WITHIN;
    loop {
        let text = http_get(service.http, "/metrics").await;
        let dropped = text
            .lines()
            .find_map(|it| it.strip_prefix("throttlegate_statsd_dropped_lines_total "))
            .and_then(|it| it.trim().parse::<f64>().ok())
            .expect("the dropped lines counter");
        if dropped > 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "no drops counted\n{text}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_absent_receiver_costs_no_decision() {
    // Nothing listens there.
    let nowhere = free_addr();
    let mut service = Serve::yaml(PER_VALUE)
        .args(&[
            "--statsd-addr",
            &nowhere.to_string(),
            "--statsd-flush-interval-ms",
            "20",
        ])
        .spawn();
    decide_many(&mut service, 2_000).await;
    wait_for_drops(&service).await;
    assert!(service.is_running());
}

#[tokio::test]
async fn a_stalled_receiver_costs_no_decision() {
    // Accepts connections and never reads them, with a small receive
    // buffer: writes block once the buffers are full.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap();
    let listener = socket.listen(16).unwrap();
    let held = tokio::spawn(async move {
        let mut streams = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            streams.push(stream);
        }
    });
    let mut service = Serve::yaml(PER_VALUE)
        .args(&[
            "--statsd-addr",
            &addr.to_string(),
            "--statsd-flush-interval-ms",
            "20",
        ])
        .spawn();
    // Rounds of fresh values until lines are dropped; every round decided.
    let deadline = Instant::now() + WITHIN;
    loop {
        decide_many(&mut service, 2_000).await;
        let text = http_get(service.http, "/metrics").await;
        if text
            .lines()
            .find_map(|it| it.strip_prefix("throttlegate_statsd_dropped_lines_total "))
            .is_some_and(|it| it.trim() != "0")
        {
            break;
        }
        assert!(Instant::now() < deadline, "no drops counted\n{text}");
    }
    held.abort();
}
