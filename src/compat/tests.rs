use super::*;

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn translate(pairs: &[(&str, &str)]) -> (Vec<FlagValue>, Vec<String>) {
    from_envoyproxy_env(&vars(pairs))
}

fn refused(pairs: &[(&str, &str)]) -> Vec<String> {
    refusals(&vars(pairs))
}

fn flags(pairs: &[(&str, &str)]) -> Vec<(&'static str, String)> {
    let (flags, warnings) = translate(pairs);
    assert!(warnings.is_empty(), "{warnings:?}");
    flags
}

fn one(flag: &'static str, value: &str) -> Vec<FlagValue> {
    vec![(flag, value.to_owned())]
}

#[test]
fn nothing_set_translates_to_nothing() {
    assert_eq!(translate(&[]), (vec![], vec![]));
}

#[test]
fn tcp_host_port_becomes_a_redis_url() {
    assert_eq!(
        flags(&[("REDIS_SOCKET_TYPE", "tcp"), ("REDIS_URL", "redis:6379")]),
        one("redis-url", "redis://redis:6379")
    );
}

#[test]
fn auth_and_tls_go_into_the_url() {
    assert_eq!(
        flags(&[
            ("REDIS_SOCKET_TYPE", "tcp"),
            ("REDIS_URL", "redis:6379"),
            ("REDIS_AUTH", "p@ss/word"),
            ("REDIS_TLS", "true"),
        ]),
        one("redis-url", "rediss://:p%40ss%2Fword@redis:6379")
    );
    assert_eq!(
        flags(&[("REDIS_URL", "redis:6379"), ("REDIS_AUTH", "user:secret")]),
        one("redis-url", "redis://user:secret@redis:6379")
    );
}

#[test]
fn a_unix_socket_path_becomes_a_redis_unix_url() {
    assert_eq!(
        flags(&[("REDIS_SOCKET_TYPE", "unix"), ("REDIS_URL", "/run/r.sock")]),
        one("redis-url", "redis+unix:///run/r.sock")
    );
    assert_eq!(
        flags(&[("REDIS_URL", "/run/r.sock"), ("REDIS_AUTH", "s")]),
        one("redis-url", "redis+unix:///run/r.sock?pass=s")
    );
}

#[test]
fn a_url_in_redis_url_is_left_to_our_flag() {
    assert_eq!(
        flags(&[("REDIS_URL", "redis://r:6379"), ("REDIS_AUTH", "x")]),
        vec![]
    );
}

#[test]
fn our_cluster_or_sentinel_variables_leave_redis_url_alone() {
    assert_eq!(
        flags(&[
            ("REDIS_URL", "r:6379"),
            ("THROTTLEGATE_REDIS_CLUSTER_NODES", "a:1"),
        ]),
        vec![]
    );
}

#[test]
fn cluster_lists_its_nodes() {
    assert_eq!(
        flags(&[("REDIS_TYPE", "CLUSTER"), ("REDIS_URL", "a:7000, b:7001")]),
        vec![
            ("redis-cluster-nodes", "a:7000".to_owned()),
            ("redis-cluster-nodes", "b:7001".to_owned()),
        ]
    );
    assert_eq!(
        flags(&[
            ("REDIS_TYPE", "cluster"),
            ("REDIS_URL", "a:7000"),
            ("REDIS_AUTH", "pw"),
        ]),
        one("redis-cluster-nodes", "redis://:pw@a:7000")
    );
}

#[test]
fn sentinel_splits_master_from_nodes() {
    assert_eq!(
        flags(&[
            ("REDIS_TYPE", "sentinel"),
            ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
            ("REDIS_AUTH", "pw"),
        ]),
        vec![
            ("redis-sentinel-master", "mymaster".to_owned()),
            ("redis-sentinel-nodes", "s1:26379".to_owned()),
            ("redis-sentinel-nodes", "s2:26379".to_owned()),
            ("redis-url", "redis://:pw@mymaster".to_owned()),
        ]
    );
    let (flags, warnings) = translate(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "m")]);
    assert!(flags.is_empty());
    assert!(
        warnings[0].contains("master_name,host:port"),
        "{warnings:?}"
    );
}

#[test]
fn listen_addresses_default_the_missing_part() {
    assert_eq!(
        flags(&[
            ("GRPC_PORT", "9081"),
            ("HOST", "127.0.0.1"),
            ("PORT", "9080")
        ]),
        vec![
            ("grpc-addr", "0.0.0.0:9081".to_owned()),
            ("http-addr", "127.0.0.1:9080".to_owned()),
        ]
    );
    assert_eq!(
        flags(&[("GRPC_HOST", "::1")]),
        one("grpc-addr", "[::1]:8081")
    );
}

#[test]
fn runtime_directories_make_the_config_path() {
    assert_eq!(
        flags(&[
            ("RUNTIME_ROOT", "/data"),
            ("RUNTIME_SUBDIRECTORY", "ratelimit")
        ]),
        one("config", "/data/ratelimit/config")
    );
    assert_eq!(
        flags(&[
            ("RUNTIME_SUBDIRECTORY", "rl"),
            ("RUNTIME_APPDIRECTORY", "rules"),
        ]),
        one("config", "/srv/runtime_data/current/rl/rules")
    );
}

#[test]
fn switches_and_values_carry_over() {
    assert_eq!(
        flags(&[
            ("SHADOW_MODE", "True"),
            ("LIMIT_RESPONSE_HEADERS_ENABLED", "false"),
            ("LOG_FORMAT", "JSON"),
            ("CACHE_KEY_PREFIX", "rl_"),
            ("NEAR_LIMIT_RATIO", "0.9"),
            ("REDIS_POOL_SIZE", "20"),
        ])
        .into_iter()
        .collect::<std::collections::BTreeSet<_>>(),
        [
            ("shadow-mode", "true"),
            ("response-headers", "off"),
            ("log-format", "json"),
            ("redis-key-prefix", "rl_"),
            ("near-limit-ratio", "0.9"),
            ("redis-pool-size", "20"),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.to_owned()))
        .collect()
    );
}

#[test]
fn unsupported_variables_are_named_in_one_warning() {
    let (flags, warnings) = translate(&[
        ("USE_DOG_STATSD_MOGRIFIERS", "m"),
        ("DEBUG_PORT", "6070"),
        ("REDIS_PERSECOND_URL", "x:1"),
        ("MEMCACHE_HOST_PORT", "m:11211"),
        ("BACKEND_TYPE", "memcache"),
        ("PATH", "/usr/bin"),
    ]);
    assert!(flags.is_empty());
    assert_eq!(
        warnings,
        vec![
            "envoyproxy/ratelimit variables not supported, ignored: BACKEND_TYPE, \
                 DEBUG_PORT, MEMCACHE_HOST_PORT, REDIS_PERSECOND_URL, USE_DOG_STATSD_MOGRIFIERS"
                .to_owned()
        ]
    );
}

#[test]
fn what_we_do_anyway_is_not_warned_about() {
    assert_eq!(
        translate(&[("BACKEND_TYPE", "redis"), ("CONFIG_TYPE", "FILE")]),
        (vec![], vec![])
    );
    assert_eq!(
        translate(&[
            ("RUNTIME_IGNOREDOTFILES", "true"),
            ("RUNTIME_WATCH_ROOT", "false"),
        ]),
        (vec![], vec![])
    );
    let (_, warnings) = translate(&[("RUNTIME_IGNOREDOTFILES", "false")]);
    assert_eq!(warnings.len(), 1, "{warnings:?}");
}

#[test]
fn a_redis_that_cannot_be_used_is_refused() {
    let sentinel = refused(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "redis:6379")]);
    assert_eq!(sentinel.len(), 1, "{sentinel:?}");
    assert!(sentinel[0].starts_with("REDIS_URL=redis:6379 with REDIS_TYPE=sentinel"));
    assert_eq!(
        refused(&[("REDIS_TYPE", "ring"), ("REDIS_URL", "r:1")]).len(),
        1
    );
    assert!(refused(&[("REDIS_TYPE", "sentinel"), ("REDIS_URL", "m,s:1")]).is_empty());
    assert!(refused(&[("REDIS_URL", "r:1")]).is_empty());
}

#[test]
fn values_that_cannot_be_used_are_warned_about() {
    let (flags, warnings) = translate(&[
        ("REDIS_TYPE", "ring"),
        ("REDIS_URL", "r:1"),
        ("LOG_FORMAT", "xml"),
        ("SHADOW_MODE", "yes"),
    ]);
    assert!(flags.is_empty());
    assert_eq!(warnings.len(), 3, "{warnings:?}");
}

#[test]
fn server_tls_variables_become_the_tls_flags() {
    let vars = [
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
        ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
        ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.pem"),
        ("GRPC_CLIENT_TLS_SAN", "envoy.internal"),
    ];
    assert_eq!(
        flags(&vars),
        vec![
            ("tls-cert", "/tls/cert.pem".to_owned()),
            ("tls-key", "/tls/key.pem".to_owned()),
            ("tls-client-ca", "/tls/ca.pem".to_owned()),
            ("tls-client-san", "envoy.internal".to_owned()),
            ("http-tls", "off".to_owned()),
        ]
    );
    assert!(refused(&vars).is_empty());
}

#[test]
fn server_tls_that_cannot_be_honoured_is_refused() {
    assert_eq!(
        refused(&[("GRPC_SERVER_USE_TLS", "true")]),
        [
            "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_CERT",
            "GRPC_SERVER_USE_TLS=true needs GRPC_SERVER_TLS_KEY",
        ]
    );
    assert_eq!(
        refused(&[("GRPC_SERVER_USE_TLS", "yes")]),
        ["GRPC_SERVER_USE_TLS=yes is not a boolean"]
    );
    let ignored = refused(&[
        ("GRPC_CLIENT_TLS_SAN", "envoy"),
        ("GRPC_CLIENT_TLS_CACERT", "/ca.pem"),
    ]);
    assert_eq!(ignored.len(), 1, "{ignored:?}");
    assert!(
        ignored[0].starts_with("GRPC_CLIENT_TLS_CACERT, GRPC_CLIENT_TLS_SAN set without"),
        "{ignored:?}"
    );
    // Without GRPC_SERVER_USE_TLS=true nothing becomes a TLS flag.
    assert_eq!(
        translate(&[("GRPC_SERVER_TLS_CERT", "/c.pem")]).0,
        Vec::<FlagValue>::new()
    );
    assert!(refused(&[("GRPC_SERVER_USE_TLS", "false")]).is_empty());
}

#[test]
fn redis_tls_variables_become_the_redis_tls_flags() {
    assert_eq!(
        flags(&[
            ("REDIS_TLS_CACERT", "/r/ca.pem"),
            ("REDIS_TLS_CLIENT_CERT", "/r/cert.pem"),
            ("REDIS_TLS_CLIENT_KEY", "/r/key.pem"),
            ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
        ]),
        vec![
            ("redis-tls-ca", "/r/ca.pem".to_owned()),
            ("redis-tls-cert", "/r/cert.pem".to_owned()),
            ("redis-tls-key", "/r/key.pem".to_owned()),
            ("redis-tls-skip-hostname-verification", "true".to_owned()),
        ]
    );
    assert_eq!(
        flags(&[("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "false")]),
        vec![]
    );
}

#[test]
fn tracing_variables_become_the_tracing_flags() {
    assert_eq!(
        flags(&[
            ("TRACING_ENABLED", "true"),
            ("TRACING_EXPORTER_PROTOCOL", "GRPC"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317"),
            ("TRACING_SAMPLING_RATE", "0.25"),
            ("TRACING_SERVICE_NAME", "rl"),
            ("TRACING_SERVICE_NAMESPACE", "gateway"),
            ("TRACING_SERVICE_INSTANCE_ID", "pod-1"),
        ]),
        vec![
            ("tracing", "on".to_owned()),
            ("tracing-protocol", "grpc".to_owned()),
            ("tracing-endpoint", "http://otel:4317".to_owned()),
            ("tracing-sampling-rate", "0.25".to_owned()),
            ("tracing-service-name", "rl".to_owned()),
            ("tracing-service-namespace", "gateway".to_owned()),
            ("tracing-service-instance-id", "pod-1".to_owned()),
        ]
    );
    // Their default service name when tracing is on without one.
    assert_eq!(
        flags(&[("TRACING_ENABLED", "1")]),
        vec![
            ("tracing", "on".to_owned()),
            ("tracing-service-name", "RateLimit".to_owned()),
        ]
    );
    assert_eq!(
        flags(&[("TRACING_ENABLED", "false")]),
        one("tracing", "off")
    );
    let (flags, warnings) = translate(&[
        ("TRACING_ENABLED", "yes"),
        ("TRACING_EXPORTER_PROTOCOL", "zipkin"),
        ("TRACING_OTHER", "x"),
    ]);
    assert!(flags.is_empty(), "{flags:?}");
    assert_eq!(
        warnings,
        [
            "envoyproxy/ratelimit variables not supported, ignored: TRACING_OTHER",
            "TRACING_ENABLED=yes is not a boolean; tracing stays off",
            "TRACING_EXPORTER_PROTOCOL=zipkin is neither http nor grpc",
        ]
    );
}

#[test]
fn log_levels_map_to_filters() {
    assert_eq!(log_filter("DEBUG"), Some("debug"));
    assert_eq!(log_filter("warning"), Some("warn"));
    assert_eq!(log_filter("fatal"), Some("error"));
    assert_eq!(log_filter("loud"), None);
}
