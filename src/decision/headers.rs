//! The `RateLimit-*` response headers: those of the most restrictive status.

use super::answer::{Candidate, ceil_seconds, more_restrictive};

/// Names of the response headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderNames {
    pub limit: String,
    pub remaining: String,
    pub reset: String,
    pub retry_after: String,
}

impl HeaderNames {
    /// `RateLimit-Limit`, `RateLimit-Remaining`, `RateLimit-Reset`, `Retry-After`.
    pub fn standard() -> HeaderNames {
        HeaderNames {
            limit: "RateLimit-Limit".to_owned(),
            remaining: "RateLimit-Remaining".to_owned(),
            reset: "RateLimit-Reset".to_owned(),
            retry_after: "Retry-After".to_owned(),
        }
    }
}

/// The headers of the most restrictive of `reported` (each the limit a
/// status reports); `Retry-After` too when `retry`. None without limits.
pub(super) fn headers(
    names: &HeaderNames,
    reported: &[Candidate<'_>],
    retry: bool,
) -> Vec<(String, String)> {
    let Some(chosen) = reported.iter().reduce(more_restrictive) else {
        return Vec::new();
    };
    let reset = ceil_seconds(chosen.reset_us).to_string();
    let mut headers = vec![
        (names.limit.clone(), chosen.limit.limit.to_string()),
        (names.remaining.clone(), chosen.remaining.to_string()),
        (names.reset.clone(), reset.clone()),
    ];
    if retry {
        headers.push((names.retry_after.clone(), reset));
    }
    headers
}

#[cfg(test)]
mod tests;
