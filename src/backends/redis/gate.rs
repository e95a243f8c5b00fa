//! The bound on work queued toward one Redis.
//!
//! Redis runs one command at a time; whatever is written to it beyond what
//! it can answer within the timeout is work nobody waits for by the time it
//! runs (its caller has already answered under the failure mode), and it
//! delays every call behind it, so goodput collapses under overload. The
//! gate keeps the queue on our side, where it can be abandoned unsent:
//!
//! - at most [`Gate::max_in_flight`] calls are sent and not yet answered or
//!   abandoned (a permit is held from before the pool checkout until the
//!   call returns or its caller gives up at its deadline);
//! - at most [`Gate::max_waiting`] more wait for a permit, each until its
//!   own deadline; a wait that reaches it ends without sending anything
//!   ([`Refused::Expired`]);
//! - beyond both, a call is refused at once ([`Refused::Shed`]), so the
//!   request is answered under `--failure-mode` immediately instead of
//!   after the timeout, and no backlog can grow without bound.
//!
//! Both bounds derive from the pool size: [`IN_FLIGHT_PER_CONNECTION`] and
//! [`WAITING_PER_CONNECTION`] per pooled connection.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::{Instant, timeout_at};

use crate::backends::Error;

/// A call is sent only while more than `1 / SEND_MARGIN` of its timeout
/// is left: one sent later is unlikely to be answered in time, and its work
/// in Redis would delay the calls behind it.
const SEND_MARGIN: u32 = 4;

/// The last moment a call due by `deadline`, of a `timeout`, may be sent.
pub(super) fn send_by(deadline: Instant, timeout: Duration) -> Instant {
    deadline
        .checked_sub(timeout / SEND_MARGIN)
        .unwrap_or(deadline)
}

/// Calls sent and unanswered per pooled connection. Enough pipelining to
/// keep Redis busy (a call costs Redis 25 to 400 µs), few enough that the
/// calls ahead of a new one finish well within any sensible timeout.
pub(super) const IN_FLIGHT_PER_CONNECTION: usize = 8;

/// Calls waiting for a permit per pooled connection (2,048 with the
/// default pool of 8). A waiting call costs Redis nothing and leaves unsent
/// when its time runs short, so the line can be long: shedding is for a
/// flood beyond it. Shorter, it sheds requests that would have been decided
/// in time: a service answering sheds at once invites the next request at
/// once, and with 1,000 requests in flight against one Redis a line of 64
/// per connection decided fewer requests than no bound at all.
pub(super) const WAITING_PER_CONNECTION: usize = 256;

/// Admission to one Redis.
pub(super) struct Gate {
    permits: Semaphore,
    max_in_flight: usize,
    max_waiting: usize,
    waiting: AtomicUsize,
}

/// Why a call was not let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// The waiting room was full: answered at once.
    Shed,
    /// Its deadline passed while it waited: never sent.
    Expired,
}

/// Holds a place in the waiting room; gives it back on drop, however the
/// wait ended.
struct Waiting<'a>(&'a AtomicUsize);

impl Gate {
    /// The gate of a pool of `pool_size` connections.
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
            permits: Semaphore::new(max_in_flight),
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
    pub(super) async fn enter(&self, deadline: Instant) -> Result<SemaphorePermit<'_>, Refused> {
        if let Ok(permit) = self.permits.try_acquire() {
            return Ok(permit);
        }
        let _place = self.take_place()?;
        match timeout_at(deadline, self.permits.acquire()).await {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; were it, nothing could be sent.
            Ok(Err(_)) | Err(_) => Err(Refused::Expired),
        }
    }

    /// [`Gate::enter`] by `send_by`, its refusals as the backend's errors:
    /// shed, or timed out (of `timeout_ms`) without being sent.
    pub(super) async fn admit(
        &self,
        send_by: Instant,
        timeout_ms: u64,
    ) -> Result<SemaphorePermit<'_>, Error> {
        self.enter(send_by).await.map_err(|refused| match refused {
            Refused::Shed => Error::Shed(self.max_waiting),
            Refused::Expired => Error::Timeout(timeout_ms),
        })
    }

    fn take_place(&self) -> Result<Waiting<'_>, Refused> {
        self.waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.max_waiting).then_some(n + 1)
            })
            .map(|_| Waiting(&self.waiting))
            .map_err(|_| Refused::Shed)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;

    use super::*;

    #[tokio::test]
    async fn beyond_the_permits_and_the_line_calls_are_shed_at_once() {
        let gate = Gate::new(2, 3);
        let deadline = Instant::now() + Duration::from_millis(100);
        let a = gate.enter(deadline).await.expect("first permit");
        let _b = gate.enter(deadline).await.expect("second permit");
        let mut waiters = Vec::new();
        for _ in 0..3 {
            let wait = Box::pin(gate.enter(deadline));
            waiters.push(wait);
        }
        // Poll each waiter once so it takes its place in line.
        for wait in &mut waiters {
            assert!(wait.as_mut().now_or_never().is_none());
        }
        assert_eq!(gate.enter(deadline).await.err(), Some(Refused::Shed));
        drop(a);
        let mut waiters = waiters.into_iter();
        let first = waiters.next().expect("three waiters");
        let _first = first
            .await
            .expect("the oldest waiter gets the freed permit");
        // Its place in line can be taken again.
        let mut again = Box::pin(gate.enter(deadline));
        assert!(again.as_mut().now_or_never().is_none());
        assert_eq!(gate.enter(deadline).await.err(), Some(Refused::Shed));
        // No permit is released any more: the others wait until their
        // deadline and are refused as expired, never shed.
        for wait in waiters {
            assert_eq!(wait.await.err(), Some(Refused::Expired));
        }
        assert_eq!(again.await.err(), Some(Refused::Expired));
        assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_wait_ends_at_its_deadline() {
        let gate = Gate::new(1, 10);
        let _held = gate.enter(Instant::now()).await.expect("a free permit");
        let started = Instant::now();
        let res = gate.enter(started + Duration::from_millis(50)).await;
        assert_eq!(res.err(), Some(Refused::Expired));
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn bounds_follow_the_pool_size() {
        let gate = Gate::for_pool(8);
        assert_eq!(gate.max_in_flight(), 8 * IN_FLIGHT_PER_CONNECTION);
        assert_eq!(gate.max_waiting(), 8 * WAITING_PER_CONNECTION);
        assert_eq!(Gate::for_pool(0).max_in_flight(), IN_FLIGHT_PER_CONNECTION);
    }
}
