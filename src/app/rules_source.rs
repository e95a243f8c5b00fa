//! Where the rules come from and what reloads them: the config files
//! (loaded off the runtime, reloaded on SIGHUP and on change) or an xDS
//! management server's subscription. Invariant: every reload goes through
//! a `Reloader` into the one `ArcSwap<RuleSet>` the limiter reads, counted
//! in the metrics and recorded in the config status.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::signal::unix::Signal;
use tokio_stream::StreamExt;

use crate::config::reload::{ReloadGuard, Reloader};
use crate::config::{self, ConfigStatus, LoadOptions};
use crate::metrics::Metrics;
use crate::rules::RuleSet;
use crate::xds::{self, Subscription, XdsSettings};

use super::signals::StopSignals;
use super::{Aborted, Settings};

/// The rules to start with: the config's, loaded off the runtime, or none.
pub(super) async fn load_rules(
    settings: &Settings,
    stop: &mut StopSignals,
) -> Result<RuleSet, Aborted> {
    if let Some(xds) = &settings.xds {
        if settings.config.is_some() {
            return Err(Aborted::Failed(
                "--config and --config-xds-server exclude each other: the rules come from \
                 files or from the xDS server"
                    .to_owned(),
            ));
        }
        xds.settings
            .check()
            .map_err(|err| Aborted::Failed(format!("xds: {err}")))?;
        return Ok(RuleSet::awaiting_first_config());
    }
    let Some(path) = &settings.config else {
        tracing::warn!("no --config given: every domain is unknown and every request is OK");
        return Ok(RuleSet::default());
    };
    match stop.or_stop(load_config(path, settings.load)).await {
        Some(Ok(it)) => Ok(it),
        Some(Err(message)) => Err(Aborted::Failed(message)),
        None => Err(Aborted::Stopped),
    }
}

/// Loads the config on a blocking thread: a big one takes seconds, and the
/// runtime keeps handling signals meanwhile.
async fn load_config(path: &Path, options: LoadOptions) -> Result<RuleSet, String> {
    tracing::info!(path = %path.display(), "loading the config");
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || load_config_now(&path, &options))
        .await
        .map_err(|err| format!("config load failed: {err}"))?
}

fn load_config_now(path: &Path, options: &LoadOptions) -> Result<RuleSet, String> {
    let loaded = config::load(path, options).map_err(|err| format!("{err:#}"))?;
    for warning in &loaded.warnings {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        path = %path.display(),
        domains = loaded.rules.domains().len(),
        files = loaded.files.len(),
        "config loaded"
    );
    Ok(loaded.rules)
}

/// Reloads into `rules`, counted in `metrics` and recorded in `status`;
/// `None` without a config.
pub(super) fn reloader(
    settings: &Settings,
    rules: &Arc<ArcSwap<RuleSet>>,
    metrics: &Arc<Metrics>,
    status: &Arc<ConfigStatus>,
) -> Option<Arc<Reloader>> {
    let path = settings.config.as_ref()?;
    let metrics = metrics.clone();
    let reloader = Reloader::new(path.clone(), settings.load, rules.clone())
        .with_status(status.clone())
        .with_observer(move |ok| metrics.record_reload(ok));
    Some(Arc::new(reloader))
}

// === rules over xDS ===

/// Where the rules come from, as `/rlconfig` names it.
pub(super) fn config_source(settings: &Settings) -> Option<PathBuf> {
    match &settings.xds {
        Some(xds) => Some(PathBuf::from(xds_source(&xds.settings))),
        None => settings.config.clone(),
    }
}

fn xds_source(settings: &XdsSettings) -> String {
    format!(
        "xds://{}:{} (node {})",
        settings.server.host, settings.server.port, settings.node_id
    )
}

/// With `--config-xds-server`: the subscription, whose configs go through
/// a reloader into `rules` (counted in `metrics`, recorded in `status`).
/// Without `--config-xds-force-start`, start-up waits here for the first
/// config the server sends that is accepted (SIGTERM or SIGINT end the
/// wait); with it, serving starts with no rules.
pub(super) async fn xds_subscription(
    settings: &Settings,
    rules: &Arc<ArcSwap<RuleSet>>,
    metrics: &Arc<Metrics>,
    status: &Arc<ConfigStatus>,
    stop: &mut StopSignals,
) -> Result<Option<Subscription>, Aborted> {
    let Some(flags) = &settings.xds else {
        return Ok(None);
    };
    let observed = metrics.clone();
    let reloader = Reloader::new(
        PathBuf::from(xds_source(&flags.settings)),
        settings.load,
        rules.clone(),
    )
    .with_status(status.clone())
    .with_observer(move |ok| observed.record_reload(ok));
    let mut subscription =
        xds::subscribe(flags.settings.clone(), Arc::new(reloader), settings.load);
    if flags.force_start {
        tracing::warn!(
            "--config-xds-force-start: serving before the first config; until it arrives \
             every request is answered through --failure-mode"
        );
        return Ok(Some(subscription));
    }
    tracing::info!("waiting for the first config from the xDS server");
    match stop.or_stop(subscription.first_config()).await {
        Some(()) => Ok(Some(subscription)),
        None => Err(Aborted::Stopped),
    }
}

/// SIGHUP (`hangups`, listened for since start-up; one received during
/// start-up reloads right away) reloads the config, and so does a change
/// of its files with `watch`; the guards stop both.
pub(super) fn reload_triggers(
    reloader: Option<&Arc<Reloader>>,
    watch: bool,
    hangups: Option<Signal>,
) -> Vec<ReloadGuard> {
    let mut guards = Vec::new();
    // Without a config there is nothing to reload; the handler, once
    // registered, still keeps SIGHUP from ending the process.
    let Some(reloader) = reloader else {
        return guards;
    };
    if let Some(hangups) = hangups {
        let hangups = tokio_stream::wrappers::SignalStream::new(hangups).map(|()| {
            tracing::info!("SIGHUP: reloading the config");
        });
        guards.push(reloader.spawn_on(hangups));
    }
    if watch {
        guards.push(reloader.spawn_watcher());
    }
    guards
}
