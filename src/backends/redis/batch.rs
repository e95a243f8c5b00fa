//! Concurrent decisions bound for one Redis coalesced into one call. The
//! batching rules, written here only:
//!
//! - Calls in flight are limited to one per pooled connection: each is a
//!   turn. A request that finds a free turn is sent at once, alone: an
//!   idle service adds no wait.
//! - A request that finds every turn taken waits in a queue of at most
//!   `max_waiting` requests (as many as the gate lets wait); beyond, it is
//!   refused at once with [`Error::Shed`]. A wait is bounded by the
//!   request's own timeout.
//! - When a call returns, its turn takes the queue's oldest requests that
//!   can still be written (at most [`BatchSettings::max_requests`] and
//!   [`BatchSettings::max_keys`], and with the calls in flight at most
//!   `max_keys_in_flight` keys, eight batches' worth, which only caps the
//!   work ahead of a new call when the pool is large) into one call of
//!   `decide_batch`, which decides them one after the other, in arrival
//!   order, each all-or-nothing with its own answer.
//! - Each request keeps its own [`CallTerms`] in a batch. Requests whose
//!   moment to be written has passed are answered when a batch is formed,
//!   never carried into it: under overload the oldest requests are out of
//!   time, and batches of them kept Redis working for callers already
//!   answered. At the moment the call is written each request is looked
//!   at again: one whose caller has gone is left out unsent, one whose own
//!   moment has passed (its caller's `send_by`, or a quarter of its
//!   timeout left) is left out and answered ([`Error::Deadline`], or
//!   [`Error::Timeout`]); the others go. A caller that leaves once its
//!   request is written finds it in [`Stage::Backend`] and its decision
//!   is still counted; one that leaves before can no longer be written
//!   ([`crate::backends::Progress`]).
//! - A batch that fails (timeout, dropped connection, an error reply)
//!   fails every request in it with the same classified error, and is
//!   never retried: it may have run. A member the script refuses or fails
//!   on its own (bad parameters, a Redis error on one of its keys) is
//!   answered in its own section of the reply: it alone gets the error,
//!   the others their verdicts.
//!
//! Invariant: every request taken into a batch is answered exactly once,
//! and no request is written after its own `send_by`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::call::{CallTerms, LateDropped, LateReply};
use super::engine::{Engine, LuaEntry};
use super::script::{self, BATCH_FIELDS, REQUEST_FIELDS};
use super::server::{Encoded, SingleServer};
use super::settings::BatchSettings;
use crate::algorithms::Verdict;
use crate::backends::{CallContext, Error, Stage};

/// The queue and the turns of one server's calls.
pub(super) struct Batcher {
    server: Arc<SingleServer>,
    settings: BatchSettings,
    max_in_flight: usize,
    max_waiting: usize,
    /// Most keys in the calls in flight together (eight times
    /// [`BatchSettings::max_keys`]), so that the work ahead of a new call
    /// in Redis stays a few batches' worth, however many connections.
    max_keys_in_flight: usize,
    /// A std Mutex: held only to push, pop and count, never across `.await`.
    queue: Mutex<BatchQueue>,
}

/// The requests waiting for a turn, and the turns taken.
struct BatchQueue {
    /// Calls in flight (turns taken).
    in_flight: usize,
    /// Requests in the calls in flight.
    keys_in_flight: usize,
    waiting: VecDeque<QueuedRequest>,
}

/// A queued request and where its answer goes.
struct QueuedRequest {
    request: Encoded,
    /// Its own terms: when its caller gives up, and the last moment it may
    /// be written (and its answer when that passes unwritten).
    terms: CallTerms<LateDropped>,
    /// Its caller's deadline for sending, its stage, and where its late
    /// verdict goes.
    call: CallContext,
    answer: oneshot::Sender<Result<Verdict, Error>>,
}

/// A turn: one of the calls allowed in flight, handed on to the queue
/// when dropped, however the call ended (answered, failed, or its caller
/// gone).
struct Turn {
    batcher: Arc<Batcher>,
    /// The keys its call carries.
    keys: usize,
}

impl Batcher {
    /// The batcher of `server`'s calls: at most `max_in_flight` of them.
    pub(super) fn new(
        server: Arc<SingleServer>,
        settings: BatchSettings,
        max_in_flight: usize,
        max_keys_in_flight: usize,
        max_waiting: usize,
    ) -> Batcher {
        Batcher {
            server,
            settings,
            max_in_flight: max_in_flight.max(1),
            max_keys_in_flight: max_keys_in_flight.max(1),
            max_waiting,
            queue: Mutex::new(BatchQueue {
                in_flight: 0,
                keys_in_flight: 0,
                waiting: VecDeque::new(),
            }),
        }
    }

    pub(super) fn settings(&self) -> BatchSettings {
        self.settings
    }

    fn lock(&self) -> MutexGuard<'_, BatchQueue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next batch: the oldest waiting requests that can still be
    /// written, within [`BatchSettings`] and within the keys the calls in
    /// flight leave of `max_keys_in_flight` (at least one request, when any
    /// waits). Those met on the way whose callers gave up are dropped, and
    /// those whose own moment to be written has passed answered, unsent.
    /// Empty when none waits: the turn is then given back. The call that
    /// just ended carried `done` keys, no longer in flight.
    fn next_batch(&self, done: usize) -> Vec<QueuedRequest> {
        self.lock()
            .next_batch(done, self.settings, self.max_keys_in_flight)
    }

    /// Decides `request`: at once when a turn is free, else with the next
    /// batch.
    pub(super) async fn decide(
        self: &Arc<Self>,
        request: Encoded,
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        let server = &self.server;
        let answer_by = Instant::now() + server.timeout;
        let receiver = {
            let mut queue = self.lock();
            if queue.in_flight < self.max_in_flight {
                queue.in_flight += 1;
                queue.keys_in_flight += request.keys.len();
                Err(request)
            } else if queue.waiting.len() >= self.max_waiting {
                return Err(Error::Shed(self.max_waiting));
            } else {
                let (answer, receiver) = oneshot::channel();
                call.progress.set(Stage::Queue);
                let send_by = call.send_by.map(Instant::from_std);
                queue.waiting.push_back(QueuedRequest {
                    request,
                    terms: CallTerms::new(answer_by, server.timeout, send_by, None),
                    call: call.clone(),
                    answer,
                });
                Ok(receiver)
            }
        };
        let receiver = match receiver {
            Ok(receiver) => receiver,
            Err(request) => {
                let _turn = Turn {
                    batcher: self.clone(),
                    keys: request.keys.len(),
                };
                return server.decide_one_by(answer_by, &request, call).await;
            }
        };
        match timeout_at(answer_by, receiver).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Error::Unavailable("redis batch abandoned".into())),
            Err(_) => Err(Error::Timeout(server.timeout_ms)),
        }
    }
}

impl BatchQueue {
    /// As [`Batcher::next_batch`], within `settings` and
    /// `max_keys_in_flight`.
    fn next_batch(
        &mut self,
        done: usize,
        settings: BatchSettings,
        max_keys_in_flight: usize,
    ) -> Vec<QueuedRequest> {
        let now = Instant::now();
        self.keys_in_flight = self.keys_in_flight.saturating_sub(done);
        let room = max_keys_in_flight
            .saturating_sub(self.keys_in_flight)
            .min(settings.max_keys);
        let mut batch = Vec::new();
        let mut n_keys = 0;
        while let Some(next) = self.waiting.front() {
            if next.answer.is_closed() {
                self.waiting.pop_front();
                continue;
            }
            if next.terms.send_by <= now {
                if let Some(expired) = self.waiting.pop_front() {
                    let _ = expired.answer.send(Err(expired.terms.unsent));
                }
                continue;
            }
            let keys = next.request.keys.len();
            let full =
                batch.len() >= settings.max_requests || (!batch.is_empty() && n_keys + keys > room);
            if full {
                break;
            }
            n_keys += keys;
            batch.extend(self.waiting.pop_front());
        }
        if batch.is_empty() {
            self.in_flight -= 1;
        }
        self.keys_in_flight += n_keys;
        batch
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let batch = self.batcher.next_batch(self.keys);
        if batch.is_empty() {
            return;
        }
        // The turn goes with the batch: a new task, so the call that just
        // ended answers its own caller without waiting for the next one.
        let batcher = self.batcher.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to send it: the waiters are answered by the
            // dropped senders.
            return;
        };
        runtime.spawn(async move {
            let _turn = Turn {
                batcher: batcher.clone(),
                keys: batch.iter().map(|it| it.request.keys.len()).sum(),
            };
            send(&batcher.server, batch).await;
        });
    }
}

/// Sends one batch and answers each of its requests, each by its own
/// terms. The call waits for a place and a connection while any of its
/// requests can still be written in time (the latest of their `send_by`);
/// at the moment it is written each request is looked at again: one whose
/// caller has gone is left out, one whose own moment has passed is left
/// out and answered ([`Error::Deadline`], or [`Error::Timeout`] for the
/// backend's own bound), and the others go in one call. The reply is
/// awaited until the latest request's `answer_by`.
async fn send(server: &SingleServer, batch: Vec<QueuedRequest>) {
    let answer_by = batch
        .iter()
        .map(|it| it.terms.answer_by)
        .max()
        .unwrap_or_else(|| Instant::now() + server.timeout);
    let send_by = batch.iter().map(|it| it.terms.send_by).max();
    let entry = match batch.len() {
        1 => LuaEntry::Decide,
        _ => LuaEntry::DecideBatch,
    };
    let report = |stage| {
        for it in &batch {
            it.call.progress.set(stage);
        }
    };
    // Which requests the call wrote, settled as it was written; shared
    // with the counting of a reply that comes after the call's timeout.
    let wrote_late = Arc::new(OnceLock::new());
    let late = LateBatch::of(&batch, entry, &wrote_late);
    let terms = CallTerms::new(answer_by, server.timeout, send_by, late);
    let mut written = vec![false; batch.len()];
    let taken = Instant::now();
    let mut written_at = None;
    let reply = server
        .call(terms, report, entry, |engine| {
            let now = Instant::now();
            written_at = Some(now);
            written = to_write(&batch, now);
            let _ = wrote_late.set(written.clone());
            compose(engine, entry, &batch, &written)
        })
        .await;
    if tracing::enabled!(tracing::Level::DEBUG) {
        log_batch(server, &batch, &written, taken, written_at, reply.is_ok());
    }
    let sizes = written_sizes(batch.iter().map(|it| it.request.keys.len()), &written);
    let mut answers = reply
        .and_then(|reply| parse_answers(&reply, entry, &sizes))
        .map(Vec::into_iter);
    let now = Instant::now();
    for (it, wrote) in batch.into_iter().zip(written) {
        let answer = match (&mut answers, wrote) {
            (Ok(answers), true) => answers
                .next()
                .unwrap_or_else(|| Err(Error::Protocol("a batch reply too short".into()))),
            (Err(err), true) => Err(err.clone()),
            // Left out: its own moment passed, or its caller has gone.
            (_, false) if now >= it.terms.send_by => Err(it.terms.unsent),
            (Err(err), false) => Err(err.clone()),
            (Ok(_), false) => Err(Error::Deadline),
        };
        if let Err(Ok(verdict)) = it.answer.send(answer) {
            // Its own timeout ended before the batch's reply came: it was
            // answered without this decision, which is counted here.
            it.call.deliver_late(verdict);
        }
    }
}

/// The debug line of one batch sent: how many it took and wrote, how many
/// were out of time at the write, their ages, and how long it took.
fn log_batch(
    server: &SingleServer,
    batch: &[QueuedRequest],
    written: &[bool],
    taken: Instant,
    written_at: Option<Instant>,
    ok: bool,
) {
    let ages: Vec<u128> = batch
        .iter()
        .map(|it| (taken + server.timeout - it.terms.answer_by).as_millis())
        .collect();
    let out_of_time = batch
        .iter()
        .filter(|it| written_at.is_some_and(|w| w >= it.terms.send_by))
        .count();
    tracing::debug!(
        taken = batch.len(),
        written = written.iter().filter(|it| **it).count(),
        late_at_write = out_of_time,
        oldest_ms = ages.iter().max().copied().unwrap_or(0),
        newest_ms = ages.iter().min().copied().unwrap_or(0),
        to_write_ms = written_at.map(|w| (w - taken).as_millis()),
        reply_ms = written_at.map(|w| w.elapsed().as_millis()),
        ok,
        "redis batch"
    );
}

/// The key counts of the requests marked `written`, in order.
fn written_sizes(sizes: impl Iterator<Item = usize>, written: &[bool]) -> Vec<usize> {
    sizes
        .zip(written)
        .filter(|(_, wrote)| **wrote)
        .map(|(size, _)| size)
        .collect()
}

/// The answers of the written requests (of `sizes` keys each) in the reply
/// of a call of `entry`.
fn parse_answers(
    reply: &[i64],
    entry: LuaEntry,
    sizes: &[usize],
) -> Result<Vec<Result<Verdict, Error>>, Error> {
    match entry {
        LuaEntry::DecideBatch => script::parse_batch_reply(reply, sizes),
        _ => script::parse_reply(reply, sizes.iter().sum()).map(|it| vec![Ok(it)]),
    }
}

/// Where the verdicts of a batch whose reply came after its timeout go:
/// each written request's [`CallContext::late`].
struct LateBatch {
    entry: LuaEntry,
    /// Each request's key count and where its late verdict goes.
    members: Vec<(usize, CallContext)>,
    written: Arc<OnceLock<Vec<bool>>>,
}

impl LateBatch {
    /// `None` when no request of `batch` has anywhere to count a late verdict.
    fn of(
        batch: &[QueuedRequest],
        entry: LuaEntry,
        written: &Arc<OnceLock<Vec<bool>>>,
    ) -> Option<LateBatch> {
        batch
            .iter()
            .any(|it| it.call.late.is_some())
            .then(|| LateBatch {
                entry,
                members: batch
                    .iter()
                    .map(|it| (it.request.keys.len(), it.call.clone()))
                    .collect(),
                written: written.clone(),
            })
    }

    fn deliver(&self, reply: &[i64]) {
        let Some(written) = self.written.get() else {
            return;
        };
        let sizes = written_sizes(self.members.iter().map(|(size, _)| *size), written);
        let Ok(answers) = parse_answers(reply, self.entry, &sizes) else {
            return;
        };
        let calls = self
            .members
            .iter()
            .zip(written)
            .filter(|(_, wrote)| **wrote);
        for (((_, call), _), answer) in calls.zip(answers) {
            if let Ok(verdict) = answer {
                call.deliver_late(verdict);
            }
        }
    }
}

impl LateReply for LateBatch {
    async fn hear(self, reply: Vec<i64>) {
        self.deliver(&reply);
    }
}

/// Which requests of `batch` are written `now`, each moved to
/// [`Stage::Backend`]: those with time left before their `send_by` whose
/// callers are still there.
fn to_write(batch: &[QueuedRequest], now: Instant) -> Vec<bool> {
    batch
        .iter()
        // Time first: a request out of time never enters `Backend`.
        .map(|it| {
            now < it.terms.send_by && !it.answer.is_closed() && it.call.progress.enter_backend()
        })
        .collect()
}

/// The command of the requests of `batch` marked `written`: `decide` for
/// a batch of one, `decide_batch` otherwise; [`Error::Deadline`] when none
/// is to be written (nothing is).
fn compose(
    engine: Engine,
    entry: LuaEntry,
    batch: &[QueuedRequest],
    written: &[bool],
) -> Result<redis::Cmd, Error> {
    let members: Vec<&Encoded> = batch
        .iter()
        .zip(written)
        .filter(|(_, wrote)| **wrote)
        .map(|(it, _)| &it.request)
        .collect();
    if members.is_empty() {
        return Err(Error::Deadline);
    }
    let n_keys = members.iter().map(|it| it.keys.len()).sum();
    let mut cmd = engine.command(entry, n_keys);
    if let (LuaEntry::Decide, [only]) = (entry, &members[..]) {
        cmd.arg(&only.keys);
        script::write_request(&mut cmd, &only.header, &only.limits);
        return Ok(cmd);
    }
    for it in &members {
        cmd.arg(&it.keys);
    }
    for field in &BATCH_FIELDS {
        cmd.arg((field.value)(&members.len()));
    }
    for it in &members {
        for field in &REQUEST_FIELDS {
            cmd.arg((field.value)(&it.keys.len()));
        }
        script::write_request(&mut cmd, &it.header, &it.limits);
    }
    Ok(cmd)
}

#[cfg(test)]
mod tests;
