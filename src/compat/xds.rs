//! envoyproxy/ratelimit's rules over xDS (`CONFIG_TYPE=GRPC_XDS_SOTW` and
//! the `CONFIG_GRPC_XDS_*` variables) as `--config-xds-*` flags.

use std::collections::HashMap;

use super::{FlagValue, parse_bool};

/// The variables [`xds_flags`] reads.
pub const TRANSLATED: &[&str] = &[
    "CONFIG_GRPC_XDS_CLIENT_TLS_CERT",
    "CONFIG_GRPC_XDS_CLIENT_TLS_KEY",
    "CONFIG_GRPC_XDS_NODE_ID",
    "CONFIG_GRPC_XDS_NODE_METADATA",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL",
    "CONFIG_GRPC_XDS_SERVER_TLS_CACERT",
    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
    "CONFIG_GRPC_XDS_SERVER_URL",
    "CONFIG_GRPC_XDS_SERVER_USE_TLS",
    "CONFIG_TYPE",
    "FORCE_START_WITHOUT_INITIAL_CONFIG",
];

/// envoyproxy/ratelimit's default server address.
pub const DEFAULT_SERVER_URL: &str = "localhost:18000";

/// Whether `CONFIG_TYPE` asks for rules over xDS (then the runtime
/// directory is no config path).
pub fn wants_xds(vars: &HashMap<String, String>) -> bool {
    vars.get("CONFIG_TYPE")
        .is_some_and(|it| it.trim().eq_ignore_ascii_case("GRPC_XDS_SOTW"))
}

/// The `--config-xds-*` flags the variables in `vars` stand for (none
/// unless `CONFIG_TYPE=GRPC_XDS_SOTW`), and the values that could not be
/// used, each a message. As in envoyproxy/ratelimit, the TLS files count
/// only with `CONFIG_GRPC_XDS_SERVER_USE_TLS=true`.
pub fn xds_flags(
    vars: &HashMap<String, String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    if !wants_xds(vars) {
        return;
    }
    let get = |name: &str| {
        vars.get(name)
            .map(|it| it.trim())
            .filter(|it| !it.is_empty())
    };
    let url = get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or(DEFAULT_SERVER_URL);
    flags.push(("config-xds-server", url.to_owned()));
    if let Some(id) = get("CONFIG_GRPC_XDS_NODE_ID") {
        flags.push(("config-xds-node-id", id.to_owned()));
    }
    if let Some(metadata) = get("CONFIG_GRPC_XDS_NODE_METADATA") {
        // Entries without `=` are skipped, as envoyproxy/ratelimit does.
        for entry in metadata.split(',').filter(|it| it.contains('=')) {
            flags.push(("config-xds-node-metadata", entry.to_owned()));
        }
    }
    if let Some(value) = get("FORCE_START_WITHOUT_INITIAL_CONFIG") {
        match parse_bool(value) {
            Some(on) => flags.push(("config-xds-force-start", on.to_string())),
            None => problems.push(format!(
                "FORCE_START_WITHOUT_INITIAL_CONFIG={value} is not a boolean"
            )),
        }
    }
    if let Some(value) = get("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL") {
        match go_duration_ms(value) {
            Some(ms) => flags.push(("config-xds-retry-interval-ms", ms.to_string())),
            None => problems.push(format!(
                "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL={value} is not a duration such as 3s"
            )),
        }
    }
    match get("CONFIG_GRPC_XDS_SERVER_USE_TLS").map(parse_bool) {
        None | Some(Some(false)) => {}
        Some(None) => problems.push(format!(
            "CONFIG_GRPC_XDS_SERVER_USE_TLS={} is not a boolean; plain text is used",
            vars["CONFIG_GRPC_XDS_SERVER_USE_TLS"].trim()
        )),
        Some(Some(true)) => {
            flags.push(("config-xds-tls", "true".to_owned()));
            for (name, flag) in [
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "config-xds-tls-ca"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "config-xds-tls-cert"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "config-xds-tls-key"),
                (
                    "CONFIG_GRPC_XDS_SERVER_TLS_SAN",
                    "config-xds-tls-server-name",
                ),
            ] {
                if let Some(value) = get(name) {
                    flags.push((flag, value.to_owned()));
                }
            }
        }
    }
}

/// A Go duration (`time.ParseDuration`: `3s`, `1m30s`, `250ms`, `1.5s`) in
/// milliseconds; `None` when it is not one or is negative.
fn go_duration_ms(text: &str) -> Option<u64> {
    if text == "0" {
        return Some(0);
    }
    let mut rest = text;
    let mut total = 0.0_f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|it: char| !(it.is_ascii_digit() || it == '.'))
            .filter(|it| *it > 0)?;
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|it: char| it.is_ascii_digit() || it == '.')
            .unwrap_or(rest.len());
        let ms_per_unit = match &rest[..unit_end] {
            "ns" => 1e-6,
            "us" | "µs" => 1e-3,
            "ms" => 1.0,
            "s" => 1e3,
            "m" => 60e3,
            "h" => 3_600e3,
            _ => return None,
        };
        total += number * ms_per_unit;
        rest = &rest[unit_end..];
    }
    (total.is_finite() && total < u64::MAX as f64).then(|| total.round() as u64)
}

#[cfg(test)]
mod tests;
