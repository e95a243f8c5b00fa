//! Redis faults injected while a load runs: several gRPC clients send
//! ShouldRateLimit in a loop to the service binary, on a redis-server of
//! the test's own, while Redis is killed, paused, slowed, out of memory,
//! flushed of its code or cut off by a proxy. For each: every RPC answered
//! within the timeout plus a slack, with a decision or the answer the
//! failure mode gives; nothing counted twice; decisions again without a
//! restart; health following the fault where it can see it.
//!
//! Then the bound on calls queued toward Redis, driven deterministically on
//! the backend: beyond it calls are shed at once, and a call whose time ran
//! out while it waited is never sent.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinSet;
use tokio::time::error::Elapsed;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::support::ONE_AT_A_TIME;
use crate::support::cluster::Cluster;
use crate::support::keys::{check, counter_key};
use crate::support::process::{Serve, ServiceProcess, http_get};
use crate::support::proxy::{Mode, Proxy};
use crate::support::redis::{RedisServer, backend_with, command_stat, command_stats, reset_stats};
use crate::support::request::{descriptor, request};
use crate::support::service::connect;
use throttlegate::algorithms::Algorithm;
use throttlegate::backends::keys::{HashTag, KeyFormat};
use throttlegate::backends::redis::cluster::{ClusterBackend, ClusterSettings};
use throttlegate::backends::redis::{BatchSettings, ClockSource};
use throttlegate::backends::{Backend, Error};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

/// `--redis-timeout-ms` of the service under test.
const TIMEOUT: Duration = Duration::from_millis(500);

/// What an RPC may take beyond [`TIMEOUT`]. Generous: two shared cores run
/// Redis, a debug build of the service and eight busy clients (and often a
/// compiler), and stalls of several hundred ms were seen there. It still
/// catches what matters: every fault lasts [`FAULT`], longer than the
/// timeout plus this slack, so an RPC that waited for the fault to end
/// (instead of giving up at its deadline) fails the bound.
const SLACK: Duration = Duration::from_millis(1500);

/// How long each fault lasts.
const FAULT: Duration = Duration::from_secs(3);

/// Within this after a fault ends, requests are decided again and health
/// reports SERVING; within this after it starts, health notices it.
const WITHIN: Duration = Duration::from_secs(5);

/// Concurrent gRPC clients of the load, each on its own connection.
const CLIENTS: usize = 8;

/// Phases of a run: before the fault, during it, right after it, and
/// once health and decisions are back.
const BEFORE: u32 = 0;
const DURING: u32 = 1;
const HEALING: u32 = 2;
const AFTER: u32 = 3;

/// Two descriptors per request, each with its own counter: a request
/// decided by Redis adds one to both, so equal counters show that no
/// request ever wrote one and not the other. Fixed windows of a year never
/// roll over during a test, so a counter is the number of requests it
/// allowed.
const CONFIG: &str = r#"
domain: faults
descriptors:
  - key: a
    rate_limit: {unit: year, requests_per_unit: 1000000000, algorithm: fixed_window}
  - key: b
    rate_limit: {unit: year, requests_per_unit: 1000000000, algorithm: fixed_window}
"#;

/// `--failure-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Error,
    Allow,
    Deny,
}

impl Failure {
    fn flag(self) -> &'static str {
        match self {
            Failure::Error => "error",
            Failure::Allow => "allow",
            Failure::Deny => "deny",
        }
    }
}

/// What one RPC was answered.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Answer {
    /// Decided by Redis: OK with the limit's figures.
    Decided,
    /// What the failure mode gives: UNAVAILABLE for `error`; OK or
    /// OVER_LIMIT without any limit's figures for `allow` and `deny`.
    FailureMode,
    /// Anything else (a wrong code, another error, no answer at all).
    Other(String),
}

struct Rpc {
    phase: u32,
    elapsed: Duration,
    answer: Answer,
}

/// Phase `phase`'s request: both counters named after the phase, so each
/// phase's counts can be compared with its own answers.
fn phase_request(phase: u32) -> RateLimitRequest {
    let value = format!("p{phase}");
    request(
        "faults",
        vec![
            descriptor(&[("a", value.as_str())]),
            descriptor(&[("b", value.as_str())]),
        ],
    )
}

/// An RPC's outcome as the client sees it: no answer within its own
/// guard, an error status, or a response.
type Outcome = Result<Result<tonic::Response<RateLimitResponse>, tonic::Status>, Elapsed>;

fn classify(res: Outcome, failure: Failure) -> Answer {
    let res = match res {
        Err(_) => return Answer::Other("no answer within 10 s".to_owned()),
        Ok(res) => res,
    };
    match res {
        Err(status) if failure == Failure::Error && status.code() == tonic::Code::Unavailable => {
            Answer::FailureMode
        }
        Err(status) => Answer::Other(format!("{:?}: {}", status.code(), status.message())),
        Ok(res) => {
            let res = res.into_inner();
            let figures = res.statuses.iter().all(|it| it.current_limit.is_some());
            let none = res.statuses.iter().all(|it| it.current_limit.is_none());
            let code = res.overall_code;
            if code == Code::Ok as i32 && figures && res.statuses.len() == 2 {
                Answer::Decided
            } else if none
                && ((failure == Failure::Allow && code == Code::Ok as i32)
                    || (failure == Failure::Deny && code == Code::OverLimit as i32))
            {
                Answer::FailureMode
            } else {
                Answer::Other(format!("{res:?}"))
            }
        }
    }
}

/// [`CLIENTS`] clients sending in a loop, each RPC tagged with the phase
/// it was sent in.
struct Load {
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicU32>,
    /// Decided and failure-mode answers so far, per phase.
    decided: Arc<[AtomicU64; 4]>,
    failed: Arc<[AtomicU64; 4]>,
    tasks: JoinSet<Vec<Rpc>>,
}

impl Load {
    async fn start(service: &ServiceProcess, failure: Failure) -> Load {
        let mut load = Load {
            stop: Arc::default(),
            phase: Arc::default(),
            decided: Arc::default(),
            failed: Arc::default(),
            tasks: JoinSet::new(),
        };
        for _ in 0..CLIENTS {
            let mut client = RateLimitServiceClient::new(connect(service.grpc).await);
            let (stop, phase) = (load.stop.clone(), load.phase.clone());
            let (decided, failed) = (load.decided.clone(), load.failed.clone());
            load.tasks.spawn(async move {
                let mut rpcs = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let phase = phase.load(Ordering::SeqCst);
                    let started = Instant::now();
                    let res = tokio::time::timeout(
                        Duration::from_secs(10),
                        client.should_rate_limit(phase_request(phase)),
                    )
                    .await;
                    let elapsed = started.elapsed();
                    let answer = classify(res, failure);
                    match answer {
                        Answer::Decided => decided[phase as usize].fetch_add(1, Ordering::SeqCst),
                        Answer::FailureMode => {
                            failed[phase as usize].fetch_add(1, Ordering::SeqCst)
                        }
                        Answer::Other(_) => 0,
                    };
                    rpcs.push(Rpc {
                        phase,
                        elapsed,
                        answer,
                    });
                }
                rpcs
            });
        }
        load.wait_decided(BEFORE, 50, WITHIN).await;
        load
    }

    fn enter(&self, phase: u32) {
        self.phase.store(phase, Ordering::SeqCst);
    }

    /// Waits until `n` RPCs of `phase` were decided; how long it took.
    async fn wait_decided(&self, phase: u32, n: u64, within: Duration) -> Duration {
        let started = Instant::now();
        while self.decided[phase as usize].load(Ordering::SeqCst) < n {
            assert!(
                started.elapsed() < within,
                "fewer than {n} requests of phase {phase} decided within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        started.elapsed()
    }

    /// Waits until some RPC of `phase` got the failure mode's answer.
    async fn wait_failed(&self, phase: u32, within: Duration) {
        let started = Instant::now();
        while self.failed[phase as usize].load(Ordering::SeqCst) == 0 {
            assert!(
                started.elapsed() < within,
                "no failure-mode answer in phase {phase} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn finish(mut self) -> Vec<Rpc> {
        self.stop.store(true, Ordering::SeqCst);
        let mut rpcs = Vec::new();
        while let Some(res) = self.tasks.join_next().await {
            rpcs.extend(res.expect("client task"));
        }
        rpcs
    }
}

/// A redis-server, the service binary on it (directly or through a
/// proxy), and the failure mode it runs with.
struct Setup {
    redis: RedisServer,
    proxy: Option<Proxy>,
    service: ServiceProcess,
    channel: Channel,
    failure: Failure,
}

impl Setup {
    async fn start(redis_args: &[&str], failure: Failure, via_proxy: bool) -> Setup {
        let redis = RedisServer::start_with(redis_args);
        let proxy = match via_proxy {
            true => Some(Proxy::start(([127, 0, 0, 1], redis.port()).into()).await),
            false => None,
        };
        let url = proxy.as_ref().map_or_else(|| redis.url(), Proxy::redis_url);
        let timeout_ms = TIMEOUT.as_millis().to_string();
        let mut service = Serve::yaml(CONFIG)
            .args(&["--redis-url", &url])
            .args(&["--redis-timeout-ms", &timeout_ms])
            .args(&["--redis-key-prefix", "tg"])
            .args(&["--failure-mode", failure.flag()])
            .spawn();
        let channel = service.connect().await;
        Setup {
            redis,
            proxy,
            service,
            channel,
            failure,
        }
    }

    /// gRPC health of the server as a whole, and `/healthcheck`'s status code.
    async fn health(&self) -> (Option<ServingStatus>, u16) {
        let grpc = HealthClient::new(self.channel.clone())
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .ok()
            .map(|it| it.into_inner().status());
        let http = http_get(self.service.http, "/healthcheck").await;
        let code = http
            .split_whitespace()
            .nth(1)
            .and_then(|it| it.parse().ok())
            .unwrap_or_else(|| panic!("no status line in {http:?}"));
        (grpc, code)
    }

    /// Waits until both health answers say `serving`.
    async fn wait_health(&self, serving: bool, within: Duration) {
        let expected = match serving {
            true => (Some(ServingStatus::Serving), 200),
            false => (Some(ServingStatus::NotServing), 503),
        };
        let started = Instant::now();
        loop {
            let health = self.health().await;
            if health == expected {
                return;
            }
            assert!(
                started.elapsed() < within,
                "health is {health:?}, expected {expected:?} within {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Decisions again, health back, and a last phase decided normally;
    /// then every RPC of the run, checked against the bound and the
    /// failure mode.
    async fn recover(&self, load: Load) -> Vec<Rpc> {
        load.enter(HEALING);
        load.wait_decided(HEALING, 1, WITHIN).await;
        self.wait_health(true, WITHIN).await;
        load.enter(AFTER);
        load.wait_decided(AFTER, 100, WITHIN).await;
        let rpcs = load.finish().await;
        self.check_answers(&rpcs);
        rpcs
    }

    /// Every RPC within the bound, each decided or answered as the failure
    /// mode says; before the fault and once recovered, all decided.
    fn check_answers(&self, rpcs: &[Rpc]) {
        let bound = TIMEOUT + SLACK;
        let slowest = rpcs.iter().map(|it| it.elapsed).max().unwrap_or_default();
        eprintln!(
            "{} RPCs ({:?}): {} decided, {} failure-mode answers; slowest {slowest:?}",
            rpcs.len(),
            self.failure,
            rpcs.iter()
                .filter(|it| it.answer == Answer::Decided)
                .count(),
            rpcs.iter()
                .filter(|it| it.answer == Answer::FailureMode)
                .count(),
        );
        assert!(
            slowest <= bound,
            "an RPC took {slowest:?}, over the timeout and slack ({bound:?}); log:\n{}",
            self.service.log()
        );
        let others: Vec<&Answer> = rpcs
            .iter()
            .map(|it| &it.answer)
            .filter(|it| matches!(it, Answer::Other(_)))
            .take(5)
            .collect();
        assert!(
            others.is_empty(),
            "answers that are neither decisions nor {:?}'s: {others:?}",
            self.failure
        );
        // Requests sent before the fault may be answered during it; those
        // sent once it is over and health is back are all decided.
        let after: Vec<&Rpc> = rpcs.iter().filter(|it| it.phase == AFTER).collect();
        let undecided = after
            .iter()
            .filter(|it| it.answer != Answer::Decided)
            .count();
        assert_eq!(
            undecided,
            0,
            "{undecided} of {} requests not decided after recovery",
            after.len()
        );
    }

    /// Nothing counted twice, nothing half-written: for each of `phases`,
    /// both counters equal, at least the requests Redis decided and at most
    /// those plus the ones answered under the failure mode (which may have
    /// run in Redis after their caller gave up, but only once). And
    /// Redis ran no more decisions than were asked for.
    async fn check_counts(&self, rpcs: &[Rpc], phases: &[u32]) {
        let mut conn = self.redis.connection().await;
        for &phase in phases {
            let decided = count(rpcs, phase, &Answer::Decided);
            let failed = count(rpcs, phase, &Answer::FailureMode);
            let a = counter(&self.redis, &mut conn, "a", phase).await;
            let b = counter(&self.redis, &mut conn, "b", phase).await;
            assert_eq!(a, b, "phase {phase}: one counter written without the other");
            assert!(
                decided <= a && a <= decided + failed,
                "phase {phase}: counter {a}, {decided} decided, {failed} failure-mode answers"
            );
        }
        let stats = command_stats(&mut conn).await;
        let ran = |command| {
            command_stat(&stats, command, "calls").unwrap_or(0.0)
                - command_stat(&stats, command, "failed_calls").unwrap_or(0.0)
        };
        let ran = ran("fcall") + ran("evalsha");
        assert!(
            ran <= rpcs.len() as f64,
            "{ran} decisions ran in Redis for {} RPCs:\n{stats}",
            rpcs.len()
        );
    }
}

fn count(rpcs: &[Rpc], phase: u32, answer: &Answer) -> u64 {
    rpcs.iter()
        .filter(|it| it.phase == phase && it.answer == *answer)
        .count() as u64
}

/// The count of the fixed window `key=p<phase>` (its state is
/// `window_start:count`); 0 when absent.
async fn counter(
    redis: &RedisServer,
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    phase: u32,
) -> u64 {
    let suffix = format!(":{key}=p{phase}");
    let mut total = 0;
    for name in redis.keys("tg:faults:*").await {
        if !name.ends_with(&suffix) {
            continue;
        }
        let state: String = redis::cmd("GET")
            .arg(&name)
            .query_async(conn)
            .await
            .expect("GET");
        total += state
            .rsplit(':')
            .next()
            .and_then(|it| it.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("not a fixed window state: {state:?}"));
    }
    total
}

async fn admin(redis: &RedisServer, args: &[&str]) {
    let mut conn = redis.connection().await;
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    let _: redis::Value = cmd.query_async(&mut conn).await.unwrap_or_else(|err| {
        panic!("{args:?}: {err}");
    });
}

/// A crash: Redis killed (its counters lost) and started again on the same
/// port. Health sees it (connections refused); `error` answers UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_and_restarted_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let mut setup = Setup::start(&[], Failure::Error, false).await;
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    let cut = Instant::now();
    tokio::task::block_in_place(|| setup.redis.kill());
    load.wait_failed(DURING, WITHIN).await;
    setup.wait_health(false, WITHIN).await;
    tokio::time::sleep(FAULT.saturating_sub(cut.elapsed())).await;
    tokio::task::block_in_place(|| setup.redis.restart());
    let rpcs = setup.recover(load).await;
    // Counters written before the kill are gone with the process: only the
    // phases after the restart can be counted.
    setup.check_counts(&rpcs, &[HEALING, AFTER]).await;
}

/// `CLIENT PAUSE ALL` longer than the timeout: every connection stays
/// open, nothing is answered. Calls time out (`deny` answers OVER_LIMIT);
/// health notices because its PING times out too (a pause shorter than a
/// probe interval, about a second, could go unseen by health). Calls
/// written during the pause run when it ends, after their callers gave up:
/// counted once, never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_paused_longer_than_the_timeout_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let setup = Setup::start(&[], Failure::Deny, false).await;
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    let pause = FAULT.as_millis().to_string();
    let paused = Instant::now();
    admin(&setup.redis, &["CLIENT", "PAUSE", &pause, "ALL"]).await;
    load.wait_failed(DURING, WITHIN).await;
    setup.wait_health(false, FAULT).await;
    tokio::time::sleep(FAULT.saturating_sub(paused.elapsed())).await;
    let rpcs = setup.recover(load).await;
    setup
        .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
        .await;
}

/// `DEBUG SLEEP` longer than the timeout: Redis busy, as with a slow
/// script. `allow` answers OK (without a limit's figures); health notices
/// through its PING, as for a pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slow_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let setup = Setup::start(&["--enable-debug-command", "local"], Failure::Allow, false).await;
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    let sleep = setup.redis.put_to_sleep(FAULT.as_secs_f64()).await;
    load.wait_failed(DURING, WITHIN).await;
    setup.wait_health(false, FAULT).await;
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    let rpcs = setup.recover(load).await;
    setup
        .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
        .await;
}

/// Out of memory (`maxmemory` below what Redis uses, `noeviction`): Redis
/// refuses every call that may write (OOM) before running it, so no
/// request is ever half-written (both counters stay equal). PING still
/// answers: health cannot see this fault and stays SERVING while `error`
/// answers UNAVAILABLE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let setup = Setup::start(&[], Failure::Error, false).await;
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    admin(
        &setup.redis,
        &["CONFIG", "SET", "maxmemory-policy", "noeviction"],
    )
    .await;
    admin(&setup.redis, &["CONFIG", "SET", "maxmemory", "1"]).await;
    load.wait_failed(DURING, WITHIN).await;
    // Not detectable by health: Redis answers PING.
    assert_eq!(
        setup.health().await,
        (Some(ServingStatus::Serving), 200),
        "health while Redis is out of memory"
    );
    tokio::time::sleep(FAULT).await;
    admin(&setup.redis, &["CONFIG", "SET", "maxmemory", "0"]).await;
    let rpcs = setup.recover(load).await;
    setup
        .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
        .await;
}

/// The code flushed from Redis under load, again and again: each call that
/// finds it missing loads it and is sent once more, so every request is
/// decided and none gets the failure mode's answer. With functions
/// (FUNCTION FLUSH, FCALL) and without (FUNCTION renamed away: SCRIPT
/// FLUSH, EVALSHA).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn code_flushed_under_load_is_reloaded_and_every_request_decided() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let engines: [(&[&str], &[&str], &str); 2] = [
        (&[], &["FUNCTION", "FLUSH"], "fcall"),
        (
            &["--rename-command", "FUNCTION", ""],
            &["SCRIPT", "FLUSH"],
            "evalsha",
        ),
    ];
    for (redis_args, flush, command) in engines {
        let setup = Setup::start(redis_args, Failure::Allow, false).await;
        let load = Load::start(&setup.service, setup.failure).await;
        load.enter(DURING);
        let mut conn = setup.redis.connection().await;
        for _ in 0..10 {
            admin(&setup.redis, flush).await;
            let decided = load.decided[DURING as usize].load(Ordering::SeqCst);
            load.wait_decided(DURING, decided + 20, WITHIN).await;
        }
        let rpcs = setup.recover(load).await;
        let failed: u64 = (0..4)
            .map(|phase| count(&rpcs, phase, &Answer::FailureMode))
            .sum();
        assert_eq!(
            failed, 0,
            "requests answered under the failure mode ({command})"
        );
        let stats = command_stats(&mut conn).await;
        assert!(
            command_stat(&stats, command, "calls").unwrap_or(0.0) > 0.0,
            "no {command} ran:\n{stats}"
        );
        setup
            .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
            .await;
    }
}

/// A network cut without a reset (a proxy that stops forwarding, every
/// connection left open): calls time out (`deny` answers OVER_LIMIT),
/// health sees the PING time out; what was written during the cut reaches
/// Redis when it heals and runs once, after its callers gave up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_black_hole_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let setup = Setup::start(&[], Failure::Deny, true).await;
    let proxy = setup.proxy.as_ref().expect("a proxy");
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    let cut = Instant::now();
    proxy.set(Mode::BlackHole);
    load.wait_failed(DURING, WITHIN).await;
    setup.wait_health(false, FAULT).await;
    tokio::time::sleep(FAULT.saturating_sub(cut.elapsed())).await;
    proxy.set(Mode::Forward);
    let rpcs = setup.recover(load).await;
    setup
        .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
        .await;
}

/// A network cut that resets every connection, and every new one until it
/// heals: calls fail at once (`allow` answers OK), health sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_reset_under_load() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let setup = Setup::start(&[], Failure::Allow, true).await;
    let proxy = setup.proxy.as_ref().expect("a proxy");
    let load = Load::start(&setup.service, setup.failure).await;
    load.enter(DURING);
    let cut = Instant::now();
    proxy.set(Mode::Reset);
    load.wait_failed(DURING, WITHIN).await;
    setup.wait_health(false, FAULT).await;
    tokio::time::sleep(FAULT.saturating_sub(cut.elapsed())).await;
    proxy.set(Mode::Forward);
    let rpcs = setup.recover(load).await;
    setup
        .check_counts(&rpcs, &[BEFORE, DURING, HEALING, AFTER])
        .await;
}

// === the bound on calls queued toward Redis ===

/// Timeout of the backends below.
const BACKEND_TIMEOUT_MS: u64 = 300;

/// What `n` concurrent requests got: each result.
async fn flood<B: Backend + 'static>(backend: &Arc<B>, n: usize) -> Vec<Result<(), Error>> {
    let checks = vec![check(
        counter_key(Algorithm::FixedWindow, 3600, &[("user", "flood")]),
        1_000_000,
        1,
    )];
    let mut tasks = JoinSet::new();
    for _ in 0..n {
        let backend = backend.clone();
        let checks = checks.clone();
        tasks.spawn(async move { backend.decide(&checks).await.map(|_| ()) });
    }
    let mut results = Vec::new();
    while let Some(res) = tasks.join_next().await {
        results.push(res.expect("task"));
    }
    results
}

fn tally(results: &[Result<(), Error>]) -> (usize, usize, usize) {
    let shed = results
        .iter()
        .filter(|it| matches!(it, Err(Error::Shed(_))))
        .count();
    let timed_out = results
        .iter()
        .filter(|it| matches!(it, Err(Error::Timeout(_))))
        .count();
    (shed, timed_out, results.len() - shed - timed_out)
}

/// FCALLs Redis ran since the stats were reset, once everything sent
/// before on the backend's one connection has run: the backend's own
/// next call, sent after them on the same connection, is answered after
/// them.
async fn fcalls_after(
    backend: &throttlegate::backends::redis::RedisBackend,
    admin: &mut redis::aio::MultiplexedConnection,
) -> f64 {
    let checks = vec![check(
        counter_key(Algorithm::FixedWindow, 3600, &[("user", "after")]),
        1_000_000,
        1,
    )];
    backend
        .decide(&checks)
        .await
        .expect("decided once Redis is back");
    let stats = command_stats(admin).await;
    command_stat(&stats, "fcall", "calls").unwrap_or(0.0)
}

/// The gate of a single server: 64 calls in flight and 2,048 waiting,
/// whatever the pool size (`MAX_IN_FLIGHT`, `MAX_WAITING`).
const SERVER_IN_FLIGHT: usize = 64;
const SERVER_WAITING: usize = 2048;

/// Timeout of the single-server gate tests below: long enough that every
/// request of a flood of thousands takes its place in line before the
/// first waiter's time runs out, even on two loaded cores.
const GATE_TIMEOUT_MS: u64 = 800;

/// With one pooled connection (as with any), 64 calls may be in flight
/// and 2,048 wait. While Redis sleeps, 2,212 concurrent requests: 64 are
/// sent, 2,048 wait and give up unsent when their time runs short, and the
/// other 100 are shed at once. Redis then runs exactly the 64 that were
/// sent (and the one after).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_beyond_the_bound_are_shed_and_none_is_sent_after_its_time() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.pool_size = 1;
        it.timeout_ms = GATE_TIMEOUT_MS;
    });
    let backend = Arc::new(backend.await);
    let mut admin = server.connection().await;
    // Loads the library on the backend's connection.
    fcalls_after(&backend, &mut admin).await;
    reset_stats(&mut admin).await;
    let sleep = server.put_to_sleep(1.5).await;
    let results = flood(&backend, SERVER_IN_FLIGHT + SERVER_WAITING + 100).await;
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    let (shed, timed_out, other) = tally(&results);
    assert_eq!(
        (shed, timed_out, other),
        (100, SERVER_IN_FLIGHT + SERVER_WAITING, 0)
    );
    assert_eq!(
        fcalls_after(&backend, &mut admin).await,
        SERVER_IN_FLIGHT as f64 + 1.0
    );
}

/// The same bound on a Redis Cluster backend: one place per request. The
/// cluster's primaries are paused (`CLIENT PAUSE`) instead of put to sleep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_calls_beyond_the_bound_are_shed_and_none_is_sent_after_its_time() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start(3, 0).await;
    let backend = Arc::new(
        ClusterBackend::connect(ClusterSettings {
            nodes: cluster.seeds(),
            pool_size: 1,
            timeout_ms: BACKEND_TIMEOUT_MS,
            keys: KeyFormat::new("tg", HashTag::None),
            clock: ClockSource::Redis,
            expiry_grace_ms: 0,
            tls: Default::default(),
        })
        .expect("settings"),
    );
    // The library loaded and the engine chosen before the count starts.
    let sent_before = flood(&backend, 1).await;
    assert_eq!(tally(&sent_before), (0, 0, 1), "{sent_before:?}");
    cluster.reset_stats().await;
    for idx in cluster.current_primaries().await {
        let mut conn = cluster.node(idx).connection().await;
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(1_000)
            .arg("ALL")
            .query_async(&mut conn)
            .await
            .expect("CLIENT PAUSE");
    }
    let results = flood(&backend, 400).await;
    let (shed, timed_out, other) = tally(&results);
    assert_eq!((shed, timed_out, other), (136, 264, 0), "{results:?}");
    // Once the pause ends, one more call on the same key and connection
    // runs after everything sent before it.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let after = flood(&backend, 1).await;
    assert_eq!(tally(&after), (0, 0, 1), "{after:?}");
    assert_eq!(cluster.calls_on_primaries("fcall").await, 8 + 1);
}

/// The same bound with batching on: one call in flight per connection,
/// at most 2,048 requests queued for the next batch, the rest shed; the
/// queued requests' time runs out while Redis sleeps, so their batch is
/// never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_calls_beyond_the_bound_are_shed_and_a_late_batch_is_never_sent() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.pool_size = 1;
        it.timeout_ms = GATE_TIMEOUT_MS;
        it.batch = Some(BatchSettings {
            max_requests: 64,
            max_keys: 512,
        });
    });
    let backend = Arc::new(backend.await);
    let mut admin = server.connection().await;
    fcalls_after(&backend, &mut admin).await;
    reset_stats(&mut admin).await;
    let sleep = server.put_to_sleep(1.5).await;
    let results = flood(&backend, 1 + SERVER_WAITING + 100).await;
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    let (shed, timed_out, other) = tally(&results);
    assert_eq!((shed, timed_out, other), (100, 1 + SERVER_WAITING, 0));
    assert_eq!(fcalls_after(&backend, &mut admin).await, 1.0 + 1.0);
}

/// A call that gets its place with less than a quarter of its timeout
/// left is not sent. Timeout 4 s (a quarter: 1 s), Redis asleep for 5 s:
/// 8 calls take every place; 64 more start about 300 ms later and wait.
/// The first 8 time out at 4 s, when the others still have about 300 ms
/// before their deadline but less than the quarter: they give up unsent,
/// and Redis runs only the first 8. (Sent, they would have run after their
/// callers were answered.) Seconds, not milliseconds: timers on a loaded
/// two-core machine fire up to a few hundred ms late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_with_less_than_a_quarter_of_its_time_left_is_never_sent() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = RedisServer::start_with(&["--enable-debug-command", "local"]);
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.pool_size = 1;
        it.timeout_ms = 4_000;
    });
    let backend = Arc::new(backend.await);
    let mut admin = server.connection().await;
    fcalls_after(&backend, &mut admin).await;
    reset_stats(&mut admin).await;
    let sleep = server.put_to_sleep(5.0).await;
    let first = {
        let backend = backend.clone();
        tokio::spawn(async move { flood(&backend, SERVER_IN_FLIGHT).await })
    };
    // Staging, not an assertion: the second wave must start after the
    // first holds every place, and well within a quarter of the timeout.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = flood(&backend, 64).await;
    let first = first.await.expect("first wave");
    sleep.await.expect("sleep task").expect("DEBUG SLEEP");
    assert_eq!(tally(&first), (0, SERVER_IN_FLIGHT, 0), "{first:?}");
    assert_eq!(tally(&second), (0, 64, 0), "{second:?}");
    assert_eq!(
        fcalls_after(&backend, &mut admin).await,
        SERVER_IN_FLIGHT as f64 + 1.0
    );
}
