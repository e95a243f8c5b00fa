//! The cluster as the backend reaches it: the client, its pooled
//! connections, how each slot's primary runs our code, and the gate.
//! Shared with the tasks that hear a group's reply after its request's
//! timeout.
//!
//! Invariant: the engine is found once per cluster, and a slot whose node
//! refused the function library keeps to scripts for good.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::RedisError;
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use tokio::sync::OnceCell;

use super::super::engine::{self, Engine};
use super::super::failure::classify;
use super::super::gate::Gate;
use super::super::script::HeaderArgs;
use super::super::settings::ClockSource;
use crate::backends::Error;
use crate::backends::keys::{HashTag, KeyFormat};
use crate::log_gate::LogGate;

/// A Redis Cluster: what every call to it shares.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    /// Made on first use, so an unreachable cluster at start-up is not an
    /// error; a failed attempt is tried again by the next call. Emptied
    /// when the probe finds the client's slot map stale (see `probe`).
    pub(super) connections: Vec<Mutex<Option<ClusterConnection>>>,
    pub(super) next: AtomicUsize,
    /// FCALL or EVALSHA, found at the first call (see `engine`): what
    /// every node is first sent.
    pub(super) engine: OnceCell<Engine>,
    /// The slots whose node refused the function library (see
    /// `routing`): their calls go as EVALSHA.
    pub(super) scripts_only: ScriptsOnly,
    /// Set by the first `warm_up` that succeeds: the cluster has no
    /// per-thread connections, so the serving threads' warm-ups find it
    /// done (or wait for the one under way).
    pub(super) warmed: OnceCell<()>,
    pub(super) refund_failures: AtomicU64,
    pub(super) refund_log: LogGate,
    pub(super) keys: KeyFormat,
    pub(super) clock: ClockSource,
    pub(super) timeout: Duration,
    pub(super) timeout_ms: u64,
    pub(super) expiry_grace_ms: u64,
    pub(super) redacted_nodes: String,
    /// Bounds the requests sent and waiting toward the cluster (see
    /// `gate`): one place per request, whatever its number of slots.
    pub(super) gate: Gate,
}

impl Cluster {
    /// How the primary of `slot` runs our code: the cluster's engine,
    /// found once by loading the library on the first slot's primary,
    /// unless that slot's node has since refused the library.
    pub(super) async fn engine(
        &self,
        conn: &mut ClusterConnection,
        slot: Slot,
    ) -> Result<Engine, Error> {
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

    /// A cluster connection, made now if this place of the pool has none.
    pub(super) async fn connection(&self) -> Result<ClusterConnection, Error> {
        let idx = self.next.fetch_add(1, Ordering::Relaxed) % self.connections.len();
        let place = &self.connections[idx];
        if let Some(conn) = lock(place).clone() {
            return Ok(conn);
        }
        let conn = self
            .client
            .get_async_connection()
            .await
            .map_err(|err| classify(&err, self.timeout_ms))?;
        *lock(place) = Some(conn.clone());
        Ok(conn)
    }

    /// Drops every pooled connection: the next calls connect afresh and
    /// read the current slot map. Calls in flight keep their clones.
    pub(super) fn forget_connections(&self) {
        for place in &self.connections {
            *lock(place) = None;
        }
    }

    /// The decision's header; `receipts` when the request spans slots and
    /// may have to be refunded.
    pub(super) fn header(&self, receipts: bool) -> HeaderArgs {
        HeaderArgs::now(&self.clock, self.expiry_grace_ms, receipts)
    }

    /// Whether every request is one call on one slot (see
    /// `ClusterBackend::never_refunds`).
    pub(super) fn never_refunds(&self) -> bool {
        let prefix = &self.keys.prefix;
        let prefix_tagged = prefix
            .find('{')
            .and_then(|open| prefix[open + 1..].find('}'))
            .is_some_and(|len| len > 0);
        prefix_tagged || self.keys.hash_tag == HashTag::Domain
    }

    /// Remembers that `slot`'s node refused the function library.
    pub(super) fn keep_to_scripts(&self, slot: Slot, refused: &RedisError) {
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
pub(super) struct ScriptsOnly {
    any: AtomicBool,
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

/// A pooled connection's place; a panic elsewhere cannot leave an
/// `Option` half-written.
fn lock(place: &Mutex<Option<ClusterConnection>>) -> MutexGuard<'_, Option<ClusterConnection>> {
    place.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) fn single(route: Route) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route))
}
