//! `/json`: the decision over the proto3 JSON form of the rate-limit
//! messages (camelCase names, enum names; snake_case names are accepted
//! too), like envoyproxy/ratelimit's endpoint, for curl-based debugging.
//! Units and codes are named by [`crate::transport::wire`], as on gRPC.

use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Deserializer, Serialize};

use crate::decision;
use crate::metrics::Method;
use crate::rules::Unit;
use crate::transport::http::App;
use crate::transport::wire;

/// 200 with the decision, 429 when it is OVER_LIMIT (as envoyproxy/ratelimit
/// answers), 400 for a bad request, 413 for a body over 64 KiB, 503 when the
/// backend failed. The body is read as JSON whatever its content type, so a
/// plain `curl -d` works.
pub(super) async fn decide(
    State(app): State<App>,
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
            (status, axum::Json(JsonResponse::from(decision))).into_response()
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

/// Fields at their default value are omitted, as proto3 JSON does.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonResponse {
    overall_code: &'static str,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    statuses: Vec<JsonStatus>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    response_headers_to_add: Vec<JsonHeader>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct JsonStatus {
    code: &'static str,
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
    unit: &'static str,
    #[serde(skip_serializing_if = "str::is_empty")]
    name: String,
}

#[derive(Debug, Serialize)]
struct JsonHeader {
    key: String,
    value: String,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl From<decision::Decision> for JsonResponse {
    fn from(decision: decision::Decision) -> Self {
        JsonResponse {
            overall_code: wire::code_name(decision.overall),
            statuses: decision
                .statuses
                .into_iter()
                .map(|it| JsonStatus {
                    code: wire::code_name(it.code),
                    current_limit: it.current_limit.map(|limit| JsonLimit {
                        requests_per_unit: limit.requests_per_unit,
                        unit: wire::unit_name(limit.unit),
                        name: limit.name.to_string(),
                    }),
                    limit_remaining: it.limit_remaining,
                    duration_until_reset: it.duration_until_reset_s.map(|s| format!("{s}s")),
                })
                .collect(),
            response_headers_to_add: decision
                .headers
                .into_iter()
                .map(|(key, value)| JsonHeader { key, value })
                .collect(),
        }
    }
}
