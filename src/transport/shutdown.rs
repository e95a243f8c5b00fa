//! Graceful stop in stages, followed by both servers: health turns
//! NOT_SERVING first, then the listeners close and in-flight requests drain.

use tokio::sync::watch;

/// Where a graceful stop stands; stages only move forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ShutdownStage {
    /// No stop asked for.
    Serving,
    /// Health reports NOT_SERVING so that load balancers move away, while
    /// the listeners still accept and every request is answered.
    NotServing,
    /// The listeners are closed and in-flight requests drain.
    Closing,
}

/// Moves every [`Shutdown`] made with it through the [`ShutdownStage`]s.
/// Dropping it counts as [`ShutdownStage::Closing`], so no server outlives
/// its owner.
#[derive(Debug)]
pub struct ShutdownControl {
    stage: watch::Sender<ShutdownStage>,
}

/// What a server follows during a graceful stop; cheap to clone.
#[derive(Debug, Clone)]
pub struct Shutdown {
    stage: watch::Receiver<ShutdownStage>,
}

/// A control and the [`Shutdown`] it drives, at [`ShutdownStage::Serving`].
pub fn shutdown_channel() -> (ShutdownControl, Shutdown) {
    let (stage_tx, stage_rx) = watch::channel(ShutdownStage::Serving);
    (
        ShutdownControl { stage: stage_tx },
        Shutdown { stage: stage_rx },
    )
}

impl ShutdownControl {
    /// Health turns NOT_SERVING; requests are still answered.
    pub fn not_serving(&self) {
        self.advance(ShutdownStage::NotServing);
    }

    /// The listeners close and in-flight requests drain (health is
    /// NOT_SERVING too, if it was not yet).
    pub fn close(&self) {
        self.advance(ShutdownStage::Closing);
    }

    fn advance(&self, stage: ShutdownStage) {
        self.stage.send_if_modified(|current| {
            let later = *current < stage;
            if later {
                *current = stage;
            }
            later
        });
    }
}

impl Shutdown {
    /// The current stage; [`ShutdownStage::Closing`] once the control is
    /// dropped.
    pub fn stage(&self) -> ShutdownStage {
        if self.stage.has_changed().is_err() {
            return ShutdownStage::Closing;
        }
        *self.stage.borrow()
    }

    /// Completes when health should turn NOT_SERVING.
    pub async fn not_serving(&self) {
        self.reached(ShutdownStage::NotServing).await;
    }

    /// Completes when the listeners should close.
    pub async fn closing(&self) {
        self.reached(ShutdownStage::Closing).await;
    }

    async fn reached(&self, stage: ShutdownStage) {
        let mut stage_rx = self.stage.clone();
        // An error means the control was dropped, which counts as closing.
        let _ = stage_rx.wait_for(|current| *current >= stage).await;
    }
}
