//! One request's failure is its own: a request the decision script refuses
//! (parameters it cannot hold) or fails on (a key of another type) changes
//! no other request's answer, one by one or batched, by FCALL or through
//! the service, and under load.

use std::sync::Arc;

use crate::support::redis::{RedisServer, backend_with, command_stat, command_stats, load_library};
use crate::support::request::{descriptor, request};
use crate::support::service::{TestService, default_options, start_with_config};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode};
use throttlegate::backends::Backend;
use throttlegate::backends::redis::script::{
    self, BATCH_FIELDS, HeaderArgs, REQUEST_FIELDS, ReplyIntegers, ScriptLimit, argv,
};
use throttlegate::backends::redis::{BatchSettings, ClockSource};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const NOW: u64 = 1_700_000_000_000_000;

/// A window of 300 years: more µs than a double holds exactly. No config
/// loads it any more; the script still refuses it when a client sends it.
const REFUSED_WINDOW_US: u64 = 300 * 365 * 86_400 * 1_000_000;

fn header() -> HeaderArgs {
    HeaderArgs {
        now_us: Some(NOW),
        grace_ms: 60_000,
        receipts: false,
    }
}

/// A fixed window of `limit` a minute, enforced, cost 1.
fn fixed(limit: u64) -> ScriptLimit {
    let params = LimitParams::new(Algorithm::FixedWindow, limit, 60_000_000, None).unwrap();
    ScriptLimit::of(&Check {
        params,
        cost: 1,
        mode: Mode::Enforce,
    })
}

/// A limit the script refuses: its window is past 2^53 µs.
fn refused() -> ScriptLimit {
    ScriptLimit {
        window_us: REFUSED_WINDOW_US,
        ..fixed(5)
    }
}

/// FCALL of the library's `decide` on `keys` with `limits`.
async fn fcall_decide(
    conn: &mut MultiplexedConnection,
    keys: &[&str],
    limits: &[ScriptLimit],
) -> redis::RedisResult<ReplyIntegers> {
    redis::cmd("FCALL")
        .arg(&script::library().decide)
        .arg(keys.len())
        .arg(keys)
        .arg(argv(&header(), limits))
        .query_async(conn)
        .await
}

/// FCALL of the library's `decide_batch`: each request its keys and limits.
fn batch_call(requests: &[(Vec<&str>, Vec<ScriptLimit>)]) -> redis::Cmd {
    let keys: Vec<&str> = requests.iter().flat_map(|it| it.0.clone()).collect();
    let mut cmd = redis::cmd("FCALL");
    cmd.arg(&script::library().decide_batch)
        .arg(keys.len())
        .arg(&keys)
        .arg((BATCH_FIELDS[0].value)(&requests.len()));
    for (keys, limits) in requests {
        cmd.arg((REQUEST_FIELDS[0].value)(&keys.len()))
            .arg(argv(&header(), limits));
    }
    cmd
}

/// A request of five limits, then one refused at its second of three: the
/// error names that limit, and each one-limit request after it (of any
/// tenant) is decided on its own limit alone.
async fn refuse_after_a_longer_request(conn: &mut MultiplexedConnection) {
    let five: Vec<_> = (0..5).map(|_| fixed(100)).collect();
    fcall_decide(conn, &["w1", "w2", "w3", "w4", "w5"], &five)
        .await
        .expect("five limits decided");
    let err = fcall_decide(conn, &["r1", "r2", "r3"], &[fixed(5), refused(), fixed(5)])
        .await
        .expect_err("a window past 2^53 µs is refused");
    assert!(
        err.to_string().contains("bad parameters for limit 2"),
        "{err}"
    );
}

/// After a refused request, 20 one-limit requests by FCALL (two tenants):
/// every one decided, each counting down its own limit.
#[tokio::test]
async fn after_a_refused_request_one_limit_requests_are_decided_by_fcall() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    load_library(&mut conn).await;
    refuse_after_a_longer_request(&mut conn).await;
    for idx in 0..20_u64 {
        let key = if idx % 2 == 0 { "tenant-a" } else { "tenant-b" };
        let ReplyIntegers(reply) = fcall_decide(&mut conn, &[key], &[fixed(10)])
            .await
            .unwrap_or_else(|err| panic!("request {idx} after the refused one: {err}"));
        let verdict = script::parse_reply(&reply, 1).expect("one limit's reply");
        assert!(verdict.allowed, "request {idx}");
        assert_eq!(verdict.outcomes[0].remaining, 9 - idx / 2, "request {idx}");
    }
}

/// A batch holding a refused request: that member alone is refused, the
/// others decided as if it had not been sent; later calls, batched or one
/// by one, are decided too.
#[tokio::test]
async fn a_refused_batch_member_fails_alone_by_fcall() {
    let server = RedisServer::start();
    let mut conn = server.connection().await;
    load_library(&mut conn).await;
    refuse_after_a_longer_request(&mut conn).await;
    let requests = vec![
        (vec!["a"], vec![fixed(10)]),
        (vec!["b", "c"], vec![fixed(10), refused()]),
        (vec!["b"], vec![fixed(10)]),
        (vec!["a"], vec![fixed(10)]),
    ];
    let ReplyIntegers(reply) = batch_call(&requests)
        .query_async(&mut conn)
        .await
        .expect("the batch is answered");
    let answers = script::parse_batch_reply(&reply, &[1, 2, 1, 1]).expect("a batch reply");
    let remaining: Vec<_> = answers
        .iter()
        .map(|it| it.as_ref().ok().map(|it| it.outcomes[0].remaining))
        .collect();
    assert_eq!(remaining, [Some(9), None, Some(9), Some(8)], "{answers:?}");
    let err = answers[1].as_ref().unwrap_err().to_string();
    assert!(err.contains("bad parameters for limit 2"), "{err}");
    // The refused member took nothing from b.
    let ReplyIntegers(reply) = fcall_decide(&mut conn, &["b"], &[fixed(10)])
        .await
        .expect("decided after the batch");
    assert_eq!(
        script::parse_reply(&reply, 1).unwrap().outcomes[0].remaining,
        8
    );
}

const CONFIG: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1000000, algorithm: fixed_window}
"#;

/// A service on `server` deciding [`CONFIG`], batching on or off, with a
/// pool of 2 (so that concurrent requests wait and are batched).
async fn service(server: &RedisServer, batching: bool) -> TestService {
    let backend = backend_with(server, ClockSource::Redis, |it| {
        it.pool_size = 2;
        it.key_prefix = "iso".to_owned();
        it.batch = batching.then_some(BatchSettings {
            max_requests: 64,
            max_keys: 512,
        });
    })
    .await;
    let backend: Arc<dyn Backend> = Arc::new(backend);
    start_with_config(CONFIG, backend, default_options()).await
}

fn user(value: &str) -> RateLimitRequest {
    request("api", vec![descriptor(&[("user", value)])])
}

/// After a refused FCALL on the service's own library (any client sharing
/// the server could send it), ten one-limit requests through the service
/// are decided, counting down: batching off and on.
#[tokio::test]
async fn after_a_refused_request_the_service_decides_every_request() {
    for batching in [false, true] {
        let server = RedisServer::start();
        let service = service(&server, batching).await;
        let mut client = service.client();
        // The library is on the server once the service has decided.
        client.should_rate_limit(user("warm")).await.expect("warm");
        let mut conn = server.connection().await;
        refuse_after_a_longer_request(&mut conn).await;
        for idx in 0..10_u64 {
            let answer = client
                .should_rate_limit(user("alice"))
                .await
                .unwrap_or_else(|status| panic!("batching {batching}, request {idx}: {status}"))
                .into_inner();
            assert_eq!(answer.overall_code, Code::Ok as i32, "request {idx}");
            assert_eq!(
                answer.statuses[0].limit_remaining,
                u32::try_from(999_999 - idx).unwrap(),
                "batching {batching}, request {idx}"
            );
        }
    }
}

/// 64 concurrent clients through the service with batching on, 2% of the
/// requests on a counter the script fails on (its key holds a hash), while
/// another client sends refused requests to the same library: each
/// failing request fails, every other request is decided, and batches
/// were sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_only_the_failing_requests_fail() {
    const CLIENTS: usize = 64;
    const PER_CLIENT: usize = 40;
    let server = RedisServer::start();
    let service = service(&server, true).await;
    let mut client = service.client();
    client
        .should_rate_limit(user("poison"))
        .await
        .expect("poison's key made");
    let mut conn = server.connection().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("iso*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 1, "{keys:?}");
    let _: () = redis::cmd("DEL")
        .arg(&keys[0])
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(&keys[0])
        .arg("not")
        .arg("a counter")
        .query_async(&mut conn)
        .await
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .unwrap();

    // Meanwhile another client of the server sends refused requests to the
    // same library, one by one and inside batches.
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refuser = {
        let done = done.clone();
        let mut conn = server.connection().await;
        tokio::spawn(async move {
            // FCALLs sent: three per round.
            let mut sent = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                refuse_after_a_longer_request(&mut conn).await;
                let requests = vec![
                    (vec!["side-a"], vec![fixed(1_000_000)]),
                    (vec!["side-b"], vec![refused()]),
                ];
                let ReplyIntegers(reply) = batch_call(&requests)
                    .query_async(&mut conn)
                    .await
                    .expect("a batch with a refused member is answered");
                let answers = script::parse_batch_reply(&reply, &[1, 1]).expect("a batch reply");
                assert!(answers[0].is_ok() && answers[1].is_err(), "{answers:?}");
                sent += 3;
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            sent
        })
    };
    let mut tasks = Vec::new();
    for task in 0..CLIENTS {
        let mut client = service.client();
        tasks.push(tokio::spawn(async move {
            let (mut decided, mut failed, mut wrong) = (0, 0, Vec::new());
            for idx in 0..PER_CLIENT {
                let poisoned = (task * PER_CLIENT + idx).is_multiple_of(50);
                let value = if poisoned {
                    "poison".to_owned()
                } else {
                    format!("u{}", (task + idx) % 16)
                };
                match client.should_rate_limit(user(&value)).await {
                    Ok(answer) if !poisoned && answer.get_ref().overall_code == Code::Ok as i32 => {
                        decided += 1;
                    }
                    Err(_) if poisoned => failed += 1,
                    other => wrong.push(format!("{value}: {other:?}")),
                }
            }
            (decided, failed, wrong)
        }));
    }
    let (mut decided, mut failed, mut wrong) = (0, 0, Vec::new());
    for task in tasks {
        let (d, f, w) = task.await.unwrap();
        decided += d;
        failed += f;
        wrong.extend(w);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let side_calls = refuser.await.unwrap();
    assert!(side_calls > 0, "no refused request was sent alongside");
    let total = CLIENTS * PER_CLIENT;
    let poisoned = total.div_ceil(50);
    assert!(
        wrong.is_empty(),
        "{} of {total} wrong answers, e.g. {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(3)]
    );
    assert_eq!((decided, failed), (total - poisoned, poisoned));
    let stats = command_stats(&mut conn).await;
    let calls = command_stat(&stats, "fcall", "calls").unwrap_or(0.0);
    assert!(
        calls < (total + side_calls) as f64,
        "{calls} calls for {total} requests: nothing was batched"
    );
}
