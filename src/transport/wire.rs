//! The one mapping between the wire and [`crate::decision`]: requests and
//! decisions to and from the generated Envoy messages, and the names and
//! numbers of units and codes that gRPC and the JSON endpoint both use.
//!
//! Unit and code names are those of the Envoy enums (proto3 JSON writes
//! enum values by name), taken from the generated code, so they are
//! written once: in the `.proto` files. Prost types stop in
//! `crate::transport`: everything past it speaks the decision's types.

use crate::decision;
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::extensions::common::ratelimit::v3 as common;
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as WireCode, DescriptorStatus, RateLimit as WireLimit, rate_limit::Unit as WireUnit,
};
use crate::proto::envoy::r#type::v3::RateLimitUnit;
use crate::rules::Unit;

/// An override unit the wire does not have: `envoy.type.v3.RateLimitUnit`
/// has no WEEK, and knows no other name or number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnknownUnit {
    #[error("unknown unit '{0}'")]
    Name(String),
    #[error("unknown unit {0}")]
    Number(u64),
}

// === requests ===

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

/// An override's unit as prost decodes it: `None` for UNKNOWN and for
/// numbers this build does not know (proto3 enums are open).
pub fn override_unit(unit: i32) -> Option<Unit> {
    RateLimitUnit::try_from(unit).ok().and_then(unit_from_wire)
}

/// An override's unit by its proto3 JSON name (`"MINUTE"`); `Ok(None)`
/// for `"UNKNOWN"`.
pub fn override_unit_named(name: &str) -> Result<Option<Unit>, UnknownUnit> {
    RateLimitUnit::from_str_name(name)
        .map(unit_from_wire)
        .ok_or_else(|| UnknownUnit::Name(name.to_owned()))
}

/// An override's unit by its number (`2`); `Ok(None)` for 0, UNKNOWN.
pub fn override_unit_numbered(number: u64) -> Result<Option<Unit>, UnknownUnit> {
    i32::try_from(number)
        .ok()
        .and_then(|it| RateLimitUnit::try_from(it).ok())
        .map(unit_from_wire)
        .ok_or(UnknownUnit::Number(number))
}

/// `None` for UNKNOWN: the override then has no unit.
fn unit_from_wire(unit: RateLimitUnit) -> Option<Unit> {
    match unit {
        RateLimitUnit::Unknown => None,
        RateLimitUnit::Second => Some(Unit::Second),
        RateLimitUnit::Minute => Some(Unit::Minute),
        RateLimitUnit::Hour => Some(Unit::Hour),
        RateLimitUnit::Day => Some(Unit::Day),
        RateLimitUnit::Month => Some(Unit::Month),
        RateLimitUnit::Year => Some(Unit::Year),
    }
}

// === decisions ===

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

/// A decision's code by its proto3 JSON name (`"OVER_LIMIT"`).
pub fn code_name(code: decision::Code) -> &'static str {
    code_to_wire(code).as_str_name()
}

/// A limit's unit in a response, which, unlike an override's, has WEEK.
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

/// A limit's unit by its proto3 JSON name (`"MINUTE"`).
pub fn unit_name(unit: Unit) -> &'static str {
    unit_to_wire(unit).as_str_name()
}

#[cfg(test)]
mod tests {
    use super::*;

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

    /// JSON accepts the names and numbers of `envoy.type.v3.RateLimitUnit`
    /// and nothing else: WEEK is a response unit only.
    #[test]
    fn override_units_by_name_and_number() {
        let known = [
            ("UNKNOWN", None),
            ("SECOND", Some(Unit::Second)),
            ("MINUTE", Some(Unit::Minute)),
            ("HOUR", Some(Unit::Hour)),
            ("DAY", Some(Unit::Day)),
            ("MONTH", Some(Unit::Month)),
            ("YEAR", Some(Unit::Year)),
        ];
        for (number, (name, unit)) in (0u64..).zip(known) {
            assert_eq!(override_unit_named(name), Ok(unit), "{name}");
            assert_eq!(override_unit_numbered(number), Ok(unit), "{number}");
        }
        for name in ["WEEK", "minute", ""] {
            let err = override_unit_named(name).unwrap_err();
            assert_eq!(err.to_string(), format!("unknown unit '{name}'"));
        }
        for number in [7, 99, u64::MAX] {
            let err = override_unit_numbered(number).unwrap_err();
            assert_eq!(err.to_string(), format!("unknown unit {number}"));
        }
    }

    #[test]
    fn response_units_and_codes_are_named_as_envoy_names_them() {
        let names: Vec<&str> = Unit::ALL.into_iter().map(unit_name).collect();
        assert_eq!(
            names,
            ["SECOND", "MINUTE", "HOUR", "DAY", "WEEK", "MONTH", "YEAR"]
        );
        assert_eq!(code_name(decision::Code::Ok), "OK");
        assert_eq!(code_name(decision::Code::OverLimit), "OVER_LIMIT");
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
