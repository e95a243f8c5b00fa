use super::*;
use crate::backends::keys::HashTag;
use crate::backends::redis::{ClockSource, RedisTls};

fn flags(pool_size: u32, cluster_nodes: &[&str]) -> RedisFlags {
    RedisFlags {
        url: None,
        pool_size,
        timeout_ms: 250,
        key_prefix: "tg".to_owned(),
        expiry_grace_ms: 0,
        batch: None,
        clock: ClockSource::Redis,
        hash_tag: HashTag::None,
        cluster_nodes: cluster_nodes.iter().map(|it| (*it).to_owned()).collect(),
        sentinel_nodes: Vec::new(),
        sentinel_master: None,
        sentinel_password: None,
        tls: RedisTls::default(),
    }
}

#[test]
fn a_cluster_reserves_its_pool_once_per_node() {
    // The pool, and the quota pools' two sockets.
    assert_eq!(redis_sockets(&flags(8, &[]), 0), 8 + 2);
    // One seed of a cluster that has at least three primaries: the
    // pool and the quota pools' connection to each.
    assert_eq!(redis_sockets(&flags(8, &["a:1"]), 0), 24 + 3);
    let six = ["a:1", "b:1", "c:1", "d:1", "e:1", "f:1"];
    assert_eq!(redis_sockets(&flags(4, &six), 0), 24 + 6);
}

#[test]
fn each_serving_thread_reserves_a_pool_of_its_own() {
    assert_eq!(redis_sockets(&flags(8, &[]), 2), 24 + 2);
    // A cluster's connections stay on the shared runtime.
    assert_eq!(redis_sockets(&flags(8, &["a:1"]), 2), 24 + 3);
}
