//! The merge of groups: each group of a request decided on its slot's
//! node, concurrently, and the request ruled on from what each limit
//! reports (`algorithms::settle`, the rules every backend follows).
//!
//! Invariant: a request over several groups that is denied, or whose
//! group failed, consumes nothing: what its groups took is refunded.

use std::sync::Arc;

use futures_util::future::join_all;
use redis::Cmd;
use redis::cluster_async::ClusterConnection;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::timeout_at;

use super::super::call::{CallTerms, CountLate, hear_late};
use super::super::engine::{Engine, LuaEntry};
use super::super::script::{self, HeaderArgs, Receipt, ScriptLimit};
use super::nodes::Cluster;
use super::refund::{ClusterLate, RefundLate};
use super::routing::{Group, LateAttempt, Unanswered};
use crate::algorithms::{self, Check, Provisional, Verdict};
use crate::backends::{Error, KeyedCheck};

/// What one group's call answered.
pub(super) enum GroupReply {
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
impl Cluster {
    /// FCALL (or EVALSHA) of the decision over one group.
    fn decide_cmd(
        engine: Engine,
        header: &HeaderArgs,
        group: &Group,
        checks: &[KeyedCheck],
    ) -> Cmd {
        let limits: Vec<ScriptLimit> = group
            .positions
            .iter()
            .map(|&at| ScriptLimit::of(&checks[at].check))
            .collect();
        let mut cmd = engine.command(LuaEntry::Decide, group.keys.len());
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
        decision: (&CallTerms<ClusterLate>, &Arc<OwnedSemaphorePermit>),
    ) -> Result<GroupReply, Unanswered> {
        let answer_by = decision.0.answer_by;
        let engine = match timeout_at(answer_by, self.engine(&mut conn, group.slot)).await {
            Ok(engine) => engine?,
            Err(_) => return Err(Unanswered::Failed(Error::Timeout(self.timeout_ms))),
        };
        let cmd = Self::decide_cmd(engine, header, group, checks);
        let entry = (engine, LuaEntry::Decide);
        let value = self
            .route(&mut conn, entry, &cmd, group.slot, Some(decision))
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
    /// Decides every group concurrently, then the request from what each
    /// limit reports (`algorithms::settle`, the rules every backend
    /// follows); if it is denied, or a group failed (the failure mode
    /// decides then), the groups that took something are refunded
    /// (concurrently).
    ///
    /// Each group's call ends by `terms.answer_by` (NEVER retried after a
    /// timeout: its script may have run); refunds have deadlines of their
    /// own, so a group that times out never keeps the others from being
    /// refunded.
    ///
    /// A group whose call was on its way to Redis at `answer_by` fails the
    /// request (the failure mode answers it), and its reply is then heard
    /// late as `terms.late` says, holding a share of the request's `place`
    /// in the gate, for at most [`UNANSWERED_AFTER`] more: all or nothing
    /// still, so the request that failed consumes nothing.
    ///
    /// [`UNANSWERED_AFTER`]: super::super::gate::UNANSWERED_AFTER
    pub(super) async fn decide_groups(
        self: &Arc<Self>,
        conn: ClusterConnection,
        groups: &[Group],
        checks: &[KeyedCheck],
        terms: CallTerms<ClusterLate>,
        place: OwnedSemaphorePermit,
    ) -> Result<Verdict, Error> {
        let header = self.header(groups.len() > 1);
        let place = Arc::new(place);
        let timeout_ms = self.timeout_ms;
        // Every wait of a group ends by `answer_by` on its own (the engine
        // above, a script load or a pause in `route`, the reply in
        // `CallTerms::reply`), so a written attempt is always handed back
        // as `Unanswered::Late` to be heard, never dropped by an outer
        // bound.
        let calls = groups
            .iter()
            .map(|group| self.decide_group(conn.clone(), &header, group, checks, (&terms, &place)));
        let replies = join_all(calls).await;
        let mut results: Vec<Result<GroupReply, Error>> = replies
            .into_iter()
            .zip(groups)
            .map(|(reply, group)| match reply {
                Ok(reply) => Ok(reply),
                Err(Unanswered::Failed(err)) => Err(err),
                Err(Unanswered::Late(attempt)) => {
                    self.hear_late_group(attempt, group, checks, &conn, terms.late.as_ref());
                    Err(Error::Timeout(timeout_ms))
                }
            })
            .collect();
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

    /// Hears, in a task of its own, `attempt`, the decision of `group` on
    /// its way at its request's `answer_by`, as `late` says: the request's
    /// only call hands its verdict to be counted; a group of a request over
    /// several slots (which failed whole) is refunded if it took
    /// something, and nothing is counted; without `late` the reply is
    /// awaited (holding its place) and dropped.
    fn hear_late_group(
        self: &Arc<Self>,
        attempt: LateAttempt,
        group: &Group,
        checks: &[KeyedCheck],
        conn: &ClusterConnection,
        late: Option<&ClusterLate>,
    ) {
        match late {
            None => drop(attempt),
            Some(ClusterLate::Count(verdict)) => {
                hear_late(attempt, CountLate::new(verdict.clone(), group.keys.len()));
            }
            Some(ClusterLate::Refund) => {
                let refund = RefundLate {
                    cluster: self.clone(),
                    conn: conn.clone(),
                    group: group.clone(),
                    checks: checks.to_vec(),
                };
                hear_late(attempt, refund);
            }
        }
    }
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
