//! Redis backend: one atomic Lua script per request, EVALSHA over a bb8 pool.
//!
//! `lua/decide.lua` is `algorithms::decide` ported line for line; a request's
//! limits are checked and consumed in one script call, so replicas sharing
//! a Redis agree exactly. Connections are multiplexed: a call clones the
//! connection out of the pool and releases the slot at once, and broken
//! connections are detected here (see [`Manager`]). While Redis cannot be
//! reached, calls fail at once and a background task reconnects (see
//! [`Circuit`]).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bb8_redis::bb8;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, ServerErrorKind};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout_at};

use super::{Backend, Error, KeyedCheck, keys};
use crate::algorithms::{Mode, Outcome, Verdict};
use crate::clock::Clock;

/// The decision script, embedded at build time.
pub const DECIDE_LUA: &str = include_str!("../../../lua/decide.lua");

/// First wait before the background task tries to reconnect after the
/// circuit opened; doubled after every failure up to [`RECONNECT_MAX_DELAY`].
/// Short, so a blip costs little; capped, so recovery is seen within a
/// second while a long outage costs Redis one connect a second per replica.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);

/// Which clock the script uses.
#[derive(Debug, Clone)]
pub enum ClockSource {
    /// `redis.call('TIME')` inside the script: replicas with skewed clocks agree.
    Redis,
    /// The service's clock, sent as an argument (also how tests pin time).
    Local(Arc<dyn Clock>),
}

/// Everything needed to connect, from the command line.
#[derive(Clone)]
pub struct RedisSettings {
    /// `redis://`, `rediss://` or `redis+unix://`, with optional user:password.
    pub url: String,
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
}

/// Counters in Redis, shared by every replica pointed at the same server.
pub struct RedisBackend {
    pool: bb8::Pool<Manager>,
    script: redis::Script,
    key_prefix: String,
    clock: ClockSource,
    timeout: Duration,
    timeout_ms: u64,
    expiry_grace_ms: u64,
    /// Generation of connections: see [`Manager`].
    epoch: Arc<AtomicU64>,
    /// The last error from creating a connection, to say why a checkout
    /// timed out. A std Mutex: held only to swap a String, never across `.await`.
    last_connect_error: Arc<Mutex<Option<String>>>,
    redacted_url: String,
    circuit: Arc<Circuit>,
    reconnector: Arc<Reconnector>,
    /// Owns the task that reconnects while the circuit is open.
    _reconnecting: ReconnectGuard,
}

/// Open while Redis cannot be connected to: calls then fail at once with
/// [`Error::Unavailable`] instead of each waiting the whole timeout (with
/// Redis down, a wait per request would outlast Envoy's own timeout, which
/// then lets the request through whatever the failure mode says).
///
/// Only a failure to connect opens it (refused, connect timeout, DNS, TLS,
/// authentication): a slow reply on a live connection does not, so a slow
/// Redis still gets the full timeout on every call. It closes when a fresh
/// connection answers PING, made by the [`Reconnector`] in the background
/// or by a health probe.
struct Circuit {
    open: AtomicBool,
    /// Why it opened, for the errors answered meanwhile. A std Mutex: held
    /// only to swap a String, never across `.await`.
    reason: Mutex<String>,
    /// Wakes the reconnecting task, and checkouts waiting for a connection
    /// that will not come.
    opened: Notify,
    redacted_url: String,
}

/// Makes a fresh connection and PINGs it; on success the connection joins
/// the pool and the circuit closes.
struct Reconnector {
    client: redis::Client,
    config: AsyncConnectionConfig,
    pool: bb8::Pool<Manager>,
    epoch: Arc<AtomicU64>,
    circuit: Arc<Circuit>,
    timeout: Duration,
    timeout_ms: u64,
}

/// Stops the reconnecting task when the backend is dropped.
struct ReconnectGuard {
    task: JoinHandle<()>,
}

/// Creates multiplexed connections with our timeouts and tells bb8 which
/// ones are broken.
///
/// bb8-redis's manager cannot do either: its `has_broken` always answers
/// false (with the per-checkout PING off, a dead connection would stay in
/// the pool forever) and its connections carry redis-rs's fixed 500 ms
/// response timeout. Instead every connection remembers the epoch it was
/// made in; an I/O failure on a connection bumps the epoch past it, which
/// marks it and every connection made before it broken (a restart of Redis
/// kills them all at once), and bb8 drops them when they come back. A
/// suspicion about one connection only (a probe PING with no answer) marks
/// that connection alone, through its `retired` flag.
struct Manager {
    client: redis::Client,
    config: AsyncConnectionConfig,
    epoch: Arc<AtomicU64>,
    /// Cleared by a successful connect, so that a checkout timeout never
    /// blames an error from an earlier outage.
    last_connect_error: Arc<Mutex<Option<String>>>,
    /// Opened by any failure to connect.
    circuit: Arc<Circuit>,
}

struct Pooled {
    conn: MultiplexedConnection,
    epoch: u64,
    /// Shared by the pooled connection and the clones handed out, so a
    /// caller can retire the one it used.
    retired: Arc<AtomicBool>,
}

/// Records connection errors that bb8 swallows while it retries.
#[derive(Debug, Clone)]
struct LastErrorSink(Arc<Mutex<Option<String>>>);

// === impl RedisSettings ===

impl fmt::Debug for RedisSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSettings")
            .field("url", &redact(&self.url))
            .field("pool_size", &self.pool_size)
            .field("timeout_ms", &self.timeout_ms)
            .field("key_prefix", &self.key_prefix)
            .field("clock", &self.clock)
            .field("expiry_grace_ms", &self.expiry_grace_ms)
            .finish()
    }
}

// === impl RedisBackend ===

impl RedisBackend {
    /// Builds the pool. Fails when the URL or settings are invalid; an
    /// unreachable server is not an error here (probe and health report
    /// it, and connections are made when it answers). The script is loaded
    /// on first use (EVALSHA falls back to SCRIPT LOAD on NOSCRIPT).
    /// Starts the task that reconnects while the circuit is open; it stops
    /// when the backend is dropped.
    pub async fn connect(settings: RedisSettings) -> Result<RedisBackend, Error> {
        let redacted_url = redact(&settings.url);
        if settings.pool_size == 0 {
            return Err(Error::Protocol("redis pool size must be at least 1".into()));
        }
        if settings.timeout_ms == 0 {
            return Err(Error::Protocol(
                "redis timeout must be at least 1 ms".into(),
            ));
        }
        // rustls needs a process-wide crypto provider for `rediss://`; without
        // one it panics inside the connection task. Already installed (by us
        // or the embedding program) is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = redis::Client::open(settings.url.as_str())
            .map_err(|err| Error::Protocol(format!("invalid redis url {redacted_url}: {err}")))?;
        let timeout = Duration::from_millis(settings.timeout_ms);
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let epoch = Arc::new(AtomicU64::new(0));
        let last_connect_error = Arc::new(Mutex::new(None));
        let circuit = Arc::new(Circuit {
            open: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            opened: Notify::new(),
            redacted_url: redacted_url.clone(),
        });
        let manager = Manager {
            client: client.clone(),
            config: config.clone(),
            epoch: epoch.clone(),
            last_connect_error: last_connect_error.clone(),
            circuit: circuit.clone(),
        };
        let pool = bb8::Pool::builder()
            .max_size(settings.pool_size)
            // A PING per checkout doubles the round trips; broken
            // connections are found by `Manager::has_broken` instead.
            .test_on_check_out(false)
            .connection_timeout(timeout)
            // A failed connect opens the circuit, and the reconnector owns
            // retrying: bb8's own retries would only add load on a Redis
            // that is down.
            .retry_connection(false)
            .error_sink(Box::new(LastErrorSink(last_connect_error.clone())))
            // Never block start-up on an unreachable server.
            .build_unchecked(manager);
        let reconnector = Arc::new(Reconnector {
            client,
            config,
            pool: pool.clone(),
            epoch: epoch.clone(),
            circuit: circuit.clone(),
            timeout,
            timeout_ms: settings.timeout_ms,
        });
        let reconnecting = ReconnectGuard {
            task: tokio::spawn(reconnector.clone().run()),
        };
        Ok(RedisBackend {
            pool,
            script: redis::Script::new(DECIDE_LUA),
            key_prefix: settings.key_prefix,
            clock: settings.clock,
            timeout,
            timeout_ms: settings.timeout_ms,
            expiry_grace_ms: settings.expiry_grace_ms,
            epoch,
            last_connect_error,
            redacted_url,
            circuit,
            reconnector,
            _reconnecting: reconnecting,
        })
    }

    /// Whether calls fail at once because Redis could not be connected to
    /// (see [`Circuit`]).
    pub fn circuit_open(&self) -> bool {
        self.circuit.is_open()
    }

    /// The SHA1 the script is invoked by (EVALSHA).
    pub fn script_hash(&self) -> &str {
        self.script.get_hash()
    }

    /// The Redis key of a counter, as the script reads and writes it.
    pub fn key_of(&self, key: &super::CounterKey) -> String {
        keys::encode(&self.key_prefix, key)
    }

    /// A connection cloned out of the pool; the pool slot is released
    /// before the caller uses it (a multiplexed connection serves many
    /// concurrent calls, so holding the slot would only serialise them).
    async fn connection(&self) -> Result<Pooled, Error> {
        if self.circuit.is_open() {
            return Err(self.circuit.error());
        }
        // Each broken connection met is dropped by bb8 as it is put back,
        // so after pool_size of them a fresh one is made.
        for _ in 0..=self.pool.state().connections.max(1) {
            // A checkout waiting for a connection gives up as soon as a
            // connect fails, rather than at the timeout.
            let checkout = tokio::select! {
                biased;
                res = self.pool.get() => res,
                () = self.circuit.wait_open() => return Err(self.circuit.error()),
            };
            let pooled = checkout.map_err(|err| match err {
                bb8::RunError::User(err) => classify(&err, self.timeout_ms),
                bb8::RunError::TimedOut => {
                    let why = self
                        .last_connect_error
                        .lock()
                        .unwrap_or_else(|it| it.into_inner())
                        .clone()
                        .unwrap_or_else(|| "still connecting".to_owned());
                    Error::Unavailable(format!(
                        "no connection to {} within {} ms: {why}",
                        self.redacted_url, self.timeout_ms
                    ))
                }
            })?;
            if is_retired(&pooled, &self.epoch) {
                // Dropping it makes bb8 ask `has_broken`, which says yes.
                drop(pooled);
                continue;
            }
            return Ok(Pooled {
                conn: pooled.conn.clone(),
                epoch: pooled.epoch,
                retired: pooled.retired.clone(),
            });
        }
        Err(Error::Unavailable(format!(
            "no healthy connection to {}",
            self.redacted_url
        )))
    }

    /// Marks `conn` and every older connection broken when `err` means the
    /// connection is dead, and classifies the error.
    fn fail(&self, conn: &Pooled, err: &RedisError) -> Error {
        if is_broken(err) {
            self.retire(conn);
        }
        classify(err, self.timeout_ms)
    }

    fn now_arg(&self) -> String {
        match &self.clock {
            ClockSource::Redis => String::new(),
            ClockSource::Local(clock) => clock.now_us().to_string(),
        }
    }

    async fn ping(&self, deadline: Instant) -> Result<(), (Error, bool)> {
        let mut conn = match timeout_at(deadline, self.connection()).await {
            Ok(Ok(conn)) => conn,
            Ok(Err(err)) => return Err((err, false)),
            Err(_) => return Err((self.checkout_timeout(), false)),
        };
        // A PING that gets no answer in time may be on a half-open
        // connection (a partition without a reset), which a multiplexed
        // connection never notices by itself: retire it, so the pool
        // reconnects once the network heals. Only this connection: the
        // likelier cause is a slow script, and retiring every connection
        // would make every replica reconnect at once. Calls are not retired
        // on a timeout, since a slow script says nothing about the connection.
        let res: Result<String, RedisError> =
            match timeout_at(deadline, redis::cmd("PING").query_async(&mut conn.conn)).await {
                Ok(res) => res,
                Err(_) => {
                    conn.retired.store(true, Ordering::SeqCst);
                    return Err((Error::Timeout(self.timeout_ms), false));
                }
            };
        match res {
            Ok(pong) if pong == "PONG" => Ok(()),
            Ok(other) => Err((
                Error::Protocol(format!("unexpected ping reply {other:?}")),
                false,
            )),
            Err(err) => {
                if err.is_timeout() {
                    conn.retired.store(true, Ordering::SeqCst);
                }
                Err((self.fail(&conn, &err), is_broken(&err)))
            }
        }
    }

    /// Marks `conn` and every older connection broken.
    fn retire(&self, conn: &Pooled) {
        self.epoch.fetch_max(conn.epoch + 1, Ordering::SeqCst);
    }

    fn checkout_timeout(&self) -> Error {
        Error::Unavailable(format!(
            "no connection to {} within {} ms",
            self.redacted_url, self.timeout_ms
        ))
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.redacted_url)
            .field("key_prefix", &self.key_prefix)
            .field("clock", &self.clock)
            .field("timeout_ms", &self.timeout_ms)
            .field("pool", &self.pool.state())
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl Backend for RedisBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        if checks.is_empty() {
            return Ok(Verdict {
                allowed: true,
                outcomes: Vec::new(),
            });
        }
        let mut invocation = self.script.prepare_invoke();
        let mut seen = std::collections::HashSet::with_capacity(checks.len());
        for it in checks {
            let key = keys::encode(&self.key_prefix, &it.key);
            if !seen.insert(key.clone()) {
                // The script would read and write the counter twice.
                return Err(Error::Protocol(format!(
                    "counter {key} appears twice in one request"
                )));
            }
            invocation.key(key);
        }
        invocation.arg(self.now_arg()).arg(self.expiry_grace_ms);
        for it in checks {
            let params = &it.check.params;
            let rate = params.rate();
            invocation
                .arg(params.algorithm().name())
                .arg(params.limit())
                .arg(params.window_us())
                .arg(params.capacity())
                .arg(rate.per_us)
                .arg(rate.scale)
                .arg(it.check.cost)
                .arg(match it.check.mode {
                    Mode::Enforce => "enforce",
                    Mode::Shadow => "shadow",
                    Mode::Quota => "quota",
                });
        }

        let deadline = Instant::now() + self.timeout;
        let mut conn = timeout_at(deadline, self.connection())
            .await
            .map_err(|_| self.checkout_timeout())??;
        // NEVER retry after a timeout: the script may have run, and a retry
        // would count the request twice. `invoke_async` itself retries only
        // after NOSCRIPT (EVALSHA → SCRIPT LOAD → EVALSHA), when the script
        // certainly did not run. Other errors are not retried either: a
        // dropped connection may have delivered the call.
        let reply: Vec<i64> =
            match timeout_at(deadline, invocation.invoke_async(&mut conn.conn)).await {
                Err(_) => return Err(Error::Timeout(self.timeout_ms)),
                Ok(Err(err)) => return Err(self.fail(&conn, &err)),
                Ok(Ok(reply)) => reply,
            };
        parse_reply(&reply, checks.len())
    }

    /// PING within the timeout. A connection found dead is replaced and the
    /// PING retried once (PING is idempotent), so the first probe after
    /// Redis comes back already succeeds. While the circuit is open, a
    /// fresh connection is tried at once (not at the reconnector's next
    /// turn), so health reports recovery as soon as it happens.
    async fn probe(&self) -> Result<(), Error> {
        if self.circuit.is_open() {
            return self.reconnector.attempt().await;
        }
        let deadline = Instant::now() + self.timeout;
        match self.ping(deadline).await {
            Ok(()) => Ok(()),
            Err((_, true)) => self.ping(deadline).await.map_err(|(err, _)| err),
            Err((err, false)) => Err(err),
        }
    }

    fn name(&self) -> &'static str {
        "redis"
    }
}

// === impl Manager ===

impl bb8::ManageConnection for Manager {
    type Connection = Pooled;
    type Error = RedisError;

    async fn connect(&self) -> Result<Pooled, RedisError> {
        // Read before connecting: a failure reported meanwhile marks this
        // connection too, which at worst costs one reconnect.
        let epoch = self.epoch.load(Ordering::SeqCst);
        let conn = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await
            .inspect_err(|err| self.circuit.open(err.to_string()))?;
        *self
            .last_connect_error
            .lock()
            .unwrap_or_else(|it| it.into_inner()) = None;
        Ok(Pooled {
            conn,
            epoch,
            retired: Arc::default(),
        })
    }

    async fn is_valid(&self, conn: &mut Pooled) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Pooled) -> bool {
        is_retired(conn, &self.epoch)
    }
}

// === impl Circuit ===

impl Circuit {
    fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Opens the circuit (logged once per outage) or updates its reason.
    fn open(&self, reason: String) {
        *self.reason.lock().unwrap_or_else(|it| it.into_inner()) = reason;
        if !self.open.swap(true, Ordering::SeqCst) {
            let reason = self.reason.lock().unwrap_or_else(|it| it.into_inner());
            tracing::warn!(
                url = %self.redacted_url,
                reason = %*reason,
                "cannot connect to redis: answering under the failure mode until it is back"
            );
            drop(reason);
            self.opened.notify_waiters();
        }
    }

    /// Closes the circuit (logged once per outage).
    fn close(&self) {
        if self.open.swap(false, Ordering::SeqCst) {
            tracing::info!(url = %self.redacted_url, "connected to redis again: deciding requests");
        }
    }

    /// The error every call gets while the circuit is open.
    fn error(&self) -> Error {
        let reason = self.reason.lock().unwrap_or_else(|it| it.into_inner());
        Error::Unavailable(format!(
            "no connection to {} (reconnecting in the background): {reason}",
            self.redacted_url
        ))
    }

    /// Completes once the circuit is open.
    async fn wait_open(&self) {
        loop {
            let notified = self.opened.notified();
            tokio::pin!(notified);
            // Registered before the check, so an opening in between is not missed.
            notified.as_mut().enable();
            if self.is_open() {
                return;
            }
            notified.await;
        }
    }
}

// === impl Reconnector ===

impl Reconnector {
    /// Waits for the circuit to open, then tries to reconnect with backoff
    /// until it closes; forever, until its guard aborts it.
    async fn run(self: Arc<Self>) {
        loop {
            self.circuit.wait_open().await;
            let mut delay = RECONNECT_MIN_DELAY;
            while self.circuit.is_open() {
                tokio::time::sleep(delay).await;
                // A health probe may have closed it meanwhile.
                if !self.circuit.is_open() || self.attempt().await.is_ok() {
                    break;
                }
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
            }
        }
    }

    /// One fresh connection and a PING within the timeout. On success the
    /// connection joins the pool and the circuit closes; on failure the
    /// circuit opens (or stays open with the new reason).
    async fn attempt(&self) -> Result<(), Error> {
        let res = tokio::time::timeout(self.timeout, async {
            let mut conn = self
                .client
                .get_multiplexed_async_connection_with_config(&self.config)
                .await?;
            let pong: String = redis::cmd("PING").query_async(&mut conn).await?;
            Ok::<_, RedisError>((conn, pong))
        })
        .await;
        let (err, reason) = match res {
            Ok(Ok((conn, pong))) if pong == "PONG" => {
                // Connections from before the outage are not trusted after
                // it: a partition leaves them half-open, and nothing else
                // would retire them.
                let epoch = self.epoch.fetch_add(1, Ordering::SeqCst) + 1;
                // A full pool keeps its slots; the connection is then dropped
                // and bb8 makes new ones as the old ones are retired.
                let _ = self.pool.add(Pooled {
                    conn,
                    epoch,
                    retired: Arc::default(),
                });
                self.circuit.close();
                return Ok(());
            }
            Ok(Ok((_, other))) => {
                let reason = format!("unexpected ping reply {other:?}");
                (Error::Protocol(reason.clone()), reason)
            }
            Ok(Err(err)) => (classify(&err, self.timeout_ms), err.to_string()),
            Err(_) => {
                let reason = format!("no answer within {} ms", self.timeout_ms);
                (Error::Unavailable(reason.clone()), reason)
            }
        };
        self.circuit.open(reason);
        Err(err)
    }
}

impl Drop for ReconnectGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl bb8::ErrorSink<RedisError> for LastErrorSink {
    fn sink(&self, err: RedisError) {
        *self.0.lock().unwrap_or_else(|it| it.into_inner()) = Some(err.to_string());
    }

    fn boxed_clone(&self) -> Box<dyn bb8::ErrorSink<RedisError>> {
        Box::new(self.clone())
    }
}

// === helpers ===

/// Whether `conn` was retired alone or with its epoch.
fn is_retired(conn: &Pooled, epoch: &AtomicU64) -> bool {
    conn.retired.load(Ordering::SeqCst) || conn.epoch < epoch.load(Ordering::SeqCst)
}

/// Whether the connection that produced `err` is dead and must be replaced.
/// A timeout is not: the multiplexed connection still serves other calls
/// (redis-rs reports it as an I/O error, hence the explicit exclusion).
fn is_broken(err: &RedisError) -> bool {
    !err.is_timeout()
        && (err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error())
}

/// Maps a Redis failure to a backend error where it arises.
fn classify(err: &RedisError, timeout_ms: u64) -> Error {
    if err.is_timeout() {
        return Error::Timeout(timeout_ms);
    }
    if is_broken(err) || err.is_connection_refusal() {
        return Error::Unavailable(err.to_string());
    }
    let unavailable = matches!(
        err.kind(),
        ErrorKind::AuthenticationFailed
            | ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
    ) || matches!(err.code(), Some("BUSY" | "NOAUTH" | "WRONGPASS"));
    if unavailable {
        Error::Unavailable(err.to_string())
    } else {
        Error::Protocol(err.to_string())
    }
}

/// Reads `{allowed, now, (has_room, consumed, remaining, reset_us)*n}`.
fn parse_reply(reply: &[i64], n_checks: usize) -> Result<Verdict, Error> {
    let bad = || Error::Protocol(format!("unexpected script reply {reply:?}"));
    if reply.len() != 2 + 4 * n_checks {
        return Err(bad());
    }
    let flag = |value: i64| match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad()),
    };
    let count = |value: i64| u64::try_from(value).map_err(|_| bad());
    let allowed = flag(reply[0])?;
    let outcomes = reply[2..]
        .chunks_exact(4)
        .map(|it| {
            Ok(Outcome {
                has_room: flag(it[0])?,
                consumed: flag(it[1])?,
                remaining: count(it[2])?,
                reset_us: count(it[3])?,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(Verdict { allowed, outcomes })
}

/// The URL without its password, for logs and errors.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:secret@h"), "redis://:***@h");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }

    #[test]
    fn replies_are_checked() {
        assert!(parse_reply(&[1, 5, 1, 1, 3, 10], 1).is_ok());
        assert!(parse_reply(&[1, 5, 1, 1, 3], 1).is_err());
        assert!(parse_reply(&[2, 5, 1, 1, 3, 10], 1).is_err());
        assert!(parse_reply(&[1, 5, 1, 1, -3, 10], 1).is_err());
    }
}
