//! Where each RLQS stream counts: at most [`MAX_STREAMS`] open, at most
//! [`MAX_STREAMS_PER_CONNECTION`] per connection, and of those, streams
//! that have not reported yet within a budget of their own
//! ([`MAX_UNREPORTED_STREAMS`] in all, [`MAX_UNREPORTED_PER_CONNECTION`]
//! per connection).
//!
//! A stream that has reported is never displaced by one that has not: a
//! new stream finding the unreported budget full (or the server full)
//! ends the oldest unreported stream and takes its seat; a connection
//! with its own unreported streams at their bound is refused. So streams
//! that only open cannot keep a proxy out, which reports within
//! milliseconds of opening.
//!
//! A seat is given back when its stream's reader ends, whatever the
//! answer side is doing (a proxy that does not read keeps nothing).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tonic::Status;

use crate::metrics::QuotaMetrics;

/// RLQS streams one connection may hold open (Envoy opens one).
pub const MAX_STREAMS_PER_CONNECTION: usize = 16;
/// RLQS streams open on the server at once.
pub const MAX_STREAMS: usize = 16_384;
/// Streams that have not reported yet, on the server at once: a new one
/// past it displaces the oldest.
pub const MAX_UNREPORTED_STREAMS: usize = 1024;
/// Streams that have not reported yet, per connection: one more is
/// refused.
pub const MAX_UNREPORTED_PER_CONNECTION: usize = 4;

/// Which connection a request came on (the server sets it), so streams
/// can be counted per connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnectionTag(pub usize);

/// Every open stream's seat.
#[derive(Debug)]
pub(super) struct Seats {
    state: Mutex<OpenStreams>,
    metrics: QuotaMetrics,
}

/// The open streams and their counts, under one lock.
#[derive(Debug, Default)]
struct OpenStreams {
    /// Open streams by number.
    open: HashMap<u64, Open>,
    /// Unreported streams, oldest first.
    unreported: BTreeMap<u64, Arc<Notify>>,
    per_connection: HashMap<ConnectionTag, PerConnection>,
    next: u64,
}

#[derive(Debug)]
struct Open {
    tag: Option<ConnectionTag>,
    reported: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct PerConnection {
    streams: usize,
    unreported: usize,
}

/// One open stream's seat, given back on drop.
pub(super) struct Seat {
    seats: Arc<Seats>,
    number: u64,
    /// Woken when a newer stream displaced this one.
    displaced: Arc<Notify>,
}

impl Seats {
    pub(super) fn new(metrics: QuotaMetrics) -> Arc<Seats> {
        Arc::new(Seats {
            state: Mutex::default(),
            metrics,
        })
    }

    /// A seat for a new stream on connection `tag`, or why none.
    pub(super) fn admit(self: &Arc<Self>, tag: Option<ConnectionTag>) -> Result<Seat, Status> {
        let mut state = lock(&self.state);
        if let Some(tag) = tag {
            let here = state.per_connection.get(&tag).copied().unwrap_or_default();
            if here.streams >= MAX_STREAMS_PER_CONNECTION {
                return Err(Status::resource_exhausted(format!(
                    "at most {MAX_STREAMS_PER_CONNECTION} rate-limit quota streams per connection"
                )));
            }
            if here.unreported >= MAX_UNREPORTED_PER_CONNECTION {
                return Err(Status::resource_exhausted(format!(
                    "at most {MAX_UNREPORTED_PER_CONNECTION} rate-limit quota streams per \
                     connection that have not reported yet"
                )));
            }
        }
        if state.unreported.len() >= MAX_UNREPORTED_STREAMS
            || (state.open.len() >= MAX_STREAMS && !state.unreported.is_empty())
        {
            self.displace_oldest(&mut state);
        }
        if state.open.len() >= MAX_STREAMS {
            return Err(Status::resource_exhausted(format!(
                "the server holds {MAX_STREAMS} rate-limit quota streams already"
            )));
        }
        let number = state.next;
        state.next += 1;
        let displaced = Arc::new(Notify::new());
        state.open.insert(
            number,
            Open {
                tag,
                reported: false,
            },
        );
        state.unreported.insert(number, displaced.clone());
        if let Some(tag) = tag {
            let here = state.per_connection.entry(tag).or_default();
            here.streams += 1;
            here.unreported += 1;
        }
        self.metrics.add_streams(1);
        Ok(Seat {
            seats: self.clone(),
            number,
            displaced,
        })
    }

    /// Ends the oldest unreported stream: its seat is free at once.
    fn displace_oldest(&self, state: &mut OpenStreams) {
        if let Some((&number, _)) = state.unreported.first_key_value()
            && let Some(notify) = self.release(state, number)
        {
            notify.notify_one();
        }
    }

    /// Frees stream `number`'s seat (once); its displacement signal when
    /// it had not reported.
    fn release(&self, state: &mut OpenStreams, number: u64) -> Option<Arc<Notify>> {
        let open = state.open.remove(&number)?;
        self.metrics.add_streams(-1);
        let notify = state.unreported.remove(&number);
        if let Some(tag) = open.tag
            && let Some(here) = state.per_connection.get_mut(&tag)
        {
            here.streams -= 1;
            if !open.reported {
                here.unreported -= 1;
            }
            if here.streams == 0 {
                state.per_connection.remove(&tag);
            }
        }
        notify
    }

    /// Streams open and, of those, not reported yet.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let state = lock(&self.state);
        (state.open.len(), state.unreported.len())
    }
}

impl Seat {
    /// The stream reported: it can no longer be displaced.
    pub(super) fn reported(&self) {
        let mut state = lock(&self.seats.state);
        let Some(open) = state.open.get_mut(&self.number) else {
            return;
        };
        if open.reported {
            return;
        }
        open.reported = true;
        let tag = open.tag;
        state.unreported.remove(&self.number);
        if let Some(tag) = tag
            && let Some(here) = state.per_connection.get_mut(&tag)
        {
            here.unreported -= 1;
        }
    }

    /// Completes once a newer stream has displaced this one.
    pub(super) async fn displaced(&self) {
        self.displaced.notified().await;
    }
}

impl Drop for Seat {
    fn drop(&mut self) {
        let mut state = lock(&self.seats.state);
        self.seats.release(&mut state, self.number);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
