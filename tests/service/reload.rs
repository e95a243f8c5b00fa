//! Hot reload against the real server: file edits, ConfigMap symlink swaps, polling, SIGHUP, counters.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support;
use crate::support::process::{ServiceProcess, http_get};
use crate::support::service::{TestService, default_options, memory_backend, start_service};
use throttlegate::config;
use throttlegate::config::reload::{POLL_EVERY, ReloadGuard, Reloader};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitRequest;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

type Client = RateLimitServiceClient<tonic::transport::Channel>;

/// The bound a changed config must be in force within.
const WITHIN: Duration = Duration::from_secs(2);

/// Every request of user alice is denied.
const BLOCKED: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 0}\n";
/// Every request of user alice is allowed.
const OPEN: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n";
/// Refused: a misspelled key.
const BAD: &str = "domain: api\ndescriptors:\n  - key: user\n    ratelimit: {unit: minute, requests_per_unit: 1000}\n";

use crate::support::config::load_options as options;

/// A server whose rules come from `path`, and a reloader on them (no
/// trigger yet) counting into the server's metrics, as `serve` wires it.
async fn start(path: &Path) -> (TestService, Arc<Reloader>) {
    let rules = config::load(path, &options())
        .unwrap_or_else(|err| panic!("{err:#}"))
        .rules;
    let (backend, _clock) = memory_backend();
    let service = start_service(rules, backend, default_options()).await;
    let metrics = service.limiter.metrics().clone();
    let reloader = Arc::new(
        Reloader::new(
            path.to_path_buf(),
            options(),
            service.limiter.rules().clone(),
        )
        .with_observer(move |ok| metrics.record_reload(ok)),
    );
    (service, reloader)
}

/// [`start`] with the reloader watching the config: the service, the
/// watch (it ends when dropped), and a client.
async fn start_watching(path: &Path) -> (TestService, ReloadGuard, Client) {
    let (service, reloader) = start(path).await;
    let watch = reloader.spawn_watcher();
    let client = service.client();
    (service, watch, client)
}

/// `config.yaml` in a directory of its own, holding [`BLOCKED`].
fn blocked_file() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, BLOCKED).unwrap();
    (dir, path)
}

/// Reloads so far, by result, as `throttlegate_config_reloads_total`
/// exposes them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Reloads {
    ok: u64,
    error: u64,
}

fn reloads_of(service: &TestService) -> Reloads {
    let text = service.limiter.metrics().encode();
    let count = |result: &str| {
        let series = format!("throttlegate_config_reloads_total{{result=\"{result}\"}} ");
        text.lines()
            .find_map(|line| line.strip_prefix(&series))
            .map_or(0, |value| value.trim().parse().expect("a counter value"))
    };
    Reloads {
        ok: count("ok"),
        error: count("error"),
    }
}

fn alice() -> RateLimitRequest {
    support::service::one_entry_request("api", "user", "alice")
}

async fn code(client: &mut Client) -> Code {
    let res = client.should_rate_limit(alice()).await.expect("rpc");
    res.into_inner().overall_code()
}

/// Polls until alice gets `expected`, panicking if that takes longer than
/// [`WITHIN`] from `since`.
async fn wait_for(client: &mut Client, expected: Code, since: Instant) {
    loop {
        let got = code(client).await;
        if got == expected {
            return;
        }
        assert!(
            since.elapsed() < WITHIN,
            "still {got:?} {:?} after the change, expected {expected:?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `done` holds for the service's reload counters, for at most
/// [`WITHIN`].
async fn wait_for_reloads(service: &TestService, done: impl Fn(Reloads) -> bool) -> Reloads {
    let deadline = Instant::now() + WITHIN;
    loop {
        let reloads = reloads_of(service);
        if done(reloads) {
            return reloads;
        }
        assert!(Instant::now() < deadline, "reloads stuck at {reloads:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Replaces `path` atomically, as most tools that write configs do.
fn replace(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A ConfigMap-style mount: `..<version>/config.yaml`, `..data` pointing
/// at it, `config.yaml` pointing through `..data`.
fn configmap(root: &Path, yaml: &str) {
    std::fs::create_dir(root.join("..v0")).unwrap();
    std::fs::write(root.join("..v0/config.yaml"), yaml).unwrap();
    std::os::unix::fs::symlink("..v0", root.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/config.yaml", root.join("config.yaml")).unwrap();
}

/// What the kubelet does on an update: a new timestamped directory, a new
/// `..data` symlink renamed over the old one, the old directory removed.
fn configmap_swap(root: &Path, from: u32, to: u32, yaml: &str) {
    let new = format!("..v{to}");
    std::fs::create_dir(root.join(&new)).unwrap();
    std::fs::write(root.join(&new).join("config.yaml"), yaml).unwrap();
    std::os::unix::fs::symlink(&new, root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    std::fs::remove_dir_all(root.join(format!("..v{from}"))).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_file_is_in_force_within_2_s() {
    let (_dir, path) = blocked_file();
    let (_service, _watch, mut client) = start_watching(&path).await;
    assert_eq!(code(&mut client).await, Code::OverLimit);

    // Written in place, as an editor saving over the file does.
    std::fs::write(&path, OPEN).unwrap();
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    // Renamed over the file: the watch must follow the new file.
    replace(&path, BLOCKED);
    wait_for(&mut client, Code::OverLimit, Instant::now()).await;
    replace(&path, OPEN);
    wait_for(&mut client, Code::Ok, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_edit_is_refused_and_a_later_good_one_is_taken() {
    let (_dir, path) = blocked_file();
    let (service, _watch, mut client) = start_watching(&path).await;

    replace(&path, BAD);
    let reloads = wait_for_reloads(&service, |it| it.error >= 1).await;
    assert_eq!(reloads.ok, 0, "{reloads:?}");
    assert_eq!(
        code(&mut client).await,
        Code::OverLimit,
        "old rules in force"
    );
    // A refused config sitting there is not retried (nor logged) again and
    // again: only a change reloads.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(
        reloads_of(&service),
        reloads,
        "reloaded with nothing changed"
    );

    replace(&path, OPEN);
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    let reloads = wait_for_reloads(&service, |it| it.ok >= 1).await;
    assert!(reloads.error >= 1, "{reloads:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_directory_swap_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ratelimit");
    std::fs::create_dir(&root).unwrap();
    configmap(&root, BLOCKED);
    let (_service, _watch, mut client) = start_watching(&root).await;
    assert_eq!(code(&mut client).await, Code::OverLimit);

    configmap_swap(&root, 0, 1, OPEN);
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    // And the next one: the watch survives the old directory's removal.
    configmap_swap(&root, 1, 2, BLOCKED);
    wait_for(&mut client, Code::OverLimit, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configmap_file_swap_is_picked_up() {
    let dir = tempfile::tempdir().unwrap();
    configmap(dir.path(), BLOCKED);
    // The file itself, a symlink through `..data`.
    let (_service, _watch, mut client) = start_watching(&dir.path().join("config.yaml")).await;
    assert_eq!(code(&mut client).await, Code::OverLimit);

    configmap_swap(dir.path(), 0, 1, OPEN);
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    configmap_swap(dir.path(), 1, 2, BLOCKED);
    wait_for(&mut client, Code::OverLimit, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_polling_fallback_picks_up_an_edit_within_2_s() {
    let (_dir, path) = blocked_file();
    let (service, reloader) = start(&path).await;
    let _poll = reloader.spawn_poller(POLL_EVERY);
    let mut client = service.client();

    std::fs::write(&path, OPEN).unwrap();
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    // Nothing changed since: polls do not reload again.
    let before = reloads_of(&service);
    tokio::time::sleep(POLL_EVERY * 2).await;
    assert_eq!(reloads_of(&service), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_files_the_loader_reads_trigger_a_reload() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ratelimit");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join("config.yaml"), BLOCKED).unwrap();
    let (service, _watch, mut client) = start_watching(&root).await;

    // Files beside the config that the loader does not read: no reload,
    // not even an unchanged one.
    std::fs::write(root.join("README.md"), "how to edit the limits").unwrap();
    std::fs::write(root.join("config.yaml.orig"), OPEN).unwrap();
    std::fs::write(root.join("notes.txt"), "x").unwrap();
    std::fs::write(root.join("README.md"), "edited again").unwrap();
    // Well past the debounce: a reload would have happened by now.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(reloads_of(&service), Reloads { ok: 0, error: 0 });
    assert_eq!(code(&mut client).await, Code::OverLimit);

    // An edit of the YAML file still reloads.
    std::fs::write(root.join("config.yaml"), OPEN).unwrap();
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    wait_for_reloads(&service, |it| it == Reloads { ok: 1, error: 0 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_counters_count_reloads_by_result() {
    let (_dir, path) = blocked_file();
    let (service, reloader) = start(&path).await;
    assert_eq!(reloads_of(&service), Reloads { ok: 0, error: 0 });
    // Triggers as SIGHUP delivers them in `main`.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    let _triggers = reloader.spawn_on(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut client = service.client();

    std::fs::write(&path, OPEN).unwrap();
    tx.send(()).await.unwrap();
    wait_for_reloads(&service, |it| it == Reloads { ok: 1, error: 0 }).await;
    assert_eq!(code(&mut client).await, Code::Ok);

    std::fs::write(&path, BAD).unwrap();
    tx.send(()).await.unwrap();
    wait_for_reloads(&service, |it| it == Reloads { ok: 1, error: 1 }).await;
    assert_eq!(code(&mut client).await, Code::Ok, "old rules in force");

    std::fs::remove_file(&path).unwrap();
    tx.send(()).await.unwrap();
    wait_for_reloads(&service, |it| it == Reloads { ok: 1, error: 2 }).await;

    std::fs::write(&path, BLOCKED).unwrap();
    tx.send(()).await.unwrap();
    wait_for_reloads(&service, |it| it == Reloads { ok: 2, error: 2 }).await;
    assert_eq!(code(&mut client).await, Code::OverLimit);
}

// === the binary ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_when_the_watcher_is_off() {
    let (_dir, path) = blocked_file();
    let mut server = ServiceProcess::spawn(&path, &["--watch-config", "off"]);
    let mut client = server.client().await;
    assert_eq!(code(&mut client).await, Code::OverLimit);

    std::fs::write(&path, OPEN).unwrap();
    // Longer than a watcher would take: nothing watches.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(code(&mut client).await, Code::OverLimit, "no watcher");
    server.signal("HUP");
    wait_for(&mut client, Code::Ok, Instant::now()).await;

    // SIGHUP with nothing changed: counted and logged, the rules kept.
    server.signal("HUP");
    server
        .wait_for_log("config reloaded, unchanged", WITHIN)
        .await;
    assert_eq!(code(&mut client).await, Code::Ok);

    // A refused config on SIGHUP: logged with its problem, the process
    // lives on with the last good rules.
    std::fs::write(&path, BAD).unwrap();
    server.signal("HUP");
    server.wait_for_log("config refused", WITHIN).await;
    let log = server.log();
    assert!(log.contains("unknown key 'ratelimit'"), "{log}");
    assert!(server.is_running(), "the server exited");
    assert_eq!(code(&mut client).await, Code::Ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_watches_its_config_by_default() {
    let (_dir, path) = blocked_file();
    let mut server = ServiceProcess::spawn(&path, &[]);
    let mut client = server.client().await;
    assert_eq!(code(&mut client).await, Code::OverLimit);
    std::fs::write(&path, OPEN).unwrap();
    wait_for(&mut client, Code::Ok, Instant::now()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rlconfig_names_the_source_the_load_time_and_a_refused_reload() {
    let (_dir, path) = blocked_file();
    let mut server = ServiceProcess::spawn(&path, &["--watch-config", "off"]);
    let mut client = server.client().await;
    const LAST_GOOD: &str = "throttlegate_config_last_success_timestamp_seconds";
    let started = server.metric(LAST_GOOD).await;
    assert!(
        started > 1.7e9,
        "the start-up load is the first good one: {started}"
    );
    let shown = http_get(server.http, "/rlconfig").await;
    assert!(
        shown.contains(&format!("\r\n\r\nsource: {}\nloaded: ", path.display())),
        "{shown}"
    );
    assert!(
        shown.contains("  user  0/minute sliding_window_log\n"),
        "{shown}"
    );
    assert!(!shown.contains("refused"), "{shown}");

    // A refused reload: its error is shown, the rules in force stay.
    std::fs::write(&path, BAD).unwrap();
    server.signal("HUP");
    server.wait_for_log("config refused", WITHIN).await;
    let shown = http_get(server.http, "/rlconfig").await;
    assert!(shown.contains("last reload refused: "), "{shown}");
    assert!(shown.contains("unknown key 'ratelimit'"), "{shown}");
    assert!(
        shown.contains("  user  0/minute sliding_window_log\n"),
        "{shown}"
    );
    assert_eq!(
        code(&mut client).await,
        Code::OverLimit,
        "the last good rules"
    );
    assert_eq!(
        server.metric(LAST_GOOD).await,
        started,
        "a refused load is not good"
    );

    // A good reload clears it.
    let before_reload = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as f64;
    std::fs::write(&path, OPEN).unwrap();
    server.signal("HUP");
    wait_for(&mut client, Code::Ok, Instant::now()).await;
    let shown = http_get(server.http, "/rlconfig").await;
    assert!(!shown.contains("refused"), "{shown}");
    assert!(
        shown.contains("  user  1000/minute sliding_window_log\n"),
        "{shown}"
    );
    let reloaded = server.metric(LAST_GOOD).await;
    assert!(
        reloaded >= before_reload,
        "the good reload: {reloaded} < {before_reload}"
    );
}
