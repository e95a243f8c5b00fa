//! Concurrent decisions bound for one Redis coalesced into one call.
//!
//! Calls in flight are limited to one per pooled connection. A request
//! that finds a free slot is sent at once, alone: an idle service adds no
//! wait. A request that finds every slot taken waits in a queue; when a
//! call returns, its slot takes the queue's oldest requests that can
//! still be written (at most [`BatchSettings::max_requests`] and
//! [`BatchSettings::max_keys`], and with the calls in flight at most
//! `max_keys_in_flight` keys, eight batches' worth) into one call of
//! `decide_batch`, which decides them one after the other, in arrival
//! order, each all-or-nothing with its own answer. Requests whose moment
//! to be written has passed are answered when a batch is formed, never
//! carried into it: under overload the oldest requests are out of time,
//! and batches of them kept Redis working for callers already answered.
//! The bound on keys in flight only caps the work ahead of a new call when
//! the pool is large. A wait is bounded by the request's own timeout. Each request keeps its own
//! deadline in a batch: when the batch is formed and again at the moment
//! its call is written, a request whose caller has gone is left out
//! unsent, and one whose own moment to be written has passed (its
//! caller's `send_by`, or a quarter of its timeout left) is left out and
//! answered ([`Error::Deadline`], or [`Error::Timeout`]); the others go.
//! A caller that leaves once its request is written finds it in
//! [`Stage::Backend`] and its decision is still counted; one that leaves
//! before can no longer be written ([`crate::backends::Progress`]). The
//! queue holds at most
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
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use tokio::sync::oneshot;
use tokio::time::{Instant, timeout_at};

use super::engine::{Engine, Entry};
use super::script::{self, BATCH_FIELDS, REQUEST_FIELDS};
use super::{BatchSettings, CallContext, Core, Encoded, Error, Stage, sending_bound};
use crate::algorithms::Verdict;

/// The queue and the slots of one backend.
pub(super) struct Batcher {
    settings: BatchSettings,
    max_in_flight: usize,
    max_waiting: usize,
    /// Most keys in the calls in flight together (eight times
    /// [`BatchSettings::max_keys`]), so that the work ahead of a new call
    /// in Redis stays a few batches' worth, however many connections.
    max_keys_in_flight: usize,
    /// A std Mutex: held only to push, pop and count, never across `.await`.
    state: Mutex<State>,
}

struct State {
    /// Calls in flight (slots taken).
    in_flight: usize,
    /// Requests in the calls in flight.
    keys_in_flight: usize,
    waiting: VecDeque<Waiting>,
}

/// A queued request and where its answer goes.
struct Waiting {
    request: Encoded,
    /// When its caller gives up.
    deadline: Instant,
    /// The last moment it may be written, and its answer when that passes
    /// unwritten ([`sending_bound`]).
    bound: (Instant, Error),
    /// Its caller's deadline for sending, and its stage.
    call: CallContext,
    answer: oneshot::Sender<Result<Verdict, Error>>,
}

/// A call slot: handed on to the queue when dropped, however the call
/// ended (answered, failed, or its caller gone).
struct Slot {
    core: Arc<Core>,
    /// The keys its call carries.
    keys: usize,
}

impl Batcher {
    pub(super) fn new(
        settings: BatchSettings,
        max_in_flight: usize,
        max_keys_in_flight: usize,
        max_waiting: usize,
    ) -> Batcher {
        Batcher {
            settings,
            max_in_flight: max_in_flight.max(1),
            max_keys_in_flight: max_keys_in_flight.max(1),
            max_waiting,
            state: Mutex::new(State {
                in_flight: 0,
                keys_in_flight: 0,
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

    /// The next batch: the oldest waiting requests that can still be
    /// written, within [`BatchSettings`] and within the keys the calls in
    /// flight leave of `max_keys_in_flight` (at least one request, when any
    /// waits). Those met on the way whose callers gave up are dropped, and
    /// those whose own moment to be written has passed ([`sending_bound`])
    /// answered, unsent. Empty when none waits: the slot is then given
    /// back. The call that just ended carried `done` keys, no longer in
    /// flight.
    fn next_batch(&self, done: usize) -> Vec<Waiting> {
        let now = Instant::now();
        let mut state = self.lock();
        state.keys_in_flight = state.keys_in_flight.saturating_sub(done);
        let room = self
            .max_keys_in_flight
            .saturating_sub(state.keys_in_flight)
            .min(self.settings.max_keys);
        let mut batch = Vec::new();
        let mut n_keys = 0;
        while let Some(next) = state.waiting.front() {
            if next.answer.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            if next.bound.0 <= now {
                if let Some(late) = state.waiting.pop_front() {
                    let _ = late.answer.send(Err(late.bound.1));
                }
                continue;
            }
            let keys = next.request.keys.len();
            let full = batch.len() >= self.settings.max_requests
                || (!batch.is_empty() && n_keys + keys > room);
            if full {
                break;
            }
            n_keys += keys;
            batch.extend(state.waiting.pop_front());
        }
        if batch.is_empty() {
            state.in_flight -= 1;
        }
        state.keys_in_flight += n_keys;
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
            state.keys_in_flight += request.keys.len();
            Err(request)
        } else if state.waiting.len() >= batcher.max_waiting {
            return Err(Error::Shed(batcher.max_waiting));
        } else {
            let (answer, receiver) = oneshot::channel();
            call.progress.set(Stage::Queue);
            let bound = sending_bound(deadline, core.timeout, call.send_by.map(Instant::from_std));
            state.waiting.push_back(Waiting {
                request,
                deadline,
                bound,
                call: call.clone(),
                answer,
            });
            Ok(receiver)
        }
    };
    let receiver = match receiver {
        Ok(receiver) => receiver,
        Err(request) => {
            let _slot = Slot {
                core: core.clone(),
                keys: request.keys.len(),
            };
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
        let Some(batcher) = &self.core.batcher else {
            return;
        };
        let batch = batcher.next_batch(self.keys);
        if batch.is_empty() {
            return;
        }
        // The slot goes with the batch: a new task, so the call that just
        // ended answers its own caller without waiting for the next one.
        let core = self.core.clone();
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left to send it: the waiters are answered by the
            // dropped senders.
            return;
        };
        runtime.spawn(async move {
            let _slot = Slot {
                core: core.clone(),
                keys: batch.iter().map(|it| it.request.keys.len()).sum(),
            };
            send(&core, batch).await;
        });
    }
}

/// Sends one batch and answers each of its requests, each by its own
/// deadline. The call waits for a place and a connection while any of its
/// requests can still be written in time (the latest of their bounds, see
/// [`sending_bound`]); at the moment it is written each request is looked
/// at again: one whose caller has gone is left out, one whose own moment
/// has passed is left out and answered ([`Error::Deadline`], or
/// [`Error::Timeout`] for the backend's own bound), and the others go in
/// one call. The reply is awaited until the latest request's deadline.
async fn send(core: &Core, batch: Vec<Waiting>) {
    let bounds: Vec<(Instant, Error)> = batch
        .iter()
        .map(|it| {
            sending_bound(
                it.deadline,
                core.timeout,
                it.call.send_by.map(Instant::from_std),
            )
        })
        .collect();
    let deadline = batch
        .iter()
        .map(|it| it.deadline)
        .max()
        .unwrap_or_else(|| Instant::now() + core.timeout);
    let send_by = bounds.iter().map(|(at, _)| *at).max();
    let entry = match batch.len() {
        1 => Entry::Decide,
        _ => Entry::DecideBatch,
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
    let mut written = vec![false; batch.len()];
    let taken = Instant::now();
    let mut written_at = None;
    let reply = core
        .call(
            deadline,
            send_by,
            report,
            entry,
            |engine| {
                let now = Instant::now();
                written_at = Some(now);
                written = to_write(&batch, &bounds, now);
                let _ = wrote_late.set(written.clone());
                compose(engine, entry, &batch, &written)
            },
            late.map(|it| move |reply: Vec<i64>| it.deliver(&reply)),
        )
        .await;
    if tracing::enabled!(tracing::Level::DEBUG) {
        let ages: Vec<u128> = batch
            .iter()
            .map(|it| (taken + core.timeout - it.deadline).as_millis())
            .collect();
        let late = batch
            .iter()
            .zip(&bounds)
            .filter(|(_, (at, _))| written_at.is_some_and(|w| w >= *at))
            .count();
        tracing::debug!(
            taken = batch.len(),
            written = written.iter().filter(|it| **it).count(),
            late_at_write = late,
            oldest_ms = ages.iter().max().copied().unwrap_or(0),
            newest_ms = ages.iter().min().copied().unwrap_or(0),
            to_write_ms = written_at.map(|w| (w - taken).as_millis()),
            reply_ms = written_at.map(|w| w.elapsed().as_millis()),
            ok = reply.is_ok(),
            "redis batch"
        );
    }
    let sizes = written_sizes(batch.iter().map(|it| it.request.keys.len()), &written);
    let mut answers = reply
        .and_then(|reply| parse_answers(&reply, entry, &sizes))
        .map(Vec::into_iter);
    let now = Instant::now();
    for ((it, (at, late)), wrote) in batch.into_iter().zip(bounds).zip(written) {
        let answer = match (&mut answers, wrote) {
            (Ok(answers), true) => answers
                .next()
                .unwrap_or_else(|| Err(Error::Protocol("a batch reply too short".into()))),
            (Err(err), true) => Err(err.clone()),
            // Left out: its own moment passed, or its caller has gone.
            (_, false) if now >= at => Err(late),
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
    entry: Entry,
    sizes: &[usize],
) -> Result<Vec<Result<Verdict, Error>>, Error> {
    match entry {
        Entry::DecideBatch => script::parse_batch_reply(reply, sizes),
        _ => script::parse_reply(reply, sizes.iter().sum()).map(|it| vec![Ok(it)]),
    }
}

/// Where the verdicts of a batch whose reply came after its timeout go:
/// each written request's [`CallContext::late`].
struct LateBatch {
    entry: Entry,
    /// Each request's key count and where its late verdict goes.
    members: Vec<(usize, CallContext)>,
    written: Arc<OnceLock<Vec<bool>>>,
}

impl LateBatch {
    /// `None` when no request of `batch` has anywhere to count a late verdict.
    fn of(
        batch: &[Waiting],
        entry: Entry,
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

/// Which requests of `batch` are written `now`, each moved to
/// [`Stage::Backend`]: those with time left before their bound in
/// `bounds` whose callers are still there.
fn to_write(batch: &[Waiting], bounds: &[(Instant, Error)], now: Instant) -> Vec<bool> {
    batch
        .iter()
        .zip(bounds)
        // Time first: a request out of time never enters `Backend`.
        .map(|(it, (at, _))| {
            now < *at && !it.answer.is_closed() && it.call.progress.enter_backend()
        })
        .collect()
}

/// The command of the requests of `batch` marked `written`: `decide` for
/// a batch of one, `decide_batch` otherwise; [`Error::Deadline`] when none
/// is to be written (nothing is).
fn compose(
    engine: Engine,
    entry: Entry,
    batch: &[Waiting],
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
    if let (Entry::Decide, [only]) = (entry, &members[..]) {
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
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backends::Progress;
    use crate::backends::redis::script::HeaderArgs;

    type Answer = oneshot::Receiver<Result<Verdict, Error>>;

    fn waiting(send_by: Option<Instant>) -> (Waiting, Answer) {
        queued("k", Duration::ZERO, send_by)
    }

    /// A request for `key` that has waited `age` of its 1 s timeout.
    fn queued(key: &str, age: Duration, send_by: Option<Instant>) -> (Waiting, Answer) {
        let (answer, receiver) = oneshot::channel();
        let call = CallContext {
            send_by: send_by.map(Instant::into_std),
            progress: Progress::new(Stage::Queue),
            late: None,
        };
        let request = Encoded {
            keys: vec![key.to_owned()],
            header: HeaderArgs {
                now_us: None,
                grace_ms: 0,
                receipts: false,
            },
            limits: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(1) - age;
        let it = Waiting {
            request,
            bound: sending_bound(deadline, Duration::from_secs(1), send_by),
            deadline,
            call,
            answer,
        };
        (it, receiver)
    }

    /// At the moment a batch is written, each request is looked at on its
    /// own: one whose caller has left (its stage given up, or its answer
    /// dropped) is never written, nor one whose own moment has passed;
    /// the others are, and only they reach `Backend`.
    #[tokio::test]
    async fn a_batch_writes_only_the_requests_whose_callers_wait_and_have_time() {
        let now = Instant::now();
        let later = now + Duration::from_millis(100);
        let (on_time, _keep_a) = waiting(Some(later));
        let (left, _keep_b) = waiting(Some(later));
        let (dropped, receiver) = waiting(Some(later));
        let (late, _keep_d) = waiting(Some(now));
        let (no_deadline, _keep_e) = waiting(None);
        // The caller of `left` leaves after the batch was taken from the
        // queue; that of `dropped` drops its end.
        assert_eq!(left.call.progress.leave(), Stage::Queue);
        drop(receiver);
        let batch = [on_time, left, dropped, late, no_deadline];
        let bounds: Vec<(Instant, Error)> = batch
            .iter()
            .map(|it| {
                let caller = it.call.send_by.map(Instant::from_std);
                sending_bound(it.deadline, Duration::from_secs(1), caller)
            })
            .collect();
        let written = to_write(&batch, &bounds, now);
        assert_eq!(written, [true, false, false, false, true]);
        let stages: Vec<Stage> = batch.iter().map(|it| it.call.progress.get()).collect();
        assert_eq!(
            stages,
            [
                Stage::Backend,
                Stage::Queue,
                Stage::Queue,
                Stage::Queue,
                Stage::Backend
            ]
        );
        assert!(matches!(bounds[3].1, Error::Deadline));
        // Nothing to write: nothing is composed.
        let none = compose(Engine::Functions, Entry::DecideBatch, &batch, &[false; 5]);
        assert!(matches!(none, Err(Error::Deadline)));
    }

    fn keys(batch: &[Waiting]) -> Vec<&str> {
        batch.iter().map(|it| it.request.keys[0].as_str()).collect()
    }

    /// A batch takes the oldest requests that can still be written, and
    /// answers those whose moment to be written has passed at once,
    /// unsent, instead of carrying them to the write only to leave them
    /// out there (under overload, a whole batch of them).
    #[tokio::test]
    async fn a_batch_takes_the_oldest_requests_with_time_left_and_answers_the_others() {
        let settings = BatchSettings {
            max_requests: 2,
            max_keys: 512,
        };
        let batcher = Batcher::new(settings, 1, 64, 16);
        let mut receivers = Vec::new();
        {
            let mut state = batcher.lock();
            // The call whose end forms the batch.
            state.in_flight = 1;
            state.keys_in_flight = 1;
            for (key, age) in [("expired", 900), ("old", 500), ("mid", 100), ("new", 0)] {
                let (it, receiver) = queued(key, Duration::from_millis(age), None);
                state.waiting.push_back(it);
                receivers.push(receiver);
            }
        }
        let batch = batcher.next_batch(1);
        assert_eq!(keys(&batch), ["old", "mid"]);
        assert!(matches!(
            receivers[0].try_recv(),
            Ok(Err(Error::Timeout(1000)))
        ));
        let mut state = batcher.lock();
        assert_eq!(keys(state.waiting.make_contiguous()), ["new"]);
        assert_eq!((state.in_flight, state.keys_in_flight), (1, 2));
    }

    /// The keys in the calls in flight together stay within
    /// `max_keys_in_flight`: a batch takes only what the others leave (at
    /// least one request), so a batched Redis has a bounded amount of work
    /// ahead of a new call.
    #[tokio::test]
    async fn batches_in_flight_carry_at_most_their_bound_of_keys() {
        let settings = BatchSettings {
            max_requests: 64,
            max_keys: 512,
        };
        let batcher = Batcher::new(settings, 4, 4, 16);
        let mut receivers = Vec::new();
        {
            let mut state = batcher.lock();
            state.in_flight = 4;
            state.keys_in_flight = 4;
            for key in ["a", "b", "c", "d", "e", "f"] {
                let (it, receiver) = queued(key, Duration::ZERO, None);
                state.waiting.push_back(it);
                receivers.push(receiver);
            }
        }
        // Three keys still in flight (a request of one each): room for one.
        assert_eq!(keys(&batcher.next_batch(1)), ["a"]);
        assert_eq!(keys(&batcher.next_batch(1)), ["b"]);
        // The others' calls end: room for four, and four wait.
        assert_eq!(batcher.lock().keys_in_flight, 4);
        assert_eq!(keys(&batcher.next_batch(4)).len(), 4);
        // One more call ends and none waits: its slot is given back.
        assert!(batcher.next_batch(1).is_empty());
        assert_eq!(batcher.lock().in_flight, 3);
    }
}
