//! Load generator: drives ShouldRateLimit on a throttlegate (or any RLS)
//! server with bounded concurrency, count and time, and prints throughput and
//! latency percentiles.

use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

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
    /// Descriptors per request (the first with key `<key>`, then `<key>1`, ...).
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let n_connections = args.connections.max(1);
    let concurrency = args.concurrency.max(1);
    let mut clients = Vec::with_capacity(n_connections);
    for _ in 0..n_connections {
        clients.push(RateLimitServiceClient::connect(args.addr.clone()).await?);
    }
    let deadline = Instant::now() + Duration::from_secs(args.max_seconds);
    let per_worker = args.requests / concurrency as u64;
    let started = Instant::now();
    let mut workers = Vec::with_capacity(concurrency);
    for worker in 0..concurrency {
        let mut client = clients[worker % clients.len()].clone();
        let domain = args.domain.clone();
        let key = args.key.clone();
        let distinct = args.distinct_values.max(1);
        let n_descriptors = args.descriptors.max(1);
        workers.push(tokio::spawn(async move {
            let mut tally = Tally::new();
            for seq in 0..per_worker {
                if Instant::now() >= deadline {
                    break;
                }
                let value = (seq * 7919 + worker as u64) % distinct;
                let descriptors = (0..n_descriptors)
                    .map(|idx| RateLimitDescriptor {
                        entries: vec![Entry {
                            key: if idx == 0 {
                                key.clone().into_bytes()
                            } else {
                                format!("{key}{idx}").into_bytes()
                            },
                            value: value.to_string().into_bytes(),
                        }],
                        limit: None,
                        hits_addend: None,
                    })
                    .collect();
                let request = RateLimitRequest {
                    domain: domain.clone(),
                    descriptors,
                    hits_addend: 0,
                };
                let sent = Instant::now();
                let res = client.should_rate_limit(request).await;
                let micros = sent.elapsed().as_micros() as u64;
                let _ = tally.latency_us.record(micros.max(1));
                match res {
                    Ok(response) if response.get_ref().overall_code == Code::OverLimit as i32 => {
                        tally.over_limit += 1
                    }
                    Ok(_) => tally.ok += 1,
                    Err(_) => tally.errors += 1,
                }
            }
            tally
        }));
    }
    let mut total = Tally::new();
    for worker in workers {
        let tally = worker.await?;
        total.ok += tally.ok;
        total.over_limit += tally.over_limit;
        total.errors += tally.errors;
        total.latency_us.add(&tally.latency_us)?;
    }
    let elapsed = started.elapsed().as_secs_f64();
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
    Ok(())
}
