//! Our counters under envoyproxy/ratelimit's statistic names, as its
//! statsd sink sends them: `ratelimit.service.rate_limit.<domain>.<key>.<stat>`
//! per rule, `ratelimit.service.config_load_success` and `_error`,
//! `ratelimit.service.call.should_rate_limit.redis_error`, and
//! `ratelimit_server.ShouldRateLimit.total_requests` and `.response_time`.
//!
//! Everything here is read from the counters the decision path already
//! bumps ([`super::Metrics`]'s series, reloads, backend failures and the
//! decision latency histogram): nothing is counted twice, and building a
//! [`RatelimitStats`] takes no lock a decision takes for longer than a
//! copy of `Arc`s.
//!
//! `<key>` is the `rule` label ([`super::MetricRule`]): the matched rule's
//! path, `key` or `key_value` per level joined by `.`, or with
//! `detailed_metric`/`value_to_metric` the request's values, which is the
//! key envoyproxy/ratelimit builds; it is sanitized as it does (`:` and
//! `|` become `_`, and so do the dots of an IPv4 address). Per rule and
//! outcome the counts are of hits (request costs), as there:
//! `within_limit` counts every allowed hit, `near_limit` those allowed
//! near the limit, `over_limit` every denied hit and every hit a shadow
//! rule let pass, `shadow_mode` those.

use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use super::{MetricResult, Metrics, UNKNOWN_DOMAIN};

/// The prefix of every per-rule statistic.
pub const RATE_LIMIT_PREFIX: &str = "ratelimit.service.rate_limit.";
/// Successful config loads (start-up and reloads).
pub const CONFIG_LOAD_SUCCESS: &str = "ratelimit.service.config_load_success";
/// Refused config reloads.
pub const CONFIG_LOAD_ERROR: &str = "ratelimit.service.config_load_error";
/// Calls that failed in the backend.
pub const REDIS_ERROR: &str = "ratelimit.service.call.should_rate_limit.redis_error";
/// `ShouldRateLimit` calls answered.
pub const TOTAL_REQUESTS: &str = "ratelimit_server.ShouldRateLimit.total_requests";
/// `ShouldRateLimit` answer times, a timer in milliseconds.
pub const RESPONSE_TIME: &str = "ratelimit_server.ShouldRateLimit.response_time";

/// The per-rule statistics, in the order they are written.
pub const RULE_STATS: [&str; 5] = [
    "total_hits",
    "over_limit",
    "near_limit",
    "within_limit",
    "shadow_mode",
];

/// Every statistic at one moment: counters are cumulative since start-up.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RatelimitStats {
    /// `(statsd name, value)`, per-rule ones first, sorted by domain and key.
    pub counters: Vec<(String, u64)>,
    /// The answer times of `ShouldRateLimit`.
    pub response_time: ResponseTime,
}

/// A cumulative histogram of answer times, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseTime {
    /// `(upper edge in ms, answers at or below it)`, edges ascending, the
    /// last one infinite.
    pub buckets: Vec<(f64, u64)>,
    pub count: u64,
    pub sum_ms: f64,
}

impl ResponseTime {
    /// Answers per bucket since `earlier` (not cumulative): `(upper edge in
    /// ms, answers in the bucket)`, empty buckets left out.
    pub fn delta_since(&self, earlier: &ResponseTime) -> Vec<(f64, u64)> {
        let mut below_now = 0u64;
        let mut below_then = 0u64;
        let mut out = Vec::new();
        for (idx, (edge, now)) in self.buckets.iter().enumerate() {
            let then = earlier.buckets.get(idx).map_or(0, |it| it.1);
            let in_bucket = now
                .saturating_sub(below_now)
                .saturating_sub(then.saturating_sub(below_then));
            below_now = *now;
            below_then = then;
            if in_bucket > 0 {
                out.push((*edge, in_bucket));
            }
        }
        out
    }
}

impl Metrics {
    /// Every statistic under envoyproxy/ratelimit's names, now.
    pub fn ratelimit_stats(&self) -> RatelimitStats {
        let mut counters = Vec::new();
        for (domain, rule, series) in self.decisions.series.snapshot() {
            if &*domain == UNKNOWN_DOMAIN {
                // envoyproxy/ratelimit counts these per domain name, which
                // clients choose: not exported.
                continue;
            }
            let (ok, near, over, shadow) = (
                series.hits(MetricResult::Ok),
                series.hits(MetricResult::NearLimit),
                series.hits(MetricResult::OverLimit),
                series.hits(MetricResult::Shadow),
            );
            let values = [
                series.total_hits(),
                over.wrapping_add(shadow),
                near,
                ok.wrapping_add(near),
                shadow,
            ];
            let key = sanitize(&format!("{domain}.{rule}"));
            for (stat, value) in RULE_STATS.iter().zip(values) {
                counters.push((format!("{RATE_LIMIT_PREFIX}{key}.{stat}"), value));
            }
        }
        let reload_errors = self.config_loads.reload_errors();
        counters.push((
            CONFIG_LOAD_SUCCESS.to_owned(),
            self.config_loads.successes(),
        ));
        counters.push((CONFIG_LOAD_ERROR.to_owned(), reload_errors));
        counters.push((REDIS_ERROR.to_owned(), self.backends.failures()));
        let response_time = response_time(self.calls.should_rate_limit_latency());
        counters.push((TOTAL_REQUESTS.to_owned(), response_time.count));
        RatelimitStats {
            counters,
            response_time,
        }
    }
}

/// The decision latency histogram in milliseconds. prometheus-client
/// offers no reader of buckets, sum or count outside its tests, so the histogram (shared, not copied) is
/// written out and its bucket lines read back.
fn response_time(latency: &Histogram) -> ResponseTime {
    let mut registry = Registry::default();
    registry.register("latency", "", latency.clone());
    let mut text = String::new();
    if prometheus_client::encoding::text::encode(&mut text, &registry).is_err() {
        return ResponseTime::default();
    }
    let mut time = ResponseTime::default();
    for line in text.lines() {
        if let Some(sum) = line.strip_prefix("latency_sum ") {
            let seconds = sum.trim().parse::<f64>().unwrap_or(0.0);
            time.sum_ms = super::ratelimit_prometheus::tidy(seconds * 1000.0);
        } else if let Some(count) = line.strip_prefix("latency_count ") {
            time.count = count.trim().parse().unwrap_or(0);
        }
        let Some(rest) = line.strip_prefix("latency_bucket{le=\"") else {
            continue;
        };
        let Some((edge, count)) = rest.split_once("\"} ") else {
            continue;
        };
        let edge = match edge {
            "+Inf" => f64::INFINITY,
            it => match it.parse::<f64>() {
                Ok(seconds) => super::ratelimit_prometheus::tidy(seconds * 1000.0),
                Err(_) => continue,
            },
        };
        let count = count.split_whitespace().next().unwrap_or("0");
        time.buckets.push((edge, count.parse().unwrap_or(0)));
    }
    time
}

/// A statistic name as envoyproxy/ratelimit sanitizes it: `:` and `|`
/// become `_`, and so do the dots of anything shaped like an IPv4
/// address (1 to 3 digits, four times, joined by dots).
pub fn sanitize(name: &str) -> String {
    let replaced: Vec<char> = name
        .chars()
        .map(|ch| if ch == ':' || ch == '|' { '_' } else { ch })
        .collect();
    let mut out = String::with_capacity(name.len());
    let mut idx = 0;
    while idx < replaced.len() {
        match ipv4_len(&replaced[idx..]) {
            Some(len) => {
                for ch in &replaced[idx..idx + len] {
                    out.push(if *ch == '.' { '_' } else { *ch });
                }
                idx += len;
            }
            None => {
                out.push(replaced[idx]);
                idx += 1;
            }
        }
    }
    out
}

/// The length of the IPv4-shaped text `chars` starts with, leftmost
/// match first and each run of digits as long as it can be (up to 3), as
/// a regular expression `\d{1,3}(\.\d{1,3}){3}` would match.
fn ipv4_len(chars: &[char]) -> Option<usize> {
    let mut at = 0;
    for part in 0..4 {
        if part > 0 {
            if chars.get(at) != Some(&'.') {
                return None;
            }
            at += 1;
        }
        let digits = chars[at.min(chars.len())..]
            .iter()
            .take(3)
            .take_while(|it| it.is_ascii_digit())
            .count();
        if digits == 0 {
            return None;
        }
        at += digits;
    }
    Some(at)
}

#[cfg(test)]
mod tests;
