//! Hot reload of the config: load the whole path, swap the rule set atomically only if it validates.
//!
//! A [`Reloader`] owns the config path, its [`LoadOptions`] and the
//! `ArcSwap<RuleSet>` the limiter reads. [`Reloader::reload_now`] loads
//! everything again; a valid config replaces the rule set in one store (a
//! request already holds its snapshot, so in-flight requests finish on the
//! old rules), a refused one leaves the last good config in force. Both
//! outcomes are logged and handed to the observer
//! ([`Reloader::with_observer`]; `app` passes the metrics' reload counter).
//!
//! Triggers, each a task owned by a [`ReloadGuard`] that stops it on drop:
//! - [`Reloader::spawn_watcher`]: filesystem events (inotify) on the path
//!   and on the directory that contains it, so an edit, a rename over the
//!   file and a Kubernetes ConfigMap `..data` symlink swap are all seen;
//!   bursts are debounced. Falls back to polling if it cannot be set up.
//! - [`Reloader::spawn_poller`]: compares a fingerprint of the files
//!   (size, inode, mtime, ctime) at a fixed period.
//! - [`Reloader::spawn_on`]: any stream of triggers (`app` passes SIGHUP).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_stream::{Stream, StreamExt};

use crate::config::{self, ConfigStatus, LoadOptions};
use crate::rules::RuleSet;

/// Quiet time that ends a burst of filesystem events: an editor's save or
/// a ConfigMap swap is several events within a few milliseconds.
pub const DEBOUNCE: Duration = Duration::from_millis(250);

/// Longest wait from the first event of a burst to its reload, so a
/// directory that never stays quiet still reloads well within 2 s.
pub const MAX_DEBOUNCE: Duration = Duration::from_secs(1);

/// Period of the polling fallback.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// Reloads one config path into one rule set.
pub struct Reloader {
    path: PathBuf,
    options: LoadOptions,
    rules: Arc<ArcSwap<RuleSet>>,
    // A std Mutex held for a whole load and swap, so two triggers at once
    // cannot store their results out of order (an older load last). It is
    // only taken on blocking threads, never across an `.await`. It guards
    // the fingerprint of the files as they were when last loaded.
    last_seen: Mutex<Fingerprint>,
    /// Told the result of every reload (the metrics' reload counter).
    observer: Option<Box<dyn Fn(bool) + Send + Sync>>,
    /// Where every outcome is recorded for `/rlconfig`.
    status: Arc<ConfigStatus>,
}

/// What a successful reload loaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub domains: usize,
    pub files: usize,
    /// False when the config loaded equals the one in force (nothing was
    /// swapped).
    pub changed: bool,
    /// The loader's warnings, each already logged.
    pub warnings: Vec<String>,
}

/// Stops a reload task (and its filesystem watcher) when dropped.
#[must_use = "dropping the guard stops the reload task"]
#[derive(Debug)]
pub struct ReloadGuard {
    task: JoinHandle<()>,
}

/// Metadata of every file a load would read, in load order; equal
/// fingerprints mean nothing worth a reload has happened.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Fingerprint {
    entries: Vec<(PathBuf, Option<Stamp>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    // ctime cannot be set by a user, so it catches `cp -p` over a file.
    ctime: (i64, i64),
}

// === impl Reloader ===

impl Reloader {
    /// A reloader for `path`, whose config (loaded with `options`) is
    /// already in `rules`. Records the files as they are now: call it
    /// right after that load.
    pub fn new(path: PathBuf, options: LoadOptions, rules: Arc<ArcSwap<RuleSet>>) -> Self {
        let last_seen = Mutex::new(Fingerprint::of(&path));
        let status = Arc::new(ConfigStatus::new(Some(path.clone()), SystemTime::now()));
        Reloader {
            path,
            options,
            rules,
            last_seen,
            observer: None,
            status,
        }
    }

    /// Records every outcome in `status` (the one `/rlconfig` shows)
    /// instead of a status of its own.
    pub fn with_status(mut self, status: Arc<ConfigStatus>) -> Self {
        self.status = status;
        self
    }

    /// Where this reloader records its outcomes.
    pub fn status(&self) -> &Arc<ConfigStatus> {
        &self.status
    }

    /// Calls `observer` with the result of every reload (true: in force),
    /// after a loaded config is stored: once `observer` hears `true`, the
    /// rules it loaded are the ones in `rules`.
    pub fn with_observer(mut self, observer: impl Fn(bool) + Send + Sync + 'static) -> Self {
        self.observer = Some(Box::new(observer));
        self
    }

    fn observe(&self, ok: bool) {
        if let Some(observer) = &self.observer {
            observer(ok);
        }
    }

    /// The config path (for pushed rules, the name of their source, which
    /// is never read).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The rule set this reloader swaps.
    pub fn rules(&self) -> &Arc<ArcSwap<RuleSet>> {
        &self.rules
    }

    /// Loads the whole path and swaps it in if it validates; a refused
    /// config leaves the one in force. Either way the outcome is logged
    /// and observed. Blocking (file IO): async callers use [`Self::reload`].
    pub fn reload_now(&self) -> Result<Summary, config::Error> {
        let mut last_seen = self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.reload_locked(&mut last_seen)
    }

    /// [`Self::reload_now`] on a blocking thread.
    pub async fn reload(self: &Arc<Self>) -> Result<Summary, config::Error> {
        let reloader = self.clone();
        match tokio::task::spawn_blocking(move || reloader.reload_now()).await {
            Ok(res) => res,
            // Only a panic in the loader ends up here; it must not take the
            // trigger down with it.
            Err(err) => {
                tracing::error!("config reload failed: {err}");
                let error = config::Error {
                    problems: vec![config::Problem {
                        file: self.path.display().to_string(),
                        message: format!("reload failed: {err}"),
                        path: String::new(),
                        location: None,
                    }],
                };
                self.status
                    .record_refused(SystemTime::now(), format!("{error:#}"));
                Err(error)
            }
        }
    }

    /// Reloads only if the files changed since the last load (or since
    /// [`Self::new`]); `None` when they did not.
    fn reload_if_changed(&self) -> Option<Result<Summary, config::Error>> {
        let mut last_seen = self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if Fingerprint::of(&self.path) == *last_seen {
            return None;
        }
        Some(self.reload_locked(&mut last_seen))
    }

    fn reload_locked(&self, last_seen: &mut Fingerprint) -> Result<Summary, config::Error> {
        // Taken before the load: a change made during the load shows up as
        // a difference on the next comparison, never as a missed edit.
        *last_seen = Fingerprint::of(&self.path);
        self.install(config::load(&self.path, &self.options))
    }

    /// Installs rules loaded elsewhere (pushed by a management server,
    /// `crate::xds`), exactly as a reload of files would: a valid config
    /// swapped in if it differs, a refused one leaving the last good
    /// rules in force, both logged, recorded in the status and observed.
    /// Serialized with reloads by the same lock. Blocking only on that lock.
    pub fn apply(
        &self,
        loaded: Result<config::Loaded, config::Error>,
    ) -> Result<Summary, config::Error> {
        let _serialized = self
            .last_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.install(loaded)
    }

    /// Stores `loaded` if it is valid and differs from the rules in force.
    fn install(
        &self,
        loaded: Result<config::Loaded, config::Error>,
    ) -> Result<Summary, config::Error> {
        let path = self.path.display();
        match loaded {
            Ok(loaded) => {
                for warning in &loaded.warnings {
                    tracing::warn!("{warning}");
                }
                let changed = **self.rules.load() != loaded.rules;
                let summary = Summary {
                    domains: loaded.rules.domains().len(),
                    files: loaded.files.len(),
                    changed,
                    warnings: loaded.warnings,
                };
                if changed {
                    self.rules.store(Arc::new(loaded.rules));
                    self.status.record_loaded(SystemTime::now(), true);
                    tracing::info!(
                        %path,
                        domains = summary.domains,
                        files = summary.files,
                        "config reloaded"
                    );
                } else {
                    self.status.record_loaded(SystemTime::now(), false);
                    // Logged like a change: an operator who sent SIGHUP
                    // sees that it was read, and that nothing differed.
                    tracing::info!(%path, "config reloaded, unchanged");
                }
                self.observe(true);
                Ok(summary)
            }
            Err(err) => {
                self.status
                    .record_refused(SystemTime::now(), format!("{err:#}"));
                self.observe(false);
                tracing::error!(
                    %path,
                    "config refused, the last good config stays in force:\n{err:#}"
                );
                Err(err)
            }
        }
    }

    /// Reloads on each item of `triggers` until it ends or the guard is
    /// dropped.
    pub fn spawn_on<S>(self: &Arc<Self>, triggers: S) -> ReloadGuard
    where
        S: Stream<Item = ()> + Send + 'static,
    {
        let reloader = self.clone();
        let task = tokio::spawn(async move {
            let mut triggers = std::pin::pin!(triggers);
            while triggers.next().await.is_some() {
                let _ = reloader.reload().await;
            }
        });
        ReloadGuard { task }
    }

    /// Reloads when the files change, at period `every`.
    pub fn spawn_poller(self: &Arc<Self>, every: Duration) -> ReloadGuard {
        let every = every.max(Duration::from_millis(1));
        let reloader = self.clone();
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let checking = reloader.clone();
                let _ = tokio::task::spawn_blocking(move || checking.reload_if_changed()).await;
            }
        });
        ReloadGuard { task }
    }

    /// Reloads on filesystem events under the path and in the directory
    /// containing it, debounced; if the watcher cannot be set up, logs a
    /// warning and polls every [`POLL_EVERY`] instead.
    pub fn spawn_watcher(self: &Arc<Self>) -> ReloadGuard {
        // Capacity 1 and `try_send`: events arriving while one is pending
        // add nothing, so a flood of events costs no memory.
        let (tx, rx) = mpsc::channel::<()>(1);
        // The config as events name it: as given (its own watch) and as
        // seen through its directory's watch (`./config.yaml` for a bare
        // file name).
        let mut config = vec![self.path.clone()];
        if let (Some(parent), Some(name)) = (watch_parent(&self.path), self.path.file_name()) {
            config.push(parent.join(name));
        }
        let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            match res {
                Ok(event) if !worth_a_reload(event.kind) => return,
                Ok(event) if !concerns(&config, &event.paths) => return,
                Ok(_) => {}
                // Lost events (a queue overflow, a watch limit): reload to
                // be sure.
                Err(err) => tracing::warn!("config watcher: {err}"),
            }
            let _ = tx.try_send(());
        });
        let mut watcher = match watcher {
            Ok(it) => it,
            Err(err) => return self.poll_instead(&err),
        };
        if let Some(parent) = watch_parent(&self.path)
            && let Err(err) = watcher.watch(&parent, RecursiveMode::NonRecursive)
        {
            return self.poll_instead(&err);
        }
        if let Err(err) = watcher.watch(&self.path, RecursiveMode::Recursive) {
            return self.poll_instead(&err);
        }
        tracing::info!(path = %self.path.display(), "watching the config for changes");
        let reloader = self.clone();
        let task = tokio::spawn(reloader.watch(watcher, rx));
        ReloadGuard { task }
    }

    fn poll_instead(self: &Arc<Self>, err: &notify::Error) -> ReloadGuard {
        tracing::warn!(
            path = %self.path.display(),
            "cannot watch the config ({err}); polling it every {} ms instead",
            POLL_EVERY.as_millis()
        );
        self.spawn_poller(POLL_EVERY)
    }

    /// The watcher's task; owns the watcher, so aborting the task drops it
    /// and stops its thread.
    async fn watch(
        self: Arc<Self>,
        mut watcher: RecommendedWatcher,
        mut events: mpsc::Receiver<()>,
    ) {
        // A change between `new` and the watch being set up has no event.
        let checking = self.clone();
        let _ = tokio::task::spawn_blocking(move || checking.reload_if_changed()).await;
        loop {
            if events.recv().await.is_none() {
                return;
            }
            let first = Instant::now();
            loop {
                let deadline = (Instant::now() + DEBOUNCE).min(first + MAX_DEBOUNCE);
                match tokio::time::timeout_at(deadline, events.recv()).await {
                    Ok(Some(())) => {}
                    Ok(None) => return,
                    Err(_) => break,
                }
            }
            // A watch on a file or directory that was replaced (renamed
            // over, deleted and created) follows the old inode: watch the
            // path anew before loading it, so the next change is seen too.
            let _ = watcher.unwatch(&self.path);
            if let Err(err) = watcher.watch(&self.path, RecursiveMode::Recursive) {
                // Gone for now; the parent's watch sees it come back.
                tracing::debug!(path = %self.path.display(), "cannot watch the config: {err}");
            }
            // Only a real change reloads: events also come from our own
            // re-watching and from writes that leave the files as they were,
            // and a refused config must not be retried (and logged) until it
            // changes again.
            let checking = self.clone();
            let _ = tokio::task::spawn_blocking(move || checking.reload_if_changed()).await;
        }
    }
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reloader")
            .field("path", &self.path)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

/// Opening and reading a file are events too (our own loads among them):
/// only a finished write among accesses means a change.
fn worth_a_reload(kind: EventKind) -> bool {
    match kind {
        EventKind::Access(AccessKind::Close(AccessMode::Write)) => true,
        EventKind::Access(_) => false,
        _ => true,
    }
}

/// Whether an event on `paths` can change the config named `config` (its
/// spellings): the config itself or what is inside it (a directory), or a
/// name starting with `..` (a Kubernetes ConfigMap's `..data` swap) in its
/// directory. Other files of the config's directory are not the config: a
/// log written beside it would otherwise wake the watcher on every write.
/// An event without paths is taken as one that can.
fn concerns(config: &[PathBuf], paths: &[PathBuf]) -> bool {
    paths.is_empty()
        || paths.iter().any(|path| {
            config.iter().any(|it| path.starts_with(it))
                || path
                    .file_name()
                    .is_some_and(|name| name.as_encoded_bytes().starts_with(b".."))
        })
}

/// The directory containing `path`, where a rename over the file or a
/// ConfigMap's `..data` swap happens; `None` for `/`.
fn watch_parent(path: &Path) -> Option<PathBuf> {
    match path.parent() {
        Some(parent) if parent.as_os_str().is_empty() => Some(PathBuf::from(".")),
        Some(parent) => Some(parent.to_path_buf()),
        None => None,
    }
}

// === impl ReloadGuard ===

impl ReloadGuard {
    /// Whether the task still runs.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for ReloadGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// === impl Fingerprint ===

impl Fingerprint {
    /// Walks `path` as `config::load` does: the file, or the directory's
    /// YAML files in path order, skipping dot-entries and recursing into
    /// real directories only; files through symlinks are stamped by their
    /// target. Other files are not loaded, so their changes are not seen.
    fn of(path: &Path) -> Fingerprint {
        let mut entries = Vec::new();
        let meta = std::fs::metadata(path).ok();
        let is_dir = meta.as_ref().is_some_and(|it| it.is_dir());
        let stamp = meta.as_ref().map(|it| {
            if is_dir {
                Stamp::of_dir(it)
            } else {
                Stamp::of(it)
            }
        });
        entries.push((path.to_path_buf(), stamp));
        if is_dir {
            walk_dir(path, &mut entries);
        }
        Fingerprint { entries }
    }
}

fn walk_dir(dir: &Path, entries: &mut Vec<(PathBuf, Option<Stamp>)>) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    for path in config::config_entries(read) {
        let is_real_dir = std::fs::symlink_metadata(&path).is_ok_and(|it| it.is_dir());
        if is_real_dir {
            walk_dir(&path, entries);
        } else {
            let stamp = std::fs::metadata(&path).ok().map(|it| Stamp::of(&it));
            entries.push((path, stamp));
        }
    }
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime: (meta.mtime(), meta.mtime_nsec()),
            ctime: (meta.ctime(), meta.ctime_nsec()),
        }
    }

    /// A directory's size and times change whenever any entry is added or
    /// removed, read by the loader or not; only its identity counts (the
    /// directory replaced). A YAML file added or removed changes the list
    /// of entries instead.
    fn of_dir(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: meta.dev(),
            ino: meta.ino(),
            len: 0,
            mtime: (0, 0),
            ctime: (0, 0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = "domain: one\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1}\n";
    const TWO: &str = "domain: two\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 2}\n";
    const BAD: &str = "domain: two\ndescriptors:\n  - key: k\n    ratelimit: {unit: second, requests_per_unit: 2}\n";

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
        let reloader =
            reloader(dir.path(), ONE).with_observer(move |ok| observed.record_reload(ok));
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
}
