use super::*;

const ONE: &str =
    "domain: one\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
const TWO: &str =
    "domain: two\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n";
const BAD: &str =
    "domain: two\ndescriptors:\n  - key: k\n    ratelimit: {unit: second, requests_per_unit: 2}\n";

use crate::testing::load_options as options;

/// A reloader on `dir/config.yaml` holding `yaml`, loaded.
fn reloader(dir: &Path, yaml: &str) -> Reloader {
    let path = dir.join("config.yaml");
    std::fs::write(&path, yaml).unwrap();
    let rules = config::load(&path, &options()).unwrap().rules;
    Reloader::new(path, options(), Arc::new(ArcSwap::from_pointee(rules)))
}

/// The results `reloader` reports to its observer, in order.
fn heard(reloader: Reloader) -> (Reloader, Arc<Mutex<Vec<bool>>>) {
    let heard = Arc::new(Mutex::new(Vec::new()));
    let hearing = heard.clone();
    let reloader = reloader.with_observer(move |ok| hearing.lock().unwrap().push(ok));
    (reloader, heard)
}

fn domains(reloader: &Reloader) -> Vec<String> {
    let rules = reloader.rules().load();
    rules.domains().map(|it| it.name().to_string()).collect()
}

#[test]
fn a_valid_config_is_swapped_in_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (reloader, heard) = heard(reloader(dir.path(), ONE));
    std::fs::write(reloader.path(), TWO).unwrap();
    let summary = reloader.reload_now().unwrap();
    assert_eq!(
        (summary.domains, summary.files, summary.changed),
        (1, 1, true)
    );
    assert_eq!(domains(&reloader), ["two"]);
    assert_eq!(*heard.lock().unwrap(), [true]);
}

#[test]
fn a_refused_config_leaves_the_last_good_one_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (reloader, heard) = heard(reloader(dir.path(), ONE));
    let before = reloader.rules().load_full();
    std::fs::write(reloader.path(), BAD).unwrap();
    let err = reloader.reload_now().unwrap_err();
    assert_eq!(err.problems.len(), 1, "{err:#}");
    assert!(
        err.problems[0].message.contains("unknown key 'ratelimit'"),
        "{err:#}"
    );
    assert!(Arc::ptr_eq(&before, &reloader.rules().load_full()));
    assert_eq!(*heard.lock().unwrap(), [false]);
    // A missing file is refused the same way.
    std::fs::remove_file(reloader.path()).unwrap();
    assert!(reloader.reload_now().is_err());
    assert!(Arc::ptr_eq(&before, &reloader.rules().load_full()));
    assert_eq!(*heard.lock().unwrap(), [false, false]);
    // And the next good one is taken.
    std::fs::write(reloader.path(), TWO).unwrap();
    assert!(reloader.reload_now().unwrap().changed);
    assert_eq!(domains(&reloader), ["two"]);
    assert_eq!(*heard.lock().unwrap(), [false, false, true]);
}

#[test]
fn a_hostile_config_is_refused_and_the_last_good_one_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, ONE).unwrap();
    let options = LoadOptions {
        limits: config::ConfigLimits {
            max_file_bytes: 16_384,
            ..config::ConfigLimits::STANDARD
        },
        ..options()
    };
    let rules = config::load(&path, &options).unwrap().rules;
    let (reloader, heard) = heard(Reloader::new(
        path,
        options,
        Arc::new(ArcSwap::from_pointee(rules)),
    ));
    let before = reloader.rules().load_full();
    let items = vec!["x"; 1_000].join(",");
    let aliases = vec!["*big"; 1_500].join(",");
    let bomb = format!("{TWO}big: &big [{items}]\nmany: [{aliases}]\n");
    let oversized = format!("{TWO}#{}\n", "x".repeat(16_384));
    for (hostile, reason) in [
        (bomb, "YAML nodes once aliases are repeated"),
        (
            oversized,
            "larger than 16384 bytes (--max-config-file-bytes)",
        ),
    ] {
        std::fs::write(reloader.path(), hostile).unwrap();
        let err = reloader.reload_now().unwrap_err();
        assert!(err.to_string().contains(reason), "{err:#}");
        assert!(Arc::ptr_eq(&before, &reloader.rules().load_full()));
    }
    assert_eq!(domains(&reloader), ["one"]);
    assert_eq!(*heard.lock().unwrap(), [false, false]);
}

#[test]
fn the_observer_hears_every_result_and_feeds_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = Arc::new(crate::metrics::Metrics::new());
    let observed = metrics.clone();
    let reloader = reloader(dir.path(), ONE).with_observer(move |ok| observed.record_reload(ok));
    std::fs::write(reloader.path(), TWO).unwrap();
    reloader.reload_now().unwrap();
    std::fs::write(reloader.path(), BAD).unwrap();
    reloader.reload_now().unwrap_err();
    reloader.reload_now().unwrap_err();
    let text = metrics.encode();
    assert!(
        text.contains("throttlegate_config_reloads_total{result=\"ok\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("throttlegate_config_reloads_total{result=\"error\"} 2"),
        "{text}"
    );
}

#[test]
fn an_unchanged_config_is_not_swapped() {
    let dir = tempfile::tempdir().unwrap();
    let (reloader, heard) = heard(reloader(dir.path(), ONE));
    let before = reloader.rules().load_full();
    let summary = reloader.reload_now().unwrap();
    assert!(!summary.changed);
    assert!(Arc::ptr_eq(&before, &reloader.rules().load_full()));
    assert_eq!(*heard.lock().unwrap(), [true]);
}

#[test]
fn a_snapshot_taken_before_a_reload_keeps_the_old_rules() {
    let dir = tempfile::tempdir().unwrap();
    let reloader = reloader(dir.path(), ONE);
    // What `Limiter::decide` holds for the duration of a request.
    let in_flight = reloader.rules().load_full();
    std::fs::write(reloader.path(), TWO).unwrap();
    reloader.reload_now().unwrap();
    assert!(in_flight.domain("one").is_some());
    assert_eq!(domains(&reloader), ["two"]);
}

#[test]
fn reload_if_changed_reloads_only_after_a_change() {
    let dir = tempfile::tempdir().unwrap();
    let (reloader, heard) = heard(reloader(dir.path(), ONE));
    assert!(reloader.reload_if_changed().is_none());
    std::fs::write(reloader.path(), TWO).unwrap();
    assert!(reloader.reload_if_changed().unwrap().unwrap().changed);
    assert!(reloader.reload_if_changed().is_none());
    // A refused config is not retried until it changes again.
    std::fs::write(reloader.path(), BAD).unwrap();
    assert!(reloader.reload_if_changed().unwrap().is_err());
    assert!(reloader.reload_if_changed().is_none());
    assert_eq!(*heard.lock().unwrap(), [true, false]);
}

#[test]
fn the_fingerprint_sees_a_configmap_symlink_swap() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join("..v1")).unwrap();
    std::fs::write(root.join("..v1/config.yaml"), ONE).unwrap();
    std::os::unix::fs::symlink("..v1", root.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/config.yaml", root.join("config.yaml")).unwrap();
    let before = Fingerprint::of(root);
    assert_eq!(before.entries.len(), 2, "{before:?}");
    assert_eq!(before, Fingerprint::of(root));
    // Same length, same content even: only the target's inode differs.
    std::fs::create_dir(root.join("..v2")).unwrap();
    std::fs::write(root.join("..v2/config.yaml"), ONE).unwrap();
    std::os::unix::fs::symlink("..v2", root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    assert_ne!(before, Fingerprint::of(root));
}

#[test]
fn the_fingerprint_sees_only_the_files_the_loader_reads() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::write(root.join("a.yaml"), ONE).unwrap();
    std::fs::create_dir(root.join("nested")).unwrap();
    std::fs::write(root.join("nested/b.yml"), TWO).unwrap();
    let before = Fingerprint::of(root);
    let files: Vec<&Path> = before.entries.iter().map(|(p, _)| p.as_path()).collect();
    assert_eq!(
        files,
        [root, &root.join("a.yaml"), &root.join("nested/b.yml")],
        "{before:?}"
    );
    std::fs::write(root.join("README.md"), "notes").unwrap();
    std::fs::write(root.join("nested/config.yaml.bak"), ONE).unwrap();
    assert_eq!(before, Fingerprint::of(root));
    std::fs::write(root.join("nested/b.yml"), ONE).unwrap();
    assert_ne!(before, Fingerprint::of(root));
}

#[test]
fn only_events_on_the_config_or_a_configmap_swap_concern_it() {
    let paths = |list: &[&str]| list.iter().map(PathBuf::from).collect::<Vec<_>>();
    let file = &paths(&["/etc/tg/config.yaml"]);
    let dir = &paths(&["/etc/tg/config.d"]);
    // A bare file name, watched as itself and through `.`.
    let bare = &paths(&["config.yaml", "./config.yaml"]);
    assert!(concerns(bare, &paths(&["./config.yaml"])));
    assert!(concerns(bare, &paths(&["config.yaml"])));
    assert!(!concerns(bare, &paths(&["./requests.log"])));
    assert!(concerns(file, &paths(&["/etc/tg/config.yaml"])));
    // An editor's rename over the file names the file among its paths.
    assert!(concerns(
        file,
        &paths(&["/etc/tg/.config.yaml.swp", "/etc/tg/config.yaml"])
    ));
    assert!(concerns(dir, &paths(&["/etc/tg/config.d/more.yaml"])));
    assert!(concerns(dir, &paths(&["/etc/tg/config.d"])));
    assert!(concerns(file, &paths(&["/etc/tg/..data"])));
    assert!(concerns(
        file,
        &paths(&["/etc/tg/..2026_12_04_21_50_00.123"])
    ));
    assert!(concerns(file, &[]));
    // Neighbours are not the config.
    assert!(!concerns(file, &paths(&["/etc/tg/requests.log"])));
    assert!(!concerns(file, &paths(&["/etc/tg/config.yaml.bak"])));
    assert!(!concerns(dir, &paths(&["/etc/tg/config.d.old/x.yaml"])));
}

#[test]
fn only_changes_are_worth_a_reload() {
    use notify::event::{CreateKind, ModifyKind};
    assert!(!worth_a_reload(EventKind::Access(AccessKind::Open(
        AccessMode::Any
    ))));
    assert!(!worth_a_reload(EventKind::Access(AccessKind::Close(
        AccessMode::Read
    ))));
    assert!(worth_a_reload(EventKind::Access(AccessKind::Close(
        AccessMode::Write
    ))));
    assert!(worth_a_reload(EventKind::Modify(ModifyKind::Any)));
    assert!(worth_a_reload(EventKind::Create(CreateKind::File)));
}

#[test]
fn the_parent_of_a_bare_file_name_is_the_current_directory() {
    assert_eq!(
        watch_parent(Path::new("config.yaml")),
        Some(PathBuf::from("."))
    );
    assert_eq!(
        watch_parent(Path::new("/etc/rl")),
        Some(PathBuf::from("/etc"))
    );
    assert_eq!(watch_parent(Path::new("/")), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_cannot_be_watched_is_polled() {
    let dir = tempfile::tempdir().unwrap();
    let reloader = Arc::new(reloader(dir.path(), ONE));
    // Watching a missing path fails: the watcher falls back to polling.
    std::fs::remove_file(reloader.path()).unwrap();
    let guard = reloader.spawn_watcher();
    assert!(guard.is_running());
    std::fs::write(reloader.path(), TWO).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while domains(&reloader) != ["two"] {
        assert!(Instant::now() < deadline, "not reloaded within 2 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn dropping_the_guard_stops_the_task() {
    let dir = tempfile::tempdir().unwrap();
    let reloader = Arc::new(reloader(dir.path(), ONE));
    for poll in [false, true] {
        let guard = if poll {
            reloader.spawn_poller(Duration::from_millis(5))
        } else {
            reloader.spawn_watcher()
        };
        assert!(guard.is_running());
        drop(guard);
        // The task held the only other reference.
        let deadline = Instant::now() + Duration::from_secs(2);
        while Arc::strong_count(&reloader) > 1 {
            assert!(Instant::now() < deadline, "the task outlived its guard");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}
