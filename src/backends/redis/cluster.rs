//! Redis Cluster backend: a request's counters grouped by hash slot, one
//! call of the decision script per group, the groups sent concurrently and
//! their verdicts merged in check order.
//!
//! The script touches only the keys it declares, and a script's keys must
//! share a slot (CROSSSLOT otherwise), hence the grouping. With
//! `--redis-hash-tag domain` every request is one group, so one call, and
//! the decision is as atomic as on a single server. A request over several
//! groups asks each for receipts: a group takes what an allowed request
//! takes (nothing when one of its enforcing limits has no room) and tells
//! what each limit reports either way; the request is ruled on by
//! `algorithms::settle`, the rules every backend follows (a quota limit
//! with room in one slot allows a request whose other quota limits are
//! full). If it is denied, or a group fails, what the groups took is
//! refunded (`lua/refund.lua`, see `script`'s "Refunds"), so a denied
//! request ends up consuming nothing but the charges of limits charged
//! always, and each limit reports what it has with nothing taken. Between
//! the decision and the refund the counters are only higher: a concurrent
//! request may be denied that would have passed, never allowed over a
//! limit.
//!
//! Routing is ours, not the client's: the cluster client is built with no
//! retries, because it retries after I/O errors and timeouts, when the
//! script may have run (counting a request twice). We follow only the
//! answers that prove the script did not run: MOVED (to the named node),
//! ASK (ASKING then the script, on the named node), NOSCRIPT or a missing
//! function (SCRIPT LOAD or FUNCTION LOAD on that node, then again: each
//! primary gets the library the first time it is called after a start, a
//! flush or a failover), and TRYAGAIN, CLUSTERDOWN, MASTERDOWN,
//! READONLY, LOADING or a node not connected (again after a short pause,
//! routed by slot on the refreshed map). All of it within one deadline.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Poll;
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SingleNodeRoutingInfo, Slot,
    SlotAddr,
};
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, TlsMode, Value};
use tokio::sync::{OnceCell, OwnedSemaphorePermit};
use tokio::time::{Instant, sleep, timeout_at};

use super::engine::{self, Engine, Entry};
use super::gate::{self, Gate};
use super::script::{self, HeaderArgs, LimitArgs, Receipt, RefundArgs, RefundHeader};
use super::{ClockSource, RedisTls, classify, redact, sending_bound};
use crate::algorithms::{self, Check, Provisional, Verdict};
use crate::backends::keys::{HashTag, KeyFormat};
use crate::backends::{Backend, CallContext, Error, KeyedCheck, LateVerdict, Stage};
use crate::clock::Clock;
use crate::log_gate::LogGate;

/// Most redirects (MOVED, ASK, NOSCRIPT) of one call in a row: each
/// follows an answer that proves the script did not run, so the bound only
/// stops a loop between nodes that disagree.
const MAX_REDIRECTS: usize = 8;

/// Pause before routing again after TRYAGAIN, CLUSTERDOWN and the like,
/// while the client refreshes its slot map.
const REROUTE_PAUSE: Duration = Duration::from_millis(20);

/// Everything needed to reach a cluster, from the command line.
#[derive(Clone)]
pub struct ClusterSettings {
    /// Seed nodes: `host:port`, `redis://` or `rediss://` URLs (with
    /// user:password); any subset of the cluster.
    pub nodes: Vec<String>,
    /// Cluster connections kept (each multiplexed, one socket per node).
    pub pool_size: u32,
    /// Bound on every call, including its redirects; also the probe's.
    pub timeout_ms: u64,
    /// Prefix and hash tag of every key.
    pub keys: KeyFormat,
    pub clock: ClockSource,
    /// As [`super::RedisSettings::expiry_grace_ms`].
    pub expiry_grace_ms: u64,
    /// As [`super::RedisSettings::tls`]: for every node.
    pub tls: RedisTls,
}

/// Counters in a Redis Cluster, shared by every replica pointed at it.
pub struct ClusterBackend {
    shared: Arc<Shared>,
}

/// The backend's state, shared with the tasks that await a group's reply
/// after its request's timeout (see `Shared::decide_groups`).
struct Shared {
    client: ClusterClient,
    /// Made on first use, so an unreachable cluster at start-up is not an
    /// error; a failed attempt is tried again by the next call. Emptied
    /// when the probe finds the client's slot map stale (see `probe`).
    connections: Vec<Mutex<Option<ClusterConnection>>>,
    next: AtomicUsize,
    /// FCALL or EVALSHA, found at the first call (see `engine`): what
    /// every node is first sent.
    engine: OnceCell<Engine>,
    /// The slots whose node refused the function library (see
    /// `ClusterBackend::call`): their calls go as EVALSHA.
    scripts_only: ScriptsOnly,
    /// Set by the first `warm_up` that succeeds: the cluster has no
    /// per-thread connections, so the serving threads' warm-ups find it
    /// done (or wait for the one under way).
    warmed: OnceCell<()>,
    refund_failures: AtomicU64,
    refund_log: LogGate,
    keys: KeyFormat,
    clock: ClockSource,
    timeout: Duration,
    timeout_ms: u64,
    expiry_grace_ms: u64,
    redacted_nodes: String,
    /// Bounds the requests sent and waiting toward the cluster (see
    /// `gate`): one place per request, whatever its number of slots.
    gate: Gate,
}

/// Where one attempt of a group's call goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    /// The primary serving the slot, as the client's map says.
    Slot(Slot),
    /// The node a MOVED named.
    Moved(String, u16),
    /// The node an ASK named: ASKING first.
    Ask(String, u16),
}

/// The last moment a request's calls may be written, and its error after.
struct WriteBy {
    at: Instant,
    /// [`Error::Deadline`] when the caller's deadline set it, else the
    /// backend's own [`Error::Timeout`].
    late: Error,
}

/// When a request's calls must be written and answered by, and the place
/// it holds in the gate (kept by a call still unanswered at `deadline`).
struct Bounds {
    deadline: Instant,
    write_by: WriteBy,
    permit: OwnedSemaphorePermit,
}

/// The attempt of a group's call on its way to Redis, if one is: kept here,
/// outside the call, so that it can still be awaited once its request's
/// timeout has dropped the call (see `Shared::decide_groups`).
#[derive(Default)]
struct InFlight(Mutex<Option<Reply>>);

/// One attempt's reply, owning all it needs.
type Reply = Pin<Box<dyn Future<Output = RedisResult<Value>> + Send>>;

/// What one group's call answered.
enum GroupReply {
    /// The request's only group: its verdict, ruled by the script.
    Whole(Verdict),
    /// One group of several: each limit's outcome either way, and its
    /// receipt.
    Provisional(Vec<Provisional>, Vec<Receipt>),
}

impl GroupReply {
    /// What the group may have to give back.
    fn receipts(&self) -> &[Receipt] {
        match self {
            GroupReply::Whole(_) => &[],
            GroupReply::Provisional(_, receipts) => receipts,
        }
    }
}

/// The checks of one slot, by their positions in the request.
#[derive(Clone)]
struct Group {
    slot: Slot,
    positions: Vec<usize>,
    keys: Vec<String>,
}

// === impl ClusterSettings ===

impl ClusterSettings {
    fn validate(&self) -> Result<(), Error> {
        if self.nodes.is_empty() {
            return Err(Error::Protocol("redis cluster needs a seed node".into()));
        }
        if self.pool_size == 0 {
            return Err(Error::Protocol("redis pool size must be at least 1".into()));
        }
        if self.timeout_ms == 0 {
            return Err(Error::Protocol(
                "redis timeout must be at least 1 ms".into(),
            ));
        }
        Ok(())
    }

    /// The client; nothing is connected yet. No retries (see the module
    /// doc); connect bounded by the timeout, a reply awaited for
    /// [`gate::UNANSWERED_AFTER`] beyond it: every call is bounded by its
    /// caller's deadline (`timeout_at`), and a decision that comes after it
    /// is still read (`Shared::await_late`).
    fn client(&self) -> Result<ClusterClient, Error> {
        let timeout = Duration::from_millis(self.timeout_ms);
        let builder = self.builder()?.retries(0);
        self.build(builder.response_timeout(timeout.saturating_add(gate::UNANSWERED_AFTER)))
    }

    /// A client for calls that may be sent again (they are safe to run
    /// twice): the client itself follows MOVED and ASK, and tries again
    /// after TRYAGAIN, CLUSTERDOWN, READONLY or a lost connection, at most
    /// `retries` times; same seeds, TLS and bounds as the backend's.
    pub fn redirecting_client(&self, retries: u32) -> Result<ClusterClient, Error> {
        self.validate()?;
        self.build(self.builder()?.retries(retries))
    }

    fn build(&self, builder: ClusterClientBuilder) -> Result<ClusterClient, Error> {
        builder.build().map_err(|err| {
            Error::Protocol(format!(
                "invalid redis cluster nodes {}: {err}",
                redact_nodes(&self.nodes)
            ))
        })
    }

    /// The seeds as URLs, with the TLS settings; connect and response
    /// bounded by the timeout.
    fn builder(&self) -> Result<ClusterClientBuilder, Error> {
        // rustls needs a process-wide crypto provider for `rediss://`.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let timeout = Duration::from_millis(self.timeout_ms);
        let nodes = if self.tls.is_set() {
            // A bare `host:port` is reached the way the TLS settings say.
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|it| match it.contains("://") {
                    true => it.clone(),
                    false => format!("rediss://{}", it.trim()),
                })
                .collect();
            seed_urls(&nodes)
        } else {
            seed_urls(&self.nodes)
        };
        let mut builder = ClusterClientBuilder::new(nodes.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout);
        if self.tls.is_set() {
            if let Some(plain) = nodes.iter().find(|it| !it.starts_with("rediss://")) {
                return Err(Error::Protocol(format!(
                    "redis tls settings need rediss:// cluster nodes, not {}",
                    redact(plain)
                )));
            }
            if let Some(certs) = self.tls.certificates()? {
                builder = builder.certs(certs);
            }
            if self.tls.insecure {
                builder = builder.tls(TlsMode::Insecure);
            }
            if self.tls.skip_hostname_verification {
                builder = builder.danger_accept_invalid_hostnames(true);
            }
        }
        Ok(builder)
    }
}

/// `host:port` as a URL; URLs as given.
fn node_url(node: &str) -> String {
    let node = node.trim();
    if node.contains("://") {
        node.to_owned()
    } else {
        format!("redis://{node}")
    }
}

/// Every seed as a URL. The client needs the same credentials (and TLS)
/// on every seed, so a bare `host:port` takes the scheme and user:password
/// of the first URL that has them: credentials given once apply to all.
fn seed_urls(nodes: &[String]) -> Vec<String> {
    let urls: Vec<String> = nodes.iter().map(|it| node_url(it)).collect();
    let with_credentials = urls.iter().find_map(|url| {
        let (scheme, rest) = url.split_once("://")?;
        let (userinfo, _) = rest.rsplit_once('@')?;
        Some((scheme.to_owned(), userinfo.to_owned()))
    });
    let Some((scheme, userinfo)) = with_credentials else {
        return urls;
    };
    nodes
        .iter()
        .zip(urls)
        .map(|(node, url)| {
            if node.trim().contains("://") {
                url
            } else {
                format!("{scheme}://{userinfo}@{}", node.trim())
            }
        })
        .collect()
}

fn redact_nodes(nodes: &[String]) -> String {
    nodes
        .iter()
        .map(|it| redact(it))
        .collect::<Vec<_>>()
        .join(",")
}

impl fmt::Debug for ClusterSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterSettings")
            .field("nodes", &redact_nodes(&self.nodes))
            .field("pool_size", &self.pool_size)
            .field("timeout_ms", &self.timeout_ms)
            .field("keys", &self.keys)
            .field("clock", &self.clock)
            .field("expiry_grace_ms", &self.expiry_grace_ms)
            .field("tls", &self.tls)
            .finish()
    }
}

// === impl ClusterBackend ===

impl ClusterBackend {
    /// Checks the settings; connects on first use.
    pub fn connect(settings: ClusterSettings) -> Result<ClusterBackend, Error> {
        settings.validate()?;
        let client = settings.client()?;
        let pool_size = usize::try_from(settings.pool_size).unwrap_or(1);
        let shared = Shared {
            client,
            connections: (0..pool_size).map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
            engine: OnceCell::new(),
            scripts_only: ScriptsOnly::default(),
            warmed: OnceCell::new(),
            refund_failures: AtomicU64::new(0),
            refund_log: LogGate::new(),
            keys: settings.keys,
            clock: settings.clock,
            timeout: Duration::from_millis(settings.timeout_ms),
            timeout_ms: settings.timeout_ms,
            expiry_grace_ms: settings.expiry_grace_ms,
            redacted_nodes: redact_nodes(&settings.nodes),
            gate: Gate::for_pool(settings.pool_size),
        };
        Ok(ClusterBackend {
            shared: Arc::new(shared),
        })
    }

    /// The Redis key of a counter, as the script reads and writes it.
    pub fn key_of(&self, key: &super::super::CounterKey) -> String {
        self.shared.keys.encode(key)
    }

    /// The SHA1 the decision script is invoked by where the servers have
    /// no functions (EVALSHA).
    pub fn script_hash(&self) -> String {
        redis::Script::new(super::DECIDE_LUA).get_hash().to_owned()
    }

    /// Whether every request is one call on one slot, so that no refund is
    /// ever made: the domain hash tag, or a prefix carrying a hash tag of
    /// its own (the first `{...}` of every key).
    pub fn never_refunds(&self) -> bool {
        self.shared.never_refunds()
    }

    /// Refunds that failed (timed out, or an error) since start-up.
    pub fn refund_failures(&self) -> u64 {
        self.shared.refund_failures.load(Ordering::Relaxed)
    }
}

impl Shared {
    /// How the primary of `slot` runs our code: the cluster's engine,
    /// found once by loading the library on the first slot's primary,
    /// unless that slot's node has since refused the library.
    async fn engine(&self, conn: &mut ClusterConnection, slot: Slot) -> Result<Engine, Error> {
        let detect = async {
            let routing = single(Route::with_slot(slot, SlotAddr::Master));
            let res = conn.route_command(engine::library_load(), routing).await;
            engine::from_load_on_cluster(res).map_err(|err| classify(&err, self.timeout_ms))
        };
        let engine = self.engine.get_or_try_init(|| detect).await.copied()?;
        if self.scripts_only.has(slot) {
            return Ok(Engine::Scripts);
        }
        Ok(engine)
    }

    /// A cluster connection, made now if this slot of the pool has none.
    async fn connection(&self) -> Result<ClusterConnection, Error> {
        let idx = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let slot = &self.connections[idx];
        if let Some(conn) = lock(slot).clone() {
            return Ok(conn);
        }
        let conn = self
            .client
            .get_async_connection()
            .await
            .map_err(|err| classify(&err, self.timeout_ms))?;
        *lock(slot) = Some(conn.clone());
        Ok(conn)
    }

    /// Drops every pooled connection: the next calls connect afresh and
    /// read the current slot map. Calls in flight keep their clones.
    fn forget_connections(&self) {
        for slot in &self.connections {
            *lock(slot) = None;
        }
    }

    /// The decision's header; `receipts` when the request spans slots and
    /// may have to be refunded.
    fn header(&self, receipts: bool) -> HeaderArgs {
        HeaderArgs::now(&self.clock, self.expiry_grace_ms, receipts)
    }

    /// As [`ClusterBackend::never_refunds`].
    fn never_refunds(&self) -> bool {
        let prefix = &self.keys.prefix;
        let prefix_tagged = prefix
            .find('{')
            .and_then(|open| prefix[open + 1..].find('}'))
            .is_some_and(|len| len > 0);
        prefix_tagged || self.keys.hash_tag == HashTag::Domain
    }

    /// The checks grouped by slot, groups in the order of their first check.
    /// Refuses a request naming one counter twice.
    fn groups(&self, checks: &[KeyedCheck]) -> Result<Vec<Group>, Error> {
        let mut seen = HashSet::with_capacity(checks.len());
        let mut groups: Vec<Group> = Vec::new();
        for (position, check) in checks.iter().enumerate() {
            let key = self.keys.encode(&check.key);
            if !seen.insert(key.clone()) {
                return Err(Error::Protocol(format!(
                    "counter {key} appears twice in one request"
                )));
            }
            let slot = Slot::for_key(key.as_bytes());
            match groups.iter_mut().find(|it| it.slot == slot) {
                Some(group) => {
                    group.positions.push(position);
                    group.keys.push(key);
                }
                None => groups.push(Group {
                    slot,
                    positions: vec![position],
                    keys: vec![key],
                }),
            }
        }
        Ok(groups)
    }

    /// FCALL (or EVALSHA) of the decision over one group.
    fn decide_cmd(
        engine: Engine,
        header: &HeaderArgs,
        group: &Group,
        checks: &[KeyedCheck],
    ) -> Cmd {
        let limits: Vec<LimitArgs> = group
            .positions
            .iter()
            .map(|&at| LimitArgs::of(&checks[at].check))
            .collect();
        let mut cmd = engine.command(Entry::Decide, group.keys.len());
        cmd.arg(&group.keys);
        script::write_request(&mut cmd, header, &limits);
        cmd
    }

    /// One group decided on its node: the group's checks decided
    /// provisionally, with their receipts, when the header asks for
    /// receipts; else the verdict on the request (its only group).
    async fn decide_group(
        &self,
        mut conn: ClusterConnection,
        header: &HeaderArgs,
        group: &Group,
        checks: &[KeyedCheck],
        write_by: &WriteBy,
        in_flight: &InFlight,
    ) -> Result<GroupReply, Error> {
        let engine = self.engine(&mut conn, group.slot).await?;
        let cmd = Self::decide_cmd(engine, header, group, checks);
        let value = self
            .call(
                &mut conn,
                (engine, Entry::Decide),
                &cmd,
                group.slot,
                Some((write_by, in_flight)),
            )
            .await?;
        let reply = script::reply_integers(value)?;
        if header.receipts {
            let (provisional, receipts) = script::decode_provisional(&reply, group.keys.len())?;
            return Ok(GroupReply::Provisional(provisional, receipts));
        }
        Ok(GroupReply::Whole(script::parse_reply(
            &reply,
            group.keys.len(),
        )?))
    }

    /// Gives back what a group took, once, within its own deadline. A
    /// failure is logged (at most once a second) and counted: it only
    /// leaves the group's counters higher until their window passes, never
    /// lets a request over a limit.
    async fn refund_group(
        &self,
        mut conn: ClusterConnection,
        group: &Group,
        checks: &[KeyedCheck],
        receipts: &[Receipt],
    ) {
        let deadline = Instant::now() + self.timeout;
        let refunded = timeout_at(deadline, async {
            // Known by now: the group's decision found it.
            let engine = self.engine(&mut conn, group.slot).await?;
            let Some((cmd, positions)) = self.refund_cmd(engine, group, checks, receipts) else {
                return Ok(());
            };
            // Sent whoever still waits: it only gives back room.
            let value = self
                .call(&mut conn, (engine, Entry::Refund), &cmd, group.slot, None)
                .await?;
            let reply: Vec<i64> = redis::from_redis_value(value)
                .map_err(|err| Error::Protocol(format!("unexpected refund reply: {err}")))?;
            script::decode_refund_reply(&reply, positions.len())?;
            Ok(())
        });
        let err = match refunded.await {
            Ok(Ok(())) => return,
            Ok(Err(err)) => err,
            Err(_) => Error::Timeout(self.timeout_ms),
        };
        self.refund_failures.fetch_add(1, Ordering::Relaxed);
        if let Some(suppressed) = self.refund_log.admit() {
            tracing::warn!(
                suppressed,
                "redis cluster refund failed, counters stay higher until their window passes: {err}"
            );
        }
    }

    /// FCALL (or EVALSHA) of the refund over the group's limits that
    /// consumed, and their positions in the request; `None` when none did.
    fn refund_cmd(
        &self,
        engine: Engine,
        group: &Group,
        checks: &[KeyedCheck],
        receipts: &[Receipt],
    ) -> Option<(Cmd, Vec<usize>)> {
        let mut positions = Vec::new();
        let (keys, limits): (Vec<&String>, Vec<RefundArgs>) = group
            .positions
            .iter()
            .zip(&group.keys)
            .zip(receipts)
            .filter(|(_, receipt)| !receipt.is_empty())
            .map(|((&at, key), receipt)| {
                positions.push(at);
                (key, RefundArgs::of(&checks[at].check, *receipt))
            })
            .unzip();
        if keys.is_empty() {
            return None;
        }
        let header = RefundHeader {
            now_us: self.header(false).now_us,
        };
        let mut cmd = engine.command(Entry::Refund, keys.len());
        cmd.arg(keys).arg(script::refund_argv(&header, &limits));
        Some((cmd, positions))
    }

    /// Decides every group concurrently, then the request from what each
    /// limit reports (`algorithms::settle`, the rules every backend
    /// follows); if it is denied, or a group failed (the failure mode
    /// decides then), the groups that took something are refunded
    /// (concurrently).
    ///
    /// Each group's call ends by `deadline` (NEVER retried after a timeout:
    /// its script may have run); refunds have deadlines of their own, so a
    /// group that times out never keeps the others from being refunded.
    ///
    /// A group whose call was on its way to Redis at `deadline` fails the
    /// request (the failure mode answers it), and its reply is then awaited
    /// in a task of its own (`await_late`), holding the request's place in
    /// the gate, for at most [`gate::UNANSWERED_AFTER`] more: all or nothing
    /// still, so the request that failed consumes nothing.
    async fn decide_groups(
        self: &Arc<Self>,
        conn: ClusterConnection,
        groups: &[Group],
        checks: &[KeyedCheck],
        bounds: Bounds,
        context: &CallContext,
    ) -> Result<Verdict, Error> {
        let header = self.header(groups.len() > 1);
        let in_flight: Vec<InFlight> = groups.iter().map(|_| InFlight::default()).collect();
        let calls = groups.iter().zip(&in_flight).map(|(group, in_flight)| {
            let call = self.decide_group(
                conn.clone(),
                &header,
                group,
                checks,
                &bounds.write_by,
                in_flight,
            );
            async move {
                timeout_at(bounds.deadline, call)
                    .await
                    .unwrap_or(Err(Error::Timeout(self.timeout_ms)))
            }
        });
        let mut results = join_all(calls).await;
        let permit = Arc::new(bounds.permit);
        for (group, in_flight) in groups.iter().zip(&in_flight) {
            if let Some(reply) = in_flight.take() {
                let late = match groups.len() {
                    1 => Late::Count(context.late.clone()),
                    _ => Late::Refund(conn.clone(), checks.to_vec()),
                };
                self.await_late(reply, group.clone(), late, permit.clone());
            }
        }
        if let [Ok(GroupReply::Whole(_))] = results.as_slice()
            && let Some(Ok(GroupReply::Whole(verdict))) = results.pop()
        {
            // The request's only group: ruled by its script, nothing to refund.
            return Ok(verdict);
        }
        let verdict = match results.iter().find_map(|it| it.as_ref().err()) {
            Some(err) => Err(err.clone()),
            None => merge(checks, groups, &results),
        };
        if !verdict.as_ref().is_ok_and(|it| it.allowed) {
            let refunds = groups.iter().zip(&results).filter_map(|(group, result)| {
                let receipts = result.as_ref().ok()?.receipts();
                (!receipts.iter().all(Receipt::is_empty))
                    .then(|| self.refund_group(conn.clone(), group, checks, receipts))
            });
            join_all(refunds).await;
        }
        verdict
    }

    /// Awaits `reply`, the decision of `group` on its way at its request's
    /// timeout, in a task of its own holding `permit` (the request's place
    /// in the gate), for at most [`gate::UNANSWERED_AFTER`]. If it comes, the
    /// request's only call hands its verdict to be counted; a group of a
    /// request over several slots (which failed whole) is refunded if it
    /// took something, and nothing is counted.
    fn await_late(
        self: &Arc<Self>,
        reply: Reply,
        group: Group,
        late: Late,
        permit: Arc<OwnedSemaphorePermit>,
    ) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let this = Arc::clone(self);
        runtime.spawn(async move {
            let answered = tokio::time::timeout(gate::UNANSWERED_AFTER, reply).await;
            drop(permit);
            let Ok(Ok(value)) = answered else {
                return;
            };
            let Ok(reply) = script::reply_integers(value) else {
                return;
            };
            let n_keys = group.keys.len();
            match late {
                Late::Count(Some(late)) => {
                    if let Ok(verdict) = script::parse_reply(&reply, n_keys) {
                        late.deliver(verdict);
                    }
                }
                Late::Count(None) => {}
                Late::Refund(conn, checks) => {
                    if let Ok((_, receipts)) = script::decode_provisional(&reply, n_keys)
                        && !receipts.iter().all(Receipt::is_empty)
                    {
                        this.refund_group(conn, &group, &checks, &receipts).await;
                    }
                }
            }
        });
    }

    /// Runs the script command, following only the answers that prove it
    /// did not run (see the module doc). Bounded by the caller's deadline;
    /// at most [`MAX_REDIRECTS`] redirects or loads in a row without a pause.
    /// With a `bound` (a decision's), no attempt (the first, or one after a
    /// redirect, a load or a pause) is written once its moment has passed,
    /// and each attempt is kept in its `InFlight` while it waits for its
    /// reply.
    ///
    /// The engine is settled per node, as on a single server: an FCALL the
    /// node refuses (unknown, renamed away, or not allowed), or one that
    /// finds no library where FUNCTION LOAD is refused, is sent again as
    /// EVALSHA, and the slot keeps to scripts.
    async fn call(
        &self,
        conn: &mut ClusterConnection,
        (mut engine, entry): (Engine, Entry),
        cmd: &Cmd,
        slot: Slot,
        bound: Option<(&WriteBy, &InFlight)>,
    ) -> Result<Value, Error> {
        let mut target = Target::Slot(slot);
        let mut redirects = 0;
        let mut as_script = None;
        loop {
            if let Some((write_by, _)) = bound
                && Instant::now() >= write_by.at
            {
                return Err(write_by.late.clone());
            }
            let sent = as_script.as_ref().unwrap_or(cmd);
            let replied = match bound {
                Some((_, in_flight)) => {
                    let (mut conn, sent, target) = (conn.clone(), sent.clone(), target.clone());
                    let reply = async move { attempt(&mut conn, &sent, &target).await };
                    in_flight.run(Box::pin(reply)).await
                }
                None => attempt(conn, sent, &target).await,
            };
            let err = match replied {
                Ok(value) => return Ok(value),
                Err(err) => err,
            };
            let mut step = next_step(&err);
            if engine == Engine::Functions && engine::lacks_functions(&err) {
                step = Next::Scripts;
            }
            if matches!(step, Next::Load | Next::Scripts | Next::Go(_)) {
                redirects += 1;
                if redirects > MAX_REDIRECTS {
                    return Err(classify(&err, self.timeout_ms));
                }
            }
            target = match step {
                Next::Load => match self.load(conn, (engine, entry), &target).await {
                    Err(err) if engine == Engine::Functions && engine::lacks_functions(&err) => {
                        self.keep_to_scripts(slot, &err);
                        engine = Engine::Scripts;
                        as_script = Some(engine::as_script(cmd, entry));
                        target
                    }
                    res => {
                        res.map_err(|err| classify(&err, self.timeout_ms))?;
                        target
                    }
                },
                Next::Scripts => {
                    self.keep_to_scripts(slot, &err);
                    engine = Engine::Scripts;
                    as_script = Some(engine::as_script(cmd, entry));
                    target
                }
                Next::Go(next) => next,
                Next::Pause => {
                    redirects = 0;
                    sleep(REROUTE_PAUSE).await;
                    Target::Slot(slot)
                }
                Next::Fail => return Err(classify(&err, self.timeout_ms)),
            };
        }
    }

    /// SCRIPT LOAD or FUNCTION LOAD of `code` on the node `target` names.
    async fn load(
        &self,
        conn: &mut ClusterConnection,
        (engine, entry): (Engine, Entry),
        target: &Target,
    ) -> RedisResult<()> {
        let cmd = engine.load_command(entry);
        let routing = match target {
            Target::Slot(slot) => single(Route::with_slot(*slot, SlotAddr::Master)),
            Target::Moved(host, port) | Target::Ask(host, port) => by_address(host, *port),
        };
        Engine::loaded(conn.route_command(cmd, routing).await)
    }

    /// Remembers that `slot`'s node refused the function library.
    fn keep_to_scripts(&self, slot: Slot, refused: &RedisError) {
        if self.scripts_only.set(slot) {
            tracing::info!(
                "redis cluster: a node cannot run the function library ({refused}): its slots \
                 are decided with EVALSHA (logged once)"
            );
        }
    }
}

/// The slots that keep to scripts; `any` spares the lock while none does.
#[derive(Default)]
struct ScriptsOnly {
    any: std::sync::atomic::AtomicBool,
    slots: Mutex<HashSet<Slot>>,
}

impl ScriptsOnly {
    fn has(&self, slot: Slot) -> bool {
        self.any.load(Ordering::Relaxed)
            && self
                .slots
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&slot)
    }

    /// Adds `slot`; whether it is the first.
    fn set(&self, slot: Slot) -> bool {
        self.slots
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(slot);
        !self.any.swap(true, Ordering::Relaxed)
    }
}

impl InFlight {
    /// Keeps `reply` here and awaits it; it leaves once answered.
    async fn run(&self, reply: Reply) -> RedisResult<Value> {
        *self.lock() = Some(reply);
        std::future::poll_fn(|cx| {
            let mut held = self.lock();
            let Some(reply) = held.as_mut() else {
                // Taken only once its call has been dropped.
                return Poll::Pending;
            };
            let answer = std::task::ready!(reply.as_mut().poll(cx));
            *held = None;
            Poll::Ready(answer)
        })
        .await
    }

    /// The attempt still on its way, if its call was dropped before its reply.
    fn take(&self) -> Option<Reply> {
        self.lock().take()
    }

    fn lock(&self) -> MutexGuard<'_, Option<Reply>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What becomes of a group's decision that came after its request's timeout.
enum Late {
    /// The request's only call: its verdict is counted, there if any.
    Count(Option<LateVerdict>),
    /// One group of several: refunded if it allowed (on this connection,
    /// for the request's checks), since the request failed whole.
    Refund(ClusterConnection, Vec<KeyedCheck>),
}

/// A pool slot; a panic elsewhere cannot leave an `Option` half-written.
fn lock(slot: &Mutex<Option<ClusterConnection>>) -> MutexGuard<'_, Option<ClusterConnection>> {
    slot.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What to do after a failed attempt.
enum Next {
    /// NOSCRIPT or a missing function: load the code on that node, then
    /// the same target again.
    Load,
    /// FCALL refused by the node: the same call as EVALSHA, same target.
    Scripts,
    /// MOVED or ASK: the node named.
    Go(Target),
    /// The script did not run and the slot's owner may be changing.
    Pause,
    /// The script may have run, or it can never succeed: no retry.
    Fail,
}

fn next_step(err: &RedisError) -> Next {
    let named = || {
        err.redirect_node().and_then(|(addr, _)| {
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_owned(), port.parse::<u16>().ok()?))
        })
    };
    if engine::is_missing_code(err) {
        return Next::Load;
    }
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => named().map_or(Next::Pause, |(host, port)| {
            Next::Go(Target::Moved(host, port))
        }),
        ErrorKind::Server(ServerErrorKind::Ask) => named().map_or(Next::Pause, |(host, port)| {
            Next::Go(Target::Ask(host, port))
        }),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::BusyLoading,
        )
        | ErrorKind::ClusterConnectionNotFound => Next::Pause,
        _ => Next::Fail,
    }
}

/// One attempt on one node; a server error reply is an `Err`.
async fn attempt(conn: &mut ClusterConnection, cmd: &Cmd, target: &Target) -> RedisResult<Value> {
    match target {
        Target::Slot(slot) => {
            let routing = single(Route::with_slot(*slot, SlotAddr::Master));
            conn.route_command(cmd.clone(), routing)
                .await
                .and_then(Value::extract_error)
        }
        Target::Moved(host, port) => conn
            .route_command(cmd.clone(), by_address(host, *port))
            .await
            .and_then(Value::extract_error),
        Target::Ask(host, port) => {
            let mut pipe = redis::pipe();
            pipe.cmd("ASKING").add_command(cmd.clone());
            let routing = SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            };
            let values = conn.route_pipeline(pipe, 1, 1, routing).await?;
            values
                .into_iter()
                .next()
                .ok_or_else(|| RedisError::from((ErrorKind::Parse, "empty reply to ASKING")))
                .and_then(Value::extract_error)
        }
    }
}

fn single(route: Route) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route))
}

fn by_address(host: &str, port: u16) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    })
}

/// The replies of a request's several groups as its verdict, in check
/// order: their limits, decided provisionally, are ruled on together by
/// [`algorithms::settle`], each reporting its outcome for that verdict.
fn merge(
    checks: &[KeyedCheck],
    groups: &[Group],
    results: &[Result<GroupReply, Error>],
) -> Result<Verdict, Error> {
    let mut provisional: Vec<Option<Provisional>> = vec![None; checks.len()];
    for (group, result) in groups.iter().zip(results) {
        match result {
            Ok(GroupReply::Provisional(outcomes, _)) => {
                for (&at, outcome) in group.positions.iter().zip(outcomes) {
                    provisional[at] = Some(*outcome);
                }
            }
            Ok(GroupReply::Whole(_)) => {
                return Err(Error::Protocol("a slot group ruled on the request".into()));
            }
            Err(err) => return Err(err.clone()),
        }
    }
    let provisional = provisional
        .into_iter()
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| Error::Protocol("a check got no outcome".into()))?;
    let checks: Vec<Check> = checks.iter().map(|it| it.check).collect();
    Ok(algorithms::settle(&checks, &provisional))
}

impl fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBackend")
            .field("nodes", &self.shared.redacted_nodes)
            .field("keys", &self.shared.keys)
            .field("clock", &self.shared.clock)
            .field("timeout_ms", &self.shared.timeout_ms)
            .finish_non_exhaustive()
    }
}

#[async_trait::async_trait]
impl Backend for ClusterBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        self.decide_within(checks, &CallContext::unbounded()).await
    }

    /// As the single server's: admitted by the gate (stage queue), a
    /// connection (stage connect), then the groups' calls (stage backend),
    /// none written after the caller's `send_by` ([`Error::Deadline`]) or
    /// the backend's own bound, a retry after a redirect or a pause
    /// included.
    async fn decide_within(
        &self,
        checks: &[KeyedCheck],
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        let this = &self.shared;
        if checks.is_empty() {
            return Ok(Verdict {
                allowed: true,
                outcomes: Vec::new(),
            });
        }
        let groups = this.groups(checks)?;
        let deadline = Instant::now() + this.timeout;
        let (at, late) = sending_bound(deadline, this.timeout, call.send_by.map(Instant::from_std));
        let write_by = WriteBy { at, late };
        // Refunds are not admitted: they must go even when the line is full.
        call.progress.set(Stage::Queue);
        let permit = match this.gate.admit(write_by.at, this.timeout_ms).await {
            Err(Error::Timeout(_)) => return Err(write_by.late),
            admitted => admitted?,
        };
        call.progress.set(Stage::Connect);
        let conn = timeout_at(deadline, this.connection())
            .await
            .map_err(|_| Error::Timeout(this.timeout_ms))??;
        if Instant::now() >= write_by.at {
            // Nobody would wait for its answer (see `Core::call`).
            return Err(write_by.late);
        }
        call.progress.set(Stage::Backend);
        let bounds = Bounds {
            deadline,
            write_by,
            permit,
        };
        this.decide_groups(conn, &groups, checks, bounds, call)
            .await
    }

    /// The cluster reports `cluster_state:ok`, and for every primary the
    /// cluster names, a command routed to one of its slots is answered by
    /// that very node (CLUSTER MYID), within the timeout: a primary down
    /// (the client falls back to another node) or a slot unserved is
    /// unhealthy.
    async fn probe(&self) -> Result<(), Error> {
        let this = &self.shared;
        let deadline = Instant::now() + this.timeout;
        let probed = async {
            let mut conn = this.connection().await?;
            let fail = |err: RedisError| classify(&err, this.timeout_ms);
            // The first primary that answers: a random node may be the dead one.
            let any = RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::OneSucceeded),
            ));
            let value = conn
                .route_command(cluster_cmd("INFO"), any.clone())
                .await
                .map_err(fail)?;
            cluster_ok(value)?;
            let value = conn
                .route_command(cluster_cmd("SLOTS"), any)
                .await
                .map_err(fail)?;
            let checks = primaries(value)?.into_iter().map(|(slot, id)| {
                let mut conn = conn.clone();
                async move {
                    let routing = single(Route::new(slot, SlotAddr::Master));
                    let value = conn.route_command(cluster_cmd("MYID"), routing).await?;
                    let answered: String = redis::from_redis_value(value.extract_error()?)?;
                    Ok::<_, RedisError>((id, answered))
                }
            });
            for result in join_all(checks).await {
                let (id, answered) = result.map_err(fail)?;
                if id != answered {
                    // Down, or failed over while this client's map (which
                    // only a MOVED refreshes) still names it.
                    this.forget_connections();
                    return Err(Error::Unavailable(format!(
                        "redis cluster primary {id} does not answer for its slots"
                    )));
                }
            }
            Ok(())
        };
        timeout_at(deadline, probed)
            .await
            .map_err(|_| Error::Timeout(this.timeout_ms))?
    }

    /// Every pooled connection made, and the function library loaded on
    /// every primary, within the timeout: what the first calls would
    /// otherwise wait for. Done once per backend; a failure is logged at
    /// debug level (the calls then connect and load as they do without it)
    /// and the next warm-up tries again.
    async fn warm_up(&self) {
        let this = &self.shared;
        let deadline = Instant::now() + this.timeout;
        let fail = |err: RedisError| classify(&err, this.timeout_ms);
        let warm = async {
            for _ in 0..this.connections.len() {
                this.connection().await?;
            }
            let conn = this.connection().await?;
            let any = RoutingInfo::MultiNode((
                MultipleNodeRoutingInfo::AllMasters,
                Some(ResponsePolicy::OneSucceeded),
            ));
            let value = conn
                .clone()
                .route_command(cluster_cmd("SLOTS"), any)
                .await
                .map_err(fail)?;
            let loads = primaries(value)?.into_iter().map(|(slot, _)| {
                let mut conn = conn.clone();
                async move {
                    let routing = single(Route::new(slot, SlotAddr::Master));
                    engine::from_load_on_cluster(
                        conn.route_command(engine::library_load(), routing).await,
                    )
                }
            });
            let mut engines = Vec::new();
            for engine in join_all(loads).await {
                engines.push(engine.map_err(fail)?);
            }
            // Functions if any primary has them: a node that refuses them
            // has its slots settled on scripts by its first call (`call`).
            if let Some(&engine) = engines.iter().max_by_key(|it| **it == Engine::Functions) {
                let _ = this.engine.set(engine);
            }
            Ok::<_, Error>(())
        };
        let bounded = async {
            match timeout_at(deadline, warm).await {
                Ok(res) => res,
                Err(_) => Err(Error::Timeout(this.timeout_ms)),
            }
        };
        if let Err(err) = this.warmed.get_or_try_init(|| bounded).await {
            tracing::debug!("redis cluster: could not connect ahead of the first call: {err}");
        }
    }

    fn name(&self) -> &'static str {
        "redis-cluster"
    }

    /// Only where no request spans slots ([`ClusterBackend::never_refunds`]):
    /// elsewhere a refund gives room back to a counter another request
    /// found full (on this instance or another), so the over-limit cache,
    /// which holds that only time frees room, would deny wrongly until the
    /// counter's reset.
    fn local_clock(&self) -> Option<Arc<dyn Clock>> {
        let this = &self.shared;
        this.never_refunds().then(|| this.clock.local_clock())
    }
}

fn cluster_cmd(sub: &str) -> Cmd {
    let mut cmd = redis::cmd("CLUSTER");
    cmd.arg(sub);
    cmd
}

/// One slot of each primary and its id, from a CLUSTER SLOTS answer:
/// `[[start, end, [host, port, id, ...], replicas...], ...]`.
fn primaries(value: Value) -> Result<Vec<(u16, String)>, Error> {
    let bad =
        |err: redis::ParsingError| Error::Protocol(format!("unexpected cluster slots: {err}"));
    let ranges: Vec<Vec<Value>> = redis::from_redis_value(value).map_err(bad)?;
    let mut out: Vec<(u16, String)> = Vec::new();
    for range in ranges {
        let mut fields = range.into_iter();
        let (Some(start), Some(_), Some(node)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let start: u16 = redis::from_redis_value(start).map_err(bad)?;
        let node: Vec<Value> = redis::from_redis_value(node).map_err(bad)?;
        let Some(id) = node.into_iter().nth(2) else {
            continue;
        };
        let id: String = redis::from_redis_value(id).map_err(bad)?;
        if !out.iter().any(|(_, it)| *it == id) {
            out.push((start, id));
        }
    }
    Ok(out)
}

/// Every CLUSTER INFO in `value` (one per primary) says the state is ok.
fn cluster_ok(value: Value) -> Result<(), Error> {
    let mut infos = Vec::new();
    collect_texts(value, &mut infos)?;
    if infos.is_empty() {
        return Err(Error::Unavailable(
            "redis cluster: no primary answered".into(),
        ));
    }
    match infos.iter().find(|it| !it.contains("cluster_state:ok")) {
        Some(_) => Err(Error::Unavailable("redis cluster state is not ok".into())),
        None => Ok(()),
    }
}

/// The text answers in `value`, however the client aggregated them; an
/// error answer is an error.
fn collect_texts(value: Value, out: &mut Vec<String>) -> Result<(), Error> {
    match value {
        Value::BulkString(bytes) => out.push(String::from_utf8_lossy(&bytes).into_owned()),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => out.push(text),
        Value::Array(items) | Value::Set(items) => {
            for item in items {
                collect_texts(item, out)?;
            }
        }
        Value::Map(pairs) => {
            for (_, item) in pairs {
                collect_texts(item, out)?;
            }
        }
        Value::ServerError(err) => {
            return Err(Error::Unavailable(format!("redis cluster: {err:?}")));
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_may_be_addresses_or_urls_and_passwords_are_redacted() {
        assert_eq!(node_url("10.0.0.1:7000"), "redis://10.0.0.1:7000");
        assert_eq!(node_url(" h:1 "), "redis://h:1");
        assert_eq!(node_url("rediss://u:pw@h:1"), "rediss://u:pw@h:1");
        let nodes = ["redis://u:secret@h:1".to_owned(), "h:2".to_owned()];
        assert_eq!(redact_nodes(&nodes), "redis://u:***@h:1,h:2");
    }

    #[test]
    fn credentials_given_on_one_seed_apply_to_the_bare_ones() {
        let nodes = ["h:1".to_owned(), "rediss://:pw@h:2/#insecure".to_owned()];
        assert_eq!(
            seed_urls(&nodes),
            ["rediss://:pw@h:1", "rediss://:pw@h:2/#insecure"]
        );
        let plain = ["h:1".to_owned(), "redis://h:2".to_owned()];
        assert_eq!(seed_urls(&plain), ["redis://h:1", "redis://h:2"]);
    }

    /// Only where every request is one slot is the over-limit cache
    /// offered a clock: the domain tag, or a prefix tagged by the operator.
    #[test]
    fn the_over_limit_cache_is_offered_only_where_nothing_is_refunded() {
        let with = |prefix: &str, hash_tag| {
            ClusterBackend::connect(ClusterSettings {
                nodes: vec!["127.0.0.1:7000".to_owned()],
                pool_size: 1,
                timeout_ms: 100,
                keys: KeyFormat::new(prefix, hash_tag),
                clock: ClockSource::Redis,
                expiry_grace_ms: 0,
                tls: RedisTls::default(),
            })
            .expect("settings")
        };
        for (prefix, hash_tag, cached) in [
            ("tg", HashTag::Domain, true),
            ("{tg}", HashTag::None, true),
            ("a{tg}b", HashTag::Descriptor, true),
            ("tg", HashTag::None, false),
            ("tg", HashTag::Descriptor, false),
            ("{}tg", HashTag::None, false),
            ("{tg", HashTag::None, false),
        ] {
            let backend = with(prefix, hash_tag);
            assert_eq!(backend.never_refunds(), cached, "{prefix} {hash_tag:?}");
            assert_eq!(
                backend.local_clock().is_some(),
                cached,
                "{prefix} {hash_tag:?}"
            );
        }
    }

    #[test]
    fn settings_without_seeds_or_with_a_zero_bound_are_refused() {
        let settings = ClusterSettings {
            nodes: vec!["127.0.0.1:7000".to_owned()],
            pool_size: 1,
            timeout_ms: 100,
            keys: KeyFormat::default(),
            clock: ClockSource::Redis,
            expiry_grace_ms: 0,
            tls: RedisTls::default(),
        };
        assert!(ClusterBackend::connect(settings.clone()).is_ok());
        for bad in [
            ClusterSettings {
                nodes: Vec::new(),
                ..settings.clone()
            },
            ClusterSettings {
                pool_size: 0,
                ..settings.clone()
            },
            ClusterSettings {
                timeout_ms: 0,
                ..settings.clone()
            },
        ] {
            let err = ClusterBackend::connect(bad).expect_err("refused");
            assert!(matches!(err, Error::Protocol(_)), "{err:?}");
        }
    }
}
