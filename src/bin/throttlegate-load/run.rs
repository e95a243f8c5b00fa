//! The load itself: N connections, M streams on each, sending requests
//! until a phase's budget or deadline runs out.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

use crate::args::Args;
use crate::keys::{KeySource, Rng};
use crate::summary::Tally;

/// What every request looks like; only the varying entry's value changes.
#[derive(Debug)]
pub struct Plan {
    template: RateLimitRequest,
    keys: KeySource,
    timeout: Duration,
    seed: u64,
}

impl Plan {
    pub fn new(args: &Args) -> Plan {
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
        Plan {
            template: RateLimitRequest {
                domain: args.domain.clone(),
                descriptors,
                hits_addend: 0,
            },
            keys: KeySource::new(args.keys, args.distribution, args.zipf_exponent),
            timeout: args.timeout,
            seed: args.seed,
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
    deadline: Option<Instant>,
    started: AtomicU64,
    /// Mixed into the seeds so that each phase draws its own values.
    number: u64,
}

impl Phase {
    pub fn new(budget: Option<u64>, length: Option<Duration>, number: u64) -> Phase {
        Phase {
            budget,
            deadline: length.map(|it| Instant::now() + it),
            started: AtomicU64::new(0),
            number,
        }
    }

    /// Whether one more request may start.
    fn take(&self) -> bool {
        if self.deadline.is_some_and(|it| Instant::now() >= it) {
            return false;
        }
        match self.budget {
            Some(budget) => self.started.fetch_add(1, Ordering::Relaxed) < budget,
            None => true,
        }
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

/// Runs `streams` concurrent streams on each channel until the phase ends,
/// and merges their tallies.
pub async fn run_phase(
    channels: &[Channel],
    streams: usize,
    plan: &Arc<Plan>,
    phase: &Arc<Phase>,
) -> Result<Tally, String> {
    let mut tasks = Vec::with_capacity(channels.len() * streams);
    for (conn_idx, channel) in channels.iter().enumerate() {
        for stream_idx in 0..streams {
            let client = RateLimitServiceClient::new(channel.clone());
            let stream_no = (conn_idx * streams + stream_idx) as u64;
            let seed = plan.seed ^ (phase.number << 48) ^ stream_no.wrapping_mul(0x1000_0001);
            let rng = Rng::new(seed);
            tasks.push(tokio::spawn(stream(
                client,
                Arc::clone(plan),
                Arc::clone(phase),
                rng,
            )));
        }
    }
    let mut total = Tally::new();
    for task in tasks {
        let tally = task
            .await
            .map_err(|err| format!("a stream failed: {err}"))?;
        total
            .add(&tally)
            .map_err(|err| format!("cannot merge latencies: {err:?}"))?;
    }
    Ok(total)
}

/// One stream: one request in flight at a time, each timed.
async fn stream(
    mut client: RateLimitServiceClient<Channel>,
    plan: Arc<Plan>,
    phase: Arc<Phase>,
    mut rng: Rng,
) -> Tally {
    let mut tally = Tally::new();
    while phase.take() {
        let request = plan.request(plan.keys.draw(&mut rng));
        let sent = Instant::now();
        let res = match tokio::time::timeout(plan.timeout, client.should_rate_limit(request)).await
        {
            Ok(res) => res,
            Err(_) => Err(Status::deadline_exceeded("no answer within --timeout")),
        };
        tally.record(&res, sent.elapsed().as_micros() as u64);
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn requests_carry_the_prefix_entries_then_the_value_in_every_descriptor() {
        let args = Args::parse_from([
            "throttlegate-load",
            "--domain",
            "d",
            "--key",
            "user",
            "--prefix-entry",
            "method=GET",
            "--descriptors",
            "2",
        ]);
        let request = Plan::new(&args).request(17);
        assert_eq!(request.domain, "d");
        let entries: Vec<Vec<(&[u8], &[u8])>> = request
            .descriptors
            .iter()
            .map(|d| {
                d.entries
                    .iter()
                    .map(|e| (e.key.as_slice(), e.value.as_slice()))
                    .collect()
            })
            .collect();
        assert_eq!(
            entries,
            vec![
                vec![(&b"method"[..], &b"GET"[..]), (b"user", b"17")],
                vec![(b"method", b"GET"), (b"user_1", b"17")],
            ]
        );
    }

    #[test]
    fn a_phase_with_a_budget_lets_exactly_that_many_start() {
        let phase = Phase::new(Some(3), None, 0);
        let started = (0..10).filter(|_| phase.take()).count();
        assert_eq!(started, 3);
    }

    #[test]
    fn a_phase_past_its_deadline_lets_none_start() {
        let phase = Phase::new(None, Some(Duration::ZERO), 0);
        assert!(!phase.take());
    }
}
