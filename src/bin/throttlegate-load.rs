//! Load generator: drives ShouldRateLimit on a throttlegate (or any RLS)
//! server with bounded concurrency, count and time, and prints throughput and
//! latency percentiles.

use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use throttlegate::proto::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tonic::Status;
use tonic::transport::Channel;

#[derive(Debug, Parser)]
#[command(
    name = "throttlegate-load",
    about = "Bounded gRPC load against a rate-limit service"
)]
struct Args {
    /// Server address.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    addr: String,
    /// Concurrent in-flight requests.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Total requests to send (the run also stops at --max-seconds).
    #[arg(long, default_value_t = 100_000)]
    requests: u64,
    /// Upper bound on the run's duration.
    #[arg(long, default_value_t = 60)]
    max_seconds: u64,
    /// gRPC connections shared round-robin by the workers.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    #[arg(long, default_value = "loadgen")]
    domain: String,
    /// Descriptor entry key.
    #[arg(long, default_value = "client")]
    key: String,
    /// Distinct values cycled through (1 = one hot key).
    #[arg(long, default_value_t = 1)]
    distinct_values: u64,
    /// Descriptors per request: the first with key `<key>`, then
    /// `<key>_1`, `<key>_2`, ..., all with the same value. Each key needs a
    /// rule of its own; each descriptor is then a counter of its own, which
    /// on a Redis Cluster without a hash tag lands in a slot of its own.
    #[arg(long, default_value_t = 1)]
    descriptors: usize,
}

#[derive(Debug)]
struct Tally {
    ok: u64,
    over_limit: u64,
    errors: u64,
    latency_us: Histogram<u64>,
}

impl Tally {
    fn new() -> Tally {
        Tally {
            ok: 0,
            over_limit: 0,
            errors: 0,
            // 1 µs .. 60 s at 3 significant digits: valid bounds, cannot fail.
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
        }
    }
}

impl Tally {
    /// Counts one answer and its latency.
    fn record(&mut self, res: &Result<tonic::Response<RateLimitResponse>, Status>, micros: u64) {
        let _ = self.latency_us.record(micros.max(1));
        match res {
            Ok(response) if response.get_ref().overall_code == Code::OverLimit as i32 => {
                self.over_limit += 1
            }
            Ok(_) => self.ok += 1,
            Err(_) => self.errors += 1,
        }
    }

    fn add(&mut self, other: &Tally) -> Result<(), hdrhistogram::AdditionError> {
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.errors += other.errors;
        self.latency_us.add(&other.latency_us)
    }
}

/// What every worker sends, and until when.
#[derive(Debug, Clone)]
struct Load {
    domain: String,
    key: String,
    distinct: u64,
    descriptors: usize,
    requests: u64,
    deadline: Instant,
}

impl Load {
    /// The `seq`-th request of `worker`: the first descriptor has key
    /// `<key>`, then `<key>_1`, ..., all with the same cycled value.
    fn request(&self, worker: usize, seq: u64) -> RateLimitRequest {
        let value = (seq * 7919 + worker as u64) % self.distinct;
        let descriptors = (0..self.descriptors)
            .map(|idx| RateLimitDescriptor {
                entries: vec![Entry {
                    key: if idx == 0 {
                        self.key.clone().into_bytes()
                    } else {
                        format!("{}_{idx}", self.key).into_bytes()
                    },
                    value: value.to_string().into_bytes(),
                }],
                limit: None,
                hits_addend: None,
            })
            .collect();
        RateLimitRequest {
            domain: self.domain.clone(),
            descriptors,
            hits_addend: 0,
        }
    }
}

/// Sends `load.requests` requests one after the other, or fewer if the
/// deadline comes first.
async fn work(mut client: RateLimitServiceClient<Channel>, load: Load, worker: usize) -> Tally {
    let mut tally = Tally::new();
    for seq in 0..load.requests {
        if Instant::now() >= load.deadline {
            break;
        }
        let request = load.request(worker, seq);
        let sent = Instant::now();
        let res = client.should_rate_limit(request).await;
        tally.record(&res, sent.elapsed().as_micros() as u64);
    }
    tally
}

fn report(total: &Tally, elapsed: f64) {
    let sent = total.ok + total.over_limit + total.errors;
    let latency = &total.latency_us;
    println!(
        "requests {sent} in {elapsed:.2}s: {:.0}/s; ok {} over_limit {} errors {}",
        sent as f64 / elapsed,
        total.ok,
        total.over_limit,
        total.errors
    );
    println!(
        "latency µs: p50 {} p90 {} p99 {} p99.9 {} max {}",
        latency.value_at_quantile(0.50),
        latency.value_at_quantile(0.90),
        latency.value_at_quantile(0.99),
        latency.value_at_quantile(0.999),
        latency.max()
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let n_connections = args.connections.max(1);
    let concurrency = args.concurrency.max(1);
    let mut clients = Vec::with_capacity(n_connections);
    for _ in 0..n_connections {
        clients.push(RateLimitServiceClient::connect(args.addr.clone()).await?);
    }
    let load = Load {
        domain: args.domain,
        key: args.key,
        distinct: args.distinct_values.max(1),
        descriptors: args.descriptors.max(1),
        requests: args.requests / concurrency as u64,
        deadline: Instant::now() + Duration::from_secs(args.max_seconds),
    };
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|worker| {
            let client = clients[worker % clients.len()].clone();
            tokio::spawn(work(client, load.clone(), worker))
        })
        .collect();
    let mut total = Tally::new();
    for worker in workers {
        total.add(&worker.await?)?;
    }
    report(&total, started.elapsed().as_secs_f64());
    Ok(())
}
