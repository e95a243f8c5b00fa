//! Bounded accepting: a cap on open connections, back-off when descriptors run out, and a deadline on every connection until it has sent a request.
//!
//! Both servers accept through a [`Listener`]. It takes a permit before
//! calling `accept`, so at the cap new peers wait in the kernel's backlog
//! and cost no descriptor. When `accept` fails (EMFILE, ENFILE, ENOBUFS...)
//! it sleeps with a doubling back-off instead of retrying at once (the
//! socket stays readable, so an immediate retry spins), logs at most once a
//! second and counts the failure. Each accepted [`Conn`] carries a
//! [`Watchdog`]: while it holds a deadline, a read or write still pending
//! past it fails with `TimedOut`, which makes hyper drop the connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_util::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::log_gate::LogGate;
use crate::metrics::{ListenerMetrics, Metrics};

/// First pause after a failed `accept`; doubled on each failure in a row.
const FIRST_BACKOFF: Duration = Duration::from_millis(5);
/// Longest pause: a freed descriptor is used within this time.
const MAX_BACKOFF: Duration = Duration::from_millis(200);

/// Accepts connections on a TCP listener, at most `max_connections` open
/// at once; `accept` never fails.
pub struct Listener {
    inner: TcpListener,
    name: &'static str,
    permits: Arc<Semaphore>,
    metrics: ListenerMetrics,
    backoff: Duration,
    log: LogGate,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("name", &self.name)
            .field("available", &self.permits.available_permits())
            .finish_non_exhaustive()
    }
}

impl Listener {
    /// `name` labels the metrics and log lines (`grpc`, `http`);
    /// `max_connections` below 1 counts as 1.
    pub fn new(
        inner: TcpListener,
        name: &'static str,
        max_connections: usize,
        metrics: &Metrics,
    ) -> Self {
        Self {
            inner,
            name,
            permits: Arc::new(Semaphore::new(
                max_connections.clamp(1, Semaphore::MAX_PERMITS),
            )),
            metrics: metrics.listener(name),
            backoff: FIRST_BACKOFF,
            log: LogGate::new(),
        }
    }

    /// The next connection, once fewer than the cap are open; its watchdog
    /// starts with `first_deadline` (`None`: no deadline), and its IO fails
    /// after `lifetime` whatever the watchdog says.
    pub async fn accept(
        &mut self,
        first_deadline: Option<Duration>,
        lifetime: Option<Duration>,
    ) -> Conn {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        loop {
            match self.inner.accept().await {
                Ok((stream, _peer)) => {
                    self.backoff = FIRST_BACKOFF;
                    // Small unary answers: never wait for Nagle.
                    let _ = stream.set_nodelay(true);
                    let limits = ConnLimits {
                        first_deadline,
                        lifetime,
                    };
                    return Conn::new(stream, permit, &self.metrics, limits);
                }
                // The peer gave up before we took the connection: nothing to wait for.
                Err(err) if is_peer_error(&err) => {}
                Err(err) => self.back_off(&err).await,
            }
        }
    }

    /// The listener as an endless stream of connections, each accepted
    /// as by [`Listener::accept`].
    pub fn into_incoming(
        self,
        first_deadline: Option<Duration>,
        lifetime: Option<Duration>,
    ) -> impl Stream<Item = Conn> + Send + 'static {
        futures_util::stream::unfold(self, move |mut listener| async move {
            let conn = listener.accept(first_deadline, lifetime).await;
            Some((conn, listener))
        })
    }

    async fn back_off(&mut self, err: &io::Error) {
        let out_of_descriptors = matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
        if out_of_descriptors {
            self.metrics.accept_errors_descriptors.inc();
        } else {
            self.metrics.accept_errors_other.inc();
        }
        if let Some(suppressed) = self.log.admit() {
            let open = self.metrics.open.get();
            if out_of_descriptors {
                tracing::error!(
                    listener = self.name,
                    open_connections = open,
                    suppressed,
                    "cannot accept connections, out of file descriptors: {err}"
                );
            } else {
                tracing::error!(
                    listener = self.name,
                    open_connections = open,
                    suppressed,
                    "cannot accept connections: {err}"
                );
            }
        }
        tokio::time::sleep(self.backoff).await;
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
    }
}

/// Errors that concern one connection the peer already abandoned, not the
/// listener: retried at once.
fn is_peer_error(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionRefused
    )
}

/// When a connection must have made progress by, as its requests go.
///
/// gRPC arms it at accept (the peer must send the preface and a complete
/// request's headers: the server sends GOAWAY at the handshake deadline,
/// and this deadline, a grace later, closes a peer that does not go) and
/// disarms it for good at the first request: from then on HTTP/2
/// keepalive and the maximum connection age bound it. HTTP/1
/// re-arms it between requests: an idle deadline after each response, a
/// header deadline from the first byte of the next request head.
#[derive(Debug)]
pub struct Watchdog {
    state: Mutex<Guarded>,
}

/// The phase, and the task whose IO last waited without a deadline: arming
/// one must wake it, or the deadline is not seen until the peer sends.
#[derive(Debug)]
struct Guarded {
    state: RequestPhase,
    waiting: Option<Waker>,
}

/// Where a connection stands between its requests, which says which
/// deadline the watchdog enforces.
#[derive(Debug, Clone, Copy)]
enum RequestPhase {
    /// Waiting for the first byte of a request head.
    Idle { deadline: Instant, head: Duration },
    /// A request head has begun; no request is being served.
    Head { deadline: Instant },
    /// Serving a request, or (gRPC) past the first one: no deadline.
    Settled,
}

impl Watchdog {
    fn new(first_deadline: Option<Duration>) -> Self {
        let state = match first_deadline {
            Some(within) => RequestPhase::Head {
                deadline: Instant::now() + within,
            },
            None => RequestPhase::Settled,
        };
        Self {
            state: Mutex::new(Guarded {
                state,
                waiting: None,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Guarded> {
        // Never held across an await; a poisoned state is still a state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The deadline in force, if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.lock().state.deadline()
    }

    /// The deadline in force; without one, `waker` is woken when one is set.
    fn deadline_or_wake(&self, waker: &Waker) -> Option<Instant> {
        let mut guarded = self.lock();
        let deadline = guarded.state.deadline();
        if deadline.is_none() {
            match &mut guarded.waiting {
                Some(it) => it.clone_from(waker),
                None => guarded.waiting = Some(waker.clone()),
            }
        }
        deadline
    }

    /// A request was received whole (its head, for HTTP/1): no deadline
    /// until [`Watchdog::idle`].
    pub fn request_started(&self) {
        self.lock().state = RequestPhase::Settled;
    }

    /// The connection waits for the next request: it must start within
    /// `idle`, and its head then arrive whole within `head`.
    pub fn idle(&self, idle: Duration, head: Duration) {
        let waiting = {
            let mut guarded = self.lock();
            guarded.state = RequestPhase::Idle {
                deadline: Instant::now() + idle,
                head,
            };
            guarded.waiting.take()
        };
        if let Some(waker) = waiting {
            waker.wake();
        }
    }

    /// Bytes arrived: a waiting connection starts its header deadline.
    fn bytes_read(&self) {
        let mut guarded = self.lock();
        if let RequestPhase::Idle { head, .. } = guarded.state {
            guarded.state = RequestPhase::Head {
                deadline: Instant::now() + head,
            };
        }
    }
}

impl RequestPhase {
    fn deadline(self) -> Option<Instant> {
        match self {
            RequestPhase::Idle { deadline, .. } | RequestPhase::Head { deadline } => Some(deadline),
            RequestPhase::Settled => None,
        }
    }
}

/// Connection info for the servers: the TCP addresses and the
/// connection's watchdog.
#[derive(Debug, Clone)]
pub struct ConnInfo {
    pub tcp: TcpConnectInfo,
    pub watchdog: Arc<Watchdog>,
}

/// The deadlines of one accepted connection.
#[derive(Debug, Clone, Copy)]
struct ConnLimits {
    first_deadline: Option<Duration>,
    lifetime: Option<Duration>,
}

/// An accepted connection: holds its slot under the cap until dropped,
/// and fails IO pending past its watchdog's deadline or its lifetime.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    watchdog: Arc<Watchdog>,
    /// The end of the connection's lifetime, whatever the watchdog says.
    end_of_life: Option<Instant>,
    sleep: Pin<Box<Sleep>>,
    _open: OpenConnection,
    _permit: OwnedSemaphorePermit,
}

/// The open-connections gauge's count of one connection, taken back when
/// dropped.
#[derive(Debug)]
struct OpenConnection(prometheus_client::metrics::gauge::Gauge);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Conn {
    fn new(
        stream: TcpStream,
        permit: OwnedSemaphorePermit,
        metrics: &ListenerMetrics,
        limits: ConnLimits,
    ) -> Self {
        let watchdog = Arc::new(Watchdog::new(limits.first_deadline));
        let end_of_life = limits.lifetime.map(|it| Instant::now() + it);
        let sleep = Box::pin(tokio::time::sleep_until(
            watchdog.deadline().unwrap_or_else(Instant::now),
        ));
        metrics.open.inc();
        Self {
            stream,
            watchdog,
            end_of_life,
            sleep,
            _open: OpenConnection(metrics.open.clone()),
            _permit: permit,
        }
    }

    /// The same connection (deadlines, slot, count) moved to the runtime
    /// this is called on: its socket and its timer are registered with
    /// that runtime's reactor and clock instead of the accepting one's.
    /// Must be called within a tokio runtime.
    pub fn rehome(self) -> io::Result<Conn> {
        let deadline = self.sleep.deadline();
        let stream = TcpStream::from_std(self.stream.into_std()?)?;
        Ok(Conn {
            stream,
            sleep: Box::pin(tokio::time::sleep_until(deadline)),
            ..self
        })
    }

    /// The watchdog the server updates as requests come and go.
    pub fn watchdog(&self) -> Arc<Watchdog> {
        self.watchdog.clone()
    }

    /// `Ready(error)` once the deadline in force has passed; otherwise
    /// registers the waker for it.
    fn poll_deadline(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let deadline = match (self.watchdog.deadline_or_wake(cx.waker()), self.end_of_life) {
            (Some(watchdog), Some(end)) => watchdog.min(end),
            (Some(it), None) | (None, Some(it)) => it,
            (None, None) => return Poll::Pending,
        };
        if self.sleep.deadline() != deadline {
            self.sleep.as_mut().reset(deadline);
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection made no progress before its deadline",
            )),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        ConnInfo {
            tcp: self.stream.connect_info(),
            watchdog: self.watchdog.clone(),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.watchdog.bytes_read();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending => this.poll_deadline(cx).map(Err),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_write(cx, buf) {
            Poll::Pending => this.poll_deadline(cx).map(Err),
            ready => ready,
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_write_vectored(cx, bufs) {
            Poll::Pending => this.poll_deadline(cx).map(Err),
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.stream).poll_flush(cx) {
            Poll::Pending => this.poll_deadline(cx).map(Err),
            ready => ready,
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The descriptor limit at start and how the connection caps follow from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorBudget {
    /// The soft `RLIMIT_NOFILE` in force (after raising it).
    pub limit: u64,
    /// Kept free of client connections: Redis connections, the config
    /// watcher, logs, the listening sockets.
    pub reserve: u64,
}

impl DescriptorBudget {
    /// Largest default HTTP cap: the port serves health checks, scrapes
    /// and debugging, never the request path.
    pub const MAX_HTTP: usize = 1024;

    /// Default caps `(grpc, http)`: together at most `limit - reserve`, a
    /// quarter (at most [`Self::MAX_HTTP`]) for HTTP, so neither port can
    /// take the descriptors the other or Redis needs.
    pub fn default_caps(self) -> (usize, usize) {
        let budget = usize::try_from(self.limit.saturating_sub(self.reserve)).unwrap_or(usize::MAX);
        let http = (budget / 4).clamp(1, Self::MAX_HTTP);
        let grpc = budget.saturating_sub(http).max(1);
        (grpc, http)
    }
}

#[cfg(test)]
mod tests;
