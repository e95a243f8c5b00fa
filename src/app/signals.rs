//! The signals `serve` follows: SIGTERM and SIGINT stop it (during
//! start-up too), SIGHUP reloads the config. Invariant: each is listened
//! for from the moment it is installed, so none sent early is lost.

use std::future::Future;

use tokio::signal::unix::{Signal, SignalKind, signal};

/// Listens for `kind` from now on; `None` (logged) if that cannot be set up.
pub(super) fn listen_for(kind: SignalKind, name: &str) -> Option<Signal> {
    match signal(kind) {
        Ok(it) => Some(it),
        Err(err) => {
            tracing::error!("cannot listen for {name}: {err}");
            None
        }
    }
}

/// SIGTERM and SIGINT (Ctrl-C), listened for from creation on: a signal
/// received before [`StopSignals::recv`] is called is not lost.
pub(super) struct StopSignals {
    terminate: Option<Signal>,
    interrupt: Option<Signal>,
}

impl StopSignals {
    pub(super) fn install() -> Self {
        StopSignals {
            terminate: listen_for(SignalKind::terminate(), "SIGTERM"),
            interrupt: listen_for(SignalKind::interrupt(), "SIGINT"),
        }
    }

    /// Waits for the next SIGTERM or SIGINT and returns its name.
    pub(super) async fn recv(&mut self) -> &'static str {
        async fn next(signal: &mut Option<Signal>) {
            match signal {
                Some(signal) => {
                    signal.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(&mut self.terminate) => "SIGTERM",
            () = next(&mut self.interrupt) => "SIGINT",
        }
    }

    /// Runs a start-up `step`; `None` (logged) if SIGTERM or SIGINT comes
    /// first. The step is dropped, but blocking work it started may still
    /// run: the runtime is shut down without waiting for it.
    pub(super) async fn or_stop<T>(&mut self, step: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            res = step => Some(res),
            name = self.recv() => {
                tracing::info!("{name} during start-up: exiting");
                None
            }
        }
    }
}
