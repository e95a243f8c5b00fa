use std::collections::HashMap;
use std::ffi::OsString;

use clap::{CommandFactory, FromArgMatches};

use super::traces::parse_sampling_rate;
use super::*;
use crate::cli::envoyproxy_defaults::{compat_flags, with_defaults};
use crate::cli::{Cli, Command};
use crate::metrics::statsd::{StatsdProtocol, TagFormat};
use crate::traces::OtlpProtocol;
use crate::xds::{XdsServerAddress, XdsTls};

fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn serve_args(pairs: &[(&str, &str)], argv: &[&str]) -> ServeArgs {
    let argv: Vec<OsString> = argv.iter().map(OsString::from).collect();
    let (flags, warnings) = compat_flags(&vars(pairs), &argv);
    assert!(warnings.is_empty(), "{warnings:?}");
    let matches = with_defaults(Cli::command(), &flags, true)
        .try_get_matches_from(argv)
        .expect("parses");
    let cli = Cli::from_arg_matches(&matches).expect("arguments");
    match cli.command {
        Some(Command::Serve(args)) => *args,
        None => cli.serve,
        Some(
            Command::CheckConfig(_)
            | Command::Simulate(_)
            | Command::PrintLua(_)
            | Command::Check(_),
        ) => {
            panic!("not serve")
        }
    }
}

/// Every flag the translation can name exists and takes its value,
/// with or without the `serve` subcommand.
#[test]
fn translated_variables_become_serve_defaults() {
    let env = [
        ("REDIS_TYPE", "cluster"),
        ("REDIS_URL", "a:7000,b:7001"),
        ("REDIS_POOL_SIZE", "20"),
        ("GRPC_PORT", "9081"),
        ("HOST", "127.0.0.1"),
        ("LOG_FORMAT", "json"),
        ("SHADOW_MODE", "true"),
        ("MERGE_DOMAIN_CONFIG", "true"),
        ("CACHE_KEY_PREFIX", "rl_"),
        ("NEAR_LIMIT_RATIO", "0.5"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "false"),
        ("LIMIT_REMAINING_HEADER", "X-Left"),
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "rl"),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
        ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
        ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.pem"),
        ("GRPC_CLIENT_TLS_SAN", "envoy"),
        ("REDIS_TLS_CACERT", "/r/ca.pem"),
        ("REDIS_TLS_CLIENT_CERT", "/r/cert.pem"),
        ("REDIS_TLS_CLIENT_KEY", "/r/key.pem"),
        ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
    ];
    for argv in [&["throttlegate"][..], &["throttlegate", "serve"]] {
        let args = serve_args(&env, argv);
        assert_eq!(args.redis_cluster_nodes, ["a:7000", "b:7001"]);
        assert_eq!(args.redis_url, None);
        assert_eq!(args.redis_pool_size, 20);
        assert_eq!(args.grpc_addr.to_string(), "0.0.0.0:9081");
        assert_eq!(args.http_addr.to_string(), "127.0.0.1:8080");
        assert_eq!(args.log_format, LogFormat::Json);
        assert!(args.shadow_mode);
        assert!(args.config_options.merge_domains);
        assert_eq!(args.redis_key_prefix, "rl_");
        assert_eq!(args.near_limit_ratio, NearLimitRatio::new(0.5).unwrap());
        assert_eq!(args.response_headers, Switch::Off);
        assert_eq!(args.remaining_header, "X-Left");
        assert_eq!(args.config, Some(PathBuf::from("/data/rl/config")));
        assert_eq!(args.tls_cert, Some(PathBuf::from("/tls/cert.pem")));
        assert_eq!(args.tls_key, Some(PathBuf::from("/tls/key.pem")));
        assert_eq!(args.tls_client_ca, Some(PathBuf::from("/tls/ca.pem")));
        assert_eq!(args.tls_client_san.as_deref(), Some("envoy"));
        assert_eq!(args.redis_tls_ca, Some(PathBuf::from("/r/ca.pem")));
        assert_eq!(args.redis_tls_cert, Some(PathBuf::from("/r/cert.pem")));
        assert_eq!(args.redis_tls_key, Some(PathBuf::from("/r/key.pem")));
        assert!(args.redis_tls_skip_hostname_verification);
        assert!(!args.redis_tls_insecure);
    }
}

/// Envoy Gateway's variables for rules over xDS become the xDS flags,
/// and its runtime directory no config path.
#[test]
fn xds_variables_become_the_xds_settings() {
    let env = [
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "a=1,b=2"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ];
    let mut args = serve_args(&env, &["throttlegate"]);
    assert_eq!(args.config, None);
    let xds = xds_flags(std::mem::take(&mut args.xds))
        .unwrap()
        .expect("rules over xds");
    assert!(xds.force_start);
    let settings = xds.settings;
    assert_eq!(
        settings.server,
        XdsServerAddress::parse("envoy-gateway:18001").unwrap()
    );
    assert_eq!(settings.node_id, "envoy-ratelimit");
    assert_eq!(
        settings.node_metadata,
        [
            ("a".to_owned(), "1".to_owned()),
            ("b".to_owned(), "2".to_owned())
        ]
    );
    assert_eq!(settings.retry_interval, Duration::from_secs(3));
    assert_eq!(
        settings.tls,
        Some(XdsTls {
            ca: Some(PathBuf::from("/certs/ca.crt")),
            cert: Some(PathBuf::from("/certs/tls.crt")),
            key: Some(PathBuf::from("/certs/tls.key")),
            server_name: None,
        })
    );
    let plain = serve_args(&[], &["throttlegate"]);
    assert!(xds_flags(plain.xds).unwrap().is_none());
}

#[test]
fn flags_on_the_command_line_win() {
    let args = serve_args(
        &[
            ("REDIS_URL", "r:6379"),
            ("GRPC_PORT", "9081"),
            ("REDIS_POOL_SIZE", "20"),
        ],
        &[
            "throttlegate",
            "--redis-cluster-nodes=a:1",
            "--grpc-addr",
            "127.0.0.1:7000",
        ],
    );
    assert_eq!(args.redis_url, None, "REDIS_URL yields to cluster nodes");
    assert_eq!(args.redis_cluster_nodes, ["a:1"]);
    assert_eq!(args.grpc_addr.to_string(), "127.0.0.1:7000");
    assert_eq!(args.redis_pool_size, 20);
}

/// envoyproxy/ratelimit's statistics variables reach the flags.
#[test]
fn statistics_variables_become_serve_defaults() {
    let args = serve_args(
        &[
            ("USE_PROMETHEUS", "true"),
            ("PROMETHEUS_ADDR", ":19001"),
            ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml"),
            ("USE_STATSD", "true"),
            ("STATSD_HOST", "exporter"),
            ("STATSD_PORT", "9125"),
            ("EXTRA_TAGS", "env:prod,team:edge"),
            ("STATS_FLUSH_INTERVAL", "2s"),
        ],
        &["throttlegate"],
    );
    let settings = ratelimit_stats_settings(args.ratelimit_stats);
    let prometheus = settings.prometheus.expect("on");
    assert_eq!(prometheus.addr.to_string(), "0.0.0.0:19001");
    assert_eq!(prometheus.path, "/metrics");
    assert_eq!(
        prometheus.mapping,
        Some(PathBuf::from("/etc/statsd-exporter/conf.yaml"))
    );
    let statsd = settings.statsd.expect("on");
    assert_eq!(statsd.addr, "exporter:9125");
    assert_eq!(statsd.protocol, StatsdProtocol::Tcp);
    assert_eq!(statsd.flush_interval, Duration::from_secs(2));
    assert_eq!(
        statsd.tags,
        [
            ("env".to_owned(), "prod".to_owned()),
            ("team".to_owned(), "edge".to_owned())
        ]
    );
    assert_eq!(statsd.tag_format, TagFormat::Name);
    let args = serve_args(&[("USE_DOG_STATSD", "true")], &["throttlegate", "serve"]);
    let statsd = ratelimit_stats_settings(args.ratelimit_stats)
        .statsd
        .expect("on");
    assert_eq!(statsd.addr, "localhost:8125");
    assert_eq!(statsd.protocol, StatsdProtocol::Udp);
    assert_eq!(statsd.tag_format, TagFormat::DogStatsd);
}

/// Tracing is off unless asked for; their variables turn it on, and
/// the endpoint's default follows the protocol.
#[test]
fn tracing_flags_and_variables_become_trace_settings() {
    assert_eq!(
        trace_settings(serve_args(&[], &["throttlegate"]).traces),
        None
    );
    let on = trace_settings(
        serve_args(
            &[
                ("TRACING_ENABLED", "true"),
                ("TRACING_EXPORTER_PROTOCOL", "grpc"),
            ],
            &["throttlegate"],
        )
        .traces,
    )
    .expect("tracing on");
    assert_eq!(on.endpoint, "http://localhost:4317");
    assert_eq!(on.protocol, OtlpProtocol::Grpc);
    assert_eq!(on.service_name, "RateLimit");
    assert_eq!(on.sampling_rate, 1.0);
    let http = trace_settings(
        serve_args(
            &[("TRACING_SAMPLING_RATE", "0.01")],
            &["throttlegate", "--tracing", "on"],
        )
        .traces,
    )
    .expect("tracing on");
    assert_eq!(http.endpoint, "http://localhost:4318");
    assert_eq!(http.service_name, "throttlegate");
    assert_eq!(http.sampling_rate, 0.01);
    assert!(parse_sampling_rate("1.5").is_err());
    assert!(parse_sampling_rate("-0.1").is_err());
}

#[test]
fn without_their_variables_our_defaults_stand() {
    let args = serve_args(&[], &["throttlegate"]);
    assert_eq!(args.grpc_addr.to_string(), "0.0.0.0:8081");
    assert_eq!(args.redis_key_prefix, "throttlegate");
    assert!(!args.shadow_mode);
    let stats = ratelimit_stats_settings(args.ratelimit_stats);
    assert!(stats.prometheus.is_none() && stats.statsd.is_none());
}
