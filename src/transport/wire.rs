//! The one mapping between the wire and [`crate::decision`]: requests and
//! decisions to and from the generated Envoy messages, and the names and
//! numbers of units and codes that gRPC and the JSON endpoint both use.
//!
//! Unit and code names are those of the Envoy enums (proto3 JSON writes
//! enum values by name), taken from the generated code, so they are
//! written once: in the `.proto` files. Prost types stop in
//! `crate::transport`: everything past it speaks the decision's types.

use bytes::BufMut;

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

// === decisions, encoded ===

/// The length of [`encode`]'s bytes for `decision`.
pub fn encoded_len(decision: &decision::Decision) -> usize {
    let statuses: usize = decision
        .statuses
        .iter()
        .map(|it| message_len(status_len(it)))
        .sum();
    let headers: usize = decision
        .headers
        .iter()
        .map(|(key, value)| message_len(header_len(key, value)))
        .sum();
    varint_len(code_number(decision.overall)) + statuses + headers
}

/// Writes `decision` as a `RateLimitResponse`: the same bytes prost
/// writes for [`to_wire`]'s message (fields in number order, proto3
/// defaults left out), without building that message, its strings and
/// its vectors. `tests::encode_writes_what_prost_writes` holds the two to
/// the same bytes.
pub fn encode(decision: &decision::Decision, out: &mut impl BufMut) {
    put_varint(out, 1, code_number(decision.overall));
    for status in &decision.statuses {
        put_message(out, 2, status_len(status));
        put_varint(out, 1, code_number(status.code));
        if let Some(limit) = &status.current_limit {
            put_message(out, 2, limit_len(limit));
            put_varint(out, 1, u64::from(limit.requests_per_unit));
            put_varint(out, 2, unit_number(limit.unit));
            put_bytes(out, 3, limit.name.as_bytes());
        }
        put_varint(out, 3, u64::from(status.limit_remaining));
        if let Some(seconds) = status.duration_until_reset_s {
            put_message(out, 4, varint_len(duration_varint(seconds)));
            put_varint(out, 1, duration_varint(seconds));
        }
    }
    for (key, value) in &decision.headers {
        put_message(out, 3, header_len(key, value));
        put_bytes(out, 1, key.as_bytes());
        put_bytes(out, 2, value.as_bytes());
    }
}

fn status_len(status: &decision::Status) -> usize {
    varint_len(code_number(status.code))
        + status
            .current_limit
            .as_ref()
            .map_or(0, |it| message_len(limit_len(it)))
        + varint_len(u64::from(status.limit_remaining))
        + status
            .duration_until_reset_s
            .map_or(0, |it| message_len(varint_len(duration_varint(it))))
}

fn limit_len(limit: &decision::CurrentLimit) -> usize {
    varint_len(u64::from(limit.requests_per_unit))
        + varint_len(unit_number(limit.unit))
        + bytes_len(limit.name.len())
}

fn header_len(key: &str, value: &str) -> usize {
    bytes_len(key.len()) + bytes_len(value.len())
}

fn code_number(code: decision::Code) -> u64 {
    // The wire's numbers are positive.
    code_to_wire(code) as i32 as u64
}

fn unit_number(unit: Unit) -> u64 {
    unit_to_wire(unit) as i32 as u64
}

/// A `google.protobuf.Duration`'s seconds: `seconds`, clamped to `i64`
/// (both [`to_wire`] and [`encode`] send this).
fn duration_seconds(seconds: u64) -> i64 {
    i64::try_from(seconds).unwrap_or(i64::MAX)
}

/// [`duration_seconds`] as its varint is written (never negative).
fn duration_varint(seconds: u64) -> u64 {
    duration_seconds(seconds).unsigned_abs()
}

// Every field number here is below 16: its key is one byte.

/// A varint field: absent when 0, as proto3 writes defaults.
fn varint_len(value: u64) -> usize {
    if value == 0 {
        0
    } else {
        1 + prost::encoding::encoded_len_varint(value)
    }
}

/// A string or bytes field of `len` bytes: absent when empty.
fn bytes_len(len: usize) -> usize {
    if len == 0 { 0 } else { message_len(len) }
}

/// A message field whose body is `len` bytes: present even when empty.
fn message_len(len: usize) -> usize {
    1 + prost::encoding::encoded_len_varint(len as u64) + len
}

fn put_key(out: &mut impl BufMut, field: u8, wire_type: u8) {
    out.put_u8(field << 3 | wire_type);
}

fn put_varint(out: &mut impl BufMut, field: u8, value: u64) {
    if value != 0 {
        put_key(out, field, 0);
        prost::encoding::encode_varint(value, out);
    }
}

fn put_bytes(out: &mut impl BufMut, field: u8, bytes: &[u8]) {
    if !bytes.is_empty() {
        put_message(out, field, bytes.len());
        out.put_slice(bytes);
    }
}

/// The key and length of a length-delimited field; its body follows.
fn put_message(out: &mut impl BufMut, field: u8, len: usize) {
    put_key(out, field, 2);
    prost::encoding::encode_varint(len as u64, out);
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
                seconds: duration_seconds(seconds),
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
mod tests;
