//! Redis Cluster: the decision script on one cluster node (it touches only
//! the keys it declares, so it runs wherever its keys share a slot), and the
//! cluster backend on a real 3-primary cluster (slot groups, hash tags,
//! NOSCRIPT per node, several instances, resharding, failover).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::support;
use crate::support::cluster::Cluster;
use crate::support::keys::{check, check_on, counter_key};
use crate::support::process::{Serve, command};
use crate::support::redis::{RedisServer, backend, backend_with, hammer};
use crate::support::request::{descriptor, request};
use throttlegate::algorithms::Algorithm::{self, FixedWindow, SlidingWindowLog, TokenBucket};
use throttlegate::backends::keys::{HashTag, KeyFormat};
use throttlegate::backends::redis::ClockSource;
use throttlegate::backends::redis::cluster::{ClusterBackend, ClusterSettings};
use throttlegate::backends::{Backend, CallContext, Error, KeyedCheck, LateVerdict};
use throttlegate::clock::{Clock, ManualClock, SystemClock};
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

/// A one-node cluster serving every slot.
async fn single_node_cluster() -> RedisServer {
    let server = RedisServer::start_with(&["--cluster-enabled", "yes"]);
    let mut conn = server.connection().await;
    let () = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16_383)
        .query_async(&mut conn)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("CLUSTER")
            .arg("INFO")
            .query_async(&mut conn)
            .await
            .unwrap();
        if info.contains("cluster_state:ok") {
            return server;
        }
        assert!(Instant::now() < deadline, "cluster not ok:\n{info}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_script_runs_on_a_cluster_node_when_keys_share_a_slot() {
    let server = single_node_cluster().await;
    // The operator's prefix may carry a hash tag; user bytes never do.
    let backend = backend_with(&server, ClockSource::Redis, |it| {
        it.key_prefix = "{tg}".to_owned();
    })
    .await;
    let checks = [
        check_on(SlidingWindowLog, 60, &[("ip", "1")], 2, 1),
        check_on(TokenBucket, 60, &[("user", "{u}")], 5, 1),
    ];
    assert!(backend.decide(&checks).await.unwrap().allowed);
    assert!(backend.decide(&checks).await.unwrap().allowed);
    assert!(!backend.decide(&checks).await.unwrap().allowed);
}

#[tokio::test]
async fn keys_in_different_slots_are_refused_whole() {
    let server = single_node_cluster().await;
    let backend = backend(&server, ClockSource::Redis).await;
    let checks = [
        check_on(SlidingWindowLog, 60, &[("ip", "1")], 2, 1),
        check_on(SlidingWindowLog, 60, &[("ip", "2")], 2, 1),
    ];
    let err = backend.decide(&checks).await.expect_err("crossslot");
    assert!(matches!(err, Error::Protocol(_)), "{err:?}");
    assert!(
        err.to_string().to_lowercase().contains("crossslot"),
        "{err}"
    );
    let mut conn = server.connection().await;
    let size: u64 = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
    assert_eq!(size, 0, "nothing was written");
}

// === the cluster backend on a 3-primary cluster ===

/// The pool size of [`cluster_settings`].
const POOL: usize = 4;

/// Settings for a backend on `cluster`: pool of [`POOL`], 5 s timeout,
/// prefix `tg`.
fn cluster_settings(cluster: &Cluster, hash_tag: HashTag) -> ClusterSettings {
    ClusterSettings {
        nodes: cluster.seeds(),
        pool_size: POOL as u32,
        timeout_ms: 5_000,
        keys: KeyFormat::new("tg", hash_tag),
        clock: ClockSource::Redis,
        expiry_grace_ms: 0,
        tls: Default::default(),
    }
}

fn cluster_backend(cluster: &Cluster, hash_tag: HashTag) -> Arc<ClusterBackend> {
    Arc::new(ClusterBackend::connect(cluster_settings(cluster, hash_tag)).expect("settings"))
}

/// A limit of 50 that cannot refill while the test runs.
fn slow_check(algorithm: Algorithm, user: &str) -> KeyedCheck {
    check_on(algorithm, 3_600, &[("user", user)], 50, 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_on_one_cluster_key_admit_exactly_the_limit() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    for algorithm in Algorithm::ALL {
        let total = hammer(vec![backend.clone()], vec![slow_check(algorithm, "a")], 256).await;
        assert_eq!(total, 50, "{algorithm}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_one_cluster_admit_exactly_the_limit_in_total() {
    let cluster = Cluster::start(3, 0).await;
    let first = cluster_backend(&cluster, HashTag::None);
    let second = cluster_backend(&cluster, HashTag::Descriptor);
    let third = cluster_backend(&cluster, HashTag::Descriptor);
    for algorithm in Algorithm::ALL {
        // Two instances with the same key format share the counter.
        let total = hammer(
            vec![second.clone(), third.clone()],
            vec![slow_check(algorithm, "b")],
            256,
        )
        .await;
        assert_eq!(total, 50, "{algorithm}");
    }
    let total = hammer(vec![first], vec![slow_check(TokenBucket, "b")], 128).await;
    assert_eq!(total, 50, "an untagged key is another counter");
}

/// Checks on `n` descriptors of one domain: without a tag, spread over the
/// primaries.
fn spread_checks(n: usize) -> Vec<KeyedCheck> {
    (0..n)
        .map(|idx| check_on(SlidingWindowLog, 60, &[("ip", &idx.to_string())], 1_000, 1))
        .collect()
}

#[tokio::test]
async fn with_a_domain_tag_every_request_is_one_script_call() {
    let cluster = Cluster::start(3, 0).await;
    let tagged = cluster_backend(&cluster, HashTag::Domain);
    let untagged = cluster_backend(&cluster, HashTag::None);
    let checks = spread_checks(8);
    // Loads the script where it is needed.
    assert!(tagged.decide(&checks).await.unwrap().allowed);
    assert!(untagged.decide(&checks).await.unwrap().allowed);
    cluster.reset_stats().await;
    for _ in 0..10 {
        assert!(tagged.decide(&checks).await.unwrap().allowed);
    }
    assert_eq!(cluster.calls_on_primaries("fcall").await, 10);
    let keys = cluster.keys("tg:{test}:*").await;
    assert_eq!(keys.len(), 8, "{keys:?}");

    // The same request untagged is one call per slot: more than one.
    cluster.reset_stats().await;
    assert!(untagged.decide(&checks).await.unwrap().allowed);
    let calls = cluster.calls_on_primaries("fcall").await;
    assert!(calls > 1 && calls <= 8, "{calls} calls");
}

#[tokio::test]
async fn the_library_is_loaded_again_on_a_primary_that_lost_it() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::Descriptor);
    let checks = spread_checks(12);
    assert!(backend.decide(&checks).await.unwrap().allowed);
    for idx in 0..cluster.primaries() {
        cluster.function_flush(idx).await;
    }
    cluster.reset_stats().await;
    let verdict = backend
        .decide(&checks)
        .await
        .expect("a missing function is followed by FUNCTION LOAD");
    assert!(verdict.allowed);
    // Counted once each: the calls that met no function did not run.
    assert!(verdict.outcomes.iter().all(|it| it.remaining == 998));
    let loads = cluster.calls_on_primaries("function|load").await;
    assert!(loads >= 1, "{loads} loads");
}

/// Warming up connects to every primary and loads the library on each, so
/// the first decisions load nothing: none of them meets a missing function.
/// A second warm-up (a serving thread's) does nothing again.
#[tokio::test]
async fn warm_up_connects_to_every_primary_and_loads_the_library_on_each() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::Descriptor);
    for idx in 0..cluster.primaries() {
        assert_eq!(cluster.clients_of(idx).await, 0, "primary {idx} before");
    }
    backend.warm_up().await;
    for idx in 0..cluster.primaries() {
        assert!(
            cluster.clients_of(idx).await >= 1,
            "primary {idx}: no connection"
        );
        let mut conn = cluster.node(idx).connection().await;
        let libraries: Vec<::redis::Value> = ::redis::cmd("FUNCTION")
            .arg("LIST")
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(libraries.len(), 1, "primary {idx}: {libraries:?}");
    }
    cluster.reset_stats().await;
    assert!(backend.decide(&spread_checks(12)).await.unwrap().allowed);
    assert_eq!(cluster.calls_on_primaries("function|load").await, 0);
    // Done once: the serving threads' warm-ups find it done.
    backend.warm_up().await;
    assert_eq!(cluster.calls_on_primaries("function|load").await, 0);
}

#[tokio::test]
async fn hostile_values_get_their_own_counters_and_no_hash_tag_of_their_own() {
    let cluster = Cluster::start(3, 0).await;
    let hostile = [
        "{a}", "a", "{a", "a}", "}{", "{}", "%7Ba%7D", "a:b", "{a}:b",
    ];
    for tag in [HashTag::None, HashTag::Domain, HashTag::Descriptor] {
        let backend = cluster_backend(&cluster, tag);
        for value in hostile {
            let one = [check(counter_key(TokenBucket, 60, &[("k", value)]), 1, 1)];
            let verdict = backend.decide(&one).await.unwrap();
            assert!(verdict.allowed, "{tag:?} {value}: a counter of its own");
        }
    }
    let keys = cluster.keys("tg:*").await;
    assert_eq!(keys.len(), hostile.len() * 3, "{keys:#?}");
    for key in keys {
        let braces = key.matches('{').count() + key.matches('}').count();
        let tagged = key.starts_with("tg:{");
        assert_eq!(braces, if tagged { 2 } else { 0 }, "{key}");
    }
}

#[tokio::test]
async fn a_primary_down_makes_the_probe_fail_within_the_timeout() {
    let mut cluster = Cluster::start(3, 0).await;
    let backend = ClusterBackend::connect(ClusterSettings {
        timeout_ms: 500,
        ..cluster_settings(&cluster, HashTag::None)
    })
    .unwrap();
    backend.probe().await.expect("a healthy cluster");
    cluster.kill(2);
    let started = Instant::now();
    let err = backend.probe().await.expect_err("a primary is down");
    assert!(
        started.elapsed() < Duration::from_millis(500 + 250),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(err, Error::Unavailable(_) | Error::Timeout(_)),
        "{err:?}"
    );
}

// === the binary ===

const TWO_PER_MINUTE: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 5}\n";

#[tokio::test]
async fn serve_decides_on_a_cluster_given_its_nodes() {
    let cluster = Cluster::start(3, 0).await;
    // Any one node is seed enough; a URL with credentials is accepted too.
    let seeds = format!("{},redis://{}", cluster.seeds()[1], cluster.seeds()[2]);
    // `domain`: one slot per request; `descriptor`: one per descriptor, so
    // the stacked request below spans slots and its denial is refunded.
    for (tag, key_pattern) in [("domain", "tg:{api}:*"), ("descriptor", "tg:{api:*}:*")] {
        let prefix = format!("tg-{tag}");
        let mut service = Serve::yaml(TWO_PER_MINUTE)
            .args(&["--redis-cluster-nodes", &seeds, "--redis-hash-tag", tag])
            .args(&["--redis-key-prefix", &prefix])
            .spawn();
        let mut client = service.client().await;
        let stacked = request(
            "api",
            vec![descriptor(&[("user", "a")]), descriptor(&[("ip", "1")])],
        );
        let mut codes = Vec::new();
        for _ in 0..4 {
            let answer = client
                .should_rate_limit(stacked.clone())
                .await
                .expect("decided")
                .into_inner();
            codes.push(answer.overall_code);
        }
        let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
        assert_eq!(codes, [ok, ok, over, over], "{tag}");
        // The denied requests took nothing from the limit of 5.
        let lone = request("api", vec![descriptor(&[("ip", "1")])]);
        let answer = client.should_rate_limit(lone).await.unwrap().into_inner();
        assert_eq!(answer.statuses[0].limit_remaining, 2, "{tag}");
        let pattern = key_pattern.replacen("tg", &prefix, 1);
        let keys = cluster.keys(&pattern).await;
        assert_eq!(keys.len(), 2, "{tag}: {keys:?}");
    }
}

#[test]
fn serve_refuses_a_url_and_cluster_nodes_together() {
    let out = command()
        .args(["serve", "--redis-url", "redis://127.0.0.1:1"])
        .args([
            "--redis-cluster-nodes",
            "127.0.0.1:2",
            "--redis-hash-tag",
            "domain",
        ])
        .output()
        .expect("run the binary");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--redis-url and --redis-cluster-nodes"),
        "{stderr}"
    );
}

// === resharding and failover ===

/// The slot Redis puts `key` in (CLUSTER KEYSLOT).
/// A backend on `cluster` whose calls time out after 300 ms.
fn impatient_backend(cluster: &Cluster) -> ClusterBackend {
    ClusterBackend::connect(ClusterSettings {
        timeout_ms: 300,
        ..cluster_settings(cluster, HashTag::None)
    })
    .unwrap()
}

/// The node serving `check`'s counter.
async fn primary_of(cluster: &Cluster, backend: &ClusterBackend, check: &KeyedCheck) -> usize {
    cluster
        .owner_of(slot_of(cluster, &backend.key_of(&check.key)).await)
        .await
}

async fn slot_of(cluster: &Cluster, key: &str) -> u16 {
    let mut conn = cluster.any_connection().await;
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("CLUSTER KEYSLOT")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moving_a_slot_with_live_keys_under_load_keeps_limits_exact() {
    let cluster = Arc::new(Cluster::start(3, 0).await);
    // Every counter of domain `test` in one slot, the one moved.
    let backend = cluster_backend(&cluster, HashTag::Domain);
    let hot = check_on(SlidingWindowLog, 3_600, &[("user", "hot")], 300, 1);
    let side = |idx: usize| {
        check_on(
            SlidingWindowLog,
            3_600,
            &[("ip", &idx.to_string())],
            10_000,
            1,
        )
    };
    // Enough live keys that the move takes many MIGRATE batches.
    for idx in 0..20 {
        assert!(backend.decide(&[side(idx)]).await.unwrap().allowed);
    }
    let slot = slot_of(&cluster, &backend.key_of(&hot.key)).await;
    let from = cluster.owner_of(slot).await;
    let to = (from + 1) % cluster.primaries();

    let mut tasks = Vec::new();
    for task in 0..16 {
        let backend = backend.clone();
        let checks = vec![hot.clone(), side(task)];
        tasks.push(tokio::spawn(async move {
            let mut allowed = 0;
            for _ in 0..60 {
                // Any error here would go through the failure mode.
                let verdict = backend
                    .decide(&checks)
                    .await
                    .expect("decided during the move");
                allowed += usize::from(verdict.allowed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            allowed
        }));
    }
    cluster.move_slot(slot, to, Duration::from_millis(20)).await;
    let mut allowed = Vec::new();
    for task in tasks {
        allowed.push(task.await.expect("task"));
    }
    assert_eq!(cluster.owner_of(slot).await, to);
    let total: usize = allowed.iter().sum();
    assert_eq!(total, 300, "exactly the limit of 300 out of 960 requests");
    // The moved counters are the ones counted: none lost, none doubled.
    let verdict = backend.decide(std::slice::from_ref(&hot)).await.unwrap();
    assert!(!verdict.allowed);
    let verdict = backend.decide(&[side(0)]).await.unwrap();
    let taken = 1 + allowed[0] + 1;
    assert_eq!(verdict.outcomes[0].remaining, 10_000 - taken as u64);
}

/// Failover bound: `--cluster-node-timeout` (1 s here) to mark the primary
/// failed, the replica's election, and the client's slot refresh on the
/// next MOVED; 10 s is generous for all three.
const FAILOVER_BOUND: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_and_its_slots_decided_again() {
    let mut cluster = Cluster::start(3, 1).await;
    let backend = cluster_backend(&cluster, HashTag::Descriptor);
    let on = |user: &str| vec![check_on(TokenBucket, 3_600, &[("user", user)], 100_000, 1)];
    // Two descriptors on two different primaries.
    let mut by_owner = std::collections::BTreeMap::new();
    for idx in 0..64 {
        let checks = on(&format!("u{idx}"));
        let slot = slot_of(&cluster, &backend.key_of(&checks[0].key)).await;
        by_owner
            .entry(cluster.owner_of(slot).await)
            .or_insert(checks);
        if by_owner.len() == 2 {
            break;
        }
    }
    let mut owners = by_owner.into_iter();
    let (victim, on_victim) = owners.next().expect("two owners");
    let (_, elsewhere) = owners.next().expect("two owners");
    assert!(backend.decide(&on_victim).await.unwrap().allowed);
    assert!(backend.decide(&elsewhere).await.unwrap().allowed);

    cluster.kill(victim);
    let killed = Instant::now();
    let mut failures_elsewhere = 0;
    let mut slowest_elsewhere = Duration::ZERO;
    let resumed = loop {
        let started = Instant::now();
        if backend.decide(&elsewhere).await.is_err() {
            failures_elsewhere += 1;
        }
        slowest_elsewhere = slowest_elsewhere.max(started.elapsed());
        if let Ok(verdict) = backend.decide(&on_victim).await {
            assert!(verdict.allowed);
            break killed.elapsed();
        }
        assert!(
            killed.elapsed() < FAILOVER_BOUND,
            "the victim's slots were not decided again within {FAILOVER_BOUND:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "decisions on the failed primary's slots resumed after {resumed:?}; \
         the slowest decision elsewhere took {slowest_elsewhere:?}"
    );
    assert_eq!(failures_elsewhere, 0, "other slots kept being decided");
    cluster.wait_ok(FAILOVER_BOUND).await;
    // The promoted replica has the library (functions are replicated).
    let victim_slot = slot_of(&cluster, &backend.key_of(&on_victim[0].key)).await;
    let promoted = cluster.owner_of(victim_slot).await;
    assert_ne!(promoted, victim);
    let library = &throttlegate::backends::redis::script::library().name;
    assert!(support::redis::library_loaded(cluster.node(promoted), library).await);
    // A probe that finds the client's slot map stale reconnects, so the
    // next one (health probes every second) sees the new primary.
    let ok_by = Instant::now() + Duration::from_secs(3);
    while let Err(err) = backend.probe().await {
        assert!(
            Instant::now() < ok_by,
            "still unhealthy after the failover: {err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// === requests over several slots: all or nothing through refunds ===

/// `n` descriptors `user=<prefix><i>` whose counters lie on `n` different
/// primaries (untagged keys), for `algorithm` with the given limits.
async fn on_different_primaries(
    cluster: &Cluster,
    backend: &ClusterBackend,
    algorithm: Algorithm,
    prefix: &str,
    limits: &[u64],
) -> Vec<KeyedCheck> {
    let mut chosen: Vec<(usize, KeyedCheck)> = Vec::new();
    for idx in 0.. {
        let limit = limits[chosen.len()];
        let check = check_on(
            algorithm,
            3_600,
            &[("user", &format!("{prefix}{idx}"))],
            limit,
            1,
        );
        let slot = slot_of(cluster, &backend.key_of(&check.key)).await;
        let owner = cluster.owner_of(slot).await;
        if chosen.iter().all(|(it, _)| *it != owner) {
            chosen.push((owner, check));
        }
        if chosen.len() == limits.len() {
            break;
        }
    }
    chosen.into_iter().map(|(_, it)| it).collect()
}

/// What a lone request on `check` is told remains after it.
async fn remaining_after_one(backend: &ClusterBackend, check: &KeyedCheck) -> u64 {
    let verdict = backend.decide(std::slice::from_ref(check)).await.unwrap();
    verdict.outcomes[0].remaining
}

#[tokio::test]
async fn a_request_over_two_primaries_is_all_or_nothing_whichever_denies() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    for algorithm in Algorithm::ALL {
        for denying_first in [true, false] {
            let prefix = format!("{algorithm}-{denying_first}-");
            let checks =
                on_different_primaries(&cluster, &backend, algorithm, &prefix, &[1, 5]).await;
            let (full, open) = (&checks[0], &checks[1]);
            // The limit of 1 is used up, the limit of 5 untouched.
            assert!(
                backend
                    .decide(std::slice::from_ref(full))
                    .await
                    .unwrap()
                    .allowed
            );
            let request = if denying_first {
                vec![full.clone(), open.clone()]
            } else {
                vec![open.clone(), full.clone()]
            };
            for _ in 0..3 {
                let verdict = backend.decide(&request).await.unwrap();
                assert!(!verdict.allowed, "{algorithm}");
                assert!(
                    verdict.outcomes.iter().all(|it| !it.consumed),
                    "{algorithm}"
                );
            }
            // The open limit gave back what the denied requests took.
            assert_eq!(
                remaining_after_one(&backend, open).await,
                4,
                "{algorithm}, denying check first: {denying_first}"
            );
        }
    }
    assert_eq!(backend.refund_failures(), 0);
}

/// A limit charged always in a request split over three primaries keeps
/// its charge when another slot denies: the slots that allowed are
/// refunded except for it, so the debt of usage reported after the fact
/// is never given back.
#[tokio::test]
async fn a_charge_over_several_primaries_is_never_refunded() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    for algorithm in Algorithm::ALL {
        let prefix = format!("{algorithm}-charge-");
        let mut checks =
            on_different_primaries(&cluster, &backend, algorithm, &prefix, &[1, 5, 5]).await;
        let params = checks[2].check.params;
        checks[2].check.params = params
            .with_charge(throttlegate::algorithms::Charge::Always)
            .unwrap();
        let (full, open, tokens) = (&checks[0], &checks[1], &checks[2]);
        assert!(
            backend
                .decide(std::slice::from_ref(full))
                .await
                .unwrap()
                .allowed
        );
        for _ in 0..3 {
            let verdict = backend.decide(&checks).await.unwrap();
            assert!(!verdict.allowed, "{algorithm}");
        }
        assert_eq!(remaining_after_one(&backend, open).await, 4, "{algorithm}");
        // 3 charges kept, and 1 more now.
        assert_eq!(
            remaining_after_one(&backend, tokens).await,
            1,
            "{algorithm}"
        );
    }
    assert_eq!(backend.refund_failures(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_over_three_primaries_never_exceed_a_limit() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    let limits = [40, 60, 100];
    let checks =
        Arc::new(on_different_primaries(&cluster, &backend, SlidingWindowLog, "c", &limits).await);
    // Each task sends the pairs in turn: every limit is met by requests
    // that also hold another, so denials and refunds interleave.
    let pairs = [(0, 1), (1, 2), (0, 2)];
    let mut tasks = Vec::new();
    for task in 0..64 {
        let backend = backend.clone();
        let checks = checks.clone();
        tasks.push(tokio::spawn(async move {
            let mut allowed = [0u64; 3];
            for round in 0..6 {
                let (a, b) = pairs[(task + round) % pairs.len()];
                let request = [checks[a].clone(), checks[b].clone()];
                if backend.decide(&request).await.expect("decided").allowed {
                    allowed[a] += 1;
                    allowed[b] += 1;
                }
            }
            allowed
        }));
    }
    let mut allowed = [0u64; 3];
    for task in tasks {
        let counts = task.await.expect("task");
        for idx in 0..3 {
            allowed[idx] += counts[idx];
        }
    }
    for idx in 0..3 {
        assert!(allowed[idx] <= limits[idx], "{allowed:?} over {limits:?}");
        // Exactly the allowed requests stay counted: every denied one was
        // given back.
        let lone = std::slice::from_ref(&checks[idx]);
        let verdict = backend.decide(lone).await.unwrap();
        let left = limits[idx] - allowed[idx];
        assert_eq!(
            verdict.allowed,
            left > 0,
            "limit {idx}: {allowed:?} of {limits:?}"
        );
        if left > 0 {
            assert_eq!(
                verdict.outcomes[0].remaining,
                left - 1,
                "limit {idx}: {allowed:?}"
            );
        }
    }
    assert!(allowed.iter().sum::<u64>() > 0);
    assert_eq!(backend.refund_failures(), 0);
}

#[tokio::test]
async fn a_slot_that_times_out_fails_the_request_and_the_others_are_refunded() {
    let cluster = Cluster::start(3, 0).await;
    let backend = impatient_backend(&cluster);
    let checks = on_different_primaries(&cluster, &backend, SlidingWindowLog, "f", &[5, 5]).await;
    let (alive, stuck) = (&checks[0], &checks[1]);
    assert!(backend.decide(&checks).await.unwrap().allowed);
    let stuck_node = primary_of(&cluster, &backend, stuck).await;
    // Paused for less than the cluster's node timeout: the rest of the
    // cluster stays ok while the stuck slot never answers.
    cluster.node(stuck_node).pause();
    let started = Instant::now();
    let err = backend
        .decide(&checks)
        .await
        .expect_err("a primary is stuck");
    let took = started.elapsed();
    cluster.node(stuck_node).resume();
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    // The decision's deadline, then the refund's own.
    assert!(took < Duration::from_millis(2 * 300 + 200), "{took:?}");
    // Only the first, allowed request stays counted on the live primary.
    assert_eq!(remaining_after_one(&backend, alive).await, 3);
    assert_eq!(backend.refund_failures(), 0);
}

#[tokio::test]
async fn a_timed_out_call_is_never_sent_again() {
    let cluster = Cluster::start(3, 0).await;
    let backend = impatient_backend(&cluster);
    let check = check_on(SlidingWindowLog, 3_600, &[("user", "slow")], 10, 1);
    let one = std::slice::from_ref(&check);
    assert!(backend.decide(one).await.unwrap().allowed);
    let owner = primary_of(&cluster, &backend, &check).await;
    cluster.node(owner).pause();
    let started = Instant::now();
    let err = backend
        .decide(one)
        .await
        .expect_err("the primary is paused");
    let took = started.elapsed();
    cluster.node(owner).resume();
    assert!(matches!(err, Error::Timeout(300)), "{err:?}");
    // The product's bound: --redis-timeout-ms, plus scheduling slack.
    assert!(took < Duration::from_millis(300 + 200), "{took:?}");
    // Whether the paused node ran the call when it woke or never got it,
    // it ran at most once: the first request, maybe the timed-out one, and
    // this one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let remaining = remaining_after_one(&backend, &check).await;
    assert!((7..=8).contains(&remaining), "{remaining} left of 10");
}

#[tokio::test]
async fn a_hash_tag_on_a_single_server_is_harmless() {
    let server = RedisServer::start();
    let backend = backend(&server, ClockSource::Redis)
        .await
        .with_hash_tag(HashTag::Domain);
    let checks = [
        check_on(SlidingWindowLog, 60, &[("ip", "1")], 2, 1),
        check_on(TokenBucket, 60, &[("user", "{u}")], 5, 1),
    ];
    assert!(backend.decide(&checks).await.unwrap().allowed);
    assert!(backend.decide(&checks).await.unwrap().allowed);
    assert!(!backend.decide(&checks).await.unwrap().allowed);
    let keys = server.keys("tg:*").await;
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys.iter().all(|it| it.starts_with("tg:{test}:")),
        "{keys:?}"
    );
}

#[tokio::test]
async fn a_password_given_on_one_seed_reaches_every_node() {
    let cluster = Cluster::start_with(3, 0, Some("s3cret")).await;
    let seeds = cluster.seeds();
    let with_password = ClusterBackend::connect(ClusterSettings {
        nodes: vec![
            seeds[0].clone(),
            format!("redis://:s3cret@{}", seeds[1]),
            seeds[2].clone(),
        ],
        ..cluster_settings(&cluster, HashTag::None)
    })
    .unwrap();
    // Counters on every primary: every node was reached with the password.
    let checks =
        on_different_primaries(&cluster, &with_password, TokenBucket, "p", &[1, 1, 1]).await;
    assert!(with_password.decide(&checks).await.unwrap().allowed);
    assert!(!with_password.decide(&checks).await.unwrap().allowed);
    with_password.probe().await.expect("healthy");

    let without = ClusterBackend::connect(cluster_settings(&cluster, HashTag::None)).unwrap();
    let err = without.decide(&checks).await.expect_err("no password");
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    assert!(without.probe().await.is_err());
}

// === time: each node's TIME is its own ===

const HOUR_US: u64 = 3_600_000_000;

/// A backend on `cluster` with every counter of domain `test` in one slot,
/// deciding at `clock`'s time.
fn tagged_backend(cluster: &Cluster, clock: ClockSource) -> Arc<ClusterBackend> {
    Arc::new(
        ClusterBackend::connect(ClusterSettings {
            clock,
            ..cluster_settings(cluster, HashTag::Domain)
        })
        .expect("settings"),
    )
}

/// How many of `tries` lone requests on `check` are allowed.
async fn allowed_of(backend: &ClusterBackend, check: &KeyedCheck, tries: usize) -> usize {
    let mut allowed = 0;
    for _ in 0..tries {
        let verdict = backend.decide(std::slice::from_ref(check)).await.unwrap();
        allowed += usize::from(verdict.allowed);
    }
    allowed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_moved_to_a_node_whose_clock_lags_never_admits_over_its_limit() {
    let cluster = Cluster::start(3, 0).await;
    // A decides 1 s into the next hour; B, 30 s behind A, is still in the
    // hour before: another fixed or counter window, a bucket 30 s emptier.
    // Redis TIME (now) is behind both.
    let ahead_us = (SystemClock.now_us() / HOUR_US + 1) * HOUR_US + 1_000_000;
    let ahead = tagged_backend(
        &cluster,
        ClockSource::Local(Arc::new(ManualClock::new(ahead_us))),
    );
    let behind_clock = ManualClock::new(ahead_us - 30_000_000);
    let behind = tagged_backend(&cluster, ClockSource::Local(Arc::new(behind_clock)));
    let redis_time = tagged_backend(&cluster, ClockSource::Redis);

    // 10 per hour: nothing refills while the test runs.
    let full = |algorithm| check_on(algorithm, 3_600, &[("user", "full")], 10, 1);
    let part = |algorithm| check_on(algorithm, 3_600, &[("user", "part")], 10, 1);
    for algorithm in Algorithm::ALL {
        assert_eq!(
            allowed_of(&ahead, &full(algorithm), 12).await,
            10,
            "{algorithm}"
        );
        assert_eq!(
            allowed_of(&ahead, &part(algorithm), 4).await,
            4,
            "{algorithm}"
        );
    }
    let slot = slot_of(&cluster, &ahead.key_of(&full(TokenBucket).key)).await;
    let from = cluster.owner_of(slot).await;
    let to = (from + 1) % cluster.primaries();
    cluster.move_slot(slot, to, Duration::ZERO).await;
    assert_eq!(cluster.owner_of(slot).await, to);
    let moved = cluster.node(to).keys("tg:{test}:*").await;
    assert_eq!(moved.len(), 2 * Algorithm::ALL.len(), "{moved:?}");

    for algorithm in Algorithm::ALL {
        // The lagging node's time is its own, but the stored time wins.
        let on_full = allowed_of(&behind, &full(algorithm), 5).await;
        assert_eq!(on_full, 0, "{algorithm}: the limit was used up on A");
        let on_part = allowed_of(&behind, &part(algorithm), 10).await;
        // GCRA keeps no time of its own but the arrival time: seen from
        // 30 s earlier, A's 4 requests weigh 4 × 360 s + 30 s, which leaves
        // room for 5 (fewer, never more); the others decide at A's time.
        let expected = if algorithm == Algorithm::Gcra { 5 } else { 6 };
        assert_eq!(on_part, expected, "{algorithm}: 4 taken on A of 10");
        // Redis TIME, behind both local clocks: still exactly the limit.
        for check in [full(algorithm), part(algorithm)] {
            let verdict = redis_time.decide(std::slice::from_ref(&check)).await;
            assert!(!verdict.unwrap().allowed, "{algorithm}: Redis TIME");
        }
    }
}

// === refunds under contention: the one imprecision ===

/// What one contended load left: the limit it ran against and how many
/// requests of each kind were allowed.
struct Contended {
    limit: KeyedCheck,
    normal_allowed: u64,
    doomed_allowed: u64,
}

/// `normal + doomed` requests in an even mix, `true` for a doomed one.
fn mixed_queue(normal: usize, doomed: usize) -> Vec<bool> {
    let total = normal + doomed;
    (0..total)
        .map(|idx| (idx + 1) * doomed / total > idx * doomed / total)
        .collect()
}

/// How many requests of each kind one contended load sends.
#[derive(Clone, Copy)]
struct Mix {
    normal: usize,
    doomed: usize,
}

/// 64 tasks take requests in turn from one queue: `mix.normal` requests on
/// a limit L1 of `capacity` per hour, evenly mixed with `mix.doomed`
/// requests on L1 and L2, a limit of 0 on another primary. A doomed request
/// is always denied (by L2), and what it took on L1 is refunded. On one
/// atomic limit exactly `capacity` normal requests would pass (all of them
/// when there are no more), whatever the doomed ones.
async fn contended_load(
    cluster: &Cluster,
    backend: &Arc<ClusterBackend>,
    algorithm: Algorithm,
    prefix: &str,
    capacity: u64,
    mix: Mix,
) -> Contended {
    let limits = on_different_primaries(cluster, backend, algorithm, prefix, &[capacity, 0]).await;
    let normal_request = Arc::new(vec![limits[0].clone()]);
    let doomed_request = Arc::new(limits.clone());
    let queue = Arc::new(mixed_queue(mix.normal, mix.doomed));
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (backend, queue, next) = (backend.clone(), queue.clone(), next.clone());
        let (normal_request, doomed_request) = (normal_request.clone(), doomed_request.clone());
        tasks.push(tokio::spawn(async move {
            let mut allowed = [0u64; 2];
            loop {
                let idx = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&is_doomed) = queue.get(idx) else {
                    return allowed;
                };
                let request = if is_doomed {
                    &doomed_request
                } else {
                    &normal_request
                };
                let verdict = backend.decide(request).await.expect("decided");
                allowed[usize::from(is_doomed)] += u64::from(verdict.allowed);
            }
        }));
    }
    let mut allowed = [0u64; 2];
    for task in tasks {
        let counts = task.await.expect("task");
        allowed[0] += counts[0];
        allowed[1] += counts[1];
    }
    Contended {
        limit: limits[0].clone(),
        normal_allowed: allowed[0],
        doomed_allowed: allowed[1],
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_under_contention_never_admit_over_the_limit_and_leave_nothing_behind() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    // The windows and the log give back exactly what was taken (a bucket
    // gets back less by the refill since its decision: see "Refunds").
    let exact = [
        SlidingWindowLog,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindowCounter,
    ];
    for algorithm in exact {
        let mix = Mix {
            normal: 200,
            doomed: 200,
        };
        let run = contended_load(&cluster, &backend, algorithm, "inv", 200, mix).await;
        eprintln!(
            "{algorithm}: {} of 200 normal requests allowed",
            run.normal_allowed
        );
        assert_eq!(run.doomed_allowed, 0, "{algorithm}");
        assert!(
            run.normal_allowed <= 200,
            "{algorithm}: {}",
            run.normal_allowed
        );
        assert!(run.normal_allowed > 0, "{algorithm}");
        // Every doomed request's units came back: exactly the normal ones
        // allowed stay counted.
        let left = 200 - run.normal_allowed;
        let verdict = backend
            .decide(std::slice::from_ref(&run.limit))
            .await
            .unwrap();
        assert_eq!(verdict.allowed, left > 0, "{algorithm}: {left} left");
        if left > 0 {
            assert_eq!(verdict.outcomes[0].remaining, left - 1, "{algorithm}");
        }
    }
    assert_eq!(backend.refund_failures(), 0);
}

/// The figure in docs/redis.md ("Under contention", in Refunds):
/// `cargo test --test cluster_sentinel -- --ignored --nocapture cluster::refund_shortfall`.
/// With as many normal requests as the limit, each one denied is a request
/// denied only because a doomed one's units were not yet given back; with
/// twice as many, the load goes on past the limit and the shortfall is the
/// room left unused when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: prints the shortfall refunds cause under contention"]
async fn refund_shortfall_under_contention() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    println!(
        "algorithm | N | normal | doomed share | requests | shortfall per run | mean % of N | mean % of requests"
    );
    for algorithm in Algorithm::ALL {
        // (N, normal requests, doomed share of all requests in %, runs)
        for row in [
            (200, 200, 10, 10),
            (200, 200, 50, 10),
            (200, 400, 50, 10),
            (2_000, 2_000, 50, 3),
        ] {
            shortfall_row(&cluster, &backend, algorithm, row).await;
        }
    }
    assert_eq!(backend.refund_failures(), 0);
}

/// Runs one row of [`refund_shortfall_under_contention`] and prints it.
async fn shortfall_row(
    cluster: &Cluster,
    backend: &Arc<ClusterBackend>,
    algorithm: Algorithm,
    (capacity, normal, doomed_pct, runs): (u64, usize, usize, usize),
) {
    let doomed = normal * doomed_pct / (100 - doomed_pct);
    let requests = normal + doomed;
    let mut shortfalls = Vec::new();
    for run in 0..runs {
        let prefix = format!("m{capacity}-{normal}-{doomed_pct}-{run}-");
        let mix = Mix { normal, doomed };
        let result = contended_load(cluster, backend, algorithm, &prefix, capacity, mix).await;
        assert_eq!(result.doomed_allowed, 0);
        assert!(result.normal_allowed <= capacity);
        shortfalls.push(capacity - result.normal_allowed);
    }
    let mean = shortfalls.iter().sum::<u64>() as f64 / runs as f64;
    println!(
        "{algorithm} | {capacity} | {normal} | {doomed_pct}% | {requests} | {shortfalls:?} | {:.1}% | {:.1}%",
        100.0 * mean / capacity as f64,
        100.0 * mean / requests as f64,
    );
}

// === descriptors ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_backend_holds_at_most_its_pool_on_each_node() {
    let cluster = Cluster::start(3, 1).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    // 64 tasks over counters on every primary use the pooled connections
    // on every primary; the probe reuses them.
    hammer(vec![backend.clone()], spread_checks(12), 640).await;
    backend.probe().await.expect("healthy");
    let primaries = cluster.current_primaries().await;
    assert_eq!(primaries.len(), 3);
    let seeds = cluster.seeds().len();
    // What the descriptor reserve counts: the pool once per seed node. The
    // client may also open connections to replicas (topology discovery),
    // never more than the pool on any node.
    let within_the_reserve = |clients: &[usize]| {
        clients.iter().all(|&it| it <= POOL)
            && clients.iter().sum::<usize>() <= POOL * seeds
            && primaries.iter().all(|&idx| clients[idx] >= 1)
    };
    // The test's own dropped connections close when their driver tasks
    // next run, which on a loaded machine may take a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut clients = Vec::new();
        for idx in 0..6 {
            clients.push(cluster.clients_of(idx).await);
        }
        if within_the_reserve(&clients) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "clients per node {clients:?}: over {POOL} on a node, over {POOL} x {seeds} seeds \
             in all, or a primary {primaries:?} unused"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// === the caller's deadline ===

/// As on a single server: a caller out of time gets [`Error::Deadline`] at
/// once and nothing is sent; a caller whose `send_by` passes while its call
/// waits behind calls to a stalled primary is answered [`Error::Deadline`]
/// then, still unsent (its counter never appears), and counted at the
/// stage it waited in, never at `backend`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_call_is_never_written_after_its_callers_send_by() {
    use throttlegate::backends::{CallContext, Progress, Stage};

    let cluster = Cluster::start(3, 0).await;
    let backend = Arc::new(
        ClusterBackend::connect(ClusterSettings {
            pool_size: 1,
            ..cluster_settings(&cluster, HashTag::None)
        })
        .expect("settings"),
    );
    let busy = vec![check_on(
        SlidingWindowLog,
        3_600,
        &[("user", "busy")],
        1_000,
        1,
    )];
    let late = vec![check_on(
        SlidingWindowLog,
        3_600,
        &[("user", "late")],
        1_000,
        1,
    )];
    assert!(backend.decide(&busy).await.expect("decided").allowed);
    cluster.reset_stats().await;
    let within = |send_by: Instant| CallContext {
        send_by: Some(send_by),
        progress: Progress::new(Stage::Decide),
        late: None,
    };

    // No time left: refused at once, nothing written.
    let gone = within(Instant::now());
    let err = backend
        .decide_within(&late, &gone)
        .await
        .expect_err("no time");
    assert!(matches!(err, Error::Deadline), "{err:?}");
    assert_ne!(gone.progress.get(), Stage::Backend);
    assert_eq!(cluster.calls_on_primaries("fcall").await, 0);

    // Far more calls than the gate lets in flight, all to a stalled
    // primary: the late caller waits for a place and its time runs out.
    let owner = primary_of(&cluster, &backend, &busy[0]).await;
    cluster.node(owner).pause();
    let stuck: Vec<_> = (0..64)
        .map(|_| {
            let (backend, busy) = (backend.clone(), busy.clone());
            tokio::spawn(async move { backend.decide(&busy).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let waiting = within(Instant::now() + Duration::from_millis(150));
    let err = backend
        .decide_within(&late, &waiting)
        .await
        .expect_err("out of time behind the stalled calls");
    cluster.node(owner).resume();
    assert!(matches!(err, Error::Deadline), "{err:?}");
    assert_eq!(waiting.progress.get(), Stage::Queue);
    for task in stuck {
        assert!(task.await.expect("task").expect("decided").allowed);
    }
    // Every stalled call ran once; the late one never reached Redis.
    assert_eq!(cluster.calls_on_primaries("fcall").await, 64);
    let late_key = backend.key_of(&late[0].key);
    assert!(
        cluster.keys(&late_key).await.is_empty(),
        "{late_key} was written"
    );
    // With time, the same request is decided.
    let patient = within(Instant::now() + Duration::from_secs(5));
    assert!(
        backend
            .decide_within(&late, &patient)
            .await
            .expect("decided")
            .allowed
    );
}

// === the over-limit cache ===

const CACHE_CONFIG: &str = r#"
domain: cache
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: fixed_window}
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 10, algorithm: fixed_window}
  - key: global
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: fixed_window}
"#;

async fn cache_hits(service: &support::service::TestService) -> f64 {
    let text = service.limiter.metrics().encode();
    support::service::sample(&text, "throttlegate_over_limit_cache_hits_total").unwrap_or(0.0)
}

/// The finding: with untagged keys, a request over two slots consumes in
/// one and is refunded when the other denies, so a counter seen full
/// while such requests were in flight has room again once their refunds
/// land, whatever time does. 24 doomed `[user, global]` requests at once
/// (global is full), then 4 `[user]` requests with the over-limit cache on
/// (the default): each is decided as Redis holds it (4, 3, 2, 1 left),
/// none denied from the cache. And the denial of a request over two slots
/// reports what remains of each limit after its refund.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refunds_never_leave_a_counter_denied_from_the_cache_and_denials_report_the_refunded_room()
{
    use crate::support::service::{call, default_options, start_with_config};

    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    assert!(!backend.never_refunds());
    let service = start_with_config(CACHE_CONFIG, backend.clone(), default_options()).await;
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let ask = |descriptors: Vec<_>| call(&service, request("cache", descriptors));
    let user = || descriptor(&[("user", "a")]);
    let global = || descriptor(&[("global", "all")]);
    assert_eq!(ask(vec![global()]).await.overall_code, ok);

    let doomed: Vec<_> = (0..24).map(|_| ask(vec![user(), global()])).collect();
    for answer in futures_util::future::join_all(doomed).await {
        assert_eq!(answer.overall_code, over);
    }
    // Each denial was answered after its refunds: all the room is back.
    for left in [4, 3, 2, 1] {
        let answer = ask(vec![user()]).await;
        assert_eq!(answer.overall_code, ok, "{left} should be left: {answer:?}");
        assert_eq!(answer.statuses[0].limit_remaining, left);
    }
    // The cache is off: `global`, full, asked twice more is asked of Redis
    // each time, where with a domain tag the second is a cache hit (the
    // next test, the same sequence).
    for _ in 0..2 {
        assert_eq!(ask(vec![global()]).await.overall_code, over);
    }
    assert!(backend.local_clock().is_none());
    assert_eq!(cache_hits(&service).await, 0.0);

    // 10 a minute with 8 left: the denial says 8, not 7.
    for _ in 0..2 {
        assert_eq!(
            ask(vec![descriptor(&[("tenant", "t")])]).await.overall_code,
            ok
        );
    }
    let answer = ask(vec![descriptor(&[("tenant", "t")]), global()]).await;
    assert_eq!(answer.overall_code, over);
    assert_eq!(answer.statuses[0].code, ok, "{answer:?}");
    assert_eq!(answer.statuses[0].limit_remaining, 8, "{answer:?}");
    assert_eq!(answer.statuses[1].code, over, "{answer:?}");
    assert_eq!(backend.refund_failures(), 0);
}

/// Where no request spans slots (the domain hash tag) nothing is ever
/// refunded, and the cache answers for counters known full: the same
/// sequence on `global` that the cache never answers without a tag.
#[tokio::test]
async fn with_a_domain_tag_the_over_limit_cache_answers_for_a_full_counter() {
    use crate::support::service::{call, default_options, start_with_config};

    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::Domain);
    assert!(backend.never_refunds());
    assert!(backend.local_clock().is_some());
    let service = start_with_config(CACHE_CONFIG, backend, default_options()).await;
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let global = || request("cache", vec![descriptor(&[("global", "all")])]);
    assert_eq!(call(&service, global()).await.overall_code, ok);
    assert_eq!(call(&service, global()).await.overall_code, over);
    assert_eq!(cache_hits(&service).await, 0.0);
    assert_eq!(call(&service, global()).await.overall_code, over);
    assert_eq!(cache_hits(&service).await, 1.0);
}

/// `cmdstat_<name>` calls on `nodes[idx]`.
async fn calls_on(cluster: &Cluster, idx: usize, name: &str) -> u64 {
    let mut conn = cluster.node(idx).connection().await;
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .expect("INFO commandstats");
    support::cluster::calls_in(&info, name)
}

/// `ACL SETUSER default <rule>` on `nodes[idx]` alone.
async fn deny_on(cluster: &Cluster, idx: usize, rule: &str) {
    let mut admin = cluster.node(idx).connection().await;
    let () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("default")
        .arg(rule)
        .query_async(&mut admin)
        .await
        .unwrap();
}

/// The engine is settled per node, as on a single server: of three
/// primaries, one refusing FCALL (an ACL on that node alone) is sent
/// EVALSHA; one refusing FUNCTION but holding the library (loaded by an
/// operator), which the first call meets, and one allowing both are sent
/// FCALL. Every request is decided right, alone on each primary or
/// spanning all three.
#[tokio::test]
async fn each_primary_gets_the_engine_it_allows() {
    let cluster = Cluster::start(3, 0).await;
    let backend = cluster_backend(&cluster, HashTag::None);
    let lone = on_different_primaries(&cluster, &backend, FixedWindow, "lone-", &[2, 2, 2]).await;
    let spanning =
        on_different_primaries(&cluster, &backend, FixedWindow, "span-", &[2, 2, 2]).await;
    let no_function = primary_of(&cluster, &backend, &lone[0]).await;
    let no_fcall = primary_of(&cluster, &backend, &lone[1]).await;
    support::redis::load_library(&mut cluster.node(no_function).connection().await).await;
    deny_on(&cluster, no_function, "-function").await;
    deny_on(&cluster, no_fcall, "-fcall").await;
    cluster.reset_stats().await;
    for check in &lone {
        let mut answers = Vec::new();
        for _ in 0..3 {
            let verdict = backend.decide(std::slice::from_ref(check)).await;
            answers.push(verdict.expect("decided").allowed);
        }
        assert_eq!(answers, [true, true, false], "{:?}", check.key);
    }
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(backend.decide(&spanning).await.expect("decided").allowed);
    }
    assert_eq!(answers, [true, true, false], "spanning");
    for idx in cluster.current_primaries().await {
        let calls = (
            calls_on(&cluster, idx, "fcall").await,
            calls_on(&cluster, idx, "evalsha").await,
        );
        // 3 alone and 3 spanning on each, and the call that met no code:
        // on the node refusing FCALL an EVALSHA (NOSCRIPT), on the one
        // allowing both an FCALL (no library yet).
        let expected = match idx {
            _ if idx == no_fcall => (0, 7),
            _ if idx == no_function => (6, 0),
            _ => (7, 0),
        };
        assert_eq!(
            calls, expected,
            "node {idx} (refusing FUNCTION: {no_function}, FCALL: {no_fcall})"
        );
    }
}

// === decisions that come after the timeout ===

/// `--redis-timeout-ms` of the late-reply tests: far shorter than the stall.
const LATE_TIMEOUT_MS: u64 = 200;

/// How long a node sleeps: past every request's timeout, well within the
/// grace a late reply is awaited for (10 s), and shorter than the
/// cluster's node timeout (1 s), so that the others do not fail it.
const STALL_S: f64 = 0.8;

/// A backend on `cluster` whose calls time out after [`LATE_TIMEOUT_MS`],
/// every pooled connection made ahead (one made during a stall would wait
/// for the sleeping node).
async fn late_backend(cluster: &Cluster) -> ClusterBackend {
    let backend = ClusterBackend::connect(ClusterSettings {
        timeout_ms: LATE_TIMEOUT_MS,
        ..cluster_settings(cluster, HashTag::None)
    })
    .unwrap();
    backend.warm_up().await;
    backend
}

/// A call context whose late verdicts add what they consumed to `hits`,
/// as the service counts them.
fn counting_late(hits: &Arc<AtomicU64>) -> CallContext {
    let hits = hits.clone();
    CallContext {
        late: Some(LateVerdict::new(move |verdict| {
            let consumed = verdict.outcomes.iter().filter(|it| it.consumed).count();
            hits.fetch_add(consumed as u64, Ordering::SeqCst);
        })),
        ..CallContext::unbounded()
    }
}

/// The count of `check`'s fixed window as its node holds it
/// (`window_start:count`; 0 when there is none).
async fn held_count(cluster: &Cluster, backend: &ClusterBackend, check: &KeyedCheck) -> u64 {
    let node = primary_of(cluster, backend, check).await;
    let mut conn = cluster.node(node).connection().await;
    let value: Option<String> = redis::cmd("GET")
        .arg(backend.key_of(&check.key))
        .query_async(&mut conn)
        .await
        .expect("GET");
    value.map_or(0, |it| {
        let count = it.rsplit(':').next().expect("a fixed window's state");
        count.parse().expect("a fixed window's count")
    })
}

/// Requests on one slot sent while its node sleeps past their timeout
/// fail at their timeout (the failure mode answers them); once the node
/// has woken, their decisions are handed over late and counted, so the
/// hits equal what the node holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_slot_decision_that_comes_late_is_counted() {
    let cluster = Cluster::start(3, 0).await;
    let backend = Arc::new(late_backend(&cluster).await);
    let check = slow_check(FixedWindow, "late-alone");
    assert!(
        backend
            .decide(std::slice::from_ref(&check))
            .await
            .unwrap()
            .allowed
    );
    let hits = Arc::new(AtomicU64::new(1));
    let node = primary_of(&cluster, &backend, &check).await;
    let sleep = cluster.node(node).put_to_sleep(STALL_S).await;
    let mut asked = Vec::new();
    for _ in 0..3 {
        let (backend, check, call) = (backend.clone(), check.clone(), counting_late(&hits));
        asked.push(tokio::spawn(async move {
            let started = Instant::now();
            let res = backend.decide_within(&[check], &call).await;
            (res, started.elapsed())
        }));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for task in asked {
        let (res, took) = task.await.expect("task");
        assert!(matches!(res, Err(Error::Timeout(_))), "{res:?}");
        assert!(
            took < Duration::from_millis(600),
            "answered at its timeout, not the stall's end: {took:?}"
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "nothing counted before the reply"
    );
    sleep.await.expect("task").expect("DEBUG SLEEP");
    let by = Instant::now() + Duration::from_secs(5);
    while hits.load(Ordering::SeqCst) < 4 && Instant::now() < by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        4,
        "each late decision counted once"
    );
    assert_eq!(
        held_count(&cluster, &backend, &check).await,
        4,
        "the hits are what the node holds"
    );
}

/// A request over two primaries, one of them asleep past its timeout:
/// the request fails at its timeout, the group that allowed in time is
/// refunded, and so is the late group once its node wakes and allows, so
/// the failed request consumes nothing and nothing of it is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_group_of_a_request_over_two_slots_is_refunded_when_it_comes() {
    let cluster = Cluster::start(3, 0).await;
    let backend = late_backend(&cluster).await;
    let checks =
        on_different_primaries(&cluster, &backend, FixedWindow, "late-pair", &[50, 50]).await;
    // Both nodes have the library and the client its connections.
    for check in &checks {
        assert_eq!(remaining_after_one(&backend, check).await, 49);
    }
    let hits = Arc::new(AtomicU64::new(0));
    let stalled = primary_of(&cluster, &backend, &checks[1]).await;
    let sleep = cluster.node(stalled).put_to_sleep(STALL_S).await;
    let res = backend.decide_within(&checks, &counting_late(&hits)).await;
    assert!(matches!(res, Err(Error::Timeout(_))), "{res:?}");
    assert_eq!(
        held_count(&cluster, &backend, &checks[0]).await,
        1,
        "refunded in time"
    );
    sleep.await.expect("task").expect("DEBUG SLEEP");
    // The late group decides as the node wakes, then is refunded.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let by = Instant::now() + Duration::from_secs(5);
    while held_count(&cluster, &backend, &checks[1]).await != 1 && Instant::now() < by {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for check in &checks {
        assert_eq!(
            held_count(&cluster, &backend, check).await,
            1,
            "only the first request's"
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "the failed request counts nothing"
    );
    assert_eq!(backend.refund_failures(), 0);
}
