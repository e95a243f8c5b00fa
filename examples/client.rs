//! Asking throttlegate from a Rust service, over the same gRPC API Envoy
//! uses: one `ShouldRateLimit` call per request to guard.
//!
//! ```text
//! cargo run --release -- serve --config examples/config.yaml &
//! cargo run --example client -- http://127.0.0.1:8081 api remote_address=10.0.0.1
//! ```
//!
//! Arguments: the server's address, the domain, then one descriptor's
//! entries as `key=value` (defaults: `http://127.0.0.1:8081 api
//! remote_address=10.0.0.1`). The message types here come from
//! throttlegate's own `.proto` files, which keep Envoy's packages and field
//! numbers: code generated from Envoy's protos works the same.

use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addr = args
        .next()
        .unwrap_or_else(|| "http://127.0.0.1:8081".to_owned());
    let domain = args.next().unwrap_or_else(|| "api".to_owned());
    let mut pairs: Vec<String> = args.collect();
    if pairs.is_empty() {
        pairs.push("remote_address=10.0.0.1".to_owned());
    }
    let entries = pairs
        .iter()
        .map(|pair| {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("'{pair}' is not key=value"))?;
            Ok(Entry {
                key: key.as_bytes().to_vec(),
                value: value.as_bytes().to_vec(),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;

    // One channel per process: it multiplexes every call over HTTP/2.
    let mut client = RateLimitServiceClient::connect(addr).await?;
    let request = RateLimitRequest {
        domain,
        descriptors: vec![RateLimitDescriptor {
            entries,
            ..Default::default()
        }],
        hits_addend: 1,
    };
    // Envoy gives the call 20 ms by default and lets the request through
    // when it fails; a service calling directly chooses its own policy.
    let response = client.should_rate_limit(request).await?.into_inner();
    let allowed = response.overall_code == Code::Ok as i32;
    println!("{}", if allowed { "allowed" } else { "over limit" });
    for status in &response.statuses {
        if let Some(limit) = &status.current_limit {
            println!(
                "  limit {} per {:?}, {} remaining",
                limit.requests_per_unit,
                limit.unit(),
                status.limit_remaining
            );
        }
    }
    for header in &response.response_headers_to_add {
        println!("  {}: {}", header.key, header.value);
    }
    Ok(())
}
