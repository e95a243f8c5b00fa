//! The binary started as an envoyproxy/ratelimit deployment starts it: no
//! flags, only their environment variables.

use crate::support::process::{ServiceProcess, free_addr, http_get, spawn_with_env};
use crate::support::redis::RedisServer;
use crate::support::service::one_entry_request;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;

const CONFIG: &str = r#"
domain: migrated
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

/// A runtime root holding `ratelimit/config/config.yaml`, as their
/// RUNTIME_ROOT=<root> RUNTIME_SUBDIRECTORY=ratelimit reads it.
fn runtime_root() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("create a temporary directory");
    let config = root.path().join("ratelimit").join("config");
    std::fs::create_dir_all(&config).expect("create the config directory");
    std::fs::write(config.join("config.yaml"), CONFIG).expect("write the config");
    root
}

/// The overall codes of two decisions on the same descriptor.
async fn two_decisions(process: &mut ServiceProcess, user: &str) -> (Code, Code) {
    let mut client = process.client().await;
    let mut codes = Vec::new();
    for _ in 0..2 {
        let response = client
            .should_rate_limit(one_entry_request("migrated", "user", user))
            .await
            .unwrap_or_else(|err| panic!("decision failed: {err}\n{}", process.log()))
            .into_inner();
        codes.push(Code::try_from(response.overall_code).expect("known code"));
    }
    (codes[0], codes[1])
}

#[tokio::test]
async fn their_environment_alone_configures_ports_config_and_logging() {
    let root = runtime_root();
    let root_path = root.path().display().to_string();
    let grpc = free_addr();
    let http = free_addr();
    let grpc_port = grpc.port().to_string();
    let http_port = http.port().to_string();
    let mut process = spawn_with_env(
        &[
            ("RUNTIME_ROOT", &root_path),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("GRPC_PORT", &grpc_port),
            ("PORT", &http_port),
            ("USE_STATSD", "false"),
            ("DEBUG_PORT", "6070"),
            ("LOG_LEVEL", "debug"),
        ],
        grpc,
        http,
    );

    assert_eq!(
        two_decisions(&mut process, "alice").await,
        (Code::Ok, Code::OverLimit),
        "the config under RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config applies"
    );
    let health = http_get(http, "/healthcheck").await;
    assert!(
        health.starts_with("HTTP/1.1 200"),
        "PORT is the HTTP port: {health}"
    );

    let log = process.log();
    assert!(
        log.lines().any(|it| it.contains(" DEBUG ")),
        "LOG_LEVEL=debug logs at debug level:\n{log}"
    );
    let warnings: Vec<&str> = log
        .lines()
        .filter(|it| it.contains("not supported"))
        .collect();
    assert_eq!(warnings.len(), 1, "one warning line:\n{log}");
    assert!(
        warnings[0].contains("DEBUG_PORT") && !warnings[0].contains("USE_STATSD"),
        "the warning names DEBUG_PORT, and not USE_STATSD (honoured): {}",
        warnings[0]
    );
    assert!(!warnings[0].contains("GRPC_PORT"), "{}", warnings[0]);
}

#[tokio::test]
async fn our_variables_win_over_theirs() {
    let root = runtime_root();
    let root_path = root.path().display().to_string();
    let grpc = free_addr();
    let http = free_addr();
    let theirs = free_addr();
    let mut process = spawn_with_env(
        &[
            ("RUNTIME_ROOT", &root_path),
            ("RUNTIME_SUBDIRECTORY", "ratelimit"),
            ("GRPC_PORT", &theirs.port().to_string()),
            ("THROTTLEGATE_GRPC_ADDR", &grpc.to_string()),
            ("THROTTLEGATE_HTTP_ADDR", &http.to_string()),
        ],
        grpc,
        http,
    );
    assert_eq!(
        two_decisions(&mut process, "bob").await,
        (Code::Ok, Code::OverLimit)
    );
    assert!(
        tokio::net::TcpStream::connect(theirs).await.is_err(),
        "nothing listens on GRPC_PORT when THROTTLEGATE_GRPC_ADDR is set"
    );
}

#[tokio::test]
async fn redis_host_and_port_keep_decisions_in_redis() {
    let redis = RedisServer::start();
    let redis_url = format!("127.0.0.1:{}", redis.port());
    let root = runtime_root();
    let root_path = root.path().display().to_string();
    let spawn = || {
        let grpc = free_addr();
        let http = free_addr();
        spawn_with_env(
            &[
                ("RUNTIME_ROOT", &root_path),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("GRPC_PORT", &grpc.port().to_string()),
                ("PORT", &http.port().to_string()),
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", &redis_url),
                ("CACHE_KEY_PREFIX", "migrated_"),
                ("USE_STATSD", "false"),
                ("DEBUG_PORT", "6070"),
            ],
            grpc,
            http,
        )
    };
    let mut first = spawn();
    assert_eq!(
        two_decisions(&mut first, "carol").await,
        (Code::Ok, Code::OverLimit)
    );
    let keys = redis.keys("*").await;
    assert!(!keys.is_empty(), "no key in Redis:\n{}", first.log());
    assert!(
        keys.iter().all(|it| it.starts_with("migrated_")),
        "CACHE_KEY_PREFIX prefixes every key: {keys:?}"
    );

    // A second instance on the same Redis sees the count the first kept.
    let mut second = spawn();
    assert_eq!(
        two_decisions(&mut second, "carol").await,
        (Code::OverLimit, Code::OverLimit),
        "{}",
        second.log()
    );
    let log = second.stop().await;
    assert!(log.contains("DEBUG_PORT"), "{log}");
}

/// docs/migrating.md names every variable the service translates and every
/// one it warns about.
#[test]
fn the_migration_guide_names_every_variable() {
    use throttlegate::compat::{TRANSLATED, TRANSLATED_XDS, UNSUPPORTED, UNSUPPORTED_PREFIXES};
    let guide = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/migrating.md"),
    )
    .expect("read docs/migrating.md");
    for name in TRANSLATED.iter().chain(TRANSLATED_XDS).chain(UNSUPPORTED) {
        assert!(
            guide.contains(&format!("`{name}")),
            "{name} is not in the guide"
        );
    }
    for prefix in UNSUPPORTED_PREFIXES {
        assert!(
            guide.contains(&format!("`{prefix}")),
            "{prefix} is not in the guide"
        );
    }
}
