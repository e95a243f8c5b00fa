//! envoyproxy/ratelimit's statistics sent as statsd lines (`--statsd-addr`),
//! over TCP as it sends them, or over UDP.
//!
//! Never on a decision's path: decisions only bump the counters they
//! always bump. A flusher task reads [`RatelimitStats`] every flush
//! interval and sends what changed since its last flush, as
//! envoyproxy/ratelimit's stats store does: a counter's increase
//! (`name:N|c`, a counter that did not move is not sent) and the answers
//! timed since, as timers in milliseconds (`name:T|ms`; answers are
//! counted per bucket of the decision latency histogram, so one line per
//! bucket that moved carries its count as a sample rate, `|@0.25` for 4
//! answers, timed at the bucket's upper edge). Lines leave in batches
//! through a queue of [`QUEUED_BATCHES`]; a batch that finds the queue
//! full, cannot be sent, or is cut off by a write that does not finish in
//! time, is dropped and its lines counted in
//! `throttlegate_statsd_dropped_lines_total`. A connection that fails is
//! made again after a back-off doubling from 100 ms to 10 s; batches
//! meanwhile are dropped. The kernel holds at most about [`SEND_BUFFER`]
//! of lines a receiver has not read. A receiver that is slow, stalls or
//! is absent thus costs lines and bounded memory, never decision time.
//!
//! Tags (`--statsd-tag`, envoyproxy/ratelimit's `EXTRA_TAGS`) go on every
//! line: in the name as `.__key=value` (how envoyproxy/ratelimit's statsd
//! sink writes them), or with `--statsd-tag-format dogstatsd` as
//! `|#key:value`.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpSocket, TcpStream, UdpSocket};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::Metrics;
use super::ratelimit_names::{RESPONSE_TIME, RatelimitStats, ResponseTime};

/// Batches waiting for the connection; a flush that finds them all taken
/// is dropped.
pub const QUEUED_BATCHES: usize = 4;
/// The largest UDP datagram sent (lines are never split).
pub const MAX_DATAGRAM: usize = 1432;
/// The TCP send buffer asked of the kernel: what it holds for a receiver
/// that does not read, before writes wait (and then time out).
pub const SEND_BUFFER: u32 = 64 * 1024;
/// The first wait before connecting again; it doubles up to
/// [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// How lines travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatsdProtocol {
    Tcp,
    Udp,
}

/// How tags are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TagFormat {
    /// `name.__key=value:1|c`.
    Name,
    /// `name:1|c|#key:value`.
    DogStatsd,
}

/// Where and how the statistics go.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsdSettings {
    /// `host:port`, resolved at each connection.
    pub addr: String,
    pub protocol: StatsdProtocol,
    pub flush_interval: Duration,
    /// `(key, value)` on every line.
    pub tags: Vec<(String, String)>,
    pub tag_format: TagFormat,
}

/// Keeps the flusher and the sender running; both stop when it is dropped.
#[derive(Debug)]
pub struct StatsdGuard {
    tasks: [JoinHandle<()>; 2],
}

impl Drop for StatsdGuard {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// One batch of lines for the sender.
struct Batch {
    text: String,
    lines: u64,
}

/// Starts sending `metrics`' statistics as `settings` say.
pub fn spawn(metrics: Arc<Metrics>, settings: StatsdSettings) -> StatsdGuard {
    metrics.register_statsd_drops();
    let (tx, rx) = mpsc::channel(QUEUED_BATCHES);
    let tags = tag_text(&settings.tags, settings.tag_format);
    let sender = tokio::spawn(send(
        rx,
        settings.addr.clone(),
        settings.protocol,
        write_timeout(settings.flush_interval),
        metrics.clone(),
    ));
    let flusher = tokio::spawn(flush_every(
        metrics,
        settings.flush_interval,
        tags,
        settings.tag_format,
        tx,
    ));
    StatsdGuard {
        tasks: [flusher, sender],
    }
}

/// A write must finish within one flush interval (at least 1 s, at most
/// 10 s), or the connection is dropped.
fn write_timeout(flush_interval: Duration) -> Duration {
    flush_interval.clamp(Duration::from_secs(1), MAX_BACKOFF)
}

impl Metrics {
    /// Registers `throttlegate_statsd_dropped_lines` (once statsd is on).
    fn register_statsd_drops(&self) {
        self.registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .register(
                "statsd_dropped_lines",
                "statsd lines not delivered: the send queue was full, the receiver could not be reached, or a write did not finish within the flush interval",
                self.statsd_dropped.clone(),
            );
    }
}

/// Every `interval`, the lines of what changed; a full queue drops them.
async fn flush_every(
    metrics: Arc<Metrics>,
    interval: Duration,
    tags: String,
    format: TagFormat,
    tx: mpsc::Sender<Batch>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let mut last = Flushed::default();
    loop {
        ticker.tick().await;
        let stats = metrics.ratelimit_stats();
        let batch = last.lines_since(&stats, &tags, format);
        if batch.lines == 0 {
            continue;
        }
        if let Err(err) = tx.try_send(batch) {
            let batch = match err {
                mpsc::error::TrySendError::Full(it) | mpsc::error::TrySendError::Closed(it) => it,
            };
            metrics.statsd_dropped.inc_by(batch.lines);
        }
    }
}

/// What the last flush sent.
#[derive(Default)]
struct Flushed {
    counters: HashMap<String, u64>,
    response_time: ResponseTime,
}

impl Flushed {
    /// The lines of every change from the last flush to `stats`, which
    /// becomes the last flush.
    fn lines_since(&mut self, stats: &RatelimitStats, tags: &str, format: TagFormat) -> Batch {
        let mut text = String::new();
        let mut lines = 0u64;
        for (name, value) in &stats.counters {
            let before = self.counters.get(name).copied().unwrap_or(0);
            let delta = value.saturating_sub(before);
            if delta > 0 {
                line(&mut text, name, &delta.to_string(), "c", None, tags, format);
                lines += 1;
            }
            if value != &before {
                self.counters.insert(name.clone(), *value);
            }
        }
        let time = &stats.response_time;
        let last_finite = time
            .buckets
            .iter()
            .rev()
            .map(|it| it.0)
            .find(|it| it.is_finite())
            .unwrap_or(0.0);
        for (edge, answers) in time.delta_since(&self.response_time) {
            let edge = if edge.is_finite() { edge } else { last_finite };
            let rate = (answers > 1).then(|| 1.0 / answers as f64);
            line(
                &mut text,
                RESPONSE_TIME,
                &edge.to_string(),
                "ms",
                rate,
                tags,
                format,
            );
            lines += 1;
        }
        self.response_time = time.clone();
        Batch { text, lines }
    }
}

/// Appends one statsd line.
fn line(
    out: &mut String,
    name: &str,
    value: &str,
    kind: &str,
    rate: Option<f64>,
    tags: &str,
    format: TagFormat,
) {
    // Writing into a String cannot fail.
    let _ = match format {
        TagFormat::Name => write!(out, "{name}{tags}:{value}|{kind}"),
        TagFormat::DogStatsd => write!(out, "{name}:{value}|{kind}"),
    };
    if let Some(rate) = rate {
        let _ = write!(out, "|@{rate}");
    }
    if format == TagFormat::DogStatsd {
        out.push_str(tags);
    }
    out.push('\n');
}

/// The tags as every line carries them: `.__k=v` per tag sorted by key, or
/// `|#k:v,...`. Characters that would break a line or a tag become `_`.
pub fn tag_text(tags: &[(String, String)], format: TagFormat) -> String {
    let clean = |text: &str, extra: &[char]| -> String {
        text.chars()
            .map(|ch| {
                if ch.is_control() || ch == ' ' || ":|@#,".contains(ch) || extra.contains(&ch) {
                    '_'
                } else {
                    ch
                }
            })
            .collect()
    };
    let mut sorted: Vec<&(String, String)> = tags.iter().collect();
    sorted.sort();
    let mut out = String::new();
    for (idx, (key, value)) in sorted.into_iter().enumerate() {
        match format {
            TagFormat::Name => {
                let _ = write!(
                    out,
                    ".__{}={}",
                    clean(key, &['.', '=']),
                    clean(value, &['.', '='])
                );
            }
            TagFormat::DogStatsd => {
                out.push_str(if idx == 0 { "|#" } else { "," });
                let _ = write!(out, "{}:{}", clean(key, &[]), clean(value, &[]));
            }
        }
    }
    out
}

/// The sender: one connection (TCP) or socket (UDP) at a time, made again
/// after a failure once its back-off has passed; batches that find none
/// are dropped.
async fn send(
    mut rx: mpsc::Receiver<Batch>,
    addr: String,
    protocol: StatsdProtocol,
    timeout: Duration,
    metrics: Arc<Metrics>,
) {
    let mut link: Option<Link> = None;
    let mut backoff = MIN_BACKOFF;
    let mut retry_at = tokio::time::Instant::now();
    let mut reported = false;
    while let Some(batch) = rx.recv().await {
        if link.is_none() && tokio::time::Instant::now() >= retry_at {
            match tokio::time::timeout(timeout, Link::connect(&addr, protocol)).await {
                Ok(Ok(it)) => {
                    if reported {
                        tracing::info!(addr, "statsd receiver reachable again");
                        reported = false;
                    }
                    link = Some(it);
                    backoff = MIN_BACKOFF;
                }
                failed => {
                    let why = match failed {
                        Ok(Err(err)) => err.to_string(),
                        _ => "connection timed out".to_owned(),
                    };
                    fail(&addr, &why, &mut reported);
                    retry_at = tokio::time::Instant::now() + backoff;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
            }
        }
        let Some(open) = link.as_mut() else {
            metrics.statsd_dropped.inc_by(batch.lines);
            continue;
        };
        match tokio::time::timeout(timeout, open.write(&batch.text)).await {
            Ok(Ok(unsent)) => {
                metrics.statsd_dropped.inc_by(unsent);
            }
            failed => {
                let why = match failed {
                    Ok(Err(err)) => err.to_string(),
                    _ => "a write did not finish in time".to_owned(),
                };
                fail(&addr, &why, &mut reported);
                metrics.statsd_dropped.inc_by(batch.lines);
                link = None;
                retry_at = tokio::time::Instant::now() + backoff;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

/// Logs the first failure of a run of them.
fn fail(addr: &str, why: &str, reported: &mut bool) {
    if !*reported {
        tracing::warn!(
            addr,
            error = why,
            "statsd receiver unreachable; lines are dropped until it is back"
        );
        *reported = true;
    }
}

/// The first address `addr` (`host:port`) resolves to.
async fn resolve(addr: &str) -> std::io::Result<std::net::SocketAddr> {
    tokio::net::lookup_host(addr)
        .await?
        .next()
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no address"))
}

enum Link {
    Tcp(TcpStream),
    Udp(UdpSocket),
}

impl Link {
    async fn connect(addr: &str, protocol: StatsdProtocol) -> std::io::Result<Link> {
        match protocol {
            StatsdProtocol::Tcp => {
                let target = resolve(addr).await?;
                let socket = if target.is_ipv4() {
                    TcpSocket::new_v4()?
                } else {
                    TcpSocket::new_v6()?
                };
                socket.set_send_buffer_size(SEND_BUFFER)?;
                let stream = socket.connect(target).await?;
                stream.set_nodelay(true)?;
                Ok(Link::Tcp(stream))
            }
            StatsdProtocol::Udp => {
                let target = resolve(addr).await?;
                let local = if target.is_ipv4() {
                    "0.0.0.0:0"
                } else {
                    "[::]:0"
                };
                let socket = UdpSocket::bind(local).await?;
                socket.connect(target).await?;
                Ok(Link::Udp(socket))
            }
        }
    }

    /// Writes `text`; over UDP returns the lines of datagrams that could
    /// not be sent (a receiver that is not listening refuses them).
    async fn write(&mut self, text: &str) -> std::io::Result<u64> {
        match self {
            Link::Tcp(stream) => {
                stream.write_all(text.as_bytes()).await?;
                Ok(0)
            }
            Link::Udp(socket) => {
                let mut unsent = 0;
                for datagram in datagrams(text, MAX_DATAGRAM) {
                    if socket.send(datagram.as_bytes()).await.is_err() {
                        unsent += datagram.lines().count() as u64;
                    }
                }
                Ok(unsent)
            }
        }
    }
}

/// `text` cut at line ends into pieces of at most `max` bytes (a longer
/// line goes alone).
fn datagrams(text: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut end = 0;
    for (idx, _) in text.match_indices('\n') {
        let next = idx + 1;
        if next - start > max && end > start {
            out.push(&text[start..end]);
            start = end;
        }
        end = next;
    }
    if end > start {
        out.push(&text[start..end]);
    }
    out
}

#[cfg(test)]
mod tests;
