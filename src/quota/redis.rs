//! Pools kept in Redis, so that the proxies connected to several
//! instances share one budget.
//!
//! A pool is one hash (`throttlegate:rlqs:<pool>`: its budget, and a field
//! per member, as [`Pool::to_fields`] writes them) plus a version field.
//! An instance reads the hash and Redis's clock in one script, applies the
//! report to the pool in process ([`Pool::report_from`], the same code as
//! in memory), and writes the result back with a second script that
//! replaces the hash only if its version is still the one read: a
//! concurrent writer makes it read again and retry, so every change is
//! decided on the latest state (exact under concurrency). The hash
//! expires a few assignment lifetimes after its last write.
//!
//! Any deployment works: one server, the master Sentinel names (asked
//! again whenever a connection is opened, so after a failover too), or a
//! cluster (a pool is one key, so both scripts run on its slot's node).
//! How connections are opened is given ([`Connect`]): `app` gives the
//! backend's settings, TLS included.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};

use crate::clock::Micros;

use super::mapping::PoolKey;
use super::share::{ASSIGNMENT_TTL_US, Budget, Pool};

/// The hash field of a pool's version.
const VERSION_FIELD: &str = "v";
/// Attempts at a write before the report is given up.
const MAX_ATTEMPTS: usize = 32;
/// A pool's hash lives this long after its last write.
const POOL_TTL_MS: u64 = 4 * ASSIGNMENT_TTL_US / 1000;
/// Every call is bounded by this.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

const READ: &str = r"
local t = redis.call('TIME')
return {t[1], t[2], redis.call('HGETALL', KEYS[1])}
";

/// Fields are written 500 at a time (1,000 values): Lua's `unpack` fails past a few
/// thousand values (its C stack), whatever the member count.
const WRITE: &str = r"
local current = redis.call('HGET', KEYS[1], 'v') or ''
if current ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if #ARGV > 2 then
  local next = tostring((tonumber(current) or 0) + 1)
  redis.call('HSET', KEYS[1], 'v', next)
  for first = 3, #ARGV, 1000 do
    redis.call('HSET', KEYS[1], unpack(ARGV, first, math.min(first + 999, #ARGV)))
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
";

/// Why a pool could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the stored pool {0} is malformed")]
    Malformed(String),
    #[error("the pool {0} changed under {MAX_ATTEMPTS} attempts in a row")]
    Contended(String),
}

/// A connection being opened.
pub type Connecting<'a> =
    Pin<Box<dyn Future<Output = Result<QuotaConnection, RedisError>> + Send + 'a>>;

/// How the pools' connections are opened: to the Redis deployment the
/// flags name (one server, the master Sentinel names now, or a cluster),
/// with its TLS settings. `app` gives the backend's settings; a
/// [`redis::Client`] (one server, by URL) and a [`ClusterClient`] open
/// connections as they are.
pub trait Connect: Send + Sync {
    fn connect(&self) -> Connecting<'_>;
}

/// A connection to one server, or to a cluster (each pool is one key, so
/// both scripts of a pool run on the node serving its slot; the cluster
/// client routes them, and follows MOVED and ASK).
#[derive(Clone)]
pub enum QuotaConnection {
    Server(MultiplexedConnection),
    Cluster(ClusterConnection),
}

/// The pools of every instance on one Redis deployment.
pub struct RedisPools {
    connector: Box<dyn Connect>,
    /// Opened at the first use (start-up never waits for Redis), then
    /// kept until a call on it fails: the next call opens another, which
    /// through Sentinel reaches the master named then (after a failover).
    connection: Mutex<Option<KeptQuotaConnection>>,
    /// Numbers the connections opened, so that a failure forgets only the
    /// connection it happened on.
    opened: AtomicU64,
    read: redis::Script,
    write: redis::Script,
    /// One lock per pool being written by this instance: its reports take
    /// turns, so that only other instances' writes make one retry.
    writing: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// The connection calls are sent on, and its number.
#[derive(Clone)]
struct KeptQuotaConnection {
    number: u64,
    connection: QuotaConnection,
}

impl std::fmt::Debug for RedisPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPools").finish_non_exhaustive()
    }
}

impl RedisPools {
    /// Pools on the single Redis server of `url` (no TLS files, no
    /// Sentinel), connected at the first use.
    pub fn new(url: &str) -> Result<RedisPools, Error> {
        Ok(RedisPools::on(Box::new(redis::Client::open(url)?)))
    }

    /// Pools on the deployment `connector` reaches, connected at the first
    /// use.
    pub fn on(connector: Box<dyn Connect>) -> RedisPools {
        RedisPools {
            connector,
            connection: Mutex::new(None),
            opened: AtomicU64::new(0),
            read: redis::Script::new(READ),
            write: redis::Script::new(WRITE),
            writing: Mutex::default(),
        }
    }

    /// Applies `change` to the stored pool `key` (a new one of `budget`
    /// when none is stored) at Redis's time, and stores the result; what
    /// `change` returned. `change` may run more than once (when another
    /// instance wrote in between), each time on the latest state.
    ///
    /// A call that fails on a connection opened before this call (Redis
    /// restarted, a failover made its node a replica: READONLY) is made
    /// once more on a new connection. A write whose answer was lost may
    /// have been stored: the version check then sends `change` to the
    /// state that holds it, where it counts the same report again (a
    /// demand set twice, not added).
    pub async fn update<R>(
        &self,
        key: &PoolKey,
        budget: Budget,
        change: impl Fn(&mut Pool, Micros) -> R,
    ) -> Result<R, Error> {
        let name = format!("throttlegate:rlqs:{}", key.as_str());
        let turn = self.turn(&name);
        let _turn = turn.lock().await;
        let outcome = self.update_in_turn(&name, key, budget, change).await;
        drop(_turn);
        self.end_turn(&name, turn);
        outcome
    }

    /// This instance's lock of the pool `name`.
    fn turn(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock_map(&self.writing)
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    /// Forgets the lock of `name` once nobody else holds or waits for it.
    fn end_turn(&self, name: &str, turn: Arc<tokio::sync::Mutex<()>>) {
        let mut writing = lock_map(&self.writing);
        drop(turn);
        if writing
            .get(name)
            .is_some_and(|it| Arc::strong_count(it) == 1)
        {
            writing.remove(name);
        }
    }

    async fn update_in_turn<R>(
        &self,
        name: &str,
        key: &PoolKey,
        budget: Budget,
        change: impl Fn(&mut Pool, Micros) -> R,
    ) -> Result<R, Error> {
        let (mut current, kept) = self.current().await?;
        match self.attempt(name, key, budget, &change, &mut current).await {
            Err(Error::Redis(err)) if kept && is_connection_failure(&err) => {
                self.forget(current.number);
                let (mut current, _) = self.current().await?;
                self.attempt(name, key, budget, &change, &mut current)
                    .await
                    .inspect_err(|err| self.forget_after(err, current.number))
            }
            outcome => outcome.inspect_err(|err| self.forget_after(err, current.number)),
        }
    }

    /// Reads, applies `change` and writes until a write finds the version
    /// it read.
    async fn attempt<R>(
        &self,
        name: &str,
        key: &PoolKey,
        budget: Budget,
        change: &impl Fn(&mut Pool, Micros) -> R,
        current: &mut KeptQuotaConnection,
    ) -> Result<R, Error> {
        let connection = &mut current.connection;
        for attempt in 0..MAX_ATTEMPTS {
            if attempt > 0 {
                // Another instance wrote in between: wait a little (more
                // after each miss, and at random) so that contending
                // instances stop meeting.
                let most = 200 * (1u64 << attempt.min(5));
                tokio::time::sleep(Duration::from_micros(jitter(most))).await;
            }
            let (seconds, micros, fields): (u64, u64, Vec<(String, String)>) =
                within(self.read.key(name).invoke_async(connection)).await??;
            let now = seconds * 1_000_000 + micros;
            let version = fields
                .iter()
                .find(|(field, _)| field == VERSION_FIELD)
                .map_or_else(String::new, |(_, value)| value.clone());
            let stored = fields.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let mut pool = Pool::from_fields(stored, budget)
                .ok_or_else(|| Error::Malformed(key.as_str().to_owned()))?;
            let out = change(&mut pool, now);
            pool.forget_expired(now);
            let mut invocation = self.write.key(name);
            invocation.arg(&version).arg(POOL_TTL_MS);
            if !pool.is_empty() {
                for (field, value) in pool.to_fields() {
                    invocation.arg(field).arg(value);
                }
            }
            let written: i64 = within(invocation.invoke_async(connection)).await??;
            if written == 1 {
                return Ok(out);
            }
        }
        Err(Error::Contended(key.as_str().to_owned()))
    }

    /// The connection kept, or a new one; whether it was kept.
    async fn current(&self) -> Result<(KeptQuotaConnection, bool), Error> {
        if let Some(current) = lock(&self.connection).clone() {
            return Ok((current, true));
        }
        // Opened without holding the lock: calls meanwhile open their own
        // rather than queue behind a connect that may take its whole
        // timeout; the first one opened is kept.
        let connection = self.connector.connect().await?;
        let number = self.opened.fetch_add(1, Ordering::Relaxed);
        let mut kept = lock(&self.connection);
        let current = kept.get_or_insert(KeptQuotaConnection { number, connection });
        Ok((current.clone(), false))
    }

    /// Drops connection `number` if it is still the one kept.
    fn forget(&self, number: u64) {
        let mut kept = lock(&self.connection);
        if kept.as_ref().is_some_and(|it| it.number == number) {
            *kept = None;
        }
    }

    /// After a failed call: a connection that timed out or failed may lead
    /// to a node that is gone, stuck or no longer master, so the next
    /// call opens another; a malformed or contended pool says nothing
    /// about the connection.
    fn forget_after(&self, err: &Error, number: u64) {
        if matches!(err, Error::Redis(_) | Error::Timeout(_)) {
            self.forget(number);
        }
    }
}

/// Whether `err` says the connection (or its node) cannot serve the call,
/// which a new connection may: lost, refused, or a node that is a replica
/// now (READONLY, after a failover).
fn is_connection_failure(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_unrecoverable_error()
        || matches!(err.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly))
}

/// A number of microseconds below `most`, at random.
fn jitter(most: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    random % most.max(1)
}

fn lock_map<T>(map: &Mutex<T>) -> MutexGuard<'_, T> {
    map.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lock(kept: &Mutex<Option<KeptQuotaConnection>>) -> MutexGuard<'_, Option<KeptQuotaConnection>> {
    kept.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn within<T>(call: impl Future<Output = T>) -> Result<T, Error> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| Error::Timeout(CALL_TIMEOUT))
}

// === impl Connect ===

impl Connect for redis::Client {
    fn connect(&self) -> Connecting<'_> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CALL_TIMEOUT))
            .set_response_timeout(None);
        Box::pin(async move {
            self.get_multiplexed_async_connection_with_config(&config)
                .await
                .map(QuotaConnection::Server)
        })
    }
}

impl Connect for ClusterClient {
    fn connect(&self) -> Connecting<'_> {
        Box::pin(async move {
            self.get_async_connection()
                .await
                .map(QuotaConnection::Cluster)
        })
    }
}

// === impl QuotaConnection ===

impl ConnectionLike for QuotaConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            QuotaConnection::Server(it) => it.req_packed_command(cmd),
            QuotaConnection::Cluster(it) => it.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            QuotaConnection::Server(it) => it.req_packed_commands(pipeline, offset, count),
            QuotaConnection::Cluster(it) => it.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            QuotaConnection::Server(it) => it.get_db(),
            QuotaConnection::Cluster(it) => it.get_db(),
        }
    }
}
