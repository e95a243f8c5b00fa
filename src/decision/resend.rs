//! Charges sent again after their caller's time: a request that records
//! usage after the fact (a limit charged always, with a cost) is written
//! to the backend even when its caller was answered without it.
//!
//! Envoy ignores the answer to a stream-done charge: what matters is that
//! the backend records it. A charge whose call was never written in its
//! caller's time (its deadline passed before it could be sent, it was left
//! out of a batch, shed by the queue bound, or failed at once while the
//! circuit was open) is handed to a task of its own, which sends it again
//! (with a growing pause between attempts) until it is written or
//! [`RESEND_WITHIN`] has passed since it was handed over. A written
//! charge's reply is awaited as any call's (its verdict counted when it
//! comes, late or not); a call once written is never sent again, since it
//! may have run.
//!
//! At most [`MAX_RESENDS`] charges are held at once, so a stalled backend
//! cannot make the service hold unbounded work; a charge beyond that, or
//! still unwritten after [`RESEND_WITHIN`], is lost and counted
//! (`throttlegate_charges_lost_total`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::algorithms::Charge;
use crate::backends::{CallContext, LateVerdict, Progress, Stage};
use crate::rules::RuleSet;

use super::Shared;
use super::plan::Plan;

/// How long a charge is sent again after it was handed over: the same
/// bound as a late reply's (`UNANSWERED_AFTER` of the Redis backend), so
/// a charge Redis could record within it is recorded.
pub const RESEND_WITHIN: Duration = Duration::from_secs(10);

/// Most charges held for sending again at once, per service. Each holds
/// its request's plan (well under a few KB), so at most tens of MB.
pub const MAX_RESENDS: usize = 10_000;

/// The first pause after an attempt that wrote nothing; doubled after each
/// up to [`LAST_PAUSE`]: a backend that is down is not asked in a loop,
/// and one that is back is used within a quarter of a second.
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const LAST_PAUSE: Duration = Duration::from_millis(250);

/// The charges held for sending again.
#[derive(Debug, Default)]
pub(super) struct Resends {
    held: Arc<AtomicUsize>,
}

/// A place among the held charges, given back on drop.
struct Held(Arc<AtomicUsize>);

/// A request's backend call as planned: its plan, the rules and domain it
/// was planned in, and the limiter; what a charge is sent again with.
#[derive(Clone)]
pub(super) struct PlannedCall {
    pub(super) shared: Arc<Shared>,
    pub(super) rules: Arc<RuleSet>,
    pub(super) domain: String,
    pub(super) plan: Arc<Plan>,
}

/// Whether `plan` records usage whatever the verdict: some limit charged
/// always with a cost. Only such requests are sent again: for any other,
/// an answer nobody waits for is worth nothing.
pub(super) fn is_charge(plan: &Plan) -> bool {
    plan.checks
        .iter()
        .any(|it| it.check.cost > 0 && it.check.params.charge() == Charge::Always)
}

impl Resends {
    fn take(&self) -> Option<Held> {
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < MAX_RESENDS).then_some(n + 1)
            })
            .ok()
            .map(|_| Held(self.held.clone()))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl PlannedCall {
    /// Hands the charge, never written, to a task that sends it again; lost
    /// (and counted) when [`MAX_RESENDS`] are held already.
    pub(super) fn resend(self) {
        let metrics = self.shared.metrics.clone();
        let Some(held) = self.shared.resends.take() else {
            metrics.record_charge_lost();
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            metrics.record_charge_lost();
            return;
        };
        runtime.spawn(async move {
            let _held = held;
            if !self.send_until(Instant::now() + RESEND_WITHIN).await {
                metrics.record_charge_lost();
            }
        });
    }

    /// Sends the charge until a call is written or `until` passes; whether
    /// one was written.
    async fn send_until(&self, until: Instant) -> bool {
        let PlannedCall {
            shared,
            rules,
            domain,
            plan,
        } = self;
        let mut pause = FIRST_PAUSE;
        loop {
            let progress = Progress::new(Stage::Decide);
            let late = {
                let (shared, rules, plan, domain) =
                    (shared.clone(), rules.clone(), plan.clone(), domain.clone());
                LateVerdict::new(move |verdict| {
                    shared.count_resent(&rules, &domain, &plan, &verdict);
                })
            };
            let call = CallContext {
                send_by: None,
                progress: progress.clone(),
                late: Some(late),
            };
            match shared.call_backend(rules, plan, Some(&call), None).await {
                Ok(verdict) => {
                    shared.count_resent(rules, domain, plan, &verdict);
                    return true;
                }
                // Written: it may have run, and is never sent again; a late
                // reply is counted through `late`.
                Err(_) if progress.get() == Stage::Backend => return true,
                Err(_) => {}
            }
            if Instant::now() + pause >= until {
                return false;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LAST_PAUSE);
        }
    }
}
