//! The terms of one Redis call ([`CallTerms`]) and the path every decision
//! takes to Redis, on a single server, in a batch and on a Cluster alike
//! (the calls that decide nothing take their own bounded paths: a Cluster
//! refund, a script load after NOSCRIPT, probes and warm-ups, and the quota
//! pools' store in `crate::quota::redis`):
//!
//! 1. admitted by the gate (stage queue), refused at once when too many
//!    calls already wait toward Redis, given up unsent at `send_by`;
//! 2. a connection, by `answer_by` (stage connect);
//! 3. written only while `send_by` has not passed (stage backend): once
//!    less than a quarter of the timeout is left, or the caller's own
//!    moment to send has passed, a call would only be work for Redis that
//!    nobody waits for, delaying the calls behind it;
//! 4. its reply awaited until `answer_by`, whoever still waits for it, so
//!    that what it consumed is counted. A reply still missing then fails
//!    the call with [`Error::Timeout`] at once; the call keeps its place
//!    in the gate until Redis answers ([`Written`]), and its reply, if it
//!    comes within [`UNANSWERED_AFTER`](super::gate::UNANSWERED_AFTER),
//!    is heard by the terms' late handler ([`LateReply`]: counted for its caller, or refunded), or
//!    dropped when there is none.
//!
//! A call is NEVER sent again after a timeout or any other error: it may
//! have run, and a retry would count its requests twice.
//!
//! Invariant: no call is written after its `send_by`, nor awaited past its
//! `answer_by`; a late reply is heard at most once, within the call's place
//! in the gate.

use std::future::Future;
use std::time::Duration;

use redis::{RedisResult, Value};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{Instant, timeout_at};

use super::failure::timeout_ms;
use super::gate::{Gate, Written};
use super::script;
use crate::backends::{Error, LateVerdict, Stage};

/// A call is sent only while more than `1 / SEND_MARGIN` of its timeout
/// is left: one sent later is unlikely to be answered in time, and its work
/// in Redis would delay the calls behind it.
const SEND_MARGIN: u32 = 4;

/// When one call must be answered, until when it may still be written,
/// and what becomes of a reply that comes after it must be answered.
#[derive(Debug)]
pub(super) struct CallTerms<L> {
    /// The end of the caller's timeout (a batch's: its latest request's):
    /// the reply is awaited until then, and no longer.
    pub(super) answer_by: Instant,
    /// The last moment the call may be written: a quarter of its timeout
    /// before `answer_by`, or the caller's own moment to send when earlier.
    pub(super) send_by: Instant,
    /// What the call fails with when `send_by` passes before it is
    /// written: [`Error::Timeout`] for the backend's own bound,
    /// [`Error::Deadline`] for the caller's (its caller is answered under
    /// the failure mode; nothing is sent).
    pub(super) unsent: Error,
    /// Hears a reply that comes after `answer_by`; `None`: it is dropped.
    pub(super) late: Option<L>,
}

/// What hears the reply of a call that came after the call's `answer_by`
/// (the call already failed with [`Error::Timeout`]).
pub(super) trait LateReply: Send + 'static {
    /// Hears the reply's integers.
    fn hear(self, reply: Vec<i64>) -> impl Future<Output = ()> + Send;
}

/// No late handler: a late reply is dropped.
#[derive(Debug)]
pub(super) enum LateDropped {}

impl LateReply for LateDropped {
    async fn hear(self, _: Vec<i64>) {
        match self {}
    }
}

/// The late verdict of a request decided in a call of its own, counted
/// for its caller.
pub(super) struct CountLate {
    late: LateVerdict,
    n_keys: usize,
}

impl CountLate {
    /// Counts for `late` the verdict on a request of `n_keys` keys.
    pub(super) fn new(late: LateVerdict, n_keys: usize) -> CountLate {
        CountLate { late, n_keys }
    }
}

impl LateReply for CountLate {
    async fn hear(self, reply: Vec<i64>) {
        if let Ok(verdict) = script::parse_reply(&reply, self.n_keys) {
            self.late.deliver(verdict);
        }
    }
}

/// The reply to a written call, or the call itself when `answer_by` came
/// first (still holding its place in the gate).
pub(super) enum Replied<T: Send + 'static, P: Send + Unpin + 'static> {
    InTime(T),
    Late(Written<T, P>),
}

impl<L> CallTerms<L> {
    /// The terms of a call of a backend's `timeout`, due by `answer_by`,
    /// whose caller may have to send by `caller_send_by`; its late reply
    /// heard by `late`.
    pub(super) fn new(
        answer_by: Instant,
        timeout: Duration,
        caller_send_by: Option<Instant>,
        late: Option<L>,
    ) -> CallTerms<L> {
        let own = answer_by
            .checked_sub(timeout / SEND_MARGIN)
            .unwrap_or(answer_by);
        let (send_by, unsent) = match caller_send_by {
            Some(caller) if caller < own => (caller, Error::Deadline),
            _ => (own, Error::Timeout(timeout_ms(timeout))),
        };
        CallTerms {
            answer_by,
            send_by,
            unsent,
            late,
        }
    }

    /// [`CallTerms::unsent`] once `send_by` has passed: then nothing may be
    /// written.
    pub(super) fn still_sendable(&self) -> Result<(), Error> {
        if Instant::now() >= self.send_by {
            return Err(self.unsent.clone());
        }
        Ok(())
    }

    /// Steps 1 to 3 of the path (see the module doc): a place in `gate`
    /// (whose refusals after a wait are for `timeout_ms`), then `connect`
    /// by `answer_by` (`too_slow` says why not, when it takes longer), and
    /// time left to write. `report` hears the stages.
    pub(super) async fn open<C>(
        &self,
        gate: &Gate,
        timeout_ms: u64,
        report: impl Fn(Stage),
        connect: impl Future<Output = Result<C, Error>>,
        too_slow: impl FnOnce() -> Error,
    ) -> Result<(OwnedSemaphorePermit, C), Error> {
        report(Stage::Queue);
        let permit = match gate.admit(self.send_by, timeout_ms).await {
            Err(Error::Timeout(_)) => return Err(self.unsent.clone()),
            admitted => admitted?,
        };
        report(Stage::Connect);
        let connected = match timeout_at(self.answer_by, connect).await {
            Ok(connected) => connected?,
            Err(_) => return Err(too_slow()),
        };
        self.still_sendable()?;
        Ok((permit, connected))
    }

    /// Step 4: the reply of `written` if it comes by `answer_by`, else the
    /// written call, to be heard late ([`hear_late`]) or dropped.
    pub(super) async fn reply<T, P>(&self, mut written: Written<T, P>) -> Replied<T, P>
    where
        T: Send + 'static,
        P: Send + Unpin + 'static,
    {
        match timeout_at(self.answer_by, &mut written).await {
            Ok(reply) => Replied::InTime(reply),
            Err(_) => Replied::Late(written),
        }
    }
}

/// Awaits, in a task of its own, the reply to `written`, a call whose
/// `answer_by` has passed, within the place it holds in the gate
/// ([`Written::outlive`]), and has `late` hear its integers if it comes.
pub(super) fn hear_late<E, P>(written: Written<Result<Value, E>, P>, late: impl LateReply)
where
    E: Send + 'static,
    P: Send + Unpin + 'static,
{
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        if let Some(Ok(value)) = written.outlive().await
            && let Ok(reply) = script::reply_integers(value)
        {
            late.hear(reply).await;
        }
    });
}

/// The reply of a call whose late reply, if any, was handed to its terms'
/// handler: [`Error::Timeout`] (of `timeout_ms`) once `answer_by` passed.
pub(super) fn in_time_or_heard<L: LateReply, P: Send + Unpin + 'static>(
    replied: Replied<RedisResult<Value>, P>,
    late: Option<L>,
    timeout_ms: u64,
) -> Result<RedisResult<Value>, Error> {
    match replied {
        Replied::InTime(reply) => Ok(reply),
        Replied::Late(written) => {
            match late {
                Some(late) => hear_late(written, late),
                // Dropped, it still holds its place until Redis answers.
                None => drop(written),
            }
            Err(Error::Timeout(timeout_ms))
        }
    }
}
