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
mod tests {
    use super::*;

    fn translate(pairs: &[(&str, &str)]) -> (Vec<FlagValue>, Vec<String>) {
        let vars = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut flags = Vec::new();
        let mut problems = Vec::new();
        xds_flags(&vars, &mut flags, &mut problems);
        (flags, problems)
    }

    fn owned(pairs: &[(&'static str, &str)]) -> Vec<FlagValue> {
        pairs.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
    }

    #[test]
    fn envoy_gateways_variables_become_the_xds_flags() {
        let (flags, problems) = translate(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,bad,team=rl=x"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "1m30s"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
        ]);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            flags,
            owned(&[
                ("config-xds-server", "envoy-gateway:18001"),
                ("config-xds-node-id", "envoy-ratelimit"),
                ("config-xds-node-metadata", "zone=a"),
                ("config-xds-node-metadata", "team=rl=x"),
                ("config-xds-force-start", "true"),
                ("config-xds-retry-interval-ms", "90000"),
                ("config-xds-tls", "true"),
                ("config-xds-tls-ca", "/certs/ca.crt"),
                ("config-xds-tls-cert", "/certs/tls.crt"),
                ("config-xds-tls-key", "/certs/tls.key"),
                ("config-xds-tls-server-name", "envoy-gateway"),
            ])
        );
    }

    #[test]
    fn without_grpc_xds_sotw_nothing_is_translated() {
        assert_eq!(
            translate(&[
                ("CONFIG_TYPE", "FILE"),
                ("CONFIG_GRPC_XDS_SERVER_URL", "eg:18001"),
                ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
            ]),
            (vec![], vec![])
        );
        // Their default server; TLS files only with USE_TLS.
        let (flags, _) = translate(&[
            ("CONFIG_TYPE", "grpc_xds_sotw"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/c.pem"),
        ]);
        assert_eq!(flags, owned(&[("config-xds-server", "localhost:18000")]));
    }

    #[test]
    fn values_that_cannot_be_used_are_reported() {
        let (_, problems) = translate(&[
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "yes"),
            ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "3 seconds"),
            ("FORCE_START_WITHOUT_INITIAL_CONFIG", "sure"),
        ]);
        assert_eq!(problems.len(), 3, "{problems:?}");
    }

    #[test]
    fn go_durations_parse_to_milliseconds() {
        for (text, ms) in [
            ("3s", Some(3_000)),
            ("250ms", Some(250)),
            ("1.5s", Some(1_500)),
            ("1h2m", Some(3_720_000)),
            ("0", Some(0)),
            ("3", None),
            ("s", None),
            ("-1s", None),
            ("3d", None),
        ] {
            assert_eq!(go_duration_ms(text), ms, "{text}");
        }
    }
}
