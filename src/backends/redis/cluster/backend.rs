//! The Redis Cluster backend: a request's counters grouped by hash slot
//! ([`routing`](super::routing)), each group decided on its node and the
//! request ruled on from all of them ([`merge`](super::merge)); health
//! from every primary, and the library loaded ahead of the first calls.
//!
//! Invariant: a request holds one place in the gate, whatever its number
//! of slots, and its decision reaches the cluster through the one call
//! path ([`call`](super::super::call)); refunds, bounded by their own
//! deadline, bypass the gate.

use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, Route, RoutingInfo, SlotAddr,
};
use redis::{Cmd, RedisError, Value};
use tokio::sync::OnceCell;
use tokio::time::{Instant, timeout_at};

use super::super::call::CallTerms;
use super::super::engine::{self, Engine};
use super::super::failure::classify;
use super::super::gate::Gate;
use super::super::script;
use super::nodes::{Cluster, ScriptsOnly, single};
use super::refund::ClusterLate;
use super::settings::{ClusterSettings, redact_nodes};
use crate::algorithms::Verdict;
use crate::backends::{Backend, CallContext, CounterKey, Error, KeyedCheck, Stage};
use crate::clock::Clock;
use crate::log_gate::LogGate;

/// Counters in a Redis Cluster, shared by every replica pointed at it.
pub struct ClusterBackend {
    cluster: Arc<Cluster>,
}

// === impl ClusterBackend ===

impl ClusterBackend {
    /// Checks the settings; connects on first use.
    pub fn connect(settings: ClusterSettings) -> Result<ClusterBackend, Error> {
        settings.validate()?;
        let client = settings.client()?;
        let pool_size = usize::try_from(settings.pool_size).unwrap_or(1);
        let cluster = Cluster {
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
            cluster: Arc::new(cluster),
        })
    }

    /// The Redis key of a counter, as the script reads and writes it.
    pub fn key_of(&self, key: &CounterKey) -> String {
        self.cluster.keys.encode(key)
    }

    /// The SHA1 the decision script is invoked by where the servers have
    /// no functions (EVALSHA).
    pub fn script_hash(&self) -> String {
        redis::Script::new(script::DECIDE_LUA).get_hash().to_owned()
    }

    /// Whether every request is one call on one slot, so that no refund is
    /// ever made: the domain hash tag, or a prefix carrying a hash tag of
    /// its own (the first `{...}` of every key).
    pub fn never_refunds(&self) -> bool {
        self.cluster.never_refunds()
    }

    /// Refunds that failed (timed out, or an error) since start-up.
    pub fn refund_failures(&self) -> u64 {
        self.cluster.refund_failures.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for ClusterBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterBackend")
            .field("nodes", &self.cluster.redacted_nodes)
            .field("keys", &self.cluster.keys)
            .field("clock", &self.cluster.clock)
            .field("timeout_ms", &self.cluster.timeout_ms)
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
        let this = &self.cluster;
        if checks.is_empty() {
            return Ok(Verdict {
                allowed: true,
                outcomes: Vec::new(),
            });
        }
        let groups = this.groups(checks)?;
        let answer_by = Instant::now() + this.timeout;
        let late = match groups.len() {
            1 => call.late.clone().map(ClusterLate::Count),
            _ => Some(ClusterLate::Refund),
        };
        let send_by = call.send_by.map(Instant::from_std);
        let terms = CallTerms::new(answer_by, this.timeout, send_by, late);
        let report = |stage| call.progress.set(stage);
        let too_slow = || Error::Timeout(this.timeout_ms);
        // Refunds are not admitted: they must go even when the line is full.
        let (place, conn) = terms
            .open(
                &this.gate,
                this.timeout_ms,
                report,
                this.connection(),
                too_slow,
            )
            .await?;
        call.progress.set(Stage::Backend);
        this.decide_groups(conn, &groups, checks, terms, place)
            .await
    }

    /// The cluster reports `cluster_state:ok`, and for every primary the
    /// cluster names, a command routed to one of its slots is answered by
    /// that very node (CLUSTER MYID), within the timeout: a primary down
    /// (the client falls back to another node) or a slot unserved is
    /// unhealthy.
    async fn probe(&self) -> Result<(), Error> {
        let this = &self.cluster;
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
        let this = &self.cluster;
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
        let this = &self.cluster;
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
mod tests;
