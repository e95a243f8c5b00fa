//! Redis behind Sentinel: the master is found through the sentinels, a
//! failover is followed without a restart, and decisions fail (through the
//! failure mode) only while no master can be reached.
//!
//! Each test runs a master, a replica and three sentinels
//! (`support::sentinel`, `down-after-milliseconds` 1000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::keys::check_on;
use crate::support::process::{Serve, ServiceProcess};
use crate::support::redis::{RedisServer, backend, library_loaded};
use crate::support::sentinel::{DOWN_AFTER_MS, MASTER_NAME, Passwords, SentinelSetup};
use throttlegate::algorithms::Algorithm::SlidingWindowLog;
use throttlegate::backends::redis::{ClockSource, RedisBackend};
use throttlegate::backends::{Backend, Error, KeyedCheck};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// `--redis-timeout-ms` of the backends under test.
const TIMEOUT_MS: u64 = 250;

/// How long decisions may fail after the master dies: the sentinels'
/// `down-after-milliseconds` (1 s here), their election and promotion
/// (a few seconds; Sentinel's own `failover-timeout` bounds a failover
/// that stalls), then our reconnect (at most the 1 s backoff cap plus one
/// connect). Generous, for two shared CI cores.
const FAILOVER_BOUND: Duration = Duration::from_secs(20);

/// Our part of it: from the moment the sentinels name the promoted replica
/// to the first decision on it. At most the reconnect backoff cap (1 s)
/// plus one connect (each of three sentinels and the master within the
/// timeout), with slack for busy cores.
const RECONNECT_BOUND: Duration = Duration::from_secs(4);

/// 10 an hour: nothing refills during a test.
fn limit_of_ten(user: &str) -> KeyedCheck {
    check_on(SlidingWindowLog, 3_600, &[("user", user)], 10, 1)
}

async fn allowed(backend: &RedisBackend, check: &KeyedCheck) -> Result<bool, Error> {
    Ok(backend.decide(std::slice::from_ref(check)).await?.allowed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_through_the_sentinel_master_are_exact() {
    let setup = SentinelSetup::start().await;
    let backend = Arc::new(setup.backend(5_000).await);
    let check = limit_of_ten("exact");
    let calls = (0..64).map(|_| {
        let backend = backend.clone();
        let check = check.clone();
        tokio::spawn(async move { allowed(&backend, &check).await.expect("decided") })
    });
    let mut admitted = 0;
    for call in calls {
        admitted += usize::from(call.await.unwrap());
    }
    assert_eq!(admitted, 10, "64 concurrent requests on a limit of 10");
    assert_eq!(
        setup.master.keys("tg:*").await.len(),
        1,
        "written on the master"
    );
    setup.wait_for_replication().await;
    assert_eq!(setup.replica.keys("tg:*").await.len(), 1, "and replicated");
}

/// Kills the master after 4 of 10 were admitted (and replicated): decisions
/// fail while the sentinels fail over, then resume on the promoted replica
/// with the 6 left, without a restart; health follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_master_fails_decisions_only_until_the_replica_is_promoted() {
    let mut setup = SentinelSetup::start().await;
    // One backend decides, one is probed like the health monitor does
    // (a probe while the circuit is open reconnects at once, which would
    // hide the decision path's own reconnect).
    let deciding = setup.backend(TIMEOUT_MS).await;
    let probed = setup.backend(TIMEOUT_MS).await;
    let check = limit_of_ten("failover");
    for _ in 0..4 {
        assert!(allowed(&deciding, &check).await.unwrap());
    }
    probed.probe().await.expect("healthy before");
    setup.wait_for_replication().await;
    // Functions are replicated: the replica to be promoted has the library
    // before the failover.
    let library = &throttlegate::backends::redis::script::library().name;
    assert!(library_loaded(&setup.replica, library).await);

    let promoted = setup.replica.port();
    let killed = Instant::now();
    setup.master.kill();
    let health = tokio::spawn(health_during_failover(probed));
    let switched = tokio::spawn(async move {
        setup.wait_for_master(promoted, FAILOVER_BOUND).await;
        (Instant::now(), setup)
    });

    let mut failures = 0;
    let resumed = loop {
        match allowed(&deciding, &check).await {
            Ok(true) => break Instant::now(),
            Ok(false) => panic!("denied during the failover: nothing was consumed after 4"),
            Err(Error::Unavailable(_) | Error::Timeout(_)) => failures += 1,
            Err(other) => panic!("not a failure the failure mode handles: {other:?}"),
        }
        assert!(
            killed.elapsed() < FAILOVER_BOUND,
            "no decision within {FAILOVER_BOUND:?} of the kill"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (switched_at, setup) = switched.await.unwrap();
    let outage = resumed - killed;
    let ours = resumed.saturating_duration_since(switched_at);
    eprintln!(
        "decisions failed for {outage:?} ({failures} calls); sentinels switched after {:?}; \
         first decision {ours:?} later",
        switched_at - killed
    );
    assert!(failures > 0, "the kill was never noticed");
    assert!(
        outage > Duration::from_millis(DOWN_AFTER_MS),
        "resumed before the sentinels could call the master down: {outage:?}"
    );
    assert!(ours < RECONNECT_BOUND, "{ours:?} after the switch");

    // 4 before the kill and the one that resumed: 5 more pass, then none.
    let mut after = 1;
    while allowed(&deciding, &check)
        .await
        .expect("decided after the failover")
    {
        after += 1;
        assert!(after <= 10, "the count restarted on the promoted replica");
    }
    assert_eq!(after, 6, "the count continued from the replicated 4");
    assert!(library_loaded(&setup.replica, library).await);
    let (unhealthy, healthy_again) = health.await.unwrap();
    assert!(unhealthy, "health never reported the failover");
    assert!(healthy_again, "health did not recover after the failover");
}

/// Probes once a second, as the health monitor does, until the probes
/// failed and then succeeded again (or the failover bound passed).
async fn health_during_failover(backend: RedisBackend) -> (bool, bool) {
    let deadline = Instant::now() + FAILOVER_BOUND;
    let mut unhealthy = false;
    while Instant::now() < deadline {
        match backend.probe().await {
            Err(_) => unhealthy = true,
            Ok(()) if unhealthy => return (true, true),
            Ok(()) => {}
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    (unhealthy, false)
}

/// A failover Sentinel is asked for: the old master stays up as a replica
/// of the new one, and decisions move to the new master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_is_left_for_the_promoted_replica() {
    let setup = SentinelSetup::start().await;
    let backend = setup.backend(TIMEOUT_MS).await;
    let check = limit_of_ten("demoted");
    for _ in 0..3 {
        assert!(allowed(&backend, &check).await.unwrap());
    }
    setup.wait_for_replication().await;
    let sentinel = &setup.nodes()[0];
    let mut conn = redis::Client::open(format!("redis://{sentinel}/"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let () = redis::cmd("SENTINEL")
        .arg("FAILOVER")
        .arg(MASTER_NAME)
        .query_async(&mut conn)
        .await
        .expect("SENTINEL FAILOVER");
    setup
        .wait_for_master(setup.replica.port(), FAILOVER_BOUND)
        .await;

    let deadline = Instant::now() + FAILOVER_BOUND;
    let mut admitted = 3;
    loop {
        match allowed(&backend, &check).await {
            Ok(true) => admitted += 1,
            Ok(false) => break,
            Err(Error::Unavailable(_) | Error::Timeout(_)) => {
                assert!(Instant::now() < deadline, "no decision after the failover");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(other) => panic!("not a failure the failure mode handles: {other:?}"),
        }
    }
    assert_eq!(admitted, 10, "exact across the failover");
    assert_eq!(
        setup.replica.keys("tg:*").await.len(),
        1,
        "written on the promoted replica"
    );
}

/// READONLY (a master demoted behind our back) is a failure the failure
/// mode handles, never a decision: it opens the circuit like a refused
/// connect, so the calls after it fail at once instead of each opening a
/// connection to the replica, and the connections to that node are
/// replaced rather than kept: the reconnector tries a fresh one with its
/// backoff (refused while the node is a replica), and once the node takes
/// writes again decisions resume.
#[tokio::test]
async fn readonly_from_a_demoted_master_is_unavailable_and_retires_its_connections() {
    let other = RedisServer::start();
    let demoted = RedisServer::start();
    let backend = backend(&demoted, ClockSource::Redis).await;
    let check = limit_of_ten("readonly");
    assert!(allowed(&backend, &check).await.unwrap());
    let mut conn = demoted.connection().await;
    let () = redis::cmd("REPLICAOF")
        .arg("127.0.0.1")
        .arg(other.port())
        .query_async(&mut conn)
        .await
        .unwrap();
    let received_before = connections_received(&mut conn).await;

    let err = allowed(&backend, &check).await.unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable(message) if message.contains("read only replica")),
        "{err:?}"
    );
    assert!(backend.circuit_open(), "READONLY left the circuit closed");
    let err = allowed(&backend, &check).await.unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable(message) if message.contains("reconnecting in the background")),
        "{err:?}"
    );
    let started = std::time::Instant::now();
    while connections_received(&mut conn).await == received_before {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "no fresh connection tried after READONLY"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let () = redis::cmd("REPLICAOF")
        .arg("NO")
        .arg("ONE")
        .query_async(&mut conn)
        .await
        .unwrap();
    let started = std::time::Instant::now();
    while allowed(&backend, &check).await.is_err() {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "no decision once the node took writes again"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn connections_received(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|it| it.trim().parse().ok())
        .expect("total_connections_received")
}

#[tokio::test]
async fn a_wrong_master_name_is_a_start_up_error() {
    let setup = SentinelSetup::start().await;
    let mut settings = setup.settings(TIMEOUT_MS);
    settings.sentinel.as_mut().unwrap().master = "nosuchmaster".to_owned();
    let err = RedisBackend::connect(settings).await.unwrap_err();
    assert!(
        err.to_string()
            .contains("no redis sentinel knows a master named \"nosuchmaster\""),
        "{err}"
    );
}

#[tokio::test]
async fn no_reachable_sentinel_is_a_start_up_error() {
    let setup = SentinelSetup::start().await;
    let mut settings = setup.settings(TIMEOUT_MS);
    let nobody = support::process::free_addr().to_string();
    settings.sentinel.as_mut().unwrap().nodes = vec![nobody.clone()];
    let err = RedisBackend::connect(settings).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("no redis sentinel could be asked"),
        "{message}"
    );
    assert!(message.contains(&nobody), "{message}");
}

/// The sentinels' password is `--redis-sentinel-password`; the master's
/// comes from the URL, whose host is not used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_reach_the_sentinels_and_the_master() {
    let setup = SentinelSetup::start_with(Passwords {
        redis: Some("nodesecret".to_owned()),
        sentinel: Some("sentinelsecret".to_owned()),
    })
    .await;
    let backend = setup.backend(5_000).await;
    assert!(allowed(&backend, &limit_of_ten("auth")).await.unwrap());
    assert_eq!(setup.master.keys("tg:*").await.len(), 1);

    let mut settings = setup.settings(TIMEOUT_MS);
    settings.sentinel.as_mut().unwrap().password = Some("wrong".to_owned());
    let err = RedisBackend::connect(settings).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("no redis sentinel could be asked"),
        "{message}"
    );
    assert!(message.contains("authentication failed"), "{message}");

    let mut settings = setup.settings(TIMEOUT_MS);
    settings.url = "redis://:wrong@sentinel-master/".to_owned();
    let backend = RedisBackend::connect(settings)
        .await
        .expect("the sentinels answer: a master refusing us is not a start-up error");
    let err = allowed(&backend, &limit_of_ten("auth")).await.unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable(message) if message.contains("authentication failed")),
        "{err:?}"
    );
}

const CONFIG: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

/// The binary serving [`CONFIG`] through `setup`'s sentinels, asking them
/// for `master`.
fn serve_through(setup: &SentinelSetup, master: &str, extra: &[&str]) -> ServiceProcess {
    let nodes = setup.nodes().join(",");
    Serve::yaml(CONFIG)
        .args(&[
            "--redis-sentinel-nodes",
            &nodes,
            "--redis-sentinel-master",
            master,
        ])
        .args(extra)
        .spawn()
}

#[tokio::test]
async fn serve_finds_the_master_through_sentinel() {
    let setup = SentinelSetup::start().await;
    let mut server = serve_through(&setup, MASTER_NAME, &["--redis-key-prefix", "clisentinel"]);
    let mut client = server.client().await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        let request = support::service::one_entry_request("api", "user", "alice");
        let answer = client.should_rate_limit(request).await.expect("rpc");
        codes.push(answer.into_inner().overall_code);
    }
    assert_eq!(
        codes,
        vec![Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]
    );
    assert_eq!(setup.master.keys("clisentinel:*").await.len(), 1);
}

#[tokio::test]
async fn serve_refuses_an_unknown_sentinel_master_with_exit_2() {
    let setup = SentinelSetup::start().await;
    let mut server = serve_through(&setup, "nosuchmaster", &[]);
    let (status, log) = server.exit(Duration::from_secs(15)).await;
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains("no redis sentinel knows a master named"),
        "{log}"
    );
}

/// Flags that cannot work together stop the start-up, saying which.
#[test]
fn incomplete_or_conflicting_sentinel_flags_are_refused_with_exit_2() {
    let cases: [(&[&str], &str); 4] = [
        (
            &["--redis-sentinel-nodes", "127.0.0.1:1"],
            "--redis-sentinel-nodes needs --redis-sentinel-master",
        ),
        (
            &["--redis-sentinel-master", "m"],
            "--redis-sentinel-master and --redis-sentinel-password need --redis-sentinel-nodes",
        ),
        (
            &["--redis-sentinel-password", "secret"],
            "--redis-sentinel-master and --redis-sentinel-password need --redis-sentinel-nodes",
        ),
        (
            &[
                "--redis-sentinel-nodes",
                "127.0.0.1:1",
                "--redis-sentinel-master",
                "m",
                "--redis-cluster-nodes",
                "127.0.0.1:2",
            ],
            "--redis-cluster-nodes and --redis-sentinel-nodes exclude each other",
        ),
    ];
    for (flags, message) in cases {
        let out = support::process::command()
            .args([
                "serve",
                "--grpc-addr",
                &support::process::free_addr().to_string(),
            ])
            .args(flags)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{flags:?}: {out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{flags:?}: {stderr}");
    }
}
