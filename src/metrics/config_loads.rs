//! Config load metrics: reloads by result, and when the config last
//! loaded without error.
//!
//! Invariant: both reload series exist from the start, so `increase()`
//! sees the first one; every successful load, start-up included, moves the
//! last-success time and envoyproxy/ratelimit's `config_load_success`.

use std::sync::atomic::AtomicI64;
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Metrics, ReloadLabels};

/// Config reloads, the last good load's time and the loads that succeeded.
#[derive(Debug)]
pub(super) struct ConfigLoadMetrics {
    reloads: Family<ReloadLabels, Counter>,
    loaded_at: Gauge<i64, AtomicI64>,
    /// Successful config loads, start-up included (not in our registry:
    /// envoyproxy/ratelimit's `config_load_success`).
    load_success: Counter,
}

impl ConfigLoadMetrics {
    /// Registers `config_reloads` and `config_last_success_timestamp_seconds`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "config_reloads",
            "Configuration reloads by result (ok, error)",
            reloads.clone(),
        );
        // Both series exist from the start, so `increase()` sees the first one.
        for result in ["ok", "error"] {
            reloads.get_or_create_owned(&ReloadLabels { result });
        }
        let loaded_at = Gauge::<i64, AtomicI64>::default();
        registry.register(
            "config_last_success_timestamp_seconds",
            "When the config last loaded without error (start-up or reload), in seconds since the epoch; 0 before",
            loaded_at.clone(),
        );
        ConfigLoadMetrics {
            reloads,
            loaded_at,
            load_success: Counter::default(),
        }
    }

    /// Successful loads, start-up included.
    pub(super) fn successes(&self) -> u64 {
        self.load_success.get()
    }

    /// Refused reloads.
    pub(super) fn reload_errors(&self) -> u64 {
        self.reloads
            .get_or_create(&ReloadLabels { result: "error" })
            .get()
    }
}

impl Metrics {
    /// Counts one configuration reload, successful or refused; a
    /// successful one is also the config's last good load.
    pub fn record_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.config_loads
            .reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
        if ok {
            self.record_config_loaded(SystemTime::now());
        }
    }

    /// The config loaded without error at `at` (at start-up, or a reload).
    pub fn record_config_loaded(&self, at: SystemTime) {
        self.config_loads.load_success.inc();
        let seconds = at.duration_since(UNIX_EPOCH).map_or(0, |it| it.as_secs());
        self.config_loads
            .loaded_at
            .set(i64::try_from(seconds).unwrap_or(i64::MAX));
    }
}
