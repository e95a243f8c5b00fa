//! The decision script on a Redis Cluster node: it touches only the keys
//! it declares, so it runs wherever its keys share a slot, and a request
//! whose keys span slots is a classified error, not a partial decision.

mod support;

use std::time::{Duration, Instant};

use support::keys::check_on;
use support::redis::{RedisServer, backend, backend_with};
use throttlegate::algorithms::Algorithm::{SlidingWindowLog, TokenBucket};
use throttlegate::backends::redis::ClockSource;
use throttlegate::backends::{Backend, Error};

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
