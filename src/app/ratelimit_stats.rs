//! envoyproxy/ratelimit's statistics beside our own `/metrics`: its
//! Prometheus endpoint (a port of its own) and its statsd lines.
//! Invariant: the mapping is loaded and the port bound before anything
//! serves, so a bad mapping or a taken port stops the start.

use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::task::AbortOnDropHandle;

use crate::metrics::Metrics;
use crate::metrics::statsd::{self, StatsdGuard, StatsdSettings};
use crate::metrics::statsd_mapping::Mapping;
use crate::transport::http::ratelimit_stats::{self, RatelimitStatsPage};
use crate::transport::shutdown::Shutdown;

use super::listeners::bind;
use super::{Aborted, RatelimitStatsSettings};

/// The endpoint's mapping loaded and its port bound: what start-up
/// checks before anything serves.
pub(super) struct RatelimitStatsPrepared {
    endpoint: Option<(TcpListener, Arc<Mapping>, String)>,
    statsd: Option<StatsdSettings>,
}

/// What keeps them running; dropping it stops them.
pub(super) struct RatelimitStatsRunning {
    _endpoint: Option<AbortOnDropHandle<()>>,
    _statsd: Option<StatsdGuard>,
}

/// Loads the mapping (an unusable one stops the start, saying why) and
/// binds the endpoint's port.
pub(super) async fn prepare(
    settings: &RatelimitStatsSettings,
) -> Result<RatelimitStatsPrepared, Aborted> {
    let endpoint = match &settings.prometheus {
        None => None,
        Some(prometheus) => {
            let mapping = match &prometheus.mapping {
                None => Mapping::envoy_gateway(),
                // Envoy Gateway mounts its mapping from an optional
                // ConfigMap: while it is absent, its mapping (the built-in
                // one) serves rather than a pod that cannot start.
                Some(path) if !path.exists() => {
                    tracing::warn!(
                        path = %path.display(),
                        "--ratelimit-prometheus-mapping: no such file; Envoy Gateway's mapping is used"
                    );
                    Mapping::envoy_gateway()
                }
                Some(path) => Mapping::load(path).map_err(|err| {
                    Aborted::Failed(format!("--ratelimit-prometheus-mapping: {err}"))
                })?,
            };
            if !prometheus.path.starts_with('/') {
                return Err(Aborted::Failed(format!(
                    "--ratelimit-prometheus-path {:?} must start with /",
                    prometheus.path
                )));
            }
            let listener = bind(prometheus.addr).await?;
            Some((listener, Arc::new(mapping), prometheus.path.clone()))
        }
    };
    Ok(RatelimitStatsPrepared {
        endpoint,
        statsd: settings.statsd.clone(),
    })
}

impl RatelimitStatsPrepared {
    pub(super) fn start(
        self,
        metrics: &Arc<Metrics>,
        shutdown: &Shutdown,
    ) -> RatelimitStatsRunning {
        let endpoint = self.endpoint.map(|(listener, mapping, path)| {
            tracing::info!(
                addr = %listener.local_addr().map_or_else(|_| "?".to_owned(), |it| it.to_string()),
                path,
                "serving envoyproxy/ratelimit's statistics for Prometheus"
            );
            let page = RatelimitStatsPage {
                metrics: metrics.clone(),
                mapping,
                path,
            };
            AbortOnDropHandle::new(tokio::spawn(ratelimit_stats::serve(
                listener,
                page,
                shutdown.clone(),
            )))
        });
        let statsd = self.statsd.map(|settings| {
            tracing::info!(
                addr = settings.addr,
                protocol = ?settings.protocol,
                "sending envoyproxy/ratelimit's statistics to statsd"
            );
            statsd::spawn(metrics.clone(), settings)
        });
        RatelimitStatsRunning {
            _endpoint: endpoint,
            _statsd: statsd,
        }
    }
}
