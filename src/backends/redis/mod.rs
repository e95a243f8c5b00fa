//! Redis backend: one atomic Lua call per request (or per batch of
//! requests), FCALL of a function library on Redis 7, EVALSHA before.
//!
//! `lua/decide.lua` is `algorithms::decide` ported line for line; a
//! request's limits are checked and consumed in one call, so replicas
//! sharing a Redis agree exactly. This module is the single-server backend
//! (directly or behind Sentinel): one [`Core`] per serving thread. Its
//! parts, from the call down:
//!
//! - [`call`]: the terms of one call and the one path every call takes
//!   (single server, batch and Cluster alike);
//! - [`server`]: calls to one server; [`batch`]: concurrent requests
//!   sharing one call; [`cluster`]: the Redis Cluster backend;
//! - [`gate`]: the bound on calls queued toward Redis;
//! - [`connections`], [`circuit`], [`dialer`], [`role`], [`sentinel`]:
//!   connections to one server and how its master is found;
//! - [`engine`]: FCALL or EVALSHA and the reload after a flush;
//!   [`script`]: the Lua's arguments, replies and library;
//! - [`settings`], [`tls`], [`failure`]: what the command line says, and
//!   how Redis failures become backend errors.
//!
//! Invariant: a request's call and its answer stay on the thread that
//! serves it, and every decision reaches Redis through [`call`].

mod batch;
mod call;
mod circuit;
pub mod cluster;
mod connections;
mod dialer;
pub mod engine;
mod failure;
mod gate;
mod role;
pub mod script;
mod sentinel;
mod server;
mod settings;
mod tls;

use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;

use self::batch::Batcher;
use self::circuit::Reachability;
use self::connections::{Reconnect, ServerConnections};
use self::dialer::Dialer;
use self::gate::Gate;
pub use self::script::DECIDE_LUA;
use self::script::{HeaderArgs, ScriptLimit};
pub use self::sentinel::SentinelSettings;
use self::server::{Encoded, SingleServer};
pub use self::settings::{BatchSettings, ClockSource, RedisSettings, ServerConnector};
pub use self::tls::RedisTls;
use super::keys::{HashTag, KeyFormat};
use super::{Backend, CallContext, Error, KeyedCheck};
use crate::algorithms::Verdict;
use crate::clock::Clock;

/// Counters in Redis, shared by every replica pointed at the same server.
pub struct RedisBackend {
    /// Calls made off the serving threads (the shared runtime's), and the
    /// health probe.
    core: Arc<Core>,
    /// One per serving thread (`--grpc-threads`), made on that thread as
    /// it starts (`warm_up`) or at its first call: its connections, their
    /// tasks and the batches it sends all run on the thread's own runtime,
    /// so a request's call and its answer never cross threads. Each has its
    /// own pool of `pool_size` connections and its own gate; the circuit
    /// and the generation of connections are shared by all (see
    /// [`Reachability`]).
    thread_cores: Box<[OnceLock<Arc<Core>>]>,
    /// What a thread's core is made from.
    recipe: CoreRecipe,
    keys: KeyFormat,
    clock: ClockSource,
    expiry_grace_ms: u64,
}

/// What sends one runtime's calls: to the server, alone or in batches.
struct Core {
    server: Arc<SingleServer>,
    batcher: Option<Arc<Batcher>>,
    /// The runtime its connections run on (a serving thread's, or the
    /// shared one), where a probe readies it ([`RedisBackend::probe`]).
    runtime: tokio::runtime::Handle,
}

/// How long a probe gives every pool to be ready for calls (a connection
/// made and the library loaded): after a restart of Redis, the first call
/// on each pool would otherwise connect and load the library within its
/// own timeout, and fail when they take longer.
const READY_WITHIN: Duration = Duration::from_secs(1);

/// What a [`Core`] is made from: the settings of its connections, gate and
/// batcher, and what every core's connections share (the circuit, the
/// generation of connections).
struct CoreRecipe {
    dialer: Dialer,
    pool_size: u32,
    timeout_ms: u64,
    batch: Option<BatchSettings>,
    redacted_url: String,
    reachability: Reachability,
}

impl CoreRecipe {
    /// A core whose connections start on the calling runtime (the tasks
    /// that make and drive them, and its reconnecting task if it `Owns`
    /// reconnecting: the shared core's).
    fn make(&self, reconnect: Reconnect) -> Core {
        let connections = ServerConnections::start(
            self.dialer.clone(),
            self.pool_size,
            self.timeout_ms,
            self.reachability.clone(),
            reconnect,
        );
        let in_flight = usize::try_from(self.pool_size).unwrap_or(1);
        let gate = Gate::for_server();
        let max_waiting = gate.max_waiting();
        let server = Arc::new(SingleServer {
            connections,
            gate,
            timeout: Duration::from_millis(self.timeout_ms),
            timeout_ms: self.timeout_ms,
            redacted_url: self.redacted_url.clone(),
        });
        let batcher = self.batch.map(|it| {
            let max_keys_in_flight = it.max_keys.saturating_mul(8);
            let batcher = Batcher::new(
                server.clone(),
                it,
                in_flight,
                max_keys_in_flight,
                max_waiting,
            );
            Arc::new(batcher)
        });
        Core {
            server,
            batcher,
            runtime: tokio::runtime::Handle::current(),
        }
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
        let (dialer, redacted_url) = settings.dialer()?;
        if let Dialer::Sentinel(sentinel) = &dialer {
            sentinel.check().await?;
        }
        let recipe = CoreRecipe {
            dialer,
            pool_size: settings.pool_size,
            timeout_ms: settings.timeout_ms,
            batch: settings.batch,
            reachability: Reachability::new(redacted_url.clone()),
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
        let deadline = Instant::now() + READY_WITHIN.max(self.core.server.timeout);
        let cores =
            std::iter::once(&self.core).chain(self.thread_cores.iter().filter_map(OnceLock::get));
        let readying: Vec<_> = cores
            .map(|core| {
                let core = core.clone();
                core.runtime
                    .clone()
                    .spawn(async move { core.server.connections.warm_up(deadline).await })
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
        self.core.server.connections.circuit_open()
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
            limits: checks.iter().map(|it| ScriptLimit::of(&it.check)).collect(),
        })
    }
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("url", &self.core.server.redacted_url)
            .field("keys", &self.keys)
            .field("clock", &self.clock)
            .field("timeout_ms", &self.core.server.timeout_ms)
            .field("pool", &self.core.server.connections.state())
            .field("max_in_flight", &self.core.server.gate.max_in_flight())
            .field("max_waiting", &self.core.server.gate.max_waiting())
            .field("batch", &self.core.batcher.as_ref().map(|it| it.settings()))
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
            None => core.server.decide_one(&request, call).await,
            Some(batcher) => batcher.decide(request, call).await,
        }
    }

    /// The calling thread's core (made now on a serving thread), its
    /// connection and the server's code, within the timeout.
    async fn warm_up(&self) {
        let core = self.core();
        let deadline = Instant::now() + core.server.timeout;
        if let Err(err) = core.server.connections.warm_up(deadline).await {
            tracing::debug!("redis: could not connect ahead of the first call: {err}");
        }
    }

    /// The function libraries of other versions of the service on the
    /// server (`FUNCTION LIST`), asked now: each version loads its own
    /// (named by a digest of its code), and nothing removes an old one.
    async fn notes(&self) -> Vec<String> {
        let others = match self.core.server.other_libraries().await {
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
        let server = &self.core.server;
        server
            .connections
            .probe(Instant::now() + server.timeout)
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

#[cfg(test)]
mod tests;
