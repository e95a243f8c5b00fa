//! Refunds: what the groups of a request over several slots took, given
//! back when the request is denied or one of its groups fails (see
//! `script`'s "Refunds"); and what becomes of a group's decision that
//! comes after its request's `answer_by`.
//!
//! Invariant: a refund is sent at most once, never retried after a
//! timeout (a replay would give back other requests' units); a lost one
//! only leaves counters higher until their window passes.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use redis::Cmd;
use redis::cluster_async::ClusterConnection;
use tokio::time::{Instant, timeout_at};

use super::super::call::{CallTerms, LateDropped, LateReply};
use super::super::engine::{Engine, LuaEntry};
use super::super::script::{self, Receipt, RefundArgs, RefundHeader};
use super::nodes::Cluster;
use super::routing::{Group, Unanswered};
use crate::backends::{Error, KeyedCheck, LateVerdict};

/// What becomes of a group's decision that comes after its request's
/// `answer_by` (the request already failed with a timeout).
pub(super) enum ClusterLate {
    /// The request's only call: its verdict is counted there.
    Count(LateVerdict),
    /// One group of several: refunded if it took something, since the
    /// request failed whole; nothing is counted.
    Refund,
}

/// A late decision of one group of several, refunded on the request's
/// connection, for the request's checks.
pub(super) struct RefundLate {
    pub(super) cluster: Arc<Cluster>,
    pub(super) conn: ClusterConnection,
    pub(super) group: Group,
    pub(super) checks: Vec<KeyedCheck>,
}

impl LateReply for RefundLate {
    async fn hear(self, reply: Vec<i64>) {
        let n_keys = self.group.keys.len();
        if let Ok((_, receipts)) = script::decode_provisional(&reply, n_keys)
            && !receipts.iter().all(Receipt::is_empty)
        {
            self.cluster
                .refund_group(self.conn, &self.group, &self.checks, &receipts)
                .await;
        }
    }
}

impl Cluster {
    /// Gives back what a group took, once, within its own deadline. A
    /// failure is logged (at most once a second) and counted: it only
    /// leaves the group's counters higher until their window passes, never
    /// lets a request over a limit.
    pub(super) async fn refund_group(
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
            let entry = (engine, LuaEntry::Refund);
            let unbound = None::<(&CallTerms<LateDropped>, _)>;
            let value = match self
                .route(&mut conn, entry, &cmd, group.slot, unbound)
                .await
            {
                Ok(value) => value,
                Err(Unanswered::Failed(err)) => return Err(err),
                // Only a decision's attempts are handed back late.
                Err(Unanswered::Late(_)) => return Err(Error::Timeout(self.timeout_ms)),
            };
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
        let mut cmd = engine.command(LuaEntry::Refund, keys.len());
        cmd.arg(keys).arg(script::refund_argv(&header, &limits));
        Some((cmd, positions))
    }
}
