//! envoyproxy/ratelimit's statistics variables as `serve` flags: its
//! Prometheus endpoint (`USE_PROMETHEUS`, `PROMETHEUS_ADDR`,
//! `PROMETHEUS_PATH`, `PROMETHEUS_MAPPER_YAML`) and its statsd sink
//! (`USE_STATSD` over TCP or `USE_DOG_STATSD` over UDP with DogStatsD
//! tags, `STATSD_HOST`, `STATSD_PORT`, `EXTRA_TAGS`,
//! `STATS_FLUSH_INTERVAL`); `DISABLE_STATS=true` turns both off.
//!
//! Unlike envoyproxy/ratelimit, whose `USE_STATSD` is true unless set, a
//! sink is started only when its variable says `true`.

use super::{FlagValue, listen_addr, parse_bool};

/// Adds the flags the statistics variables stand for (`get` reads a
/// variable, `None` when unset or blank), and a problem per value that
/// cannot be used.
pub fn stats(
    get: &dyn Fn(&str) -> Option<String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let mut switch = |name: &str| -> bool {
        let Some(value) = get(name) else {
            return false;
        };
        parse_bool(&value).unwrap_or_else(|| {
            problems.push(format!("{name}={value} is not a boolean; taken as false"));
            false
        })
    };
    if switch("DISABLE_STATS") {
        return;
    }
    let (prometheus, statsd, dog) = (
        switch("USE_PROMETHEUS"),
        switch("USE_STATSD"),
        switch("USE_DOG_STATSD"),
    );
    if prometheus {
        prometheus_flags(get, flags, problems);
    }
    if statsd || dog {
        statsd_flags(get, dog, flags, problems);
    }
}

fn prometheus_flags(
    get: &dyn Fn(&str) -> Option<String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let addr = get("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".to_owned());
    match addr.rsplit_once(':') {
        Some((host, port)) if port.parse::<u16>().is_ok() => {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let host = (!host.is_empty()).then_some(host);
            if let Some(addr) = listen_addr(host, Some(port), 9090) {
                flags.push(("ratelimit-prometheus-addr", addr));
            }
        }
        _ => {
            problems.push(format!(
                "PROMETHEUS_ADDR={addr} is not [host]:port; the endpoint is off"
            ));
            return;
        }
    }
    if let Some(path) = get("PROMETHEUS_PATH") {
        flags.push(("ratelimit-prometheus-path", path));
    }
    if let Some(file) = get("PROMETHEUS_MAPPER_YAML") {
        flags.push(("ratelimit-prometheus-mapping", file));
    }
}

fn statsd_flags(
    get: &dyn Fn(&str) -> Option<String>,
    dog: bool,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let host = get("STATSD_HOST").unwrap_or_else(|| "localhost".to_owned());
    let port = get("STATSD_PORT").unwrap_or_else(|| "8125".to_owned());
    if port.parse::<u16>().is_err() {
        problems.push(format!("STATSD_PORT={port} is not a port; statsd is off"));
        return;
    }
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host
    };
    flags.push(("statsd-addr", format!("{host}:{port}")));
    if dog {
        // DogStatsD clients send over UDP.
        flags.push(("statsd-protocol", "udp".to_owned()));
        flags.push(("statsd-tag-format", "dogstatsd".to_owned()));
    }
    if let Some(tags) = get("EXTRA_TAGS") {
        for pair in tags.split(',').map(str::trim).filter(|it| !it.is_empty()) {
            match pair.split_once(':') {
                Some((key, _)) if !key.trim().is_empty() => {
                    flags.push(("statsd-tag", pair.to_owned()));
                }
                _ => problems.push(format!("EXTRA_TAGS: {pair:?} is not key:value; left out")),
            }
        }
    }
    if let Some(interval) = get("STATS_FLUSH_INTERVAL") {
        match go_duration_ms(&interval) {
            Some(ms) if ms >= 1 => flags.push(("statsd-flush-interval-ms", ms.to_string())),
            _ => problems.push(format!(
                "STATS_FLUSH_INTERVAL={interval} is not a duration of 1ms or more (such as 10s)"
            )),
        }
    }
}

/// A Go duration (`10s`, `1m30s`, `250ms`, `1.5h`) in whole milliseconds.
fn go_duration_ms(text: &str) -> Option<u64> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|it: char| !(it.is_ascii_digit() || it == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|it: char| it.is_ascii_digit() || it == '.')
            .unwrap_or(rest.len());
        let ms_per_unit = match &rest[..unit_len] {
            "ns" => 1e-6,
            "us" | "µs" | "μs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3600e3,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * ms_per_unit;
    }
    (total.is_finite() && total < u64::MAX as f64).then_some(total as u64)
}

#[cfg(test)]
mod tests;
