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
mod tests;
