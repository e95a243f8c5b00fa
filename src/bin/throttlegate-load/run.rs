//! The load itself: N connections, M streams on each, sending requests
//! until a phase's budget or deadline runs out; as fast as answers come
//! (closed loop) or paced to a rate with planned send times (open loop);
//! the answers drained into a report at every interval.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

use crate::args::{Args, Distribution};
use crate::keys::{KeySource, Rng};
use crate::summary::Tally;

/// What the load sends: every request alike but for the varying entry's
/// value, drawn from the key source, with its timeout and pace.
#[derive(Debug)]
pub struct Workload {
    template: RateLimitRequest,
    keys: KeySource,
    timeout: Duration,
    seed: u64,
    /// Requests per second overall, when paced.
    rate: Option<f64>,
}

/// A paced request sent more than this after its planned time counts as
/// late: below it is the timer's own granularity (1 ms), not a stream
/// still busy.
pub const LATE_AFTER: Duration = Duration::from_millis(1);

impl Workload {
    pub fn new(args: &Args) -> Workload {
        let descriptors = (0..args.descriptors.max(1))
            .map(|idx| {
                let mut entries: Vec<Entry> = args
                    .prefix_entries
                    .iter()
                    .map(|(key, value)| Entry {
                        key: key.clone().into_bytes(),
                        value: value.clone().into_bytes(),
                    })
                    .collect();
                let key = match idx {
                    0 => args.key.clone(),
                    idx => format!("{}_{idx}", args.key),
                };
                entries.push(Entry {
                    key: key.into_bytes(),
                    value: Vec::new(),
                });
                RateLimitDescriptor {
                    entries,
                    limit: None,
                    hits_addend: None,
                }
            })
            .collect();
        Workload {
            template: RateLimitRequest {
                domain: args.domain.clone(),
                descriptors,
                hits_addend: 0,
            },
            keys: match args.distribution {
                Distribution::HotAndFresh => {
                    KeySource::hot_and_fresh(args.hot_keys, args.hot_share)
                }
                other => KeySource::new(args.keys, other, args.zipf_exponent),
            },
            timeout: args.timeout,
            seed: args.seed,
            rate: args.rate,
        }
    }

    /// A request whose descriptors all carry the value `value` in their
    /// last entry.
    pub fn request(&self, value: u64) -> RateLimitRequest {
        let mut request = self.template.clone();
        let text = value.to_string();
        for descriptor in &mut request.descriptors {
            if let Some(last) = descriptor.entries.last_mut() {
                last.value = text.clone().into_bytes();
            }
        }
        request
    }
}

/// When a phase ends: after `budget` requests were started, or at
/// `deadline`, whichever comes first.
#[derive(Debug)]
pub struct Phase {
    budget: Option<u64>,
    start: Instant,
    deadline: Option<Instant>,
    started: AtomicU64,
    /// Mixed into the seeds so that each phase draws its own values.
    number: u64,
}

impl Phase {
    pub fn new(budget: Option<u64>, length: Option<Duration>, number: u64) -> Phase {
        let start = Instant::now();
        Phase {
            budget,
            start,
            deadline: length.map(|it| start + it),
            started: AtomicU64::new(0),
            number,
        }
    }

    /// The number (0, 1, ...) of one more request that may start, or None
    /// once the phase is over. Paced at `rate`, a request planned at or
    /// after the deadline does not start either.
    fn take(&self, rate: Option<f64>) -> Option<u64> {
        let now = Instant::now();
        if self.deadline.is_some_and(|it| now >= it) {
            return None;
        }
        let index = self.started.fetch_add(1, Ordering::Relaxed);
        if self.budget.is_some_and(|budget| index >= budget) {
            return None;
        }
        if let (Some(rate), Some(deadline)) = (rate, self.deadline)
            && self.planned(index, rate) >= deadline
        {
            return None;
        }
        Some(index)
    }

    /// When request `index` is due at `rate` requests/s: start + index/rate.
    fn planned(&self, index: u64, rate: f64) -> Instant {
        self.start + Duration::from_secs_f64(index as f64 / rate)
    }
}

/// One channel per connection: `Endpoint::connect` opens an HTTP/2
/// connection of its own each time, and clones of a channel share it.
pub async fn connect(addr: &str, connections: usize) -> Result<Vec<Channel>, String> {
    let endpoint = Endpoint::from_shared(addr.to_owned())
        .map_err(|err| format!("bad address {addr:?}: {err}"))?
        .tcp_nodelay(true);
    let mut channels = Vec::with_capacity(connections);
    for _ in 0..connections {
        let channel = endpoint
            .connect()
            .await
            .map_err(|err| format!("cannot connect to {addr}: {err}"))?;
        channels.push(channel);
    }
    Ok(channels)
}

/// One interval of a phase: its answers, and where it ends and how long it
/// was, from the phase's start.
pub struct Interval<'a> {
    pub tally: &'a Tally,
    pub elapsed: Duration,
    pub length: Duration,
}

/// Runs `streams` concurrent streams on each channel until the phase ends,
/// and returns the tally of every answer. With `report_every`, hands each
/// interval's answers to `on_interval` (the last one possibly shorter);
/// each stream records into a tally of its own, which every interval
/// drains and resets.
pub async fn run_phase(
    channels: &[Channel],
    streams: usize,
    workload: &Arc<Workload>,
    phase: &Arc<Phase>,
    report_every: Option<Duration>,
    mut on_interval: impl FnMut(Interval<'_>),
) -> Result<Tally, String> {
    let mut slots = Vec::with_capacity(channels.len() * streams);
    let mut tasks = Vec::with_capacity(channels.len() * streams);
    for (conn_idx, channel) in channels.iter().enumerate() {
        for stream_idx in 0..streams {
            let client = RateLimitServiceClient::new(channel.clone());
            let stream_no = (conn_idx * streams + stream_idx) as u64;
            let seed = workload.seed ^ (phase.number << 48) ^ stream_no.wrapping_mul(0x1000_0001);
            let rng = Rng::new(seed);
            let slot = Arc::new(Mutex::new(Tally::new()));
            slots.push(Arc::clone(&slot));
            tasks.push(tokio::spawn(stream(
                client,
                Arc::clone(workload),
                Arc::clone(phase),
                rng,
                slot,
            )));
        }
    }
    let mut workers = tokio::spawn(async move {
        for task in tasks {
            task.await
                .map_err(|err| format!("a stream failed: {err}"))?;
        }
        Ok::<(), String>(())
    });
    let mut total = Tally::new();
    let mut interval = Tally::new();
    let mut last = phase.start;
    let finished = match report_every {
        None => (&mut workers).await,
        Some(every) => {
            let mut ticker = tokio::time::interval_at((phase.start + every).into(), every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    finished = &mut workers => break finished,
                    _ = ticker.tick() => {
                        let now = Instant::now();
                        drain(&slots, &mut interval)?;
                        on_interval(Interval {
                            tally: &interval,
                            elapsed: now - phase.start,
                            length: now - last,
                        });
                        add(&mut total, &interval)?;
                        interval.reset();
                        last = now;
                    }
                }
            }
        }
    };
    finished.map_err(|err| format!("a stream failed: {err}"))??;
    let now = Instant::now();
    drain(&slots, &mut interval)?;
    if report_every.is_some() && interval.requests() > 0 {
        on_interval(Interval {
            tally: &interval,
            elapsed: now - phase.start,
            length: now - last,
        });
    }
    add(&mut total, &interval)?;
    Ok(total)
}

/// Moves every stream's answers into `into`, leaving the streams' tallies
/// empty.
fn drain(slots: &[Arc<Mutex<Tally>>], into: &mut Tally) -> Result<(), String> {
    for slot in slots {
        let mut tally = slot.lock().unwrap_or_else(PoisonError::into_inner);
        add(into, &tally)?;
        tally.reset();
    }
    Ok(())
}

fn add(into: &mut Tally, tally: &Tally) -> Result<(), String> {
    into.add(tally)
        .map_err(|err| format!("cannot merge latencies: {err:?}"))
}

/// One stream: one request in flight at a time, each timed. Closed loop,
/// the next request goes as soon as the answer is in; paced, each request
/// waits for its planned time, and one that could only go later (the
/// stream was busy) is timed from its planned time.
async fn stream(
    mut client: RateLimitServiceClient<Channel>,
    workload: Arc<Workload>,
    phase: Arc<Phase>,
    mut rng: Rng,
    slot: Arc<Mutex<Tally>>,
) {
    while let Some(index) = phase.take(workload.rate) {
        let request = workload.request(workload.keys.draw(&mut rng));
        let (since, late) = match workload.rate {
            None => (Instant::now(), false),
            Some(rate) => {
                let planned = phase.planned(index, rate);
                let ready = Instant::now();
                if ready > planned {
                    (planned, ready - planned > LATE_AFTER)
                } else {
                    tokio::time::sleep_until(planned.into()).await;
                    (Instant::now(), false)
                }
            }
        };
        let res =
            match tokio::time::timeout(workload.timeout, client.should_rate_limit(request)).await {
                Ok(res) => res,
                Err(_) => Err(Status::deadline_exceeded("no answer within --timeout")),
            };
        let us = since.elapsed().as_micros() as u64;
        let mut tally = slot.lock().unwrap_or_else(PoisonError::into_inner);
        tally.record(&res, us);
        if late {
            tally.late += 1;
        }
    }
}

#[cfg(test)]
mod tests;
