//! Serving threads (`--grpc-threads N`, off by default): gRPC connections
//! dealt in turn to several threads, each with its own single-threaded
//! runtime.
//!
//! The idea: on tokio's shared multi-threaded runtime a request's tasks
//! (the connection's and the stream's) can be woken across worker threads,
//! and idle workers are woken to steal work; on a thread of its own, a
//! connection's tasks wake one another without leaving the thread. Each
//! thread marks itself ([`crate::serving_thread`]) so that the Redis
//! backend gives it connections of its own, made on its runtime: a call
//! and its answer then stay on the thread too. What it measured on two
//! cores shared with the load generator is in docs/benchmarks.md
//! (the `threads` rows of "CPU per decision"): less CPU per
//! decision at 500 requests in flight, but a worse p99 at one request per
//! connection on the memory backend (a thread's connections wait while it
//! is descheduled; the shared runtime's other worker would take them).
//! Hence an option, not the default.
//!
//! The listener stays on the caller's runtime: it accepts within the cap
//! and hands each connection to the next thread, which moves the socket
//! and its deadline timer to its own runtime and serves it there (TLS
//! handshake included) until it closes. What requests share (the limiter,
//! its backend, the metrics, health) is shared across threads as before.

use std::future::Future;

use futures_util::future::try_join_all;
use futures_util::{Stream, StreamExt};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::routes::GrpcService;
use super::{Connections, Error};
use crate::transport::listener::Conn;

/// Starts `threads` threads serving `connections`, and returns the future
/// that deals the connections of `conns` to them until the stop's closing
/// stage, then waits for every thread to end (the first error ends it at
/// once). Dropping the future stops the threads: their runtimes, and the
/// connections still open on them, are dropped.
pub(super) fn spawn<S: GrpcService>(
    conns: impl Stream<Item = Conn> + Send + 'static,
    threads: usize,
    connections: Connections<S>,
) -> Result<impl Future<Output = Result<(), Error>> + Send, Error> {
    let closing = connections.shutdown.clone();
    let mut ended = Vec::with_capacity(threads);
    let mut stops = Vec::with_capacity(threads);
    let mut queues = Vec::with_capacity(threads);
    for index in 0..threads {
        let connections = connections.clone();
        // Unbounded, yet bounded by the connection cap: every item holds a permit.
        let (queue, dealt) = mpsc::unbounded_channel::<Conn>();
        let (end, ended_rx) = oneshot::channel();
        let (stop, stop_rx) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name(format!("grpc-{index}"))
            .spawn(move || {
                crate::serving_thread::enter(index);
                let _ = end.send(serve_on_thread(dealt, connections, stop_rx));
            })
            .map_err(Error::Threads)?;
        ended.push(async move { ended_rx.await.unwrap_or(Err(Error::ThreadLost)) });
        stops.push(stop);
        queues.push(queue);
    }
    let deal = async move {
        deal(conns, queues, closing.closing()).await;
        // Each thread stops taking connections once its queue is empty and
        // dropped; the threads' ends are what the caller waits for.
        std::future::pending::<()>().await;
    };
    Ok(async move {
        // Held while the threads run; dropped with this future.
        let _stops = stops;
        tokio::select! {
            res = try_join_all(ended) => res.map(|_| ()),
            () = deal => unreachable!("dealing connections never ends"),
        }
    })
}

/// Hands the items of `items` to `queues` in turn, skipping queues whose
/// receiver is gone, until `items` ends, every queue is gone or `until`
/// completes; then drops `items` (for a listener's connections: the
/// listening socket closes) and the queues.
async fn deal<T>(
    items: impl Stream<Item = T>,
    queues: Vec<mpsc::UnboundedSender<T>>,
    until: impl Future<Output = ()>,
) {
    let mut items = std::pin::pin!(items);
    let mut until = std::pin::pin!(until);
    let mut next = 0;
    loop {
        let item = tokio::select! {
            item = items.next() => item,
            () = &mut until => None,
        };
        let Some(mut item) = item else { return };
        let mut handed = false;
        for _ in 0..queues.len() {
            let queue = &queues[next];
            next = (next + 1) % queues.len();
            match queue.send(item) {
                Ok(()) => {
                    handed = true;
                    break;
                }
                Err(mpsc::error::SendError(back)) => item = back,
            }
        }
        if !handed {
            return;
        }
    }
}

/// Serves the connections `dealt` to this thread on a new single-threaded
/// runtime, until the server ends or `stop` is dropped.
fn serve_on_thread<S: GrpcService>(
    dealt: mpsc::UnboundedReceiver<Conn>,
    connections: Connections<S>,
    stop: oneshot::Receiver<()>,
) -> Result<(), Error> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Threads)?;
    runtime.block_on(async move {
        // This thread's backend resources (its Redis connections) are made
        // now, on this runtime, rather than by its first request.
        tokio::spawn({
            let rate_limit = connections.rate_limit.clone();
            async move { rate_limit.warm_up().await }
        });
        let conns = UnboundedReceiverStream::new(dealt).filter_map(|conn| async move {
            match conn.rehome() {
                Ok(conn) => Some(conn),
                Err(err) => {
                    tracing::warn!("grpc connection lost while moving it to its thread: {err}");
                    None
                }
            }
        });
        tokio::select! {
            res = connections.serve(conns) => res,
            // The caller stopped waiting (the drain deadline passed).
            _ = stop => Ok(()),
        }
    })
}

#[cfg(test)]
mod tests;
