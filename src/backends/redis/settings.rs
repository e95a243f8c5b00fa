//! What the command line says of a Redis server: where it is (directly,
//! or behind Sentinel), its connections, timeout, keys, clock, batching
//! and TLS; and connections to it for other users than the decision
//! backend ([`ServerConnector`]).
//!
//! Invariant: settings no connection could work with are refused here,
//! before anything is connected; nothing here connects.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use redis::{IntoConnectionInfo, RedisError};

use super::dialer::Dialer;
use super::failure::redact;
use super::sentinel::{Sentinel, SentinelSettings};
use super::tls::RedisTls;
use crate::backends::Error;
use crate::clock::{Clock, MonotonicClock};

/// Which clock the script uses.
#[derive(Debug, Clone)]
pub enum ClockSource {
    /// `redis.call('TIME')` inside the script: replicas with skewed clocks agree.
    Redis,
    /// The service's clock, sent as an argument (also how tests pin time).
    Local(Arc<dyn Clock>),
}

impl ClockSource {
    /// The local clock the script's durations can be counted on: the
    /// service's own when it sends the time, else a monotonic one (the
    /// server's clock runs at the same rate; its offset does not matter,
    /// only durations are counted). Each call may make a new clock.
    pub fn local_clock(&self) -> Arc<dyn Clock> {
        match self {
            ClockSource::Redis => Arc::new(MonotonicClock::new()),
            ClockSource::Local(clock) => clock.clone(),
        }
    }
}

/// Everything needed to connect, from the command line.
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://`, `rediss://` or `redis+unix://`, with optional user:password.
    /// With [`RedisSettings::sentinel`], only how to reach the master
    /// (`rediss://` for TLS, user, password, db): its host and port are
    /// replaced by the address the sentinels give.
    pub url: String,
    /// Find the master through Sentinel instead of connecting to `url`.
    pub sentinel: Option<SentinelSettings>,
    /// Most connections kept open; each is multiplexed, so a few suffice.
    pub pool_size: u32,
    /// Bound on every call (checkout, connect and script); also the probe's.
    pub timeout_ms: u64,
    pub key_prefix: String,
    pub clock: ClockSource,
    /// Added to every key's TTL. 0 (the default to use) expires a key
    /// exactly when its state becomes equal to a fresh one; with
    /// [`ClockSource::Local`] and replica clocks that disagree, a grace of
    /// the skew keeps a lagging replica from reading a key already expired.
    pub expiry_grace_ms: u64,
    /// Coalesce concurrent requests into one call; `None`: one call each.
    pub batch: Option<BatchSettings>,
    /// How TLS connections (`rediss://`) verify and authenticate.
    pub tls: RedisTls,
}

/// Bounds of one batch (see `batch`): requests wait to be batched only
/// while earlier calls are in flight, one per pooled connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// Most requests in one call.
    pub max_requests: usize,
    /// Most keys in one call (a request with more is sent alone).
    pub max_keys: usize,
}

// === impl RedisSettings ===

impl RedisSettings {
    /// Refuses settings no pool can work with.
    pub(super) fn validate(&self) -> Result<(), Error> {
        if self.pool_size == 0 {
            return Err(Error::Protocol("redis pool size must be at least 1".into()));
        }
        if self.timeout_ms == 0 {
            return Err(Error::Protocol(
                "redis timeout must be at least 1 ms".into(),
            ));
        }
        if let Some(batch) = &self.batch
            && (batch.max_requests == 0 || batch.max_keys == 0)
        {
            return Err(Error::Protocol(
                "redis batches need room for at least 1 request and 1 key".into(),
            ));
        }
        Ok(())
    }

    /// Where connections go, and its name for logs; nothing is connected
    /// yet.
    pub(super) fn dialer(&self) -> Result<(Dialer, String), Error> {
        // rustls needs a process-wide crypto provider for `rediss://`; without
        // one it panics inside the connection task. Already installed (by us
        // or the embedding program) is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if let Some(sentinel) = &self.sentinel {
            let timeout = Duration::from_millis(self.timeout_ms);
            let sentinel = Sentinel::new(sentinel, &self.url, &self.tls, timeout)?;
            let name = sentinel.describe();
            return Ok((Dialer::Sentinel(Arc::new(sentinel)), name));
        }
        let info = self.url.as_str().into_connection_info().map_err(|err| {
            Error::Protocol(format!("invalid redis url {}: {err}", redact(&self.url)))
        })?;
        let info = self.tls.apply(info, &redact(&self.url))?;
        let client = redis::Client::open(info).map_err(|err| {
            Error::Protocol(format!("invalid redis url {}: {err}", redact(&self.url)))
        })?;
        Ok((Dialer::Direct(Box::new(client)), redact(&self.url)))
    }

    /// Connections beside the backend's to the same server; nothing is
    /// connected yet.
    pub fn connector(&self) -> Result<ServerConnector, Error> {
        self.validate()?;
        let (dialer, _) = self.dialer()?;
        let timeout = Duration::from_millis(self.timeout_ms);
        Ok(ServerConnector {
            dialer,
            config: redis::AsyncConnectionConfig::new()
                .set_connection_timeout(Some(timeout))
                .set_response_timeout(None),
            timeout,
        })
    }
}

/// Opens single connections to the server [`RedisSettings`] name, for
/// Redis users besides the decision backend (the rate-limit quota pools):
/// the same URL and TLS settings, and through Sentinel the node the
/// sentinels name master at each connect.
pub struct ServerConnector {
    dialer: Dialer,
    config: redis::AsyncConnectionConfig,
    timeout: Duration,
}

impl ServerConnector {
    /// A fresh multiplexed connection to the node that takes writes now
    /// (a replica is refused with READONLY), within the settings' timeout
    /// for each step (each sentinel asked, then the node). Its calls have
    /// no timeout of their own: the caller bounds them.
    pub async fn connect(&self) -> Result<redis::aio::MultiplexedConnection, RedisError> {
        let bound = self.dialer.bound(self.timeout);
        match tokio::time::timeout(bound, self.dialer.connect(&self.config)).await {
            Ok(connected) => connected,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no redis connection within {} ms", bound.as_millis()),
            ))),
        }
    }
}

impl fmt::Debug for ServerConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerConnector")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSettings")
            .field("url", &redact(&self.url))
            .field("sentinel", &self.sentinel)
            .field("pool_size", &self.pool_size)
            .field("timeout_ms", &self.timeout_ms)
            .field("key_prefix", &self.key_prefix)
            .field("clock", &self.clock)
            .field("expiry_grace_ms", &self.expiry_grace_ms)
            .field("batch", &self.batch)
            .field("tls", &self.tls)
            .finish()
    }
}
