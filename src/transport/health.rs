//! The one health answer both servers give: not while a graceful stop is
//! under way, otherwise whether the backend answers its probe in time.

use std::sync::Arc;
use std::time::Duration;

use crate::backends::{self, Backend};
use crate::transport::shutdown::{Shutdown, ShutdownStage};

/// A probe slower than this counts as a failure.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the service should be sent requests. Built once over the
/// backend and handed to both servers, each of which ties it to the
/// [`Shutdown`] it follows; cheap to clone.
#[derive(Debug, Clone)]
pub struct Health {
    backend: Arc<dyn Backend>,
    timeout: Duration,
    /// `None` for a router served on its own: it is never stopping.
    shutdown: Option<Shutdown>,
}

/// Why [`Health::check`] says not to send requests; the message is what
/// `/healthcheck` answers.
#[derive(Debug, thiserror::Error)]
pub enum Unhealthy {
    #[error("shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Backend(backends::Error),
    #[error("{0} backend did not answer in time")]
    Timeout(&'static str),
}

impl Health {
    /// Health over `backend`'s probe, bounded by [`PROBE_TIMEOUT`].
    pub fn new(backend: Arc<dyn Backend>) -> Self {
        Self {
            backend,
            timeout: PROBE_TIMEOUT,
            shutdown: None,
        }
    }

    /// The same health, unhealthy from the moment `shutdown` leaves
    /// [`ShutdownStage::Serving`].
    pub fn following(self, shutdown: Shutdown) -> Self {
        Self {
            shutdown: Some(shutdown),
            ..self
        }
    }

    /// True once a graceful stop has begun: load balancers must move away
    /// even though requests are still answered.
    pub fn stopping(&self) -> bool {
        self.shutdown
            .as_ref()
            .is_some_and(|it| it.stage() != ShutdownStage::Serving)
    }

    /// `Ok` when requests should be sent here.
    pub async fn check(&self) -> Result<(), Unhealthy> {
        if self.stopping() {
            return Err(Unhealthy::ShuttingDown);
        }
        self.probe().await
    }

    /// The backend's side of [`Health::check`] alone: whether it answers
    /// its probe within the timeout.
    pub async fn probe(&self) -> Result<(), Unhealthy> {
        match tokio::time::timeout(self.timeout, self.backend.probe()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(err)) => Err(Unhealthy::Backend(err)),
            Err(_) => Err(Unhealthy::Timeout(self.backend.name())),
        }
    }

    /// What `/rlconfig` shows about the backend (`Backend::notes`).
    pub async fn backend_notes(&self) -> Vec<String> {
        tokio::time::timeout(self.timeout, self.backend.notes())
            .await
            .unwrap_or_default()
    }

    /// The backend's name, for log lines.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }
}
