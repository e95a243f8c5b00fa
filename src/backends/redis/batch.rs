//! Concurrent decisions bound for one Redis coalesced into one call.
//!
//! Calls in flight are limited to one per pooled connection. A request
//! that finds a free slot is sent at once, alone: an idle service adds no
//! wait. A request that finds every slot taken waits in a queue; when a
//! call returns, its slot takes the queue's oldest requests (at most
//! [`BatchSettings::max_requests`] and [`BatchSettings::max_keys`]) into
//! one call of `decide_batch`, which decides them one after the other, in
//! arrival order, each all-or-nothing with its own answer. A wait is
//! bounded by the request's own timeout; a request whose caller gave up
//! before its batch left is never sent, nor one whose caller's deadline
//! leaves no time for it (answered [`Error::Deadline`] when the batch is
//! formed), and a batch is sent only before the deadline of its oldest
//! request and the earliest `send_by` of its requests' callers. The queue holds at most
//! `max_waiting` requests (as many as the gate lets wait); beyond, a
//! request is refused at once with [`Error::Shed`].
//!
//! A batch that fails (timeout, dropped connection, an error reply) fails
//! every request in it with the same classified error, and is never
//! retried: it may have run. A member the script refuses or fails on its
//! own (bad parameters, a Redis error on one of its keys) is answered in
//! its own section of the reply: it alone gets the error, the others
//! their verdicts.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::engine::Entry;
use super::script::{self, BATCH_FIELDS, REQUEST_FIELDS};
use super::{BatchSettings, CallContext, Core, Encoded, Error, Stage};
use crate::algorithms::Verdict;

/// The queue and the slots of one backend.
pub(super) struct Batcher {
    settings: BatchSettings,
    max_in_flight: usize,
    max_waiting: usize,
    /// A std Mutex: held only to push, pop and count, never across `.await`.
    state: Mutex<State>,
}

struct State {
    in_flight: usize,
    waiting: VecDeque<Waiting>,
}

/// A queued request and where its answer goes.
struct Waiting {
    request: Encoded,
    /// When its caller gives up.
    deadline: Instant,
    /// Its caller's deadline for sending, and its stage.
    call: CallContext,
    answer: oneshot::Sender<Result<Verdict, Error>>,
}

/// A call slot: handed on to the queue when dropped, however the call
/// ended (answered, failed, or its caller gone).
struct Slot(Arc<Core>);

impl Batcher {
    pub(super) fn new(
        settings: BatchSettings,
        max_in_flight: usize,
        max_waiting: usize,
    ) -> Batcher {
        Batcher {
            settings,
            max_in_flight: max_in_flight.max(1),
            max_waiting,
            state: Mutex::new(State {
                in_flight: 0,
                waiting: VecDeque::new(),
            }),
        }
    }

    pub(super) fn settings(&self) -> BatchSettings {
        self.settings
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The oldest waiting requests within the bounds (at least one, when
    /// any waits); those whose callers gave up are dropped unsent, and
    /// those whose callers' `send_by` has passed are answered
    /// [`Error::Deadline`] unsent. Empty when none waits: the slot is then
    /// given back.
    fn next_batch(&self) -> Vec<Waiting> {
        let now = std::time::Instant::now();
        let mut state = self.lock();
        let mut batch = Vec::new();
        let mut n_keys = 0;
        while let Some(next) = state.waiting.front() {
            if next.answer.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            if next.call.send_by.is_some_and(|it| it <= now) {
                if let Some(late) = state.waiting.pop_front() {
                    let _ = late.answer.send(Err(Error::Deadline));
                }
                continue;
            }
            let keys = next.request.keys.len();
            let full = batch.len() >= self.settings.max_requests
                || (!batch.is_empty() && n_keys + keys > self.settings.max_keys);
            if full {
                break;
            }
            n_keys += keys;
            batch.extend(state.waiting.pop_front());
        }
        if batch.is_empty() {
            state.in_flight -= 1;
        }
        batch
    }
}

/// Decides `request`: at once when a slot is free, else with the next
/// batch.
pub(super) async fn decide(
    core: &Arc<Core>,
    request: Encoded,
    call: &CallContext,
) -> Result<Verdict, Error> {
    let Some(batcher) = &core.batcher else {
        return core.decide_one(&request, call).await;
    };
    let deadline = Instant::now() + core.timeout;
    let receiver = {
        let mut state = batcher.lock();
        if state.in_flight < batcher.max_in_flight {
            state.in_flight += 1;
            Err(request)
        } else if state.waiting.len() >= batcher.max_waiting {
            return Err(Error::Shed(batcher.max_waiting));
        } else {
            let (answer, receiver) = oneshot::channel();
            call.progress.set(Stage::Queue);
            state.waiting.push_back(Waiting {
                request,
                deadline,
                call: call.clone(),
                answer,
            });
            Ok(receiver)
        }
    };
    let receiver = match receiver {
        Ok(receiver) => receiver,
        Err(request) => {
            let _slot = Slot(core.clone());
            return core.decide_one_by(deadline, &request, call).await;
        }
    };
    match timeout_at(deadline, receiver).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(Error::Unavailable("redis batch abandoned".into())),
        Err(_) => Err(Error::Timeout(core.timeout_ms)),
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let Some(batcher) = &self.0.batcher else {
            return;
        };
        let batch = batcher.next_batch();
        if batch.is_empty() {
            return;
        }
        // The slot goes with the batch: a new task, so the call that just
        // ended answers its own caller without waiting for the next one.
        let core = self.0.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to send it: the waiters are answered by the
            // dropped senders.
            return;
        };
        runtime.spawn(async move {
            let _slot = Slot(core.clone());
            send(&core, batch).await;
        });
    }
}

/// Sends one batch and answers each of its requests.
async fn send(core: &Core, batch: Vec<Waiting>) {
    // The oldest request's deadline: after it, that caller has been
    // answered under the failure mode, and the batch is not sent.
    let deadline = batch
        .iter()
        .map(|it| it.deadline)
        .min()
        .unwrap_or_else(|| Instant::now() + core.timeout);
    if let [only] = &batch[..] {
        let answer = core
            .decide_one_by(deadline, &only.request, &only.call)
            .await;
        for it in batch {
            let _ = it.answer.send(answer.clone());
        }
        return;
    }
    match decide_batch(core, deadline, &batch).await {
        Ok(answers) => {
            // A member the script refused gets its own error alone.
            for (it, answer) in batch.into_iter().zip(answers) {
                let _ = it.answer.send(answer);
            }
        }
        Err(err) => {
            for it in batch {
                let _ = it.answer.send(Err(err.clone()));
            }
        }
    }
}

/// One call of `decide_batch` for `batch`: an answer per request, in order.
async fn decide_batch(
    core: &Core,
    deadline: Instant,
    batch: &[Waiting],
) -> Result<Vec<Result<Verdict, Error>>, Error> {
    let sizes: Vec<usize> = batch.iter().map(|it| it.request.keys.len()).collect();
    // Written only while every request's caller can still use its answer.
    let send_by = batch
        .iter()
        .filter_map(|it| it.call.send_by)
        .min()
        .map(Instant::from_std);
    let report = |stage| {
        for it in batch {
            it.call.progress.set(stage);
        }
    };
    let reply = core
        .call(
            deadline,
            send_by,
            report,
            Entry::DecideBatch,
            sizes.iter().sum(),
            |cmd| {
                for it in batch {
                    cmd.arg(&it.request.keys);
                }
                for field in &BATCH_FIELDS {
                    cmd.arg((field.value)(&batch.len()));
                }
                for it in batch {
                    for field in &REQUEST_FIELDS {
                        cmd.arg((field.value)(&it.request.keys.len()));
                    }
                    script::write_request(cmd, &it.request.header, &it.request.limits);
                }
            },
        )
        .await?;
    script::parse_batch_reply(&reply, &sizes)
}
