//! The bound on work queued toward one Redis.
//!
//! Redis runs one command at a time; whatever is written to it beyond what
//! it can answer within the timeout is work nobody waits for by the time it
//! runs (its caller has already answered under the failure mode), and it
//! delays every call behind it, so goodput collapses under overload. The
//! gate keeps the queue on our side, where it can be abandoned unsent:
//!
//! - at most [`Gate::max_in_flight`] calls are sent and not yet answered (a
//!   permit is held from before the pool checkout until Redis answers the
//!   call or its connection fails, however long after its caller gave up:
//!   [`Written`]), so the calls Redis still has to run, whoever waits for
//!   them, never exceed the bound;
//! - at most [`Gate::max_waiting`] more wait for a permit, each until its
//!   own deadline; a wait that reaches it ends without sending anything
//!   ([`NotAdmitted::Expired`]);
//! - beyond both, a call is refused at once ([`NotAdmitted::Shed`]), so the
//!   request is answered under `--failure-mode` immediately instead of
//!   after the timeout, and no backlog can grow without bound.
//!
//! On a single server (direct or Sentinel) both bounds are fixed per pool
//! ([`Gate::for_server`]): [`MAX_IN_FLIGHT`] and [`MAX_WAITING`]. The pool
//! size does not enter them: a pool's calls share the connection last
//! checked out (for a quarter of a second at a time), so all of them are
//! multiplexed on one connection whatever the pool size, and Redis runs one
//! command at a time whatever the number of connections; what the bound
//! must hold is the depth of Redis's queue. A Redis Cluster's gate
//! ([`Gate::for_pool`]) still derives from its pool size:
//! [`IN_FLIGHT_PER_CONNECTION`] and [`WAITING_PER_CONNECTION`] per pooled
//! connection.
//!
//! Invariant: calls written and unanswered never exceed
//! [`Gate::max_in_flight`], whoever still waits for them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, timeout_at};

use crate::backends::Error;

/// Calls sent and unanswered per single-server pool (per serving thread):
/// enough pipelining to keep Redis busy, few enough that the calls ahead of
/// a new one take Redis at most 64 × 25–400 µs, 2 to 26 ms, well within any
/// sensible timeout. Also the most calls Redis runs after a stall for
/// callers who gave up during it.
pub(super) const MAX_IN_FLIGHT: usize = 64;

/// Calls waiting for a permit per single-server pool. A waiting call costs
/// Redis nothing and leaves unsent when its time runs short, so the line
/// is long; it is not tied to the pool size, so that a small pool does not
/// shed requests a healthy Redis decides in time (at pool size 1, a line
/// of 256 shed 27 % to 78 % of requests at 500 in flight).
pub(super) const MAX_WAITING: usize = 2048;

/// A call unanswered this long after it was written is taken for lost (a
/// half-open connection never answers, and nothing else would end the
/// wait): its connection is retired and its place freed. Far beyond any
/// timeout, so a merely slow Redis (a long script, `DEBUG SLEEP`) keeps
/// its places until it answers.
pub(super) const UNANSWERED_AFTER: Duration = Duration::from_secs(10);

/// Calls sent and unanswered per pooled connection of a Redis Cluster. Enough pipelining to
/// keep Redis busy (a call costs Redis 25 to 400 µs), few enough that the
/// calls ahead of a new one finish well within any sensible timeout.
pub(super) const IN_FLIGHT_PER_CONNECTION: usize = 8;

/// Calls waiting for a permit per pooled connection of a Redis Cluster
/// (2,048 with the default pool of 8). A waiting call costs Redis nothing and leaves unsent
/// when its time runs short, so the line can be long: shedding is for a
/// flood beyond it. Shorter, it sheds requests that would have been decided
/// in time: a service answering sheds at once invites the next request at
/// once, and with 1,000 requests in flight against one Redis a line of 64
/// per connection decided fewer requests than no bound at all.
pub(super) const WAITING_PER_CONNECTION: usize = 256;

/// Admission to one Redis.
pub(super) struct Gate {
    permits: Arc<Semaphore>,
    max_in_flight: usize,
    max_waiting: usize,
    waiting: AtomicUsize,
}

/// Why a call was not let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NotAdmitted {
    /// The waiting room was full: answered at once.
    Shed,
    /// Its deadline passed while it waited: never sent.
    Expired,
}

/// Holds a place in the waiting room; gives it back on drop, however the
/// wait ended.
struct PlaceInLine<'a>(&'a AtomicUsize);

/// A call written to Redis and the place it holds in the gate (`P`: its
/// permit, or a share of its request's): the place is given back when the
/// reply comes (or the connection fails), never when the caller stops
/// waiting. Dropped before the reply, the call is driven to its end in a
/// task of its own that keeps the place, for at most `unanswered_after`
/// ([`UNANSWERED_AFTER`]); then `lost`, if any, is set (the connection is
/// retired) and the place freed.
pub(super) struct Written<T: Send + 'static, P: Send + Unpin + 'static = OwnedSemaphorePermit> {
    reply: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    place: Option<P>,
    lost: Option<Arc<AtomicBool>>,
    unanswered_after: Duration,
}

impl Gate {
    /// The gate of one single-server pool: [`MAX_IN_FLIGHT`] and
    /// [`MAX_WAITING`], whatever the pool size.
    pub(super) fn for_server() -> Gate {
        Gate::new(MAX_IN_FLIGHT, MAX_WAITING)
    }

    /// The gate of a Redis Cluster with pools of `pool_size` connections.
    pub(super) fn for_pool(pool_size: u32) -> Gate {
        let connections = usize::try_from(pool_size).unwrap_or(1).max(1);
        Gate::new(
            connections.saturating_mul(IN_FLIGHT_PER_CONNECTION),
            connections.saturating_mul(WAITING_PER_CONNECTION),
        )
    }

    pub(super) fn new(max_in_flight: usize, max_waiting: usize) -> Gate {
        let max_in_flight = max_in_flight.clamp(1, Semaphore::MAX_PERMITS);
        Gate {
            permits: Arc::new(Semaphore::new(max_in_flight)),
            max_in_flight,
            max_waiting,
            waiting: AtomicUsize::new(0),
        }
    }

    pub(super) fn max_in_flight(&self) -> usize {
        self.max_in_flight
    }

    pub(super) fn max_waiting(&self) -> usize {
        self.max_waiting
    }

    /// A permit to send one call, at once when one is free; else after a
    /// wait in line (first come, first served) that ends at `deadline`;
    /// refused at once when the line is full.
    pub(super) async fn enter(
        &self,
        deadline: Instant,
    ) -> Result<OwnedSemaphorePermit, NotAdmitted> {
        if let Ok(permit) = self.permits.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let _place = self.take_place()?;
        match timeout_at(deadline, self.permits.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; were it, nothing could be sent.
            Ok(Err(_)) | Err(_) => Err(NotAdmitted::Expired),
        }
    }

    /// [`Gate::enter`] by `send_by`, its refusals as the backend's errors:
    /// shed, or timed out (of `timeout_ms`) without being sent.
    pub(super) async fn admit(
        &self,
        send_by: Instant,
        timeout_ms: u64,
    ) -> Result<OwnedSemaphorePermit, Error> {
        self.enter(send_by).await.map_err(|refused| match refused {
            NotAdmitted::Shed => Error::Shed(self.max_waiting),
            NotAdmitted::Expired => Error::Timeout(timeout_ms),
        })
    }

    fn take_place(&self) -> Result<PlaceInLine<'_>, NotAdmitted> {
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_waiting).then_some(n + 1)
            })
            .map(|_| PlaceInLine(&self.waiting))
            .map_err(|_| NotAdmitted::Shed)
    }
}

// === impl Written ===

impl<T: Send + 'static, P: Send + Unpin + 'static> Written<T, P> {
    /// `reply`, the call's answer (already on its way or about to be
    /// written), holding `place` until it ends; `lost` is the flag that
    /// retires its connection, if it has one.
    pub(super) fn new(
        place: P,
        reply: impl Future<Output = T> + Send + 'static,
        lost: Option<Arc<AtomicBool>>,
        unanswered_after: Duration,
    ) -> Written<T, P> {
        Written {
            reply: Some(Box::pin(reply)),
            place: Some(place),
            lost,
            unanswered_after,
        }
    }
}

impl<T: Send + 'static, P: Send + Unpin + 'static> Future for Written<T, P> {
    type Output = T;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        let Some(reply) = this.reply.as_mut() else {
            // Polled after it completed: never done by its callers.
            return Poll::Pending;
        };
        let output = std::task::ready!(reply.as_mut().poll(cx));
        this.reply = None;
        this.place = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static, P: Send + Unpin + 'static> Written<T, P> {
    /// The rest of the wait for a call whose caller stopped waiting, to be
    /// driven in a task of its own: its reply, if it comes within
    /// `unanswered_after` from now, else `None` (the connection, if any, is
    /// marked lost); the place is held until then. `None` as well when the
    /// call already ended.
    pub(super) fn outlive(mut self) -> impl Future<Output = Option<T>> + Send + 'static {
        let parts = self.reply.take().zip(self.place.take());
        let (lost, unanswered_after) = (self.lost.clone(), self.unanswered_after);
        async move {
            let (reply, place) = parts?;
            let reply = tokio::time::timeout(unanswered_after, reply).await.ok();
            if reply.is_none()
                && let Some(lost) = lost
            {
                lost.store(true, Ordering::SeqCst);
            }
            drop(place);
            reply
        }
    }
}

impl<T: Send + 'static, P: Send + Unpin + 'static> Drop for Written<T, P> {
    fn drop(&mut self) {
        if self.reply.is_none() || self.place.is_none() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime left: nothing can be sent or awaited any more.
            return;
        };
        let rest = Written {
            reply: self.reply.take(),
            place: self.place.take(),
            lost: self.lost.clone(),
            unanswered_after: self.unanswered_after,
        };
        runtime.spawn(rest.outlive());
    }
}

impl Drop for PlaceInLine<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests;
