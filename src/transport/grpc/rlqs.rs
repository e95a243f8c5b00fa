//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService`: one
//! long-lived stream per proxy, which reports how its buckets were used and
//! is answered, whenever a share changes, with what each bucket may admit
//! ([`crate::quota`] decides; this maps the protocol onto it).
//!
//! Every report of a bucket is answered with its assignment (the same one
//! renews its time to live without touching the proxy's bucket); a change
//! to another proxy's share is pushed to that proxy's stream at once.
//!
//! What one proxy can hold is bounded, and a stream going past a bound is
//! ended with a status saying which, never affecting another stream:
//! messages up to [`MAX_MESSAGE_BYTES`] (RESOURCE_EXHAUSTED), at most
//! [`MAX_BUCKETS_PER_STREAM`] buckets, bucket ids of at most
//! [`MAX_BUCKET_ID_BYTES`] and [`MAX_BUCKET_BYTES_PER_STREAM`] in all
//! (each kept once, counted by [`stored_bytes`]), reports at most
//! [`REPORTS_PER_SECOND`] a second after a burst of [`REPORT_BURST`]
//! (RESOURCE_EXHAUSTED), streams per connection and in all, streams not
//! reported yet within a budget of their own (`seats`: RESOURCE_EXHAUSTED
//! at the start, or for the oldest unreported one when displaced), a first
//! report within [`FIRST_REPORT_WITHIN`] and none silent for
//! [`SILENT_LIMIT`] (DEADLINE_EXCEEDED), answers left unread for
//! [`UNREAD_LIMIT`] (RESOURCE_EXHAUSTED), a missing or changed domain and
//! a malformed bucket id (INVALID_ARGUMENT). Streams end with UNAVAILABLE
//! when the server closes. A stream's seat is held by its reader, so it
//! is given back as soon as the stream is ended, whatever its proxy reads.
//! The pools a client address keeps alive are bounded too
//! (`quota::claims`): a bucket past that bound is answered DENY_ALL.
//!
//! What a report means is [`QuotaAssigner`]'s: this keeps each stream's
//! lifecycle (reading, writing, seats, deadlines) and its bucket ids as
//! the wire carries them, and maps messages to the quota assigner and its
//! grants back to answers.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::Stream;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;
use tonic::{Request, Response, Status, Streaming};

use crate::decision::Limiter;
use crate::metrics::{Metrics, QuotaMetrics};
use crate::proto::envoy::service::rate_limit_quota::v3 as rlqs;
use crate::proto::envoy::r#type::v3 as types;
use crate::quota::{
    self, ASSIGNMENT_TTL_US, BucketNumber, BucketReport, Grant, Outbox, QuotaAssigner, QuotaBook,
    REPORT_INTERVAL_US, StreamMembers, Usage,
};
use crate::transport::grpc::MAX_MESSAGE_BYTES;
use crate::transport::shutdown::Shutdown;
use rlqs::rate_limit_quota_response::BucketAction;
use rlqs::rate_limit_quota_response::bucket_action::{
    BucketAction as Action, QuotaAssignmentAction,
};
use rlqs::rate_limit_quota_service_server::{RateLimitQuotaService, RateLimitQuotaServiceServer};

mod ids;
mod seats;

pub use ids::{
    BUCKET_OVERHEAD_BYTES, ENTRY_OVERHEAD_BYTES, MAX_BUCKET_BYTES_PER_STREAM, MAX_BUCKET_ID_BYTES,
    stored_bytes,
};
use ids::{StoredId, validate_bucket};

// The bounds of the pools a client keeps alive, beside the stream's own.
pub use crate::quota::claims::{CLAIM_HOLD_US, MAX_POOL_CLAIMS, MAX_POOLS_PER_CLIENT};

pub use seats::{
    ConnectionTag, MAX_STREAMS, MAX_STREAMS_PER_CONNECTION, MAX_UNREPORTED_PER_CONNECTION,
    MAX_UNREPORTED_STREAMS,
};
use seats::{Seat, Seats};

/// Distinct buckets one stream may report.
pub const MAX_BUCKETS_PER_STREAM: usize = 4096;
/// Report messages a stream may send at once...
pub const REPORT_BURST: u32 = 200;
/// ...and per second after that.
pub const REPORTS_PER_SECOND: u32 = 50;
/// A stream whose answers wait unread this long is ended.
pub const UNREAD_LIMIT: Duration = Duration::from_micros(3 * REPORT_INTERVAL_US);
/// A stream that has reported no bucket this long after it opened is
/// ended (Envoy reports as soon as it opens one).
pub const FIRST_REPORT_WITHIN: Duration = Duration::from_secs(10);
/// A stream that has sent no report this long is ended (Envoy reports
/// every bucket each reporting interval, 5 s by default; its assignments
/// have expired long before).
pub const SILENT_LIMIT: Duration = Duration::from_micros(4 * ASSIGNMENT_TTL_US);
/// How often a stream checks its deadlines and its outbox is being read,
/// and the quota assigner is asked to sweep old shares.
const TICK: Duration = Duration::from_secs(1);

/// The address of the client a request came from (the server sets it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PeerAddress(pub IpAddr);

/// The RLQS service: streams onto the quota assigner (`QuotaAssigner`).
#[derive(Clone)]
pub struct QuotaService {
    quotas: Arc<QuotaAssigner>,
    /// For the streams' bucket ids (seats count the streams).
    metrics: QuotaMetrics,
    shutdown: Shutdown,
    seats: Arc<Seats>,
}

impl QuotaService {
    pub fn new(
        limiter: Arc<Limiter>,
        book: Arc<QuotaBook>,
        metrics: &Metrics,
        shutdown: Shutdown,
    ) -> QuotaService {
        let metrics = metrics.quota().clone();
        let quotas = QuotaAssigner::new(limiter.rules().clone(), book, metrics.clone());
        QuotaService {
            quotas: Arc::new(quotas),
            metrics: metrics.clone(),
            shutdown,
            seats: Seats::new(metrics),
        }
        .sweeping()
    }

    /// The generated server around it, with the server's message bound.
    pub fn into_server(self) -> RateLimitQuotaServiceServer<QuotaService> {
        RateLimitQuotaServiceServer::new(self)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(usize::MAX)
    }

    /// Sweeps every [`TICK`] in a task of its own, so that what expired
    /// is forgotten with no stream open (until the server stops).
    fn sweeping(self) -> QuotaService {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let service = self.clone();
            runtime.spawn(async move {
                let closing = service.shutdown.closing();
                tokio::pin!(closing);
                let mut tick = tokio::time::interval(TICK);
                loop {
                    tokio::select! {
                        () = &mut closing => break,
                        _ = tick.tick() => service.quotas.sweep_now_and_then(),
                    }
                }
            });
        }
        self
    }
}

type Answers = Pin<Box<dyn Stream<Item = Result<rlqs::RateLimitQuotaResponse, Status>> + Send>>;

#[tonic::async_trait]
impl RateLimitQuotaService for QuotaService {
    type StreamRateLimitQuotasStream = Answers;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<rlqs::RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Answers>, Status> {
        let tag = request.extensions().get::<ConnectionTag>().copied();
        let client = request.extensions().get::<PeerAddress>().map(|it| it.0);
        let seat = self.seats.admit(tag)?;
        let members = self.quotas.open(client);
        let shared = Arc::new(StreamShared {
            outbox: members.outbox().clone(),
            ids: Mutex::new(Vec::new()),
        });
        let (end_tx, end_rx) = oneshot::channel();
        let reader = QuotaStream::new(self.clone(), shared.clone(), seat, members);
        let reports = request.into_inner();
        let task = tokio::spawn(async move {
            let status = reader.run(reports).await;
            let _ = end_tx.send(status);
        });
        let writer = Writer {
            shared,
            end: end_rx,
            _task: AbortOnDropHandle::new(task),
        };
        Ok(Response::new(Box::pin(writer.into_stream())))
    }
}

/// What a stream's reader and writer share: the outbox and the bucket id
/// of each bucket number (the same allocation as the key of the reader's
/// bucket).
struct StreamShared {
    outbox: Arc<Outbox>,
    ids: Mutex<Vec<StoredId>>,
}

/// The answer side of one stream.
struct Writer {
    shared: Arc<StreamShared>,
    /// The reader's last word: the status the stream ends with.
    end: oneshot::Receiver<Status>,
    /// The reader, aborted when the answer stream is dropped (the proxy left).
    _task: AbortOnDropHandle<()>,
}

impl Writer {
    fn into_stream(self) -> impl Stream<Item = Result<rlqs::RateLimitQuotaResponse, Status>> {
        futures_util::stream::unfold(Some(self), |state| async move {
            let mut writer = state?;
            tokio::select! {
                biased;
                grants = writer.shared.outbox.take() => {
                    let ids = lock(&writer.shared.ids);
                    let actions = grants
                        .into_iter()
                        .filter_map(|(bucket, grant)| {
                            let id = ids.get(bucket as usize)?;
                            Some(action(id, grant))
                        })
                        .collect();
                    drop(ids);
                    let answer = rlqs::RateLimitQuotaResponse {
                        bucket_action: actions,
                    };
                    Some((Ok(answer), Some(writer)))
                }
                end = &mut writer.end => {
                    let status = end.unwrap_or_else(|_| Status::internal("the stream's reader stopped"));
                    if status.code() == tonic::Code::Ok {
                        None
                    } else {
                        Some((Err(status), None))
                    }
                }
            }
        })
    }
}

/// The report side of one stream.
struct QuotaStream {
    service: QuotaService,
    shared: Arc<StreamShared>,
    /// Its buckets in the quota assigner.
    members: StreamMembers,
    domain: Option<String>,
    /// Each bucket's number, by its entries sorted by key.
    buckets: HashMap<StoredId, BucketNumber>,
    /// What the stream's bucket ids count, by [`stored_bytes`].
    stored_bytes: usize,
    flood: Flood,
    /// Given back when the reader ends, whatever the writer does.
    seat: Seat,
    opened: u64,
    /// When the last report with a bucket came.
    last_report: Option<u64>,
}

impl QuotaStream {
    fn new(
        service: QuotaService,
        shared: Arc<StreamShared>,
        seat: Seat,
        members: StreamMembers,
    ) -> QuotaStream {
        QuotaStream {
            opened: service.quotas.now(),
            service,
            shared,
            members,
            domain: None,
            buckets: HashMap::new(),
            stored_bytes: 0,
            flood: Flood::new(),
            seat,
            last_report: None,
        }
    }

    /// Reads reports until the proxy closes its side (OK), the server
    /// closes (UNAVAILABLE) or the stream breaks a bound; every share it
    /// held is then left to expire.
    async fn run(mut self, mut reports: Streaming<rlqs::RateLimitQuotaUsageReports>) -> Status {
        let shutdown = self.service.shutdown.clone();
        let closing = shutdown.closing();
        tokio::pin!(closing);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let status = loop {
            tokio::select! {
                () = &mut closing => {
                    break Status::unavailable("the server is shutting down; reconnect");
                }
                () = self.seat.displaced() => {
                    break Status::resource_exhausted(format!(
                        "displaced by a newer stream: the server holds {MAX_UNREPORTED_STREAMS} \
                         streams that have not reported yet"
                    ));
                }
                _ = tick.tick() => {
                    self.service.quotas.sweep_now_and_then();
                    if let Err(status) = self.check_read().and_then(|()| self.check_silence()) {
                        break status;
                    }
                }
                message = reports.message() => match message {
                    Ok(Some(message)) => {
                        let has_buckets = !message.bucket_quota_usages.is_empty();
                        if let Err(status) = self.report(message).await {
                            break status;
                        }
                        if has_buckets {
                            if self.last_report.is_none() {
                                self.seat.reported();
                            }
                            self.last_report = Some(self.service.quotas.now());
                        }
                    }
                    Ok(None) => break Status::ok(""),
                    Err(status) => break read_failure(status),
                },
            }
        };
        self.close();
        status
    }

    /// Ends a stream that has not reported within [`FIRST_REPORT_WITHIN`]
    /// of opening, or not for [`SILENT_LIMIT`] since.
    fn check_silence(&self) -> Result<(), Status> {
        let now = self.service.quotas.now();
        match self.last_report {
            None if now.saturating_sub(self.opened) >= FIRST_REPORT_WITHIN.as_micros() as u64 => {
                Err(Status::deadline_exceeded(format!(
                    "no report within {} s of opening; the stream is closed",
                    FIRST_REPORT_WITHIN.as_secs()
                )))
            }
            Some(at) if now.saturating_sub(at) >= SILENT_LIMIT.as_micros() as u64 => {
                Err(Status::deadline_exceeded(format!(
                    "no report for {} s; the stream is closed",
                    SILENT_LIMIT.as_secs()
                )))
            }
            _ => Ok(()),
        }
    }

    /// Ends a stream whose answers wait unread for [`UNREAD_LIMIT`],
    /// giving back its bucket ids at once.
    fn check_read(&self) -> Result<(), Status> {
        let Some(since) = self.shared.outbox.waiting_since() else {
            return Ok(());
        };
        let waited = self.service.quotas.now().saturating_sub(since);
        if waited >= UNREAD_LIMIT.as_micros() as u64 {
            // Nothing more is written: the ids go now.
            drop(std::mem::take(&mut *lock(&self.shared.ids)));
            return Err(Status::resource_exhausted(format!(
                "assignments left unread for {} s; the stream is closed",
                UNREAD_LIMIT.as_secs()
            )));
        }
        Ok(())
    }

    /// Maps one message onto the quota assigner, bucket by bucket; a
    /// message breaking a bound ends the stream.
    async fn report(&mut self, message: rlqs::RateLimitQuotaUsageReports) -> Result<(), Status> {
        self.flood.take()?;
        self.check_domain(&message.domain)?;
        self.check_read()?;
        let scope = self
            .members
            .scope(self.domain.as_deref().unwrap_or_default());
        for usage in message.bucket_quota_usages {
            let id = usage
                .bucket_id
                .ok_or_else(|| Status::invalid_argument("a bucket usage without its bucket_id"))?;
            validate_bucket(&id)?;
            let entries = quota::descriptor(&id.bucket);
            let resolution = self.members.resolve(&scope, &entries);
            let (_, bucket) = self.bucket(&entries)?;
            let report = BucketReport {
                bucket,
                entries: &entries,
                usage: Usage {
                    allowed: usage.num_requests_allowed,
                    denied: usage.num_requests_denied,
                    elapsed_us: usage.time_elapsed.map_or(0, duration_us),
                },
            };
            self.members.report(&scope, report, resolution).await;
        }
        Ok(())
    }

    /// Takes the domain the stream's first report names; a stream stays
    /// in it (later reports name it again, or none).
    fn check_domain(&mut self, domain: &str) -> Result<(), Status> {
        match (&self.domain, domain) {
            (None, "") => Err(Status::invalid_argument(
                "the first report of a stream must name its domain",
            )),
            (None, domain) => {
                self.domain = Some(domain.to_owned());
                Ok(())
            }
            (Some(_), "") => Ok(()),
            (Some(known), domain) if known == domain => Ok(()),
            (Some(known), domain) => Err(Status::invalid_argument(format!(
                "a stream stays in one domain: {known:?}, then {:?}; open a new stream",
                truncate(domain)
            ))),
        }
    }

    /// The stream's bucket for `entries` (its key and number), added when
    /// new and within the stream's bounds.
    fn bucket(&mut self, entries: &[(&str, &str)]) -> Result<(StoredId, BucketNumber), Status> {
        let probe: StoredId = entries
            .iter()
            .map(|(key, value)| (Box::from(*key), Box::from(*value)))
            .collect();
        if let Some((key, bucket)) = self.buckets.get_key_value(&probe) {
            return Ok((key.clone(), *bucket));
        }
        if self.buckets.len() >= MAX_BUCKETS_PER_STREAM {
            return Err(Status::resource_exhausted(format!(
                "a stream may report at most {MAX_BUCKETS_PER_STREAM} buckets"
            )));
        }
        let bytes = stored_bytes(entries);
        if self.stored_bytes + bytes > MAX_BUCKET_BYTES_PER_STREAM {
            return Err(Status::resource_exhausted(format!(
                "a stream may keep at most {MAX_BUCKET_BYTES_PER_STREAM} bytes of bucket ids"
            )));
        }
        self.stored_bytes += bytes;
        self.service.metrics.add_bucket_bytes(bytes as i64);
        let mut ids = lock(&self.shared.ids);
        let bucket = BucketNumber::try_from(ids.len()).unwrap_or(BucketNumber::MAX);
        ids.push(probe.clone());
        drop(ids);
        self.service.metrics.add_buckets(1);
        self.buckets.insert(probe.clone(), bucket);
        Ok((probe, bucket))
    }

    /// Leaves every pool, and gives back what the stream's buckets
    /// counted.
    fn close(&mut self) {
        self.members.leave_all();
        let count = i64::try_from(self.buckets.len()).unwrap_or(i64::MAX);
        self.service.metrics.add_buckets(-count);
        self.service
            .metrics
            .add_bucket_bytes(-i64::try_from(self.stored_bytes).unwrap_or(i64::MAX));
        self.stored_bytes = 0;
        self.buckets.clear();
    }
}

impl Drop for QuotaStream {
    /// An aborted reader (the proxy went away) leaves its pools too.
    fn drop(&mut self) {
        self.close();
    }
}

/// Report messages allowed now: a token bucket of [`REPORT_BURST`]
/// refilled at [`REPORTS_PER_SECOND`].
struct Flood {
    tokens: f64,
    at: Instant,
}

impl Flood {
    fn new() -> Flood {
        Flood {
            tokens: f64::from(REPORT_BURST),
            at: Instant::now(),
        }
    }

    fn take(&mut self) -> Result<(), Status> {
        let now = Instant::now();
        let refill = now.duration_since(self.at).as_secs_f64() * f64::from(REPORTS_PER_SECOND);
        self.tokens = (self.tokens + refill).min(f64::from(REPORT_BURST));
        self.at = now;
        if self.tokens < 1.0 {
            return Err(Status::resource_exhausted(format!(
                "reports arrive faster than {REPORTS_PER_SECOND} a second"
            )));
        }
        self.tokens -= 1.0;
        Ok(())
    }
}

/// A failed read as the status the stream ends with: too large a message
/// is RESOURCE_EXHAUSTED, one that does not decode INVALID_ARGUMENT.
fn read_failure(status: Status) -> Status {
    match status.code() {
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => {
            Status::resource_exhausted(format!("a report larger than {MAX_MESSAGE_BYTES} bytes"))
        }
        tonic::Code::Internal | tonic::Code::InvalidArgument => {
            Status::invalid_argument("a report that is not a RateLimitQuotaUsageReports")
        }
        _ => status,
    }
}

fn duration_us(duration: prost_types::Duration) -> u64 {
    let seconds = u64::try_from(duration.seconds).unwrap_or(0);
    let micros = u64::try_from(duration.nanos / 1_000).unwrap_or(0);
    seconds.saturating_mul(1_000_000).saturating_add(micros)
}

fn proto_duration(us: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(us / 1_000_000).unwrap_or(i64::MAX),
        nanos: i32::try_from(us % 1_000_000 * 1_000).unwrap_or(0),
    }
}

/// `ns` nanoseconds as a protobuf duration (saturating).
fn nanos_duration(ns: u128) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ns / 1_000_000_000).unwrap_or(i64::MAX),
        nanos: i32::try_from(ns % 1_000_000_000).unwrap_or(0),
    }
}

/// The action telling a proxy to enforce `grant` on the bucket `id`.
fn action(id: &StoredId, grant: Grant) -> BucketAction {
    use types::rate_limit_strategy::{BlanketRule, Strategy};
    let strategy = match grant {
        Grant::AllowAll => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Grant::DenyAll => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Grant::Tokens(bucket) => Strategy::TokenBucket(types::TokenBucket {
            max_tokens: bucket.max_tokens,
            tokens_per_fill: Some(bucket.tokens_per_fill),
            fill_interval: Some(nanos_duration(bucket.fill_interval_ns())),
            name: String::new(),
        }),
    };
    BucketAction {
        bucket_id: Some(ids::bucket_id(id)),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(proto_duration(ASSIGNMENT_TTL_US)),
            rate_limit_strategy: Some(types::RateLimitStrategy {
                strategy: Some(strategy),
            }),
        })),
    }
}

/// A client's text in a status message, at most 64 characters.
fn truncate(text: &str) -> String {
    text.chars().take(64).collect()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
