//! The rate-limit quota service (RLQS) over gRPC, in process: the
//! assignments it streams, the budget shared among streams, and the
//! bounds that end one misbehaving stream without touching another.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Streaming};

use rlqs::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlqs::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage;
use throttlegate::proto::envoy::service::rate_limit_quota::v3 as rlqs;
use throttlegate::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use throttlegate::transport::grpc::rlqs::{MAX_BUCKETS_PER_STREAM, MAX_STREAMS_PER_CONNECTION};

use crate::support;
use crate::support::service::{TestService, default_options, memory_backend, start_with_config};

const CONFIG: &str = "
domain: quota
descriptors:
  - key: name
    value: shared
    rate_limit: {unit: minute, requests_per_unit: 300}
  - key: name
    value: blocked
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: name
    value: free
    rate_limit: {unlimited: true}
";

/// How long an answer may take under load.
const ANSWER: Duration = Duration::from_secs(10);

async fn start() -> TestService {
    let (backend, _clock) = memory_backend();
    start_with_config(CONFIG, backend, default_options()).await
}

/// One open stream: what it sends, what it is answered.
struct Proxy {
    send: mpsc::Sender<rlqs::RateLimitQuotaUsageReports>,
    answers: Streaming<rlqs::RateLimitQuotaResponse>,
}

async fn open(service: &TestService) -> Proxy {
    let (send, reports) = mpsc::channel(1024);
    let mut client = RateLimitQuotaServiceClient::new(service.channel.clone());
    let answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(reports))
        .await
        .expect("stream opened")
        .into_inner();
    Proxy { send, answers }
}

fn bucket(entries: &[(&str, &str)]) -> rlqs::BucketId {
    rlqs::BucketId {
        bucket: entries
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    }
}

fn report(
    domain: &str,
    buckets: &[(rlqs::BucketId, u64, u64)],
) -> rlqs::RateLimitQuotaUsageReports {
    rlqs::RateLimitQuotaUsageReports {
        domain: domain.to_owned(),
        bucket_quota_usages: buckets
            .iter()
            .map(|(id, allowed, denied)| BucketQuotaUsage {
                bucket_id: Some(id.clone()),
                time_elapsed: Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: *allowed,
                num_requests_denied: *denied,
                last_report: None,
            })
            .collect(),
    }
}

impl Proxy {
    async fn send(&self, message: rlqs::RateLimitQuotaUsageReports) {
        self.send.send(message).await.expect("stream open");
    }

    /// The next answer's strategy per bucket (its `name` entry).
    async fn next(&mut self) -> HashMap<String, Strategy> {
        let answer = tokio::time::timeout(ANSWER, self.answers.next())
            .await
            .expect("an answer in time")
            .expect("the stream still open")
            .expect("an answer, not a status");
        answer
            .bucket_action
            .into_iter()
            .map(|action| {
                let name = action.bucket_id.unwrap().bucket["name"].clone();
                let Some(Action::QuotaAssignmentAction(assignment)) = action.bucket_action else {
                    panic!("not an assignment");
                };
                let ttl = assignment.assignment_time_to_live.expect("a time to live");
                assert!(ttl.seconds > 0, "{ttl:?}");
                let strategy = assignment.rate_limit_strategy.unwrap().strategy.unwrap();
                (name, strategy)
            })
            .collect()
    }

    /// The status the stream ended with.
    async fn end(&mut self) -> tonic::Status {
        loop {
            match tokio::time::timeout(ANSWER, self.answers.next()).await {
                Ok(Some(Ok(_))) => continue,
                Ok(Some(Err(status))) => return status,
                Ok(None) => panic!("the stream ended with OK"),
                Err(_) => panic!("the stream did not end in time"),
            }
        }
    }
}

/// Requests per minute a token bucket admits over one minute from full.
fn per_minute(strategy: &Strategy) -> u64 {
    let Strategy::TokenBucket(bucket) = strategy else {
        panic!("not a token bucket: {strategy:?}");
    };
    let interval = bucket.fill_interval.unwrap();
    let interval_ms = interval.seconds as u64 * 1000 + interval.nanos as u64 / 1_000_000;
    u64::from(bucket.max_tokens)
        + u64::from(bucket.tokens_per_fill.unwrap_or(1)) * 60_000 / interval_ms
}

#[tokio::test]
async fn proxies_sharing_a_bucket_get_token_buckets_adding_up_to_the_limit() {
    let service = start().await;
    let shared = bucket(&[("name", "shared")]);
    let mut proxies = Vec::new();
    for _ in 0..3 {
        proxies.push(open(&service).await);
    }
    // Demands of 60, 240 and 480 a minute (in 5 s reports), twice.
    let demands = [5, 20, 40];
    let mut latest = [0u64; 3];
    for _ in 0..2 {
        for (idx, proxy) in proxies.iter_mut().enumerate() {
            proxy
                .send(report("quota", &[(shared.clone(), demands[idx], 0)]))
                .await;
            let answer = proxy.next().await;
            latest[idx] = per_minute(&answer["shared"]);
        }
    }
    // Changes pushed to the others arrive as their own answers: read
    // what is waiting.
    for (idx, proxy) in proxies.iter_mut().enumerate() {
        while let Ok(Some(Ok(answer))) =
            tokio::time::timeout(Duration::from_millis(200), proxy.answers.next()).await
        {
            for action in answer.bucket_action {
                if let Some(Action::QuotaAssignmentAction(it)) = action.bucket_action {
                    latest[idx] = per_minute(&it.rate_limit_strategy.unwrap().strategy.unwrap());
                }
            }
        }
    }
    println!("shares per minute: {latest:?} (limit 300; demands 60, 240, 480)");
    assert!(latest.iter().sum::<u64>() <= 300, "{latest:?}");
    assert_eq!(latest, [60, 120, 120]);

    // What `/rlconfig` lists, and what the metrics count.
    let pools = service.http.quota.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    let mut shares: Vec<u64> = pools[0].members.iter().filter_map(|it| it.share).collect();
    shares.sort_unstable();
    assert_eq!(shares, [60, 120, 120]);
    let text = service.http.metrics.encode();
    let metric = |series: &str| support::service::sample(&text, series);
    assert_eq!(metric("throttlegate_rlqs_streams"), Some(3.0), "{text}");
    assert_eq!(metric("throttlegate_rlqs_buckets"), Some(3.0), "{text}");
    assert_eq!(
        metric(
            "throttlegate_rlqs_assigned_requests_per_window{domain=\"quota\",rule=\"name_shared\"}"
        ),
        Some(300.0),
        "{text}"
    );
    assert_eq!(
        metric(
            "throttlegate_rlqs_reported_requests_total{domain=\"quota\",rule=\"name_shared\",kind=\"allowed\"}"
        ),
        Some(2.0 * 65.0),
        "{text}"
    );
    drop(proxies);
    let deadline = std::time::Instant::now() + ANSWER;
    while support::service::sample(&service.http.metrics.encode(), "throttlegate_rlqs_streams")
        != Some(0.0)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "streams still counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn unmatched_unlimited_and_zero_limits_are_blanket_rules() {
    let service = start().await;
    let mut proxy = open(&service).await;
    proxy
        .send(report(
            "quota",
            &[
                (bucket(&[("name", "blocked")]), 1, 0),
                (bucket(&[("name", "free")]), 1, 0),
                (bucket(&[("name", "nobody")]), 1, 0),
            ],
        ))
        .await;
    let answer = proxy.next().await;
    let allow = Strategy::BlanketRule(BlanketRule::AllowAll as i32);
    let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
    assert_eq!(answer["blocked"], deny);
    assert_eq!(answer["free"], allow);
    assert_eq!(answer["nobody"], allow);
    // A domain the config does not have: every bucket unmatched.
    let mut other = open(&service).await;
    other
        .send(report(
            "elsewhere",
            &[(bucket(&[("name", "shared")]), 1, 0)],
        ))
        .await;
    assert_eq!(other.next().await["shared"], allow);
}

#[tokio::test]
async fn a_bad_stream_is_ended_with_a_reason_and_others_go_on() {
    let service = start().await;
    let mut good = open(&service).await;
    let shared = bucket(&[("name", "shared")]);
    good.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    good.next().await;

    let cases: Vec<(rlqs::RateLimitQuotaUsageReports, Code, &str)> = vec![
        (
            report("", &[(shared.clone(), 1, 0)]),
            Code::InvalidArgument,
            "domain",
        ),
        (
            report("quota", &[(rlqs::BucketId::default(), 1, 0)]),
            Code::InvalidArgument,
            "without entries",
        ),
        (
            report("quota", &[(bucket(&[("name", "")]), 1, 0)]),
            Code::InvalidArgument,
            "empty key or value",
        ),
    ];
    for (message, code, says) in cases {
        let mut bad = open(&service).await;
        bad.send(message).await;
        let status = bad.end().await;
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(says), "{status:?}");
    }
    // A domain changed mid-stream.
    let mut bad = open(&service).await;
    bad.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    bad.send(report("other", &[(shared.clone(), 1, 0)])).await;
    let status = bad.end().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // Too many buckets, in messages under the size bound.
    let mut bad = open(&service).await;
    let per_message = 500;
    for start in (0..=MAX_BUCKETS_PER_STREAM).step_by(per_message) {
        let buckets: Vec<_> = (start..start + per_message)
            .map(|n| (bucket(&[("name", &format!("b{n}"))]), 1, 0))
            .collect();
        if bad.send.send(report("quota", &buckets)).await.is_err() {
            break;
        }
    }
    let status = bad.end().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("buckets"), "{status:?}");
    // A message over the size bound.
    let mut bad = open(&service).await;
    let huge = "x".repeat(70 * 1024);
    bad.send(report("quota", &[(bucket(&[("name", &huge)]), 1, 0)]))
        .await;
    let status = bad.end().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");

    // The good stream is still answered.
    good.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    assert!(matches!(
        good.next().await["shared"],
        Strategy::TokenBucket(_)
    ));
}

#[tokio::test]
async fn a_report_flood_ends_that_stream() {
    let service = start().await;
    let mut flood = open(&service).await;
    let shared = bucket(&[("name", "shared")]);
    let mut ended = None;
    for _ in 0..2_000 {
        if flood
            .send
            .send(report("quota", &[(shared.clone(), 1, 0)]))
            .await
            .is_err()
        {
            break;
        }
    }
    while ended.is_none() {
        match tokio::time::timeout(ANSWER, flood.answers.next()).await {
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(status))) => ended = Some(status),
            other => panic!("{other:?}"),
        }
    }
    let status = ended.unwrap();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("faster than"), "{status:?}");
}

#[tokio::test]
async fn streams_per_connection_are_bounded() {
    let service = start().await;
    let mut open_streams = Vec::new();
    for _ in 0..MAX_STREAMS_PER_CONNECTION {
        let mut proxy = open(&service).await;
        proxy
            .send(report("quota", &[(bucket(&[("name", "free")]), 1, 0)]))
            .await;
        proxy.next().await;
        open_streams.push(proxy);
    }
    let mut client = RateLimitQuotaServiceClient::new(service.channel.clone());
    let (_send, reports) = mpsc::channel(1);
    let refused = client
        .stream_rate_limit_quotas(ReceiverStream::new(reports))
        .await
        .expect_err("one stream too many");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("per connection"), "{refused:?}");
    // One closed makes room again.
    drop(open_streams.pop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut proxy = open(&service).await;
    proxy
        .send(report("quota", &[(bucket(&[("name", "free")]), 1, 0)]))
        .await;
    proxy.next().await;
}

#[tokio::test]
async fn health_knows_the_quota_service() {
    let service = start().await;
    let status = service
        .health("envoy.service.rate_limit_quota.v3.RateLimitQuotaService")
        .await
        .expect("health answers");
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );
}

/// `path` nested under `tenant`, then `name`: sorted by key the bucket
/// would be `[name, path, tenant]` and match nothing.
const ORDERED: &str = "
domain: ordered
bucket_key_order: [tenant, path]
descriptors:
  - key: tenant
    descriptors:
      - key: path
        value: /blocked
        descriptors:
          - key: name
            rate_limit: {unit: minute, requests_per_unit: 0}
";

#[tokio::test]
async fn bucket_key_order_orders_a_bucket_and_a_reload_applies_it() {
    let (backend, _clock) = memory_backend();
    let service = start_with_config(ORDERED, backend, default_options()).await;
    let mut proxy = open(&service).await;
    let id = bucket(&[("name", "b"), ("path", "/blocked"), ("tenant", "acme")]);
    proxy.send(report("ordered", &[(id.clone(), 1, 0)])).await;
    let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
    let allow = Strategy::BlanketRule(BlanketRule::AllowAll as i32);
    assert_eq!(proxy.next().await["b"], deny);
    // A reload without the order: the same bucket, sorted, matches no
    // rule at its next report.
    let sorted = ORDERED.replace("bucket_key_order: [tenant, path]\n", "");
    service
        .limiter
        .rules()
        .store(std::sync::Arc::new(support::service::rules_from(&sorted)));
    proxy.send(report("ordered", &[(id.clone(), 1, 0)])).await;
    assert_eq!(proxy.next().await["b"], allow);
    // And back.
    service
        .limiter
        .rules()
        .store(std::sync::Arc::new(support::service::rules_from(ORDERED)));
    proxy.send(report("ordered", &[(id, 1, 0)])).await;
    assert_eq!(proxy.next().await["b"], deny);
}

#[tokio::test]
async fn a_graceful_stop_ends_every_quota_stream_with_unavailable() {
    let service = start().await;
    let shared = bucket(&[("name", "shared")]);
    let mut proxies = Vec::new();
    for _ in 0..2 {
        // Each proxy on its own connection, as Envoys are.
        let channel = support::service::connect(service.addr).await;
        let (send, reports) = mpsc::channel(16);
        let answers = RateLimitQuotaServiceClient::new(channel)
            .stream_rate_limit_quotas(ReceiverStream::new(reports))
            .await
            .expect("stream opened")
            .into_inner();
        let mut proxy = Proxy { send, answers };
        proxy.send(report("quota", &[(shared.clone(), 1, 0)])).await;
        proxy.next().await;
        proxies.push(proxy);
    }
    // The stop waits for the streams: they must end on their own.
    let stop = tokio::spawn(service.stop());
    for proxy in &mut proxies {
        let status = proxy.end().await;
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().contains("shutting down"), "{status:?}");
    }
    tokio::time::timeout(ANSWER, stop)
        .await
        .expect("the server stopped in time")
        .expect("the stop task")
        .expect("a clean stop");
}

/// A proxy that never reads its answers: once its flow-control window is
/// full they wait in the server, and after 15 s unread (the quota clock
/// moved on) the stream is ended, its buckets given up; a proxy on
/// another connection is answered throughout.
#[tokio::test]
async fn a_proxy_that_never_reads_is_ended_and_others_go_on() {
    let clock = throttlegate::clock::ManualClock::new(support::service::T0);
    let service = support::service::start_with_quota_clock(CONFIG, clock.clone()).await;
    let shared = bucket(&[("name", "shared")]);
    let mut good = open(&service).await;
    good.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    good.next().await;

    // A connection of its own, as each Envoy has.
    let channel = support::service::connect(service.addr).await;
    let (lazy_send, reports) = mpsc::channel(64);
    let mut lazy_answers = RateLimitQuotaServiceClient::new(channel)
        .stream_rate_limit_quotas(ReceiverStream::new(reports))
        .await
        .expect("stream opened")
        .into_inner();
    let per_message = 500;
    let messages = 8;
    let lazy_bucket =
        |message: u32, n: u32| (bucket(&[("name", &format!("lazy-{message}-{n}"))]), 1, 0);
    let metric = |name: &str| support::service::sample(&service.http.metrics.encode(), name);
    let reported = |count: u32| async move {
        let deadline = std::time::Instant::now() + ANSWER;
        while metric(
            "throttlegate_rlqs_reported_requests_total{domain=\"quota\",rule=\"_unmatched\",kind=\"allowed\"}",
        ) != Some(f64::from(count))
        {
            assert!(std::time::Instant::now() < deadline, "reports not read");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    for message in 0..messages {
        let buckets: Vec<_> = (0..per_message).map(|n| lazy_bucket(message, n)).collect();
        lazy_send
            .send(report("quota", &buckets))
            .await
            .expect("stream open");
    }
    reported(per_message * messages).await;
    // Each round of reports is answered with about 135 KB: 30 rounds are
    // well over the client's flow-control window (2 MiB) and what the
    // server buffers past it, so the last answers wait in the server.
    for round in 0..30 {
        for message in 0..messages {
            let buckets: Vec<_> = (0..per_message).map(|n| lazy_bucket(message, n)).collect();
            lazy_send
                .send(report("quota", &buckets))
                .await
                .expect("stream open");
        }
        reported(per_message * messages * (round + 2)).await;
    }
    // Well within the bound: the stream stays.
    clock.advance(10_000_000);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    good.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    good.next().await;
    assert_eq!(
        metric("throttlegate_rlqs_buckets"),
        Some(1.0 + f64::from(per_message * messages))
    );
    // Past it: the stream is ended and gives up its buckets, unread.
    clock.advance(6_000_000);
    let deadline = std::time::Instant::now() + ANSWER;
    while metric("throttlegate_rlqs_buckets") != Some(1.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the lazy stream is still read"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    good.send(report("quota", &[(shared.clone(), 1, 0)])).await;
    assert!(matches!(
        good.next().await["shared"],
        Strategy::TokenBucket(_)
    ));
    // Its seat is given back at once, before it reads or closes.
    let deadline = std::time::Instant::now() + ANSWER;
    while metric("throttlegate_rlqs_streams") != Some(1.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the lazy stream still counted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // What the lazy proxy finds when it reads at last: some answers, then
    // the reason.
    let mut answers = 0;
    let status = loop {
        match tokio::time::timeout(ANSWER, lazy_answers.next()).await {
            Ok(Some(Ok(_))) => answers += 1,
            Ok(Some(Err(status))) => break status,
            other => panic!("{other:?}"),
        }
    };
    assert!(answers >= 1, "{answers}");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("unread for 15 s"), "{status:?}");
}
