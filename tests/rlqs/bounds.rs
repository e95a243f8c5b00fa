//! What one RLQS client can hold: streams that never report, streams gone
//! silent, the bytes of bucket ids a stream keeps, and the pools a client
//! keeps alive across reconnects.

use std::collections::HashMap;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use rlqs::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlqs::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage;
use throttlegate::clock::ManualClock;
use throttlegate::proto::envoy::service::rate_limit_quota::v3 as rlqs;
use throttlegate::proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use throttlegate::transport::grpc::rlqs::{
    FIRST_REPORT_WITHIN, MAX_BUCKET_BYTES_PER_STREAM, MAX_BUCKET_ID_BYTES, MAX_POOLS_PER_CLIENT,
    MAX_UNREPORTED_PER_CONNECTION, MAX_UNREPORTED_STREAMS, SILENT_LIMIT, stored_bytes,
};

use crate::support::service::{T0, TestService, connect, sample, start_with_quota_clock};

const CONFIG: &str = "
domain: quota
descriptors:
  - key: name
    value: shared
    rate_limit: {unit: minute, requests_per_unit: 300}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 60}
";

/// How long an answer may take under load.
const ANSWER: Duration = Duration::from_secs(10);

struct Proxy {
    send: mpsc::Sender<rlqs::RateLimitQuotaUsageReports>,
    answers: Streaming<rlqs::RateLimitQuotaResponse>,
}

async fn try_open(channel: &Channel) -> Result<Proxy, tonic::Status> {
    let (send, reports) = mpsc::channel(64);
    let answers = RateLimitQuotaServiceClient::new(channel.clone())
        .stream_rate_limit_quotas(ReceiverStream::new(reports))
        .await?
        .into_inner();
    Ok(Proxy { send, answers })
}

async fn open(channel: &Channel) -> Proxy {
    try_open(channel).await.expect("stream opened")
}

fn report(buckets: &[(&str, &str)]) -> rlqs::RateLimitQuotaUsageReports {
    rlqs::RateLimitQuotaUsageReports {
        domain: "quota".to_owned(),
        bucket_quota_usages: buckets
            .iter()
            .map(|(key, value)| BucketQuotaUsage {
                bucket_id: Some(rlqs::BucketId {
                    bucket: HashMap::from([((*key).to_owned(), (*value).to_owned())]),
                }),
                time_elapsed: Some(prost_types::Duration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: 1,
                num_requests_denied: 0,
                last_report: None,
            })
            .collect(),
    }
}

impl Proxy {
    async fn send(&self, message: rlqs::RateLimitQuotaUsageReports) {
        self.send.send(message).await.expect("stream open");
    }

    /// The next answer's strategies by the value of each bucket's entry.
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
                let id = action.bucket_id.unwrap();
                let value = id.bucket.into_values().next().unwrap();
                let Some(Action::QuotaAssignmentAction(assignment)) = action.bucket_action else {
                    panic!("not an assignment");
                };
                (
                    value,
                    assignment.rate_limit_strategy.unwrap().strategy.unwrap(),
                )
            })
            .collect()
    }

    /// Answers until every bucket of `values` has one, merged.
    async fn answers_for(&mut self, values: &[&str]) -> HashMap<String, Strategy> {
        let mut all = HashMap::new();
        while !values.iter().all(|it| all.contains_key(*it)) {
            all.extend(self.next().await);
        }
        all
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

async fn start() -> (TestService, ManualClock) {
    let clock = ManualClock::new(T0);
    (start_with_quota_clock(CONFIG, clock.clone()).await, clock)
}

fn metric(service: &TestService, name: &str) -> f64 {
    sample(&service.http.metrics.encode(), name).unwrap_or(0.0)
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + ANSWER;
    while !check() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A stream that sends nothing is ended once [`FIRST_REPORT_WITHIN`] has
/// passed, and its seat is free at once; one that reported is not.
#[tokio::test]
async fn a_stream_that_never_reports_is_ended() {
    let (service, clock) = start().await;
    let channel = connect(service.addr).await;
    let mut proxy = open(&channel).await;
    proxy.send(report(&[("name", "shared")])).await;
    proxy.next().await;
    let mut idle = open(&channel).await;
    until("both streams counted", || {
        metric(&service, "throttlegate_rlqs_streams") == 2.0
    })
    .await;
    clock.advance(FIRST_REPORT_WITHIN.as_micros() as u64 - 1_000_000);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(metric(&service, "throttlegate_rlqs_streams"), 2.0);
    clock.advance(1_000_000);
    let status = idle.end().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("no report within"), "{status:?}");
    assert_eq!(metric(&service, "throttlegate_rlqs_streams"), 1.0);
    proxy.send(report(&[("name", "shared")])).await;
    assert!(matches!(
        proxy.next().await["shared"],
        Strategy::TokenBucket(_)
    ));
}

/// A stream silent for [`SILENT_LIMIT`] after reporting is ended; one
/// reporting every 5 s stays.
#[tokio::test]
async fn a_stream_silent_after_reporting_is_ended() {
    let (service, clock) = start().await;
    let channel = connect(service.addr).await;
    let mut steady = open(&channel).await;
    let mut silent = open(&channel).await;
    steady.send(report(&[("name", "shared")])).await;
    steady.next().await;
    silent.send(report(&[("name", "shared")])).await;
    silent.next().await;
    let mut passed = Duration::ZERO;
    while passed < SILENT_LIMIT {
        clock.advance(5_000_000);
        passed += Duration::from_secs(5);
        steady.send(report(&[("name", "shared")])).await;
        steady.next().await;
    }
    let status = silent.end().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status
            .message()
            .contains(&format!("no report for {} s", SILENT_LIMIT.as_secs())),
        "{status:?}"
    );
    until("the silent stream's seat given back", || {
        metric(&service, "throttlegate_rlqs_streams") == 1.0
    })
    .await;
    steady.send(report(&[("name", "shared")])).await;
    steady.next().await;
}

/// Streams that have not reported have a budget of their own per
/// connection (one more is refused) and in all (one more displaces the
/// oldest of them), and a stream that reported is never displaced: idle
/// streams cannot keep a proxy out.
#[tokio::test]
async fn idle_streams_cannot_keep_a_proxy_out() {
    let (service, _clock) = start().await;
    let proxy_channel = connect(service.addr).await;
    let mut proxy = open(&proxy_channel).await;
    proxy.send(report(&[("name", "shared")])).await;
    proxy.next().await;

    // Per connection.
    let channel = connect(service.addr).await;
    let mut idle = Vec::new();
    for _ in 0..MAX_UNREPORTED_PER_CONNECTION {
        idle.push(open(&channel).await);
    }
    let refused = try_open(&channel).await.err().expect("refused");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("not reported"), "{refused:?}");

    // In all: connections full of idle streams up to the budget.
    let mut channels = vec![channel];
    while idle.len() < MAX_UNREPORTED_STREAMS {
        let channel = connect(service.addr).await;
        for _ in 0..MAX_UNREPORTED_PER_CONNECTION.min(MAX_UNREPORTED_STREAMS - idle.len()) {
            idle.push(open(&channel).await);
        }
        channels.push(channel);
    }
    until("every idle stream counted", || {
        metric(&service, "throttlegate_rlqs_streams") == 1.0 + MAX_UNREPORTED_STREAMS as f64
    })
    .await;
    // A new proxy gets in: the oldest idle stream makes room.
    let newcomer_channel = connect(service.addr).await;
    let mut newcomer = open(&newcomer_channel).await;
    newcomer.send(report(&[("name", "shared")])).await;
    assert!(matches!(
        newcomer.next().await["shared"],
        Strategy::TokenBucket(_)
    ));
    let status = idle[0].end().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("displaced"), "{status:?}");
    assert_eq!(
        metric(&service, "throttlegate_rlqs_streams"),
        2.0 + MAX_UNREPORTED_STREAMS as f64 - 1.0
    );
    // The proxy that had reported is still answered.
    proxy.send(report(&[("name", "shared")])).await;
    assert!(matches!(
        proxy.next().await["shared"],
        Strategy::TokenBucket(_)
    ));
}

/// A bucket id is at most [`MAX_BUCKET_ID_BYTES`], and what a stream keeps
/// for its ids, as the service counts it, never passes
/// [`MAX_BUCKET_BYTES_PER_STREAM`]: the report that would pass it ends the
/// stream, and its bytes are given back.
#[tokio::test]
async fn the_bytes_a_stream_keeps_for_bucket_ids_are_bounded() {
    let (service, _clock) = start().await;
    let channel = connect(service.addr).await;
    let bytes = || metric(&service, "throttlegate_rlqs_bucket_id_bytes");

    let mut too_long = open(&channel).await;
    let value = "v".repeat(MAX_BUCKET_ID_BYTES + 1 - "tenant".len());
    too_long.send(report(&[("tenant", &value)])).await;
    let status = too_long.end().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("at most"), "{status:?}");

    // Ids of the largest size, one per report, until the stream is ended.
    let mut proxy = open(&channel).await;
    let longest = |n: usize| {
        let prefix = format!("{n:06}");
        format!(
            "{prefix}{}",
            "v".repeat(MAX_BUCKET_ID_BYTES - "tenant".len() - prefix.len())
        )
    };
    let each = stored_bytes(&[("tenant", &longest(0))]);
    let fit = MAX_BUCKET_BYTES_PER_STREAM / each;
    // Ten to a report (within the message bound).
    for first in (0..fit).step_by(10) {
        let values: Vec<String> = (first..(first + 10).min(fit)).map(longest).collect();
        let buckets: Vec<(&str, &str)> = values.iter().map(|it| ("tenant", it.as_str())).collect();
        proxy.send(report(&buckets)).await;
        proxy
            .answers_for(&buckets.iter().map(|it| it.1).collect::<Vec<_>>())
            .await;
    }
    assert_eq!(bytes(), (fit * each) as f64);
    assert_eq!(metric(&service, "throttlegate_rlqs_buckets"), fit as f64);
    // A bucket reported again costs nothing more.
    proxy.send(report(&[("tenant", &longest(0))])).await;
    proxy.next().await;
    assert_eq!(bytes(), (fit * each) as f64);
    proxy.send(report(&[("tenant", &longest(fit))])).await;
    let status = proxy.end().await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("bytes of bucket ids"),
        "{status:?}"
    );
    until("the stream's bytes given back", || bytes() == 0.0).await;
}

/// One client reopening streams with new values under a per-value rule
/// keeps at most [`MAX_POOLS_PER_CLIENT`] pools alive: a bucket past it is
/// answered DENY_ALL (never a pool made), a pool it holds is still
/// answered, on a new connection too.
#[tokio::test]
async fn pools_one_client_keeps_alive_are_bounded_across_reconnects() {
    let (service, _clock) = start().await;
    let mut made = 0;
    let per_report = 500;
    let mut last = None;
    while made < MAX_POOLS_PER_CLIENT {
        // A new connection and stream each round: reconnecting changes
        // nothing.
        let channel = connect(service.addr).await;
        let mut proxy = open(&channel).await;
        for _ in 0..3 {
            let values: Vec<String> = (made..(made + per_report).min(MAX_POOLS_PER_CLIENT))
                .map(|n| format!("t{n}"))
                .collect();
            if values.is_empty() {
                break;
            }
            let buckets: Vec<(&str, &str)> =
                values.iter().map(|it| ("tenant", it.as_str())).collect();
            proxy.send(report(&buckets)).await;
            let answers = proxy
                .answers_for(&buckets.iter().map(|it| it.1).collect::<Vec<_>>())
                .await;
            assert!(
                answers
                    .values()
                    .all(|it| matches!(it, Strategy::TokenBucket(_))),
                "pool {made} and on"
            );
            made += values.len();
        }
        last = Some((channel, proxy));
    }
    let deny = Strategy::BlanketRule(BlanketRule::DenyAll as i32);
    // On the stream still open: a new value is denied, its own pools are
    // answered as before.
    let (_channel, mut proxy) = last.expect("a stream");
    let held = format!("t{}", MAX_POOLS_PER_CLIENT - 1);
    proxy
        .send(report(&[("tenant", "one more"), ("tenant", &held)]))
        .await;
    let answers = proxy.answers_for(&["one more", &held]).await;
    assert_eq!(answers["one more"], deny);
    assert!(matches!(answers[&held], Strategy::TokenBucket(_)));
    // A new connection changes nothing.
    let channel = connect(service.addr).await;
    let mut again = open(&channel).await;
    again.send(report(&[("tenant", "another")])).await;
    assert_eq!(again.answers_for(&["another"]).await["another"], deny);
}
