//! FCALL or EVALSHA, settled per command on a single server: a server
//! that refuses FCALL (ACL, renamed away) is decided with EVALSHA, one that
//! refuses FUNCTION but holds the library already with FCALL; and the
//! libraries other versions of the service left behind are shown in
//! `/rlconfig` until they are deleted.

use crate::support::keys::check_on;
use crate::support::process::{Serve, http_get};
use crate::support::redis::{
    RedisServer, backend_with, command_stat, command_stats, library_loaded, load_library,
    reset_stats, user_without,
};
use redis::aio::MultiplexedConnection;
use throttlegate::algorithms::Algorithm::FixedWindow;
use throttlegate::backends::redis::{ClockSource, RedisBackend, script};
use throttlegate::backends::{Backend, KeyedCheck};

const CONFIG: &str = r#"
domain: engines
descriptors:
  - key: u
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

async fn backend_at(server: &RedisServer, url: String) -> RedisBackend {
    backend_with(server, ClockSource::Redis, |it| it.url = url).await
}

async fn calls(conn: &mut MultiplexedConnection, command: &str) -> f64 {
    let stats = command_stats(conn).await;
    command_stat(&stats, command, "calls").unwrap_or(0.0)
}

/// Three requests on a limit of 2: allowed, allowed, denied (so each was
/// decided, and counted once).
async fn three_decisions(backend: &RedisBackend) {
    let checks: Vec<KeyedCheck> = vec![check_on(FixedWindow, 60, &[("u", "a")], 2, 1)];
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(backend.decide(&checks).await.expect("decided").allowed);
    }
    assert_eq!(answers, [true, true, false]);
}

/// FUNCTION allowed, FCALL refused by ACL: EVALSHA decides.
#[tokio::test]
async fn fcall_refused_by_acl_is_decided_with_evalsha() {
    let server = RedisServer::start();
    let url = user_without(&server, "-fcall").await;
    let backend = backend_at(&server, url).await;
    let mut admin = server.connection().await;
    reset_stats(&mut admin).await;
    three_decisions(&backend).await;
    assert_eq!(calls(&mut admin, "fcall").await, 0.0);
    // Three decisions, and the first EVALSHA that met NOSCRIPT.
    assert_eq!(calls(&mut admin, "evalsha").await, 4.0);
}

/// FUNCTION allowed, FCALL renamed away: EVALSHA decides.
#[tokio::test]
async fn fcall_renamed_away_is_decided_with_evalsha() {
    let server = RedisServer::start_with(&["--rename-command", "FCALL", ""]);
    let backend = backend_at(&server, server.url()).await;
    let mut admin = server.connection().await;
    reset_stats(&mut admin).await;
    three_decisions(&backend).await;
    assert_eq!(calls(&mut admin, "evalsha").await, 4.0);
}

/// FUNCTION refused by ACL, the library loaded already (by an operator or
/// an earlier version of the same code): FCALL decides, nothing loads.
#[tokio::test]
async fn function_refused_with_the_library_present_is_decided_with_fcall() {
    let server = RedisServer::start();
    let mut admin = server.connection().await;
    load_library(&mut admin).await;
    let url = user_without(&server, "-function").await;
    let backend = backend_at(&server, url).await;
    reset_stats(&mut admin).await;
    three_decisions(&backend).await;
    assert_eq!(calls(&mut admin, "fcall").await, 3.0);
    assert_eq!(calls(&mut admin, "evalsha").await, 0.0);
    assert_eq!(calls(&mut admin, "eval").await, 0.0);
}

/// FUNCTION refused by ACL and no library: the one FCALL that finds no
/// function, then EVALSHA.
#[tokio::test]
async fn function_refused_without_the_library_is_decided_with_evalsha() {
    let server = RedisServer::start();
    let url = user_without(&server, "-function").await;
    let backend = backend_at(&server, url).await;
    let mut admin = server.connection().await;
    reset_stats(&mut admin).await;
    three_decisions(&backend).await;
    assert!(!library_loaded(&server, &script::library().name).await);
    assert_eq!(calls(&mut admin, "fcall").await, 1.0);
    assert_eq!(calls(&mut admin, "evalsha").await, 4.0);
}

/// A library of the kind another version of the service loads.
async fn load_old_library(conn: &mut MultiplexedConnection, digest: &str) -> String {
    let name = format!("throttlegate_{digest}");
    let source = format!(
        "#!lua name={name}\n\
         redis.register_function('throttlegate_decide_{digest}', function() return 1 end)\n"
    );
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg(source)
        .query_async(conn)
        .await
        .expect("FUNCTION LOAD");
    name
}

/// Libraries of other versions are named in `/rlconfig` (with how to
/// remove them), this version's and other code's are not; once deleted,
/// they are no longer shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libraries_of_other_versions_are_shown_in_rlconfig_until_deleted() {
    let server = RedisServer::start();
    let mut admin = server.connection().await;
    let old = load_old_library(&mut admin, "0123456789ab").await;
    let _: String = redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("#!lua name=someone_else\nredis.register_function('other', function() return 1 end)\n")
        .query_async(&mut admin)
        .await
        .expect("FUNCTION LOAD");
    let mut service = Serve::yaml(CONFIG)
        .args(&["--redis-url", &server.url()])
        .spawn();
    service.connect().await;
    let ours = &script::library().name;
    let text = http_get(service.http, "/rlconfig").await;
    let line = text
        .lines()
        .find(|it| it.contains("other throttlegate versions"))
        .unwrap_or_else(|| panic!("no line about other versions in\n{text}"));
    assert!(line.contains(&old), "{line}");
    assert!(line.contains("FUNCTION DELETE"), "{line}");
    assert!(!line.contains("someone_else"), "{line}");
    assert!(
        !line
            .replace(&format!("this version's: {ours}"), "")
            .contains(ours.as_str()),
        "{line}"
    );

    let () = redis::cmd("FUNCTION")
        .arg("DELETE")
        .arg(&old)
        .query_async(&mut admin)
        .await
        .expect("FUNCTION DELETE");
    let text = http_get(service.http, "/rlconfig").await;
    assert!(!text.contains("other throttlegate versions"), "{text}");
}

/// The backend's own view of the same: nothing to note without other
/// versions' libraries.
#[tokio::test]
async fn without_other_versions_there_is_nothing_to_note() {
    let server = RedisServer::start();
    let backend = backend_at(&server, server.url()).await;
    three_decisions(&backend).await;
    assert!(library_loaded(&server, &script::library().name).await);
    assert_eq!(backend.notes().await, Vec::<String>::new());
}
