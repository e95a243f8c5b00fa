//! Connections to one Redis server: a bb8 pool of multiplexed
//! connections, the one calls share between checkouts, and the task that
//! reconnects while the circuit ([`circuit`](super::circuit)) is open.
//! Behind Sentinel, every new connection asks the sentinels where the
//! master is ([`dialer`](super::dialer)), so this same path follows a
//! failover.
//!
//! Invariant: a call is handed only a connection of the current
//! generation, and none while the circuit is open.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use bb8_redis::bb8;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{AsyncConnectionConfig, RedisError};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout_at};

use super::circuit::Reachability;
use super::dialer::Dialer;
use super::engine::{self, Engine, Learnt};
use super::failure::{classify, is_broken, is_demoted};
use crate::backends::Error;

/// First wait before the background task tries to reconnect after the
/// circuit opened; doubled after every failure up to [`RECONNECT_MAX_DELAY`].
/// Short, so a blip costs little; capped, so recovery is seen within a
/// second while a long outage costs Redis one connect a second per replica.
const RECONNECT_MIN_DELAY: Duration = Duration::from_millis(50);
const RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);

/// A circuit opening again this soon after it closed is taken for the same
/// outage: the reconnector keeps its backoff.
const FLAPPING: Duration = Duration::from_secs(5);

/// How long calls keep using the connection last checked out of the pool
/// before the next call checks one out again (see [`ServerConnections::connection`]).
/// Short enough that the pool sees its connections used (bb8 closes idle
/// ones and those past their lifetime) and that calls move to the others
/// in turn; long enough that checkouts are a negligible share of calls.
const HOLD: Duration = Duration::from_millis(250);

/// Connections to one Redis, and what is known about reaching it.
pub(super) struct ServerConnections {
    pool: bb8::Pool<Manager>,
    timeout_ms: u64,
    /// What this pool shares with the other pools to the same server.
    reachability: Reachability,
    redacted_url: String,
    reconnector: Arc<Reconnector>,
    /// The connection calls use without a checkout, until it is due for
    /// renewal or retired.
    current: ArcSwapOption<HeldConnection>,
    /// Owns the task that reconnects while the circuit is open: only the
    /// pool that [`Reconnect::Owns`] it.
    _reconnecting: Option<ReconnectGuard>,
}

/// Whether a pool runs the task that reconnects while the circuit is open.
/// One per [`Reachability`]: every pool shares the circuit, so one task suffices,
/// and Redis sees one reconnect at a time per replica of the service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reconnect {
    Owns,
    Shares,
}

/// A connection cloned out of the pool, shared by the calls made on it
/// until `until`.
struct HeldConnection {
    pooled: Arc<Pooled>,
    until: Instant,
}

/// A connection cloned out of the pool, with what retires it.
pub(super) struct Pooled {
    pub(super) conn: MultiplexedConnection,
    /// How the server behind it runs our code, found at its first call
    /// and shared by its clones.
    pub(super) engine: Arc<Learnt>,
    epoch: u64,
    /// Shared by the pooled connection and the clones handed out, so a
    /// caller can retire the one it used.
    retired: Arc<AtomicBool>,
}

/// Makes a fresh connection and PINGs it; on success the connection joins
/// the pool and the circuit closes.
struct Reconnector {
    dialer: Dialer,
    config: AsyncConnectionConfig,
    pool: bb8::Pool<Manager>,
    reachability: Reachability,
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
///
/// Its last connect error is cleared by a successful connect, so that a
/// checkout timeout never blames an error from an earlier outage; any
/// failure to connect opens the circuit.
struct Manager {
    dialer: Dialer,
    config: AsyncConnectionConfig,
    reachability: Reachability,
}

/// Records connection errors that bb8 swallows while it retries.
#[derive(Debug, Clone)]
struct LastErrorSink(Arc<Mutex<Option<String>>>);

// === impl ServerConnections ===

impl ServerConnections {
    /// Builds the pool without connecting (an unreachable server is not an
    /// error here), sharing `reachability` with the other pools to the same server;
    /// the pool that [`Reconnect::Owns`] reconnecting starts the task that
    /// reconnects while the circuit is open; it stops when the pool is
    /// dropped.
    pub(super) fn start(
        dialer: Dialer,
        max_size: u32,
        timeout_ms: u64,
        reachability: Reachability,
        reconnect: Reconnect,
    ) -> ServerConnections {
        let timeout = Duration::from_millis(timeout_ms);
        // No response timeout of redis-rs's own: every command sent on a
        // pooled connection is already bounded by its caller's deadline
        // (`timeout_at`), and a second timer per call is work for nothing.
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(None);
        let manager = Manager {
            dialer: dialer.clone(),
            config: config.clone(),
            reachability: reachability.clone(),
        };
        let sink = LastErrorSink(reachability.last_connect_error.clone());
        let pool = build_pool(manager, max_size, timeout, sink);
        let redacted_url = reachability.circuit.redacted_url.clone();
        let reconnector = Arc::new(Reconnector {
            dialer,
            config,
            pool: pool.clone(),
            reachability: reachability.clone(),
            timeout,
            timeout_ms,
        });
        let reconnecting = (reconnect == Reconnect::Owns).then(|| ReconnectGuard {
            task: tokio::spawn(reconnector.clone().run()),
        });
        ServerConnections {
            pool,
            timeout_ms,
            reachability,
            redacted_url,
            reconnector,
            current: ArcSwapOption::empty(),
            _reconnecting: reconnecting,
        }
    }

    /// Whether calls fail at once because Redis could not be connected to
    /// (see [`Circuit`]).
    pub(super) fn circuit_open(&self) -> bool {
        self.reachability.circuit.is_open()
    }

    /// bb8's view of the pool, for `Debug`.
    pub(super) fn state(&self) -> bb8::State {
        self.pool.state()
    }

    /// The connection for a call: the one the last checkout cloned out of
    /// the pool, while it is neither retired nor older than [`HOLD`]; else a
    /// fresh checkout, which becomes the one later calls use. A multiplexed
    /// connection serves any number of concurrent calls, so a checkout per
    /// call (a lock to take it, one to put it back, the timer bb8 arms
    /// around it) would only cost CPU; the pool still makes, validates and
    /// retires every connection, and the circuit is checked on every call.
    pub(super) async fn connection(&self) -> Result<Arc<Pooled>, Error> {
        if self.reachability.circuit.is_open() {
            return Err(self.reachability.circuit.error());
        }
        if let Some(current) = &*self.current.load()
            && !is_retired(&current.pooled, &self.reachability.epoch)
            && Instant::now() < current.until
        {
            return Ok(current.pooled.clone());
        }
        let pooled = Arc::new(self.checkout().await?);
        self.current.store(Some(Arc::new(HeldConnection {
            pooled: pooled.clone(),
            until: Instant::now() + HOLD,
        })));
        Ok(pooled)
    }

    /// A connection cloned out of the pool; the pool slot is released
    /// before the caller uses it (a multiplexed connection serves many
    /// concurrent calls, so holding the slot would only serialise them).
    async fn checkout(&self) -> Result<Pooled, Error> {
        let circuit = &self.reachability.circuit;
        if circuit.is_open() {
            return Err(circuit.error());
        }
        // Each broken connection met is dropped by bb8 as it is put back,
        // so after pool_size of them a fresh one is made.
        for _ in 0..=self.pool.state().connections.max(1) {
            // A checkout waiting for a connection gives up as soon as a
            // connect fails, rather than at the timeout.
            let checkout = tokio::select! {
                biased;
                res = self.pool.get() => res,
                () = circuit.wait_open() => return Err(circuit.error()),
            };
            let pooled = checkout.map_err(|err| self.checkout_error(err))?;
            if is_retired(&pooled, &self.reachability.epoch) {
                // Dropping it makes bb8 ask `has_broken`, which says yes.
                drop(pooled);
                continue;
            }
            return Ok(Pooled {
                conn: pooled.conn.clone(),
                engine: pooled.engine.clone(),
                epoch: pooled.epoch,
                retired: pooled.retired.clone(),
            });
        }
        Err(Error::Unavailable(format!(
            "no healthy connection to {}",
            self.redacted_url
        )))
    }

    fn checkout_error(&self, err: bb8::RunError<RedisError>) -> Error {
        match err {
            bb8::RunError::User(err) => classify(&err, self.timeout_ms),
            bb8::RunError::TimedOut => {
                let why = self
                    .reachability
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
        }
    }

    /// Marks `conn` and every older connection (of every pool to this
    /// server) broken when `err` means the connection is dead, and
    /// classifies the error. A node that refuses writes (READONLY: a
    /// replica, or a master demoted by a failover) is treated like one that
    /// refuses connections: the circuit opens (retiring every connection),
    /// calls fail at once, and the reconnector looks for a master with its
    /// backoff (through Sentinel, the new one), instead of each call
    /// opening a connection to the replica and sending it the library.
    pub(super) fn fail(&self, conn: &Pooled, err: &RedisError) -> Error {
        // A late READONLY on a connection already retired says nothing
        // about the connections made since (to a master again, perhaps).
        if is_demoted(err) && !is_retired(conn, &self.reachability.epoch) {
            self.reachability.open(format!(
                "{} refuses writes (READONLY: a replica, or a master demoted by a failover): {err}",
                self.redacted_url
            ));
        } else if is_broken(err) {
            self.reachability.retire(conn.epoch);
        }
        classify(err, self.timeout_ms)
    }

    pub(super) fn checkout_timeout(&self) -> Error {
        Error::Unavailable(format!(
            "no connection to {} within {} ms",
            self.redacted_url, self.timeout_ms
        ))
    }

    /// Makes the connection calls will use and has it find how the server
    /// runs our code (loading the function library), by `deadline`: what
    /// the first call would otherwise wait for. Does nothing while the
    /// circuit is open (the reconnector owns retrying).
    pub(super) async fn warm_up(&self, deadline: Instant) -> Result<(), Error> {
        let warm = async {
            let conn = self.connection().await?;
            match conn.engine().await {
                Ok(_) => Ok(()),
                Err(err) => Err(self.fail(&conn, &err)),
            }
        };
        match timeout_at(deadline, warm).await {
            Ok(res) => res,
            Err(_) => Err(self.checkout_timeout()),
        }
    }

    /// PING by `deadline`. A connection found dead is replaced and the
    /// PING retried once (PING is idempotent), so the first probe after
    /// Redis comes back already succeeds. While the circuit is open, a
    /// fresh connection is tried at once (not at the reconnector's next
    /// turn), so health reports recovery as soon as it happens.
    pub(super) async fn probe(&self, deadline: Instant) -> Result<(), Error> {
        if self.reachability.circuit.is_open() {
            return self.reconnector.attempt().await;
        }
        match self.ping(deadline).await {
            Ok(()) => Ok(()),
            Err((_, true)) => self.ping(deadline).await.map_err(|(err, _)| err),
            Err((err, false)) => Err(err),
        }
    }

    /// One PING; the flag says whether the connection was found dead.
    async fn ping(&self, deadline: Instant) -> Result<(), (Error, bool)> {
        let mut conn = match timeout_at(deadline, self.checkout()).await {
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
}

/// The bb8 pool over `manager`: no PING per checkout, no retries of its own,
/// and no connection made before the first call.
fn build_pool(
    manager: Manager,
    max_size: u32,
    timeout: Duration,
    sink: LastErrorSink,
) -> bb8::Pool<Manager> {
    bb8::Pool::builder()
        .max_size(max_size)
        // A PING per checkout doubles the round trips; broken
        // connections are found by `Manager::has_broken` instead.
        .test_on_check_out(false)
        .connection_timeout(timeout)
        // A failed connect opens the circuit, and the reconnector owns
        // retrying: bb8's own retries would only add load on a Redis
        // that is down.
        .retry_connection(false)
        .error_sink(Box::new(sink))
        // Never block start-up on an unreachable server.
        .build_unchecked(manager)
}

// === impl Pooled ===

impl Pooled {
    /// The flag that retires this connection alone, for a call that never
    /// got its answer on it (see `gate::Written`).
    pub(super) fn lost_flag(&self) -> Arc<AtomicBool> {
        self.retired.clone()
    }

    /// How the server behind this connection runs our code: found once, by
    /// loading the function library (see `engine`), unless a call found
    /// since that only scripts work here. An error is returned and asked
    /// again at the next call.
    pub(super) async fn engine(&self) -> Result<Engine, RedisError> {
        let mut conn = self.conn.clone();
        self.engine
            .engine(async move {
                let res = conn.req_packed_command(&engine::library_load()).await;
                engine::from_load_on_server(res)
            })
            .await
    }
}

// === impl Manager ===

impl bb8::ManageConnection for Manager {
    type Connection = Pooled;
    type Error = RedisError;

    async fn connect(&self) -> Result<Pooled, RedisError> {
        // Read before connecting: a failure reported meanwhile marks this
        // connection too, which at worst costs one reconnect.
        let epoch = self.reachability.epoch.load(Ordering::SeqCst);
        let conn = self
            .dialer
            .connect(&self.config)
            .await
            .inspect_err(|err| self.reachability.open(err.to_string()))?;
        *self
            .reachability
            .last_connect_error
            .lock()
            .unwrap_or_else(|it| it.into_inner()) = None;
        Ok(Pooled {
            conn,
            engine: Arc::default(),
            epoch,
            retired: Arc::default(),
        })
    }

    async fn is_valid(&self, conn: &mut Pooled) -> Result<(), RedisError> {
        redis::cmd("PING").query_async::<()>(&mut conn.conn).await
    }

    fn has_broken(&self, conn: &mut Pooled) -> bool {
        is_retired(conn, &self.reachability.epoch)
    }
}

// === impl Reconnector ===

impl Reconnector {
    /// Waits for the circuit to open, then tries to reconnect with backoff
    /// until it closes; forever, until its guard aborts it.
    ///
    /// A circuit that opens again within [`FLAPPING`] of closing (a node
    /// that answers a connect but fails every call) keeps its backoff
    /// instead of starting again at [`RECONNECT_MIN_DELAY`].
    async fn run(self: Arc<Self>) {
        let circuit = &self.reachability.circuit;
        let mut delay = RECONNECT_MIN_DELAY;
        let mut closed_at: Option<Instant> = None;
        loop {
            circuit.wait_open().await;
            if closed_at.is_none_or(|at| at.elapsed() >= FLAPPING) {
                delay = RECONNECT_MIN_DELAY;
            }
            while circuit.is_open() {
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RECONNECT_MAX_DELAY);
                // A health probe may have closed it meanwhile.
                if !circuit.is_open() || self.attempt().await.is_ok() {
                    break;
                }
            }
            closed_at = Some(Instant::now());
        }
    }

    /// One fresh connection and a PING within the timeout. On success the
    /// connection joins the pool and the circuit closes; on failure the
    /// circuit opens (or stays open with the new reason), unless another
    /// attempt (the reconnector's, a health probe's) closed it meanwhile:
    /// a connect that began before Redis was back, and timed out once it
    /// was, would otherwise open it again just after health reported
    /// recovery, failing every call until the next attempt.
    async fn attempt(&self) -> Result<(), Error> {
        let was_open = self.reachability.circuit.is_open();
        let res = tokio::time::timeout(self.dialer.bound(self.timeout), async {
            let mut conn = self.dialer.connect(&self.config).await?;
            let pong: String = redis::cmd("PING").query_async(&mut conn).await?;
            Ok::<_, RedisError>((conn, pong))
        })
        .await;
        let (err, reason) = match res {
            Ok(Ok((conn, pong))) if pong == "PONG" => {
                self.admit(conn);
                return Ok(());
            }
            Ok(Ok((_, other))) => {
                let reason = format!("unexpected ping reply {other:?}");
                (Error::Protocol(reason.clone()), reason)
            }
            Ok(Err(err)) => (classify(&err, self.timeout_ms), err.to_string()),
            Err(_) => {
                let bound = self.dialer.bound(self.timeout).as_millis();
                let reason = format!("no answer within {bound} ms");
                (Error::Unavailable(reason.clone()), reason)
            }
        };
        if was_open && !self.reachability.circuit.is_open() {
            return Err(err);
        }
        self.reachability.open(reason);
        Err(err)
    }

    /// Puts a connection that answered into the pool, in a new epoch, and
    /// closes the circuit.
    fn admit(&self, conn: MultiplexedConnection) {
        // Connections from before the outage are not trusted after it: a
        // partition leaves them half-open, and nothing else would retire them.
        let epoch = self.reachability.epoch.fetch_add(1, Ordering::SeqCst) + 1;
        // A full pool keeps its slots; the connection is then dropped and
        // bb8 makes new ones as the old ones are retired.
        let _ = self.pool.add(Pooled {
            conn,
            engine: Arc::default(),
            epoch,
            retired: Arc::default(),
        });
        self.reachability.circuit.close();
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

/// Whether `conn` was retired alone or with its epoch.
fn is_retired(conn: &Pooled, epoch: &AtomicU64) -> bool {
    conn.retired.load(Ordering::SeqCst) || conn.epoch < epoch.load(Ordering::SeqCst)
}
