//! envoyproxy/ratelimit's environment variables, for the settings both
//! services share: translated into `serve` flags that apply only where our
//! own flags and `THROTTLEGATE_*` variables are absent.
//!
//! [`from_envoyproxy_env`] is a pure function of the variables; `cli`
//! installs its answer as flag defaults before parsing, so a flag on the
//! command line or one of our variables still wins.

use std::collections::HashMap;

mod stats;
mod xds;

pub use xds::TRANSLATED as TRANSLATED_XDS;

/// One translated setting: the long name of a `serve` flag (without the
/// dashes) and its value. A flag taking a list appears once per value.
pub type FlagValue = (&'static str, String);

/// envoyproxy/ratelimit variables read by [`from_envoyproxy_env`].
pub const TRANSLATED: &[&str] = &[
    "CACHE_KEY_PREFIX",
    "DISABLE_STATS",
    "EXTRA_TAGS",
    "GRPC_CLIENT_TLS_CACERT",
    "GRPC_CLIENT_TLS_SAN",
    "GRPC_HOST",
    "GRPC_PORT",
    "GRPC_SERVER_TLS_CERT",
    "GRPC_SERVER_TLS_KEY",
    "GRPC_SERVER_USE_TLS",
    "HOST",
    "LIMIT_LIMIT_HEADER",
    "LIMIT_REMAINING_HEADER",
    "LIMIT_RESET_HEADER",
    "LIMIT_RESPONSE_HEADERS_ENABLED",
    "LOG_FORMAT",
    "LOG_LEVEL",
    "MERGE_DOMAIN_CONFIG",
    "NEAR_LIMIT_RATIO",
    "PORT",
    "PROMETHEUS_ADDR",
    "PROMETHEUS_MAPPER_YAML",
    "PROMETHEUS_PATH",
    "REDIS_AUTH",
    "REDIS_POOL_SIZE",
    "REDIS_SOCKET_TYPE",
    "REDIS_TLS",
    "REDIS_TLS_CACERT",
    "REDIS_TLS_CLIENT_CERT",
    "REDIS_TLS_CLIENT_KEY",
    "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION",
    "REDIS_TYPE",
    "REDIS_URL",
    "RUNTIME_APPDIRECTORY",
    "RUNTIME_ROOT",
    "RUNTIME_SUBDIRECTORY",
    "SHADOW_MODE",
    "STATSD_HOST",
    "STATSD_PORT",
    "STATS_FLUSH_INTERVAL",
    "USE_DOG_STATSD",
    "USE_PROMETHEUS",
    "USE_STATSD",
];

/// envoyproxy/ratelimit's tracing variables (and the OpenTelemetry
/// exporter's endpoint variable it reads), read by [`from_envoyproxy_env`]
/// into the `--tracing*` flags.
pub const TRACING_VARIABLES: &[&str] = &[
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "TRACING_ENABLED",
    "TRACING_EXPORTER_PROTOCOL",
    "TRACING_SAMPLING_RATE",
    "TRACING_SERVICE_INSTANCE_ID",
    "TRACING_SERVICE_NAME",
    "TRACING_SERVICE_NAMESPACE",
];

/// envoyproxy/ratelimit variables with no counterpart here: named in the
/// start-up warning when set, whatever their value.
pub const UNSUPPORTED: &[&str] = &[
    "BACKEND_TYPE",
    "CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS",
    "DEBUG_HOST",
    "DEBUG_PORT",
    "EXPIRATION_JITTER_MAX_SECONDS",
    "GRPC_MAX_CONNECTION_AGE",
    "GRPC_MAX_CONNECTION_AGE_GRACE",
    "GRPC_UDS",
    "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
    "LOCAL_CACHE_SIZE_IN_BYTES",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
    "REDIS_PIPELINE_LIMIT",
    "REDIS_PIPELINE_WINDOW",
    "RUNTIME_IGNOREDOTFILES",
    "RUNTIME_WATCH_ROOT",
    "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT",
    "USE_DOG_STATSD_MOGRIFIERS",
];

/// Prefixes of whole families of unsupported variables.
pub const UNSUPPORTED_PREFIXES: &[&str] = &[
    "MEMCACHE_",
    "REDIS_PERSECOND",
    "TRACING_",
    "XDS_CLIENT_BACKOFF_",
];

/// Their default runtime root, used when only `RUNTIME_SUBDIRECTORY` is set.
pub const DEFAULT_RUNTIME_ROOT: &str = "/srv/runtime_data/current";

/// Our variables that say where Redis is: when one is set, theirs are left
/// alone.
const OUR_REDIS_TARGETS: &[&str] = &[
    "THROTTLEGATE_REDIS_CLUSTER_NODES",
    "THROTTLEGATE_REDIS_SENTINEL_NODES",
    "THROTTLEGATE_REDIS_SENTINEL_MASTER",
];

/// The `serve` flags that envoyproxy/ratelimit's variables in `vars` stand
/// for, and warnings: at most one naming every unsupported variable that
/// is set, then one per value that could not be used.
pub fn from_envoyproxy_env(vars: &HashMap<String, String>) -> (Vec<FlagValue>, Vec<String>) {
    let mut flags = Vec::new();
    let mut problems = Vec::new();
    redis(vars, &mut flags, &mut problems);
    let get_owned = |name: &str| var(vars, name).map(str::to_owned);
    stats::stats(&get_owned, &mut flags, &mut problems);
    tracing(vars, &mut flags, &mut problems);
    server_tls_flags(vars, &mut flags);
    redis_connection_flags(vars, &mut flags, &mut problems);
    serving_flags(vars, &mut flags, &mut problems);
    decision_flags(vars, &mut flags, &mut problems);
    xds::xds_flags(vars, &mut flags, &mut problems);
    // Over xDS the runtime directory holds no rules.
    if !xds::wants_xds(vars) {
        flags.extend(runtime_config(vars));
    }
    let mut warnings: Vec<String> = unsupported_warning(vars).into_iter().collect();
    warnings.extend(problems);
    (flags, warnings)
}

/// The variable `name`, trimmed; `None` when unset or blank.
fn var<'a>(vars: &'a HashMap<String, String>, name: &str) -> Option<&'a str> {
    vars.get(name)
        .map(|it| it.trim())
        .filter(|it| !it.is_empty())
}

/// With `GRPC_SERVER_USE_TLS=true`: the certificate, key and client
/// verification of the gRPC port, and a plain HTTP port.
fn server_tls_flags(vars: &HashMap<String, String>, flags: &mut Vec<FlagValue>) {
    if server_tls(vars) != Some(true) {
        return;
    }
    for (name, flag) in SERVER_TLS {
        if let Some(value) = var(vars, name) {
            flags.push((flag, value.to_owned()));
        }
    }
    // envoyproxy/ratelimit serves TLS on its gRPC port only: the
    // readiness probes that deployments aim at `/healthcheck` speak
    // plain HTTP.
    flags.push(("http-tls", "off".into()));
}

/// How Redis is reached once found: its TLS files, host name
/// verification, and the pool size.
fn redis_connection_flags(
    vars: &HashMap<String, String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let get = |name: &str| var(vars, name);
    for (name, flag) in [
        ("REDIS_TLS_CACERT", "redis-tls-ca"),
        ("REDIS_TLS_CLIENT_CERT", "redis-tls-cert"),
        ("REDIS_TLS_CLIENT_KEY", "redis-tls-key"),
    ] {
        if let Some(value) = get(name) {
            flags.push((flag, value.to_owned()));
        }
    }
    if let Some(value) = get("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION") {
        match parse_bool(value) {
            Some(true) => flags.push(("redis-tls-skip-hostname-verification", "true".into())),
            Some(false) => {}
            None => problems.push(format!(
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION={value} is not a boolean; host names are verified"
            )),
        }
    }
    if let Some(size) = get("REDIS_POOL_SIZE") {
        match size.parse::<u32>() {
            Ok(size) if size > 0 => flags.push(("redis-pool-size", size.to_string())),
            _ => problems.push(format!("REDIS_POOL_SIZE={size} is not a positive number")),
        }
    }
}

/// Where both servers listen, and the log format.
fn serving_flags(
    vars: &HashMap<String, String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let get = |name: &str| var(vars, name);
    if let Some(addr) = listen_addr(get("GRPC_HOST"), get("GRPC_PORT"), 8081) {
        flags.push(("grpc-addr", addr));
    }
    if let Some(addr) = listen_addr(get("HOST"), get("PORT"), 8080) {
        flags.push(("http-addr", addr));
    }
    if let Some(format) = get("LOG_FORMAT") {
        match format.to_ascii_lowercase().as_str() {
            it @ ("json" | "text") => flags.push(("log-format", it.to_owned())),
            _ => problems.push(format!("LOG_FORMAT={format} is neither json nor text")),
        }
    }
}

/// How decisions are made and answered: shadow mode, merged domains,
/// response headers and their names, the key prefix, the near-limit
/// ratio.
fn decision_flags(
    vars: &HashMap<String, String>,
    flags: &mut Vec<FlagValue>,
    problems: &mut Vec<String>,
) {
    let get = |name: &str| var(vars, name);
    for (name, flag) in [
        ("SHADOW_MODE", "shadow-mode"),
        ("MERGE_DOMAIN_CONFIG", "merge-domains"),
    ] {
        if let Some(value) = get(name) {
            match parse_bool(value) {
                Some(on) => flags.push((flag, on.to_string())),
                None => problems.push(format!("{name}={value} is not a boolean")),
            }
        }
    }
    if let Some(value) = get("LIMIT_RESPONSE_HEADERS_ENABLED") {
        match parse_bool(value) {
            Some(on) => flags.push(("response-headers", if on { "on" } else { "off" }.into())),
            None => problems.push(format!(
                "LIMIT_RESPONSE_HEADERS_ENABLED={value} is not a boolean"
            )),
        }
    }
    for (name, flag) in [
        ("LIMIT_LIMIT_HEADER", "limit-header"),
        ("LIMIT_REMAINING_HEADER", "remaining-header"),
        ("LIMIT_RESET_HEADER", "reset-header"),
        ("CACHE_KEY_PREFIX", "redis-key-prefix"),
        ("NEAR_LIMIT_RATIO", "near-limit-ratio"),
    ] {
        if let Some(value) = get(name) {
            flags.push((flag, value.to_owned()));
        }
    }
}

/// The config directory their runtime variables name, as `--config`.
fn runtime_config(vars: &HashMap<String, String>) -> Option<FlagValue> {
    let get = |name: &str| var(vars, name);
    if get("RUNTIME_ROOT").is_none() && get("RUNTIME_SUBDIRECTORY").is_none() {
        return None;
    }
    let mut path = std::path::PathBuf::from(get("RUNTIME_ROOT").unwrap_or(DEFAULT_RUNTIME_ROOT));
    if let Some(sub) = get("RUNTIME_SUBDIRECTORY") {
        path.push(sub);
    }
    path.push(get("RUNTIME_APPDIRECTORY").unwrap_or("config"));
    Some(("config", path.display().to_string()))
}

/// One warning naming every unsupported variable set, sorted; `None`
/// without any.
fn unsupported_warning(vars: &HashMap<String, String>) -> Option<String> {
    let mut unsupported: Vec<&str> = vars
        .iter()
        .filter(|(name, value)| is_unsupported(name, value))
        .map(|(name, _)| name.as_str())
        .collect();
    if unsupported.is_empty() {
        return None;
    }
    unsupported.sort_unstable();
    Some(format!(
        "envoyproxy/ratelimit variables not supported, ignored: {}",
        unsupported.join(", ")
    ))
}

/// envoyproxy/ratelimit's server TLS variables besides
/// `GRPC_SERVER_USE_TLS`, and the flags they become when it is true.
const SERVER_TLS: [(&str, &str); 4] = [
    ("GRPC_SERVER_TLS_CERT", "tls-cert"),
    ("GRPC_SERVER_TLS_KEY", "tls-key"),
    ("GRPC_CLIENT_TLS_CACERT", "tls-client-ca"),
    ("GRPC_CLIENT_TLS_SAN", "tls-client-san"),
];

/// `GRPC_SERVER_USE_TLS`: `None` when unset, or not a boolean.
fn server_tls(vars: &HashMap<String, String>) -> Option<bool> {
    let value = vars.get("GRPC_SERVER_USE_TLS")?.trim();
    if value.is_empty() {
        return None;
    }
    parse_bool(value)
}

/// envoyproxy/ratelimit security settings in `vars` that cannot be honoured:
/// `serve` refuses to start with these messages rather than serve plain
/// text an operator asked to encrypt or authenticate. Envoy's server TLS
/// needs `GRPC_SERVER_USE_TLS=true` with a certificate and key; a CA or
/// name for client certificates, a certificate or key without it, are
/// refused (they would be ignored).
pub fn refusals(vars: &HashMap<String, String>) -> Vec<String> {
    let set = |name: &str| vars.get(name).is_some_and(|it| !it.trim().is_empty());
    let mut refusals = redis_refusals(vars);
    let given: Vec<&str> = SERVER_TLS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| set(name))
        .collect();
    match (set("GRPC_SERVER_USE_TLS"), server_tls(vars)) {
        (true, None) => refusals.push(format!(
            "GRPC_SERVER_USE_TLS={} is not a boolean",
            vars["GRPC_SERVER_USE_TLS"].trim()
        )),
        (_, Some(true)) => {
            for name in ["GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY"] {
                if !set(name) {
                    refusals.push(format!("GRPC_SERVER_USE_TLS=true needs {name}"));
                }
            }
        }
        _ if !given.is_empty() => refusals.push(format!(
            "{} set without GRPC_SERVER_USE_TLS=true would be ignored: set it to serve TLS, \
             or unset them",
            given.join(", ")
        )),
        _ => {}
    }
    refusals
}

/// `BACKEND_TYPE=redis` and `CONFIG_TYPE=FILE` name what this service does
/// anyway; any other value, and every other listed variable, is unsupported.
fn is_unsupported(name: &str, value: &str) -> bool {
    match name {
        "BACKEND_TYPE" => !value.trim().eq_ignore_ascii_case("redis"),
        "CONFIG_TYPE" => {
            !value.trim().eq_ignore_ascii_case("file")
                && !value.trim().eq_ignore_ascii_case("grpc_xds_sotw")
        }
        // Dot-files are always skipped, so only asking for them is not
        // honoured; the config directory is watched through symlink swaps
        // whichever root is named.
        "RUNTIME_IGNOREDOTFILES" => parse_bool(value.trim()) == Some(false),
        "RUNTIME_WATCH_ROOT" => false,
        _ => {
            UNSUPPORTED.contains(&name)
                || (UNSUPPORTED_PREFIXES.iter().any(|it| name.starts_with(it))
                    && !TRACING_VARIABLES.contains(&name))
        }
    }
}

/// `REDIS_URL` in envoyproxy/ratelimit's forms (`host:port`, a socket
/// path, a comma list for a cluster, `master,host:port,...` for Sentinel),
/// with `REDIS_SOCKET_TYPE`, `REDIS_TYPE`, `REDIS_AUTH` and `REDIS_TLS`. A
/// `REDIS_URL` that is a URL is ours and read as such.
/// A Redis named in their variables that cannot be used (`REDIS_TYPE=ring`,
/// a Sentinel `REDIS_URL` without its master's name): serving from memory
/// instead would give every instance limits of its own.
fn redis_refusals(vars: &HashMap<String, String>) -> Vec<String> {
    let (mut flags, mut problems) = (Vec::new(), Vec::new());
    redis(vars, &mut flags, &mut problems);
    if flags.iter().any(|(flag, _)| flag.starts_with("redis-")) {
        return Vec::new();
    }
    problems
        .into_iter()
        .filter(|it| it.starts_with("REDIS_TYPE=") || it.starts_with("REDIS_URL="))
        .map(|it| format!("{it}: Redis cannot be reached as configured, and the in-memory backend would give each instance limits of its own"))
        .collect()
}

fn redis(vars: &HashMap<String, String>, flags: &mut Vec<FlagValue>, problems: &mut Vec<String>) {
    let get = |name: &str| var(vars, name);
    let Some(url) = get("REDIS_URL") else { return };
    if url.contains("://") || OUR_REDIS_TARGETS.iter().any(|it| get(it).is_some()) {
        return;
    }
    let tls = match get("REDIS_TLS").map(|it| (it, parse_bool(it))) {
        None => false,
        Some((_, Some(on))) => on,
        Some((value, None)) => {
            problems.push(format!("REDIS_TLS={value} is not a boolean"));
            false
        }
    };
    let scheme = if tls { "rediss" } else { "redis" };
    let userinfo = get("REDIS_AUTH").map(|auth| match auth.split_once(':') {
        Some((user, password)) => format!("{}:{}@", encode(user), encode(password)),
        None => format!(":{}@", encode(auth)),
    });
    let userinfo = userinfo.as_deref().unwrap_or("");
    let list = || url.split(',').map(str::trim).filter(|it| !it.is_empty());
    match get("REDIS_TYPE").map(str::to_ascii_lowercase).as_deref() {
        None | Some("single") => {
            let unix = match get("REDIS_SOCKET_TYPE")
                .map(str::to_ascii_lowercase)
                .as_deref()
            {
                Some("unix") => true,
                Some("tcp") => false,
                None => url.starts_with('/'),
                Some(other) => {
                    problems.push(format!("REDIS_SOCKET_TYPE={other} is neither tcp nor unix"));
                    return;
                }
            };
            let url = if unix {
                let mut query = Vec::new();
                if let Some(auth) = get("REDIS_AUTH") {
                    match auth.split_once(':') {
                        Some((user, password)) => {
                            query.push(format!("user={}", encode(user)));
                            query.push(format!("pass={}", encode(password)));
                        }
                        None => query.push(format!("pass={}", encode(auth))),
                    }
                }
                let query = if query.is_empty() {
                    String::new()
                } else {
                    format!("?{}", query.join("&"))
                };
                format!("redis+unix://{url}{query}")
            } else {
                format!("{scheme}://{userinfo}{url}")
            };
            flags.push(("redis-url", url));
        }
        Some("cluster") => {
            for node in list() {
                let node = if userinfo.is_empty() && !tls {
                    node.to_owned()
                } else {
                    format!("{scheme}://{userinfo}{node}")
                };
                flags.push(("redis-cluster-nodes", node));
            }
        }
        Some("sentinel") => {
            let mut parts = list();
            let (Some(master), Some(first)) = (parts.next(), parts.next()) else {
                problems.push(format!(
                    "REDIS_URL={url} with REDIS_TYPE=sentinel needs master_name,host:port,..."
                ));
                return;
            };
            flags.push(("redis-sentinel-master", master.to_owned()));
            for node in std::iter::once(first).chain(parts) {
                flags.push(("redis-sentinel-nodes", node.to_owned()));
            }
            if tls || !userinfo.is_empty() {
                flags.push(("redis-url", format!("{scheme}://{userinfo}{master}")));
            }
        }
        Some(other) => problems.push(format!(
            "REDIS_TYPE={other} is not single, cluster or sentinel; REDIS_URL ignored"
        )),
    }
}

/// envoyproxy/ratelimit's tracing: `TRACING_ENABLED` turns it on or off,
/// `TRACING_EXPORTER_PROTOCOL` (`http`, its default, or `grpc`) chooses the
/// transport, `OTEL_EXPORTER_OTLP_ENDPOINT` the collector, and the rate
/// and resource names carry over. With tracing on and no
/// `TRACING_SERVICE_NAME`, spans carry its default service name,
/// `RateLimit`, so traces keep their place after a swap.
fn tracing(vars: &HashMap<String, String>, flags: &mut Vec<FlagValue>, problems: &mut Vec<String>) {
    let get = |name: &str| var(vars, name);
    let mut on = false;
    if let Some(value) = get("TRACING_ENABLED") {
        match parse_bool(value) {
            Some(enabled) => {
                on = enabled;
                flags.push(("tracing", if enabled { "on" } else { "off" }.into()));
            }
            None => problems.push(format!(
                "TRACING_ENABLED={value} is not a boolean; tracing stays off"
            )),
        }
    }
    if let Some(protocol) = get("TRACING_EXPORTER_PROTOCOL") {
        match protocol.to_ascii_lowercase().as_str() {
            it @ ("http" | "grpc") => flags.push(("tracing-protocol", it.to_owned())),
            _ => problems.push(format!(
                "TRACING_EXPORTER_PROTOCOL={protocol} is neither http nor grpc"
            )),
        }
    }
    for (name, flag) in [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "tracing-endpoint"),
        ("TRACING_SAMPLING_RATE", "tracing-sampling-rate"),
        ("TRACING_SERVICE_NAME", "tracing-service-name"),
        ("TRACING_SERVICE_NAMESPACE", "tracing-service-namespace"),
        ("TRACING_SERVICE_INSTANCE_ID", "tracing-service-instance-id"),
    ] {
        if let Some(value) = get(name) {
            flags.push((flag, value.to_owned()));
        }
    }
    if on && get("TRACING_SERVICE_NAME").is_none() {
        flags.push(("tracing-service-name", "RateLimit".into()));
    }
}

/// `host:port` to listen on, from either or both parts (the other one
/// defaulting like envoyproxy/ratelimit's); an IPv6 host gets brackets.
fn listen_addr(host: Option<&str>, port: Option<&str>, default_port: u16) -> Option<String> {
    if host.is_none() && port.is_none() {
        return None;
    }
    let host = host.unwrap_or("0.0.0.0");
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else if host.eq_ignore_ascii_case("localhost") {
        "127.0.0.1".to_owned()
    } else {
        host.to_owned()
    };
    let port = port.map_or_else(|| default_port.to_string(), str::to_owned);
    Some(format!("{host}:{port}"))
}

/// A boolean as Go's `strconv.ParseBool` reads it.
fn parse_bool(text: &str) -> Option<bool> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `LOG_LEVEL` (logrus level names, any case) as a `RUST_LOG` filter.
pub fn log_filter(level: &str) -> Option<&'static str> {
    Some(match level.trim().to_ascii_lowercase().as_str() {
        "trace" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" | "warning" => "warn",
        "error" | "fatal" | "panic" => "error",
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
