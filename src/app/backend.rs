//! The backend the flags name: the in-memory one, a Redis server (or
//! Sentinel's master), or a Redis Cluster; and the quota book on the same
//! Redis. Invariant: the in-memory backend serves only when no Redis is
//! named; Redis settings that cannot be used stop the start rather than
//! fall back to it.

use std::sync::Arc;
use std::time::Duration;

use crate::backends::Backend;
use crate::backends::keys::KeyFormat;
use crate::backends::memory::{MemoryBackend, SweeperGuard};
use crate::backends::redis::cluster::{ClusterBackend, ClusterSettings};
use crate::backends::redis::{
    RedisBackend, RedisSettings, RedisTls, SentinelSettings, ServerConnector,
};
use crate::clock::SystemClock;
use crate::metrics::Metrics;
use crate::quota::redis::RedisPools;
use crate::quota::{self, QuotaBook};

use super::signals::StopSignals;
use super::{Aborted, RedisFlags, Settings};

/// How often the memory backend reclaims idle counters.
const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// Redis when a URL is given (connected now), otherwise the in-memory
/// backend with its sweeper, whose guard is returned.
pub(super) async fn connect(
    settings: &Settings,
    metrics: &Metrics,
    stop: &mut StopSignals,
) -> Result<(Arc<dyn Backend>, Option<SweeperGuard>), Aborted> {
    warn_about_redis_tls(&settings.redis.tls);
    let redis = match redis_settings(&settings.redis).map_err(Aborted::Failed)? {
        None => {
            tracing::warn!("no --redis-url: using the in-memory backend, limits are per instance");
            let (memory, sweeper) = memory_backend(settings.memory_max_counters, metrics);
            return Ok((memory, Some(sweeper)));
        }
        Some(RedisTarget::Cluster(cluster)) => {
            return match ClusterBackend::connect(cluster) {
                Ok(it) => Ok((Arc::new(it), None)),
                Err(err) => Err(Aborted::Failed(format!("redis cluster: {err}"))),
            };
        }
        Some(RedisTarget::Single(redis)) => redis,
    };
    let hash_tag = settings.redis.hash_tag;
    match stop.or_stop(RedisBackend::connect(redis)).await {
        Some(Ok(it)) => {
            let it = it
                .with_hash_tag(hash_tag)
                .with_serving_threads(settings.limits.grpc.threads);
            Ok((Arc::new(it), None))
        }
        Some(Err(err)) => Err(Aborted::Failed(format!("redis: {err}"))),
        None => Err(Aborted::Stopped),
    }
}

/// With Redis (a server, Sentinel or a cluster, with the `--redis-tls-*`
/// settings), rate-limit quota budgets are kept there and shared with
/// every instance on it; without, each instance shares them among its own
/// streams. `None`: the in-memory book `server_apps` made stays.
pub(super) fn quota_book(flags: &RedisFlags) -> Result<Option<Arc<QuotaBook>>, Aborted> {
    let failed = |err: crate::backends::Error| Aborted::Failed(format!("redis for quotas: {err}"));
    let connector: Box<dyn quota::redis::Connect> =
        match redis_settings(flags).map_err(Aborted::Failed)? {
            None => return Ok(None),
            Some(RedisTarget::Single(settings)) => {
                Box::new(QuotaServer(settings.connector().map_err(failed)?))
            }
            Some(RedisTarget::Cluster(settings)) => Box::new(
                settings
                    .redirecting_client(QUOTA_CLUSTER_RETRIES)
                    .map_err(failed)?,
            ),
        };
    Ok(Some(Arc::new(QuotaBook::with_redis(
        Arc::new(SystemClock),
        RedisPools::on(connector),
    ))))
}

/// How often one quota call on a cluster is sent again (after MOVED, ASK,
/// TRYAGAIN, a lost connection): both scripts may run twice (a pool's
/// write checks its version).
const QUOTA_CLUSTER_RETRIES: u32 = 8;

/// The quota pools' connections to the backend's server (or Sentinel's
/// master).
struct QuotaServer(ServerConnector);

impl quota::redis::Connect for QuotaServer {
    fn connect(&self) -> quota::redis::Connecting<'_> {
        Box::pin(async move {
            self.0
                .connect()
                .await
                .map(quota::redis::QuotaConnection::Server)
        })
    }
}

/// Verification turned off, in part or whole, is said at start-up.
fn warn_about_redis_tls(tls: &RedisTls) {
    if tls.insecure {
        tracing::warn!(
            "--redis-tls-insecure: the redis server's certificate is not verified; \
             anyone on the path can pose as redis"
        );
    } else if tls.skip_hostname_verification {
        tracing::warn!(
            "--redis-tls-skip-hostname-verification: any certificate the trusted CAs \
             signed is accepted for redis, whatever host it names"
        );
    }
}

/// The URL a Sentinel master is reached with when `--redis-url` is not
/// given: plain TCP, no password, db 0 (the host is replaced by the
/// master's).
const SENTINEL_MASTER_URL: &str = "redis://sentinel-master/";

/// The Redis deployment the flags name.
enum RedisTarget {
    Single(RedisSettings),
    Cluster(ClusterSettings),
}

/// `None` without a URL, Sentinel or cluster nodes.
fn redis_settings(flags: &RedisFlags) -> Result<Option<RedisTarget>, String> {
    let sentinel = sentinel_settings(flags)?;
    if sentinel.is_some() && !flags.cluster_nodes.is_empty() {
        return Err(
            "--redis-cluster-nodes and --redis-sentinel-nodes exclude each other: \
             a cluster fails over by itself, sentinel watches one master"
                .to_owned(),
        );
    }
    if !flags.cluster_nodes.is_empty() {
        return cluster_settings(flags).map(|it| Some(RedisTarget::Cluster(it)));
    }
    let url = match (&flags.url, &sentinel) {
        (Some(url), _) => url.clone(),
        (None, Some(_)) => SENTINEL_MASTER_URL.to_owned(),
        (None, None) => return Ok(None),
    };
    Ok(Some(RedisTarget::Single(RedisSettings {
        url,
        sentinel,
        pool_size: flags.pool_size,
        timeout_ms: flags.timeout_ms,
        key_prefix: flags.key_prefix.clone(),
        clock: flags.clock.clone(),
        expiry_grace_ms: flags.expiry_grace_ms,
        batch: flags.batch,
        tls: flags.tls.clone(),
    })))
}

/// The cluster flags; one deployment only.
fn cluster_settings(flags: &RedisFlags) -> Result<ClusterSettings, String> {
    if flags.url.is_some() {
        return Err(
            "--redis-url and --redis-cluster-nodes name two redis deployments: give one".to_owned(),
        );
    }
    Ok(ClusterSettings {
        nodes: flags.cluster_nodes.clone(),
        pool_size: flags.pool_size,
        timeout_ms: flags.timeout_ms,
        keys: KeyFormat::new(flags.key_prefix.clone(), flags.hash_tag),
        clock: flags.clock.clone(),
        expiry_grace_ms: flags.expiry_grace_ms,
        tls: flags.tls.clone(),
    })
}

/// `None` without Sentinel flags; nodes and a master name come together.
fn sentinel_settings(flags: &RedisFlags) -> Result<Option<SentinelSettings>, String> {
    let nodes = &flags.sentinel_nodes;
    match (&flags.sentinel_master, nodes.is_empty()) {
        (None, true) if flags.sentinel_password.is_none() => Ok(None),
        (Some(master), false) => Ok(Some(SentinelSettings {
            nodes: nodes.clone(),
            master: master.clone(),
            password: flags.sentinel_password.clone(),
        })),
        (None, false) => Err("--redis-sentinel-nodes needs --redis-sentinel-master".to_owned()),
        (_, true) => Err(
            "--redis-sentinel-master and --redis-sentinel-password need --redis-sentinel-nodes"
                .to_owned(),
        ),
    }
}

/// The in-memory backend on the system clock, its sweeper, and the gauge
/// of the counters it stores.
fn memory_backend(max_counters: usize, metrics: &Metrics) -> (Arc<dyn Backend>, SweeperGuard) {
    let memory =
        Arc::new(MemoryBackend::new(Arc::new(SystemClock)).with_max_counters(max_counters));
    let sweeper = memory.spawn_sweeper(SWEEP_EVERY);
    // Weak: the gauge must not keep the counters alive.
    let weak = Arc::downgrade(&memory);
    metrics.observe_stored_counters(move || {
        weak.upgrade().map_or(0, |it| {
            u64::try_from(it.stored_entries()).unwrap_or(u64::MAX)
        })
    });
    (memory, sweeper)
}
