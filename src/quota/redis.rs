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

use std::time::Duration;

use redis::aio::ConnectionManager;

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

const WRITE: &str = r"
local current = redis.call('HGET', KEYS[1], 'v') or ''
if current ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
if #ARGV > 2 then
  local next = tostring((tonumber(current) or 0) + 1)
  redis.call('HSET', KEYS[1], 'v', next, unpack(ARGV, 3))
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

/// The pools of every instance on one Redis.
pub struct RedisPools {
    client: redis::Client,
    /// Made at the first use (start-up never waits for Redis), then
    /// reconnecting on its own.
    connection: tokio::sync::OnceCell<ConnectionManager>,
    read: redis::Script,
    write: redis::Script,
}

impl std::fmt::Debug for RedisPools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisPools").finish_non_exhaustive()
    }
}

impl RedisPools {
    /// Pools on the Redis of `url` (a single server), connected at the
    /// first use.
    pub fn new(url: &str) -> Result<RedisPools, Error> {
        let client = redis::Client::open(url)?;
        Ok(RedisPools {
            client,
            connection: tokio::sync::OnceCell::new(),
            read: redis::Script::new(READ),
            write: redis::Script::new(WRITE),
        })
    }

    /// Applies `change` to the stored pool `key` (a new one of `budget`
    /// when none is stored) at Redis's time, and stores the result; what
    /// `change` returned. `change` may run more than once (when another
    /// instance wrote in between), each time on the latest state.
    pub async fn update<R>(
        &self,
        key: &PoolKey,
        budget: Budget,
        change: impl Fn(&mut Pool, Micros) -> R,
    ) -> Result<R, Error> {
        let name = format!("throttlegate:rlqs:{}", key.as_str());
        let mut connection = self
            .connection
            .get_or_try_init(|| async {
                within(ConnectionManager::new(self.client.clone()))
                    .await?
                    .map_err(Error::from)
            })
            .await?
            .clone();
        for _ in 0..MAX_ATTEMPTS {
            let (seconds, micros, fields): (u64, u64, Vec<(String, String)>) =
                within(self.read.key(&name).invoke_async(&mut connection)).await??;
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
            let mut invocation = self.write.key(&name);
            invocation.arg(&version).arg(POOL_TTL_MS);
            if !pool.is_empty() {
                for (field, value) in pool.to_fields() {
                    invocation.arg(field).arg(value);
                }
            }
            let written: i64 = within(invocation.invoke_async(&mut connection)).await??;
            if written == 1 {
                return Ok(out);
            }
        }
        Err(Error::Contended(key.as_str().to_owned()))
    }
}

async fn within<T>(call: impl Future<Output = T>) -> Result<T, Error> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|_| Error::Timeout(CALL_TIMEOUT))
}
