//! RateLimitOverrides through the gRPC server: every number a client can send is decided, never more than asked.

use crate::support;
use crate::support::config::every_algorithm;
use crate::support::service::{default_options, start_on_memory};
use throttlegate::algorithms::Algorithm;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::r#type::v3::RateLimitUnit;

/// Numbers at the edges of what each algorithm can hold exactly.
const EXTREMES: [(u32, RateLimitUnit); 5] = [
    (1, RateLimitUnit::Year),
    (u32::MAX, RateLimitUnit::Second),
    (999_999, RateLimitUnit::Month),
    (1_000_003, RateLimitUnit::Year),
    (1_000_000, RateLimitUnit::Year),
];

fn with_override(
    key: &str,
    value: &str,
    requests_per_unit: u32,
    unit: RateLimitUnit,
    cost: u64,
) -> RateLimitRequest {
    let descriptor = RateLimitDescriptor {
        limit: Some(RateLimitOverride {
            requests_per_unit,
            unit: unit as i32,
        }),
        hits_addend: Some(cost),
        ..support::request::descriptor(&[(key, value)])
    };
    support::request::request("api", vec![descriptor])
}

#[tokio::test]
async fn extreme_overrides_are_decided_on_every_algorithm() {
    let service = start_on_memory(&every_algorithm(5), default_options()).await;
    let mut client = service.client();
    for algorithm in Algorithm::ALL {
        let algorithm = algorithm.name();
        for (requests, unit) in EXTREMES {
            let case = format!("{algorithm} {requests}/{unit:?}");
            let mut decide = async |cost: u64| {
                client
                    .should_rate_limit(with_override(algorithm, &case, requests, unit, cost))
                    .await
                    .unwrap_or_else(|status| panic!("{case}: an error is a bypass: {status:?}"))
                    .into_inner()
            };
            // More than asked at once never passes.
            let res = decide(u64::from(requests) + 1).await;
            assert_eq!(res.overall_code, Code::OverLimit as i32, "{case}");
            let limit = res.statuses[0].current_limit.clone().expect("a limit");
            assert_eq!(limit.unit, unit as i32, "{case}");
            let enforced = limit.requests_per_unit;
            assert!(enforced > 0 && enforced <= requests, "{case}: {enforced}");
            // All of what is enforced passes at once, then nothing more.
            let res = decide(u64::from(enforced)).await;
            assert_eq!(res.overall_code, Code::Ok as i32, "{case}");
            let res = decide(1).await;
            assert_eq!(res.overall_code, Code::OverLimit as i32, "{case}");
        }
    }
}
