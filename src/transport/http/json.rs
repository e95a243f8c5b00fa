//! `/json`: the decision over the proto3 JSON form of the rate-limit
//! messages (camelCase names, enum names; snake_case names are accepted
//! too), like envoyproxy/ratelimit's endpoint, for curl-based debugging.
//! Units and codes are named by [`crate::transport::wire`], as on gRPC.
//! The answer is written from the wire message ([`response_json`]), so
//! `throttlegate check` prints what it got over gRPC in the same form.

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Deserializer, Serialize};

use crate::decision;
use crate::metrics::Method;
use crate::proto::envoy::config::core::v3::HeaderValue;
use crate::proto::envoy::service::ratelimit::v3 as rls;
use crate::proto::envoy::service::ratelimit::v3::rate_limit_response::{
    Code as WireCode, rate_limit::Unit as WireUnit,
};
use crate::rules::Unit;
use crate::transport::http::HttpApp;
use crate::transport::wire;

/// 200 with the decision, 429 when it is OVER_LIMIT (as envoyproxy/ratelimit
/// answers), 400 for a bad request, 413 for a body over 64 KiB, 503 when the
/// backend failed. The body is read as JSON whatever its content type, so a
/// plain `curl -d` works.
pub(super) async fn decide(
    State(app): State<HttpApp>,
    body: Result<axum::body::Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(it) => it,
        Err(rejection) => return (rejection.status(), rejection.body_text()).into_response(),
    };
    let request = match serde_json::from_slice::<JsonRequest>(&body) {
        Ok(it) => it.into_request(),
        Err(err) => {
            return (
                StatusCode::BAD_REQUEST,
                format!("invalid json request: {err}\n"),
            )
                .into_response();
        }
    };
    // No deadline: an HTTP client's timeout is not sent with its request.
    let caller = decision::Caller::unbounded(Method::Json);
    let started = std::time::Instant::now();
    let decided = app.limiter.decide_within(&request, caller).await;
    app.metrics
        .observe_decision_latency(Method::Json, started.elapsed());
    match decided {
        Ok(decision) => {
            let status = match decision.overall {
                decision::Code::Ok => StatusCode::OK,
                decision::Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            let response = wire::to_wire(decision);
            (status, axum::Json(JsonResponse::from(&response))).into_response()
        }
        Err(decision::Error::InvalidArgument(message)) => {
            (StatusCode::BAD_REQUEST, message).into_response()
        }
        Err(err @ (decision::Error::Backend(_) | decision::Error::NoConfig)) => {
            (StatusCode::SERVICE_UNAVAILABLE, err.to_string()).into_response()
        }
    }
}

// === request JSON ===

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<JsonDescriptor>,
    #[serde(default, alias = "hits_addend", deserialize_with = "number")]
    hits_addend: u32,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonDescriptor {
    #[serde(default)]
    entries: Vec<JsonEntry>,
    #[serde(default)]
    limit: Option<JsonOverride>,
    #[serde(default, alias = "hits_addend", deserialize_with = "optional_number")]
    hits_addend: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JsonOverride {
    #[serde(default, alias = "requests_per_unit", deserialize_with = "number")]
    requests_per_unit: u32,
    #[serde(default)]
    unit: JsonUnit,
}

/// An override unit by name (`"MINUTE"`) or number (`2`).
#[derive(Debug, Default)]
struct JsonUnit(Option<Unit>);

impl<'de> Deserialize<'de> for JsonUnit {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Name(String),
            Number(u64),
        }
        let unit = match Raw::deserialize(deserializer)? {
            Raw::Name(name) => wire::override_unit_named(&name),
            Raw::Number(n) => wire::override_unit_numbered(n),
        };
        unit.map(JsonUnit).map_err(serde::de::Error::custom)
    }
}

/// proto3 JSON writes 64-bit integers as strings and accepts both forms.
#[derive(Deserialize)]
#[serde(untagged)]
enum JsonNumber {
    Number(u64),
    Text(String),
}

impl JsonNumber {
    fn value<E: serde::de::Error>(self) -> Result<u64, E> {
        match self {
            JsonNumber::Number(n) => Ok(n),
            JsonNumber::Text(text) => text
                .parse()
                .map_err(|_| E::custom(format!("not an unsigned integer: '{text}'"))),
        }
    }
}

fn number<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<u64>,
{
    let n = JsonNumber::deserialize(deserializer)?.value()?;
    T::try_from(n).map_err(|_| serde::de::Error::custom(format!("{n} is out of range")))
}

fn optional_number<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<u64>, D::Error> {
    match Option::<JsonNumber>::deserialize(deserializer)? {
        Some(n) => Ok(Some(n.value()?)),
        None => Ok(None),
    }
}

impl JsonRequest {
    fn into_request(self) -> decision::Request {
        decision::Request {
            domain: self.domain,
            hits_addend: self.hits_addend,
            descriptors: self
                .descriptors
                .into_iter()
                .map(|it| decision::Descriptor {
                    entries: it
                        .entries
                        .into_iter()
                        .map(|entry| decision::Entry {
                            key: entry.key.into_bytes(),
                            value: entry.value.into_bytes(),
                        })
                        .collect(),
                    limit: it.limit.map(|limit| decision::LimitOverride {
                        requests_per_unit: limit.requests_per_unit,
                        unit: limit.unit.0,
                    }),
                    hits_addend: it.hits_addend,
                })
                .collect(),
        }
    }
}

// === response JSON ===

/// The proto3 JSON of an answer, as `/json` writes it (compact): also what
/// `throttlegate check` prints for the answer it got over gRPC, so both
/// speak one form.
pub fn response_json(response: &rls::RateLimitResponse) -> String {
    serde_json::to_string(&JsonResponse::from(response)).unwrap_or_default()
}

/// Fields at their default value are omitted, as proto3 JSON does.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse {
    overall_code: JsonEnum,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    request_headers_to_add: Vec<JsonHeader>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus {
    code: JsonEnum,
    #[serde(skip_serializing_if = "Option::is_none")]
    current_limit: Option<JsonLimit>,
    #[serde(skip_serializing_if = "is_zero")]
    limit_remaining: u32,
    /// A proto3 JSON Duration: `"60s"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    duration_until_reset: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonLimit {
    #[serde(skip_serializing_if = "is_zero")]
    requests_per_unit: u32,
    unit: JsonEnum,
    #[serde(skip_serializing_if = "str::is_empty")]
    name: String,
}

#[derive(Debug, Serialize)]
struct JsonHeader {
    key: String,
    value: String,
}

/// An enum value by name, or by number when this build does not know it
/// (proto3 JSON's rule: a peer may send values added after us).
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum JsonEnum {
    Name(&'static str),
    Number(i32),
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn code(number: i32) -> JsonEnum {
    WireCode::try_from(number).map_or(JsonEnum::Number(number), |it| {
        JsonEnum::Name(it.as_str_name())
    })
}

fn unit(number: i32) -> JsonEnum {
    WireUnit::try_from(number).map_or(JsonEnum::Number(number), |it| {
        JsonEnum::Name(it.as_str_name())
    })
}

/// A proto3 JSON Duration: seconds, with the nanoseconds as a fraction
/// when there are any (`"1s"`, `"1.500000000s"`).
fn duration(it: &prost_types::Duration) -> String {
    if it.nanos == 0 {
        format!("{}s", it.seconds)
    } else {
        format!("{}.{:09}s", it.seconds, it.nanos.unsigned_abs())
    }
}

fn headers(list: &[HeaderValue]) -> Vec<JsonHeader> {
    list.iter()
        .map(|it| JsonHeader {
            key: it.key.clone(),
            value: it.value.clone(),
        })
        .collect()
}

impl From<&rls::RateLimitResponse> for JsonResponse {
    fn from(response: &rls::RateLimitResponse) -> Self {
        JsonResponse {
            overall_code: code(response.overall_code),
            statuses: response
                .statuses
                .iter()
                .map(|it| JsonStatus {
                    code: code(it.code),
                    current_limit: it.current_limit.as_ref().map(|limit| JsonLimit {
                        requests_per_unit: limit.requests_per_unit,
                        unit: unit(limit.unit),
                        name: limit.name.clone(),
                    }),
                    limit_remaining: it.limit_remaining,
                    duration_until_reset: it.duration_until_reset.as_ref().map(duration),
                })
                .collect(),
            response_headers_to_add: headers(&response.response_headers_to_add),
            request_headers_to_add: headers(&response.request_headers_to_add),
        }
    }
}
