//! Wire requests and descriptors as Envoy sends them.

use throttlegate::proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use throttlegate::proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;

/// A descriptor of `entries` given as (key, value), text or raw bytes,
/// with no override and no addend of its own.
pub fn descriptor<K: AsRef<[u8]>, V: AsRef<[u8]>>(entries: &[(K, V)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: key.as_ref().to_vec(),
                value: value.as_ref().to_vec(),
            })
            .collect(),
        limit: None,
        hits_addend: None,
    }
}

/// A request in `domain` of `descriptors`, with no request-wide addend.
pub fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_owned(),
        descriptors,
        hits_addend: 0,
    }
}

/// A request in `domain` of one descriptor `key=value` per value.
pub fn one_descriptor_per_value(
    domain: &str,
    key: &str,
    values: impl IntoIterator<Item = String>,
) -> RateLimitRequest {
    let descriptors = values
        .into_iter()
        .map(|value| descriptor(&[(key, value)]))
        .collect();
    request(domain, descriptors)
}
