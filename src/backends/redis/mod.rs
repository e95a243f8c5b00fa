//! Redis backend: one atomic Lua call per request (or per batch of
//! requests), FCALL of a function library on Redis 7, EVALSHA before,
//! over a bb8 pool.
//!
//! `lua/decide.lua` is `algorithms::decide` ported line for line; a request's
//! limits are checked and consumed in one call, so replicas sharing a Redis
//! agree exactly. `pool` holds the connections (multiplexed, broken ones
//! retired, a circuit that fails calls at once while Redis cannot be
//! reached); [`script`] the Lua's arguments and reply and the library;
//! [`engine`] FCALL or EVALSHA and the reload after a flush; `batch` how
//! concurrent requests share one call; `sentinel` how the master is found
//! behind Sentinel; [`cluster`] the Redis Cluster backend (a request grouped
//! by hash slot); this module the single-server backend and how Redis
//! failures are classified, for both.

mod batch;
pub mod cluster;
pub mod engine;
mod gate;
mod pool;
pub mod script;
mod sentinel;

use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use redis::{
    ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo, RedisError, ServerErrorKind,
    TlsCertificates,
};
use tokio::time::{Instant, timeout_at};

use self::batch::Batcher;
use self::engine::{Engine, Entry};
use self::gate::Gate;
use self::pool::{Link, Pool, Reconnect, Target};
pub use self::script::DECIDE_LUA;
use self::script::{HeaderArgs, LimitArgs};
use self::sentinel::Sentinel;
pub use self::sentinel::SentinelSettings;
use super::keys::{HashTag, KeyFormat};
use super::{Backend, CallContext, Error, KeyedCheck, Stage};
use crate::algorithms::Verdict;
use crate::clock::{Clock, MonotonicClock};
use crate::pem;

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

/// TLS to Redis beyond what a `rediss://` URL says: whom to trust, the
/// client certificate, verification. Any of it needs `rediss://`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// Trust the CA certificates in this PEM file instead of the built-in
    /// web roots.
    pub ca: Option<PathBuf>,
    /// Client certificate (PEM chain) for servers that ask for one
    /// (`tls-auth-clients yes`); comes with `client_key`.
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    /// Accept any server certificate: no verification at all.
    pub insecure: bool,
    /// Verify the server's certificate chain but not the name in it.
    pub skip_hostname_verification: bool,
}

impl RedisTls {
    /// Whether anything is asked of TLS.
    pub fn is_set(&self) -> bool {
        *self != RedisTls::default()
    }

    /// The CA and client certificate the redis client is built with, read
    /// (and checked) from their files now; `None` when neither is given.
    fn certificates(&self) -> Result<Option<TlsCertificates>, Error> {
        let failed = |err: pem::Error| Error::Protocol(format!("redis tls: {err}"));
        let client_tls = match (&self.client_cert, &self.client_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => {
                let client_cert = pem::read(cert).map_err(failed)?;
                let chain = pem::certificates_in(cert, &client_cert).map_err(failed)?;
                let client_key = pem::read(key).map_err(failed)?;
                let key_der = pem::private_key_in(key, &client_key).map_err(failed)?;
                usable_client_certificate(chain, key_der).map_err(|err| {
                    Error::Protocol(format!(
                        "redis tls: {} and {} do not make a usable client certificate: {err}",
                        cert.display(),
                        key.display()
                    ))
                })?;
                Some(redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(Error::Protocol(
                    "a redis client certificate and its key come together".into(),
                ));
            }
        };
        let root_cert = match &self.ca {
            Some(path) => {
                let text = pem::read(path).map_err(failed)?;
                pem::certificates_in(path, &text).map_err(failed)?;
                Some(text)
            }
            None => None,
        };
        if client_tls.is_none() && root_cert.is_none() {
            return Ok(None);
        }
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert,
        }))
    }

    /// `info` with these settings; refused unless it is TLS (`rediss://`)
    /// when any is given.
    fn apply(&self, info: ConnectionInfo, redacted_url: &str) -> Result<ConnectionInfo, Error> {
        if !self.is_set() {
            return Ok(info);
        }
        if !matches!(info.addr(), ConnectionAddr::TcpTls { .. }) {
            return Err(Error::Protocol(format!(
                "redis tls settings need a rediss:// url, not {redacted_url}"
            )));
        }
        let info = match self.certificates()? {
            Some(certs) => redis::Client::build_with_tls(info, certs)
                .map_err(|err| Error::Protocol(format!("redis tls: {err}")))?
                .get_connection_info()
                .clone(),
            None => info,
        };
        let mut addr = info.addr().clone();
        if let ConnectionAddr::TcpTls { insecure, .. } = &mut addr {
            *insecure |= self.insecure;
        }
        if self.skip_hostname_verification {
            addr.set_danger_accept_invalid_hostnames(true);
        }
        Ok(info.set_addr(addr))
    }
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

/// Counters in Redis, shared by every replica pointed at the same server.
pub struct RedisBackend {
    /// Calls made off the serving threads (the shared runtime's), and the
    /// health probe.
    core: Arc<Core>,
    /// One per serving thread (`--grpc-threads`), made on that thread as it
    /// starts (`warm_up`) or at its first call: its pool's connections, their tasks and the batches
    /// it sends all run on the thread's own runtime, so a request's call
    /// and its answer never cross threads. Each has its own pool of
    /// `pool_size` connections and its own gate; the circuit and the
    /// generation of connections are shared by all (see `pool::Link`).
    thread_cores: Box<[OnceLock<Arc<Core>>]>,
    /// What a thread's core is made from.
    recipe: CoreRecipe,
    keys: KeyFormat,
    clock: ClockSource,
    expiry_grace_ms: u64,
}

/// What sends calls, shared with the tasks that send batches.
struct Core {
    pool: Pool,
    /// Bounds the calls sent and waiting toward Redis (see `gate`).
    gate: Gate,
    batcher: Option<Batcher>,
    timeout: Duration,
    timeout_ms: u64,
    redacted_url: String,
    /// The runtime its pool's connections run on (a serving thread's, or
    /// the shared one), where a probe readies it ([`RedisBackend::probe`]).
    runtime: tokio::runtime::Handle,
}

/// How long a probe gives every pool to be ready for calls (a connection
/// made and the library loaded): after a restart of Redis, the first call
/// on each pool would otherwise connect and load the library within its
/// own timeout, and fail when they take longer.
const READY_WITHIN: Duration = Duration::from_secs(1);

/// What a [`Core`] is made from: the settings of its pool, gate and batcher,
/// and what every core's pool shares (the circuit, the generation of
/// connections).
struct CoreRecipe {
    target: Target,
    pool_size: u32,
    timeout_ms: u64,
    batch: Option<BatchSettings>,
    redacted_url: String,
    link: Link,
}

impl CoreRecipe {
    /// A core whose pool starts on the calling runtime (the tasks that make
    /// and drive its connections, and its reconnecting task if it `Owns`
    /// reconnecting: the shared core's).
    fn make(&self, reconnect: Reconnect) -> Core {
        let pool = Pool::start(
            self.target.clone(),
            self.pool_size,
            self.timeout_ms,
            self.link.clone(),
            reconnect,
        );
        let in_flight = usize::try_from(self.pool_size).unwrap_or(1);
        let gate = Gate::for_server();
        let max_waiting = gate.max_waiting();
        Core {
            pool,
            gate,
            batcher: self
                .batch
                .map(|it| Batcher::new(it, in_flight, it.max_keys.saturating_mul(8), max_waiting)),
            timeout: Duration::from_millis(self.timeout_ms),
            timeout_ms: self.timeout_ms,
            redacted_url: self.redacted_url.clone(),
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

/// One request, encoded: its keys, header and limits.
struct Encoded {
    keys: Vec<String>,
    header: HeaderArgs,
    limits: Vec<LimitArgs>,
}

/// Whether `chain` and `key` make a client certificate rustls can present
/// (the key parses and is of a supported kind), so that a bad pair is a
/// start-up error rather than a connection that can never be made.
fn usable_client_certificate(
    chain: Vec<rustls::pki_types::CertificateDer<'static>>,
    key: rustls::pki_types::PrivateKeyDer<'static>,
) -> Result<(), rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(drop)
}

// === impl RedisSettings ===

impl RedisSettings {
    /// Refuses settings no pool can work with.
    fn validate(&self) -> Result<(), Error> {
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
    fn target(&self) -> Result<(Target, String), Error> {
        // rustls needs a process-wide crypto provider for `rediss://`; without
        // one it panics inside the connection task. Already installed (by us
        // or the embedding program) is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
        if let Some(sentinel) = &self.sentinel {
            let timeout = Duration::from_millis(self.timeout_ms);
            let sentinel = Sentinel::new(sentinel, &self.url, &self.tls, timeout)?;
            let name = sentinel.describe();
            return Ok((Target::Sentinel(Arc::new(sentinel)), name));
        }
        let info = self.url.as_str().into_connection_info().map_err(|err| {
            Error::Protocol(format!("invalid redis url {}: {err}", redact(&self.url)))
        })?;
        let info = self.tls.apply(info, &redact(&self.url))?;
        let client = redis::Client::open(info).map_err(|err| {
            Error::Protocol(format!("invalid redis url {}: {err}", redact(&self.url)))
        })?;
        Ok((Target::Direct(Box::new(client)), redact(&self.url)))
    }

    /// Connections beside the backend's to the same server; nothing is
    /// connected yet.
    pub fn connector(&self) -> Result<ServerConnector, Error> {
        self.validate()?;
        let (target, _) = self.target()?;
        let timeout = Duration::from_millis(self.timeout_ms);
        Ok(ServerConnector {
            target,
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
    target: Target,
    config: redis::AsyncConnectionConfig,
    timeout: Duration,
}

impl ServerConnector {
    /// A fresh multiplexed connection to the node that takes writes now
    /// (a replica is refused with READONLY), within the settings' timeout
    /// for each step (each sentinel asked, then the node). Its calls have
    /// no timeout of their own: the caller bounds them.
    pub async fn connect(&self) -> Result<redis::aio::MultiplexedConnection, RedisError> {
        let bound = self.target.bound(self.timeout);
        match tokio::time::timeout(bound, self.target.connect(&self.config)).await {
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

// === impl RedisBackend ===

impl RedisBackend {
    /// Builds the pool. Fails when the URL or settings are invalid, and
    /// with Sentinel when no sentinel answers or none knows the master; an
    /// unreachable server is not an error here (probe and health report
    /// it, and connections are made when it answers). The library (or the
    /// script) is loaded on first use of each connection. Starts the task
    /// that reconnects while the circuit is open; it stops when the backend
    /// is dropped.
    pub async fn connect(settings: RedisSettings) -> Result<RedisBackend, Error> {
        settings.validate()?;
        let (target, redacted_url) = settings.target()?;
        if let Target::Sentinel(sentinel) = &target {
            sentinel.check().await?;
        }
        let recipe = CoreRecipe {
            target,
            pool_size: settings.pool_size,
            timeout_ms: settings.timeout_ms,
            batch: settings.batch,
            link: Link::new(redacted_url.clone()),
            redacted_url,
        };
        Ok(RedisBackend {
            core: Arc::new(recipe.make(Reconnect::Owns)),
            thread_cores: Box::default(),
            recipe,
            keys: KeyFormat::new(settings.key_prefix, HashTag::None),
            clock: settings.clock,
            expiry_grace_ms: settings.expiry_grace_ms,
        })
    }

    /// Writes the service's hash tag into every key (harmless on a single
    /// server; keeps keys alike when moving to a cluster).
    pub fn with_hash_tag(mut self, hash_tag: HashTag) -> RedisBackend {
        self.keys.hash_tag = hash_tag;
        self
    }

    /// Gives each of `threads` serving threads (`--grpc-threads`) its own
    /// connections, made on the thread as it starts or at its first call (see
    /// [`crate::serving_thread`]); 0, the default: every call uses the
    /// shared runtime's.
    pub fn with_serving_threads(mut self, threads: usize) -> RedisBackend {
        self.thread_cores = (0..threads).map(|_| OnceLock::new()).collect();
        self
    }

    /// The core the calling thread sends through: its own on a serving
    /// thread, else the shared one.
    fn core(&self) -> &Arc<Core> {
        let own = crate::serving_thread::current().and_then(|it| self.thread_cores.get(it));
        match own {
            Some(cell) => cell.get_or_init(|| Arc::new(self.recipe.make(Reconnect::Shares))),
            None => &self.core,
        }
    }

    /// Readies every pool made so far for calls (see [`Backend::probe`]):
    /// the first error, if any.
    async fn ready_every_pool(&self) -> Result<(), Error> {
        let deadline = Instant::now() + READY_WITHIN.max(self.core.timeout);
        let cores =
            std::iter::once(&self.core).chain(self.thread_cores.iter().filter_map(OnceLock::get));
        let readying: Vec<_> = cores
            .map(|core| {
                let core = core.clone();
                core.runtime
                    .clone()
                    .spawn(async move { core.pool.warm_up(deadline).await })
            })
            .collect();
        for ready in readying {
            // A task that did not finish: its runtime is shutting down, and
            // nothing is served there any more.
            if let Ok(res) = ready.await {
                res?;
            }
        }
        Ok(())
    }

    /// Whether calls fail at once because Redis could not be connected to.
    pub fn circuit_open(&self) -> bool {
        self.core.pool.circuit_open()
    }

    /// The SHA1 the decision script is invoked by where the server has no
    /// functions (EVALSHA).
    pub fn script_hash(&self) -> String {
        redis::Script::new(DECIDE_LUA).get_hash().to_owned()
    }

    /// The function a decision calls where the server has functions (FCALL).
    pub fn function_name(&self) -> &'static str {
        &script::library().decide
    }

    /// The Redis key of a counter, as the script reads and writes it.
    pub fn key_of(&self, key: &super::CounterKey) -> String {
        self.keys.encode(key)
    }

    fn header(&self) -> HeaderArgs {
        HeaderArgs::now(&self.clock, self.expiry_grace_ms, false)
    }

    fn encode(&self, checks: &[KeyedCheck]) -> Result<Encoded, Error> {
        Ok(Encoded {
            keys: script::request_keys(&self.keys, checks)?,
            header: self.header(),
            limits: checks.iter().map(|it| LimitArgs::of(&it.check)).collect(),
        })
    }
}

/// The last moment a call due by `deadline` (of a `timeout`) may be
/// written, and what it fails with once that has passed: the backend's own
/// bound ([`gate::send_by`], then [`Error::Timeout`]) or, when earlier, the
/// caller's `send_by` (then [`Error::Deadline`]: its caller is answered
/// through the failure mode, and nothing is sent).
fn sending_bound(
    deadline: Instant,
    timeout: Duration,
    caller_send_by: Option<Instant>,
) -> (Instant, Error) {
    let own = gate::send_by(deadline, timeout);
    match caller_send_by {
        Some(caller) if caller < own => (caller, Error::Deadline),
        _ => (own, Error::Timeout(timeout_ms(timeout))),
    }
}

/// Awaits, in a task of its own, the reply to `written`, a call whose
/// timeout has passed, and hands its integers to `late` if it comes within
/// the call's remaining place in the gate ([`gate::Written::outlive`]).
fn await_late<T>(
    written: gate::Written<Result<redis::Value, T>>,
    late: impl FnOnce(Vec<i64>) + Send + 'static,
) where
    T: Send + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        if let Some(Ok(value)) = written.outlive().await
            && let Ok(reply) = script::reply_integers(value)
        {
            late(reply);
        }
    });
}

/// A timeout in whole milliseconds, as errors report it.
fn timeout_ms(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

// === impl Core ===

impl Core {
    /// One call of `entry` by `deadline` (the end of the caller's timeout;
    /// a batch's: its latest request's), the command made by `compose` at
    /// the moment it would be written (it may refuse: nothing is written,
    /// and its error returned); the reply's integers. Loads the code and sends
    /// again only when the server says it lacks it (the call did not run);
    /// NEVER after a timeout or any other error: the call may have run,
    /// and a retry would count its requests twice.
    ///
    /// Admitted by the gate first: refused at once when too many calls
    /// already wait toward Redis. Its place is held until Redis answers
    /// the call (or its connection fails), not given back when its caller
    /// stops waiting ([`gate::Written`]). Never sent once less than a quarter of
    /// its timeout is left ([`gate::send_by`]), so never after its
    /// deadline: checked when the wait for the gate ends and again after
    /// the checkout and the engine, at the moment the call would be
    /// written.
    ///
    /// `caller_send_by`, from the callers' deadlines, can only bring the
    /// moment of sending earlier: a call refused by it fails with
    /// [`Error::Deadline`]. The reply to a call written is awaited until
    /// `deadline`, whoever still waits for it, so that what it consumed is
    /// counted. `report` hears the stages before the call is written;
    /// `compose` reports [`Stage::Backend`] for what it writes.
    ///
    /// A written call still unanswered at `deadline` fails at once with
    /// [`Error::Timeout`]; with an `on_late`, its reply is then awaited in a
    /// task of its own, within the place it holds in the gate (at most
    /// [`gate::UNANSWERED_AFTER`] more), and handed to `on_late` if it comes.
    async fn call<L>(
        &self,
        deadline: Instant,
        caller_send_by: Option<Instant>,
        report: impl Fn(Stage),
        entry: Entry,
        compose: impl FnOnce(Engine) -> Result<redis::Cmd, Error>,
        on_late: Option<L>,
    ) -> Result<Vec<i64>, Error>
    where
        L: FnOnce(Vec<i64>) + Send + 'static,
    {
        let (send_by, late) = sending_bound(deadline, self.timeout, caller_send_by);
        report(Stage::Queue);
        let permit = match self.gate.admit(send_by, self.timeout_ms).await {
            Err(Error::Timeout(_)) => return Err(late),
            admitted => admitted?,
        };
        report(Stage::Connect);
        // One timer for the checkout and the engine: both are usually ready
        // at once, and a timer is only registered when they are not.
        let mut checked_out = false;
        let ready = timeout_at(deadline, async {
            let conn = self.pool.connection().await?;
            checked_out = true;
            match conn.engine().await {
                Ok(engine) => Ok((conn, engine)),
                Err(err) => Err(self.pool.fail(&conn, &err)),
            }
        })
        .await;
        let (conn, engine): (_, Engine) = match ready {
            Ok(ready) => ready?,
            Err(_) if checked_out => return Err(Error::Timeout(self.timeout_ms)),
            Err(_) => return Err(self.pool.checkout_timeout()),
        };
        if Instant::now() >= send_by {
            // Its caller is (or is about to be) answered under the failure
            // mode: sent, it would only be work for Redis that nobody
            // waits for, delaying the calls behind it.
            return Err(late);
        }
        let cmd = compose(engine)?;
        let mut multiplexed = conn.conn.clone();
        let learnt = conn.engine.clone();
        let reply = async move {
            engine::run_adapting(&mut multiplexed, &learnt, engine, entry, &cmd).await
        };
        let mut value = gate::Written::new(permit, reply, conn.lost_flag(), gate::UNANSWERED_AFTER);
        let value = match timeout_at(deadline, &mut value).await {
            Err(_) => {
                if let Some(on_late) = on_late {
                    await_late(value, on_late);
                }
                return Err(Error::Timeout(self.timeout_ms));
            }
            Ok(Err(err)) => return Err(self.pool.fail(&conn, &err)),
            Ok(Ok(value)) => value,
        };
        script::reply_integers(value)
    }

    /// The names of the libraries of other versions of the service
    /// (`throttlegate_<digest>`, with another digest than this version's)
    /// on the server, within the timeout.
    async fn other_libraries(&self) -> Result<Vec<String>, Error> {
        let deadline = Instant::now() + self.timeout;
        let conn = timeout_at(deadline, self.pool.connection())
            .await
            .map_err(|_| self.pool.checkout_timeout())??;
        let mut multiplexed = conn.conn.clone();
        let mut list = redis::cmd("FUNCTION");
        list.arg("LIST").arg("LIBRARYNAME").arg("throttlegate_*");
        let listed: redis::Value =
            match timeout_at(deadline, list.query_async(&mut multiplexed)).await {
                Err(_) => return Err(Error::Timeout(self.timeout_ms)),
                Ok(res) => res.map_err(|err| self.pool.fail(&conn, &err))?,
            };
        let ours = &script::library().name;
        Ok(engine::library_names(&listed)
            .into_iter()
            .filter(|name| name != ours && engine::is_library_name(name))
            .collect())
    }

    /// One request in a call of its own.
    async fn decide_one(&self, request: &Encoded, call: &CallContext) -> Result<Verdict, Error> {
        self.decide_one_by(Instant::now() + self.timeout, request, call)
            .await
    }

    /// One request in a call of its own, sent only before `deadline` (and
    /// its caller's `send_by`).
    async fn decide_one_by(
        &self,
        deadline: Instant,
        request: &Encoded,
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        let send_by = call.send_by.map(Instant::from_std);
        let report = |stage| call.progress.set(stage);
        let n_keys = request.keys.len();
        let late = call.late.clone().map(|late| {
            move |reply: Vec<i64>| {
                if let Ok(verdict) = script::parse_reply(&reply, n_keys) {
                    late.deliver(verdict);
                }
            }
        });
        let compose = |engine: Engine| {
            if !call.progress.enter_backend() {
                // Its caller has gone: nobody would read the answer.
                return Err(Error::Deadline);
            }
            let mut cmd = engine.command(Entry::Decide, n_keys);
            cmd.arg(&request.keys);
            script::write_request(&mut cmd, &request.header, &request.limits);
            Ok(cmd)
        };
        let reply = self
            .call(deadline, send_by, report, Entry::Decide, compose, late)
            .await?;
        script::parse_reply(&reply, request.keys.len())
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.core.redacted_url)
            .field("keys", &self.keys)
            .field("clock", &self.clock)
            .field("timeout_ms", &self.core.timeout_ms)
            .field("pool", &self.core.pool.state())
            .field("max_in_flight", &self.core.gate.max_in_flight())
            .field("max_waiting", &self.core.gate.max_waiting())
            .field("batch", &self.core.batcher.as_ref().map(Batcher::settings))
            .field("serving_threads", &self.thread_cores.len())
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl Backend for RedisBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        self.decide_within(checks, &CallContext::unbounded()).await
    }

    async fn decide_within(
        &self,
        checks: &[KeyedCheck],
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        if checks.is_empty() {
            return Ok(Verdict {
                allowed: true,
                outcomes: Vec::new(),
            });
        }
        let request = self.encode(checks)?;
        let core = self.core();
        match &core.batcher {
            None => core.decide_one(&request, call).await,
            Some(_) => batch::decide(core, request, call).await,
        }
    }

    /// The calling thread's core (made now on a serving thread), its
    /// connection and the server's code, within the timeout.
    async fn warm_up(&self) {
        let core = self.core();
        let deadline = Instant::now() + core.timeout;
        if let Err(err) = core.pool.warm_up(deadline).await {
            tracing::debug!("redis: could not connect ahead of the first call: {err}");
        }
    }

    /// The function libraries of other versions of the service on the
    /// server (`FUNCTION LIST`), asked now: each version loads its own
    /// (named by a digest of its code), and nothing removes an old one.
    async fn notes(&self) -> Vec<String> {
        let others = match self.core.other_libraries().await {
            Ok(others) if !others.is_empty() => others,
            // None, no functions on this server, or it cannot be asked now.
            _ => return Vec::new(),
        };
        vec![format!(
            "redis: function libraries of other throttlegate versions: {} (this version's: {}); \
             once no replica runs those versions, remove each with FUNCTION DELETE <name>",
            others.join(", "),
            script::library().name
        )]
    }

    /// PING within the timeout; while the circuit is open, a fresh
    /// connection at once, so health reports recovery as soon as it happens.
    /// Then every pool (the shared one and each serving thread's) is made
    /// ready within [`READY_WITHIN`]: a connection and the library loaded
    /// on it, each on its own runtime. So once health says SERVING again
    /// after Redis restarted, no thread's first call has to connect and
    /// load the library within its timeout (at a timeout of 40 ms, one
    /// restart in ten cost a request its decision without this).
    async fn probe(&self) -> Result<(), Error> {
        self.core
            .pool
            .probe(Instant::now() + self.core.timeout)
            .await?;
        self.ready_every_pool().await
    }

    fn name(&self) -> &'static str {
        "redis"
    }

    fn local_clock(&self) -> Option<Arc<dyn Clock>> {
        Some(self.clock.local_clock())
    }
}

// === error classification ===

/// Whether the connection that produced `err` is dead and must be replaced.
/// A timeout is not: the multiplexed connection still serves other calls
/// (redis-rs reports it as an I/O error, hence the explicit exclusion).
fn is_broken(err: &RedisError) -> bool {
    !err.is_timeout()
        && (err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error())
}

/// Whether `err` says the node is a replica now (a master demoted by a
/// failover keeps its connections): connections to it must be replaced by
/// ones to the new master, which only a Sentinel target finds.
fn is_demoted(err: &RedisError) -> bool {
    matches!(err.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly))
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
            | ErrorKind::MasterNameNotFoundBySentinel
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

    /// The address of the core the calling thread sends through.
    fn core_address(backend: &RedisBackend) -> usize {
        Arc::as_ptr(backend.core()) as usize
    }

    /// Each serving thread gets a core of its own, made once, on its first
    /// call; other threads, and serving threads beyond those the backend
    /// was told of, use the shared one.
    #[test]
    fn each_serving_thread_sends_through_a_core_of_its_own() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let settings = RedisSettings {
            // Nothing listens there; connecting is not needed to route.
            url: "redis://127.0.0.1:1".to_owned(),
            sentinel: None,
            pool_size: 1,
            timeout_ms: 100,
            key_prefix: "t".to_owned(),
            clock: ClockSource::Redis,
            expiry_grace_ms: 0,
            batch: None,
            tls: RedisTls::default(),
        };
        let backend = runtime
            .block_on(RedisBackend::connect(settings))
            .expect("backend")
            .with_serving_threads(2);
        let backend = Arc::new(backend);
        let shared = runtime.block_on(async { core_address(&backend) });
        let on_thread = |index: usize| {
            let backend = backend.clone();
            std::thread::spawn(move || {
                crate::serving_thread::enter(index);
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("runtime");
                runtime.block_on(async { [core_address(&backend), core_address(&backend)] })
            })
            .join()
            .expect("thread")
        };
        let [first, again] = on_thread(0);
        let [second, _] = on_thread(1);
        let [beyond, _] = on_thread(2);
        assert_eq!(first, again, "a thread keeps its core");
        assert_ne!(first, shared);
        assert_ne!(second, shared);
        assert_ne!(first, second);
        assert_eq!(beyond, shared);
        assert_eq!(on_thread(0)[0], first, "made once per serving thread");
    }

    #[test]
    fn passwords_are_redacted() {
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("redis://:secret@h"), "redis://:***@h");
        assert_eq!(redact("redis://h:6379"), "redis://h:6379");
    }
}
