//! The gRPC RateLimitService: wire messages to limiter requests and back.
//!
//! Prost types stop here: everything past this file speaks
//! [`crate::decision`]'s types.

use std::sync::Arc;

use tonic::{Request, Response};

use crate::decision::{self, Limiter};
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::extensions::common::ratelimit::v3 as common;
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as WireCode, DescriptorStatus, RateLimit as WireLimit, rate_limit::Unit as WireUnit,
};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::rules::Unit;

/// Serves `ShouldRateLimit` through a [`Limiter`].
#[derive(Debug, Clone)]
pub struct RateLimitService {
    limiter: Arc<Limiter>,
}

impl RateLimitService {
    pub fn new(limiter: Arc<Limiter>) -> Self {
        Self { limiter }
    }

    /// The generated tonic server around this service.
    pub fn into_server(
        self,
    ) -> rls::rate_limit_service_server::RateLimitServiceServer<RateLimitService> {
        rls::rate_limit_service_server::RateLimitServiceServer::new(self)
    }
}

#[tonic::async_trait]
impl rls::rate_limit_service_server::RateLimitService for RateLimitService {
    async fn should_rate_limit(
        &self,
        request: Request<rls::RateLimitRequest>,
    ) -> Result<Response<rls::RateLimitResponse>, tonic::Status> {
        let _in_flight = self.limiter.metrics().track_in_flight();
        let request = from_wire(request.into_inner());
        let decision = self.limiter.decide(&request).await.map_err(to_status)?;
        Ok(Response::new(to_wire(decision)))
    }
}

/// The one place a limiter error becomes a gRPC status.
///
/// Envoy's rate-limit filter treats any error (and `Code::UNKNOWN` in the
/// response) as "the service could not decide" and then applies its own
/// `failure_mode_deny` (default: allow). So an infrastructure failure must be
/// a real error status, and a clear one: `UNAVAILABLE` tells operators and
/// retry policies that the backend is down, not that the request was bad.
/// A malformed request is `INVALID_ARGUMENT`: retrying it cannot help.
pub fn to_status(error: decision::Error) -> tonic::Status {
    match error {
        decision::Error::InvalidArgument(message) => tonic::Status::invalid_argument(message),
        decision::Error::Backend(error) => tonic::Status::unavailable(error.to_string()),
    }
}

/// A wire request as the limiter sees it. Never fails: bounds are the
/// limiter's job, so both transports refuse the same requests.
pub fn from_wire(request: rls::RateLimitRequest) -> decision::Request {
    decision::Request {
        domain: request.domain,
        hits_addend: request.hits_addend,
        descriptors: request
            .descriptors
            .into_iter()
            .map(descriptor_from_wire)
            .collect(),
    }
}

fn descriptor_from_wire(descriptor: common::RateLimitDescriptor) -> decision::Descriptor {
    decision::Descriptor {
        entries: descriptor
            .entries
            .into_iter()
            .map(|it| decision::Entry {
                key: it.key,
                value: it.value,
            })
            .collect(),
        limit: descriptor.limit.map(|it| decision::LimitOverride {
            requests_per_unit: it.requests_per_unit,
            unit: override_unit(it.unit),
        }),
        hits_addend: descriptor.hits_addend,
    }
}

/// `None` for UNKNOWN and for numbers this build does not know.
fn override_unit(unit: i32) -> Option<Unit> {
    match RateLimitUnit::try_from(unit).ok()? {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}

/// A decision as the wire carries it.
pub fn to_wire(decision: decision::Decision) -> rls::RateLimitResponse {
    rls::RateLimitResponse {
        overall_code: code_to_wire(decision.overall) as i32,
        statuses: decision.statuses.into_iter().map(status_to_wire).collect(),
        response_headers_to_add: decision
            .headers
            .into_iter()
            .map(|(key, value)| HeaderValue {
                key,
                value,
                raw_value: Vec::new(),
            })
            .collect(),
        ..Default::default()
    }
}

fn status_to_wire(status: decision::Status) -> DescriptorStatus {
    DescriptorStatus {
        code: code_to_wire(status.code) as i32,
        current_limit: status.current_limit.map(|it| WireLimit {
            requests_per_unit: it.requests_per_unit,
            unit: unit_to_wire(it.unit) as i32,
            name: it.name.to_string(),
        }),
        limit_remaining: status.limit_remaining,
        duration_until_reset: status
            .duration_until_reset_s
            .map(|seconds| prost_types::Duration {
                seconds: i64::try_from(seconds).unwrap_or(i64::MAX),
                nanos: 0,
            }),
    }
}

fn code_to_wire(code: decision::Code) -> WireCode {
    match code {
        decision::Code::Ok => WireCode::Ok,
        decision::Code::OverLimit => WireCode::OverLimit,
    }
}

pub fn unit_to_wire(unit: Unit) -> WireUnit {
    match unit {
        Unit::Second => WireUnit::Second,
        Unit::Minute => WireUnit::Minute,
        Unit::Hour => WireUnit::Hour,
        Unit::Day => WireUnit::Day,
        Unit::Week => WireUnit::Week,
        Unit::Month => WireUnit::Month,
        Unit::Year => WireUnit::Year,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_failure_is_unavailable_never_unknown() {
        let cases = [
            crate::backends::Error::Timeout(250),
            crate::backends::Error::Unavailable("refused".to_owned()),
            crate::backends::Error::Protocol("bad reply".to_owned()),
        ];
        for error in cases {
            let status = to_status(decision::Error::Backend(error));
            assert_eq!(status.code(), tonic::Code::Unavailable);
        }
        let status = to_status(decision::Error::InvalidArgument("empty domain".to_owned()));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "empty domain");
    }

    #[test]
    fn override_units_map_and_unknown_is_none() {
        let cases = [
            (RateLimitUnit::Unknown as i32, None),
            (RateLimitUnit::Second as i32, Some(Unit::Second)),
            (RateLimitUnit::Minute as i32, Some(Unit::Minute)),
            (RateLimitUnit::Hour as i32, Some(Unit::Hour)),
            (RateLimitUnit::Day as i32, Some(Unit::Day)),
            (RateLimitUnit::Month as i32, Some(Unit::Month)),
            (RateLimitUnit::Year as i32, Some(Unit::Year)),
            (99, None),
        ];
        for (wire, expected) in cases {
            assert_eq!(override_unit(wire), expected, "{wire}");
        }
    }

    #[test]
    fn descriptor_hits_addend_presence_is_kept() {
        let request = rls::RateLimitRequest {
            domain: "d".to_owned(),
            hits_addend: 3,
            descriptors: vec![
                common::RateLimitDescriptor {
                    entries: vec![common::rate_limit_descriptor::Entry {
                        key: "k".into(),
                        value: "v".into(),
                    }],
                    limit: None,
                    hits_addend: Some(0),
                },
                common::RateLimitDescriptor::default(),
            ],
        };
        let res = from_wire(request);
        assert_eq!(res.hits_addend, 3);
        assert_eq!(res.descriptors[0].hits_addend, Some(0));
        assert_eq!(res.descriptors[0].entries[0].key, b"k");
        assert_eq!(res.descriptors[1].hits_addend, None);
    }

    #[test]
    fn entries_that_are_not_utf8_decode_and_keep_their_bytes() {
        use prost::Message;
        // What Envoy sends for a header value with byte 0xFF: the wire form
        // of `string` and `bytes` is the same.
        let entry = common::rate_limit_descriptor::Entry {
            key: b"path".to_vec(),
            value: b"/\xff\xfe".to_vec(),
        };
        let request = rls::RateLimitRequest {
            domain: "d".to_owned(),
            descriptors: vec![common::RateLimitDescriptor {
                entries: vec![entry],
                limit: None,
                hits_addend: None,
            }],
            hits_addend: 0,
        };
        let wire = request.encode_to_vec();
        let decoded = rls::RateLimitRequest::decode(wire.as_slice()).expect("decodes");
        let res = from_wire(decoded);
        assert_eq!(res.descriptors[0].entries[0].value, b"/\xff\xfe");
    }
}
