//! A flood of per-value metric labels through the real server while `/metrics` is scraped: other clients stay fast and the series stay capped.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::service::{
    default_options, memory_backend, rules_from, sample, start_service_with_metrics,
};
use throttlegate::metrics::Metrics;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = "
domain: flood
descriptors:
  - key: client
    value_to_metric: true
    rate_limit: {unit: hour, requests_per_unit: 1000000}
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000}
";

/// Per-value series the rule may create (the flag's value in this test).
const CAP: usize = 1_000;
const VALUES: usize = 100_000;
const DESCRIPTORS_PER_REQUEST: usize = 64;
const FLOODERS: usize = 4;

/// Starts `/metrics` (the service's HTTP router) on an ephemeral port.
async fn serve_http(app: throttlegate::transport::http::HttpApp) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind an ephemeral port");
    let addr = listener.local_addr().expect("bound address");
    let router = throttlegate::transport::http::router(app);
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    addr
}

/// `GET /metrics` over a plain HTTP/1.1 connection: the body.
async fn scrape(addr: SocketAddr) -> String {
    let response = support::process::http_get(addr, "/metrics").await;
    let (head, body) = response.split_once("\r\n\r\n").expect("a response head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(!head.contains("chunked"), "{head}");
    body.to_owned()
}

/// Distinct `client_<value>` labels of `throttlegate_decisions_total`.
fn per_value_labels(text: &str) -> usize {
    let mut labels: Vec<&str> = text
        .lines()
        .filter(|line| line.starts_with("throttlegate_decisions_total{"))
        .filter_map(|line| line.split("rule=\"client_").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .collect();
    labels.sort_unstable();
    labels.dedup();
    labels.len()
}

fn flood_request(first_value: usize) -> RateLimitRequest {
    support::request::one_descriptor_per_value(
        "flood",
        "client",
        (first_value..first_value + DESCRIPTORS_PER_REQUEST).map(|value| format!("c{value}")),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_to_metric_flood_with_a_scraper_keeps_others_fast_and_series_capped() {
    let (backend, _clock) = memory_backend();
    let service = start_service_with_metrics(
        rules_from(CONFIG),
        backend,
        default_options(),
        Metrics::with_max_values_per_rule(CAP),
    )
    .await;
    let http = serve_http(service.http.clone()).await;
    let done = Arc::new(AtomicBool::new(false));

    // The scraper: back to back, with a short pause, until the flood ends.
    let scraper = {
        let done = done.clone();
        tokio::spawn(async move {
            let mut largest = 0;
            let mut scrapes = 0;
            while !done.load(Ordering::Relaxed) {
                let body = scrape(http).await;
                largest = largest.max(body.len());
                scrapes += 1;
                assert!(per_value_labels(&body) <= CAP, "more than {CAP} labels");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            (largest, scrapes)
        })
    };

    // Another client, one request at a time, timing each answer.
    let other = {
        let done = done.clone();
        let mut client = service.client();
        tokio::spawn(async move {
            let mut latencies = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let request = support::service::one_entry_request("flood", "user", "steady");
                let started = Instant::now();
                let response = client.should_rate_limit(request).await.expect("answered");
                latencies.push(started.elapsed());
                assert_eq!(response.into_inner().overall_code(), Code::Ok);
            }
            latencies
        })
    };

    // The flood: every value once, split over concurrent clients.
    let requests: Vec<usize> = (0..VALUES).step_by(DESCRIPTORS_PER_REQUEST).collect();
    let flooders: Vec<_> = (0..FLOODERS)
        .map(|flooder| {
            let mut client = service.client();
            let mine: Vec<usize> = requests
                .iter()
                .copied()
                .skip(flooder)
                .step_by(FLOODERS)
                .collect();
            tokio::spawn(async move {
                for first in mine {
                    let mut request = flood_request(first);
                    request.descriptors.truncate(VALUES - first);
                    let response = client.should_rate_limit(request).await.expect("answered");
                    assert_eq!(response.into_inner().overall_code(), Code::Ok);
                }
            })
        })
        .collect();
    for flooder in flooders {
        flooder.await.expect("flooder finished");
    }
    done.store(true, Ordering::Relaxed);
    let (largest, scrapes) = scraper.await.expect("scraper finished");
    let mut latencies = other.await.expect("other client finished");

    // Generous bound for a loaded 2-core machine and a debug build: a
    // scrape that held a lock decisions wait on stalled them for seconds.
    latencies.sort_unstable();
    let p99 = latencies[(latencies.len() * 99 / 100).min(latencies.len() - 1)];
    eprintln!(
        "other client: {} requests, p99 {p99:?}, max {:?}; {scrapes} scrapes, largest body {largest} bytes",
        latencies.len(),
        latencies.last().expect("at least one request")
    );
    assert!(scrapes >= 2, "the scraper ran during the flood");
    assert!(
        latencies.len() >= 20,
        "the other client ran during the flood"
    );
    assert!(p99 < Duration::from_secs(1), "other client's p99 {p99:?}");

    // Capped: exactly CAP values have a series, the rest is one overflow.
    let text = scrape(http).await;
    assert_eq!(per_value_labels(&text), CAP);
    let overflow = (VALUES - CAP) as f64;
    assert_eq!(
        sample(
            &text,
            "throttlegate_decisions_total{domain=\"flood\",rule=\"client:_overflow\",result=\"ok\"}"
        ),
        Some(overflow)
    );
    assert_eq!(
        sample(
            &text,
            "throttlegate_metric_value_overflows_total{domain=\"flood\",rule=\"client\"}"
        ),
        Some(overflow)
    );
    // Each capped value has one decision series and one hits series, about
    // 100 bytes each: the body does not grow with the number of values.
    let bound = CAP * 2 * 120 + 8_192;
    assert!(text.len() <= bound, "body {} > {bound} bytes", text.len());
    assert!(
        largest <= bound,
        "largest scraped body {largest} > {bound} bytes"
    );
}
