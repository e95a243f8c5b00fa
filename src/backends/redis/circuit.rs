//! What every pool of connections to one server shares: the circuit that
//! fails calls at once while the server cannot be reached, and the
//! generation of connections still trusted.
//!
//! Invariant: no connection made before an outage (the circuit opening)
//! or before one found dead is used after it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use crate::backends::Error;

/// What every pool to one server shares: the one on the shared runtime and
/// one per serving thread. One circuit, so an outage seen by any pool (or
/// by the health probe) fails every thread's calls at once, and the
/// recovery seen by the reconnector or a probe closes it for all; one
/// generation of connections, so a connection found dead in one pool
/// retires every older connection in all of them (a restart of Redis
/// kills them all at once), and so does the circuit opening: no
/// connection made before an outage is used after it.
#[derive(Clone)]
pub(super) struct Reachability {
    /// Generation of connections: a connection made in an older one is
    /// broken (see the connections' `Manager`).
    pub(super) epoch: Arc<AtomicU64>,
    /// The last error from creating a connection, to say why a checkout
    /// timed out. A std Mutex: held only to swap a String, never across `.await`.
    pub(super) last_connect_error: Arc<Mutex<Option<String>>>,
    pub(super) circuit: Arc<Circuit>,
}

/// Open while Redis cannot be connected to: calls then fail at once with
/// [`Error::Unavailable`] instead of each waiting the whole timeout (with
/// Redis down, a wait per request would outlast Envoy's own timeout, which
/// then lets the request through whatever the failure mode says).
///
/// Only a failure to connect opens it (refused, connect timeout, DNS, TLS,
/// authentication): a slow reply on a live connection does not, so a slow
/// Redis still gets the full timeout on every call. It closes when a fresh
/// connection answers PING, made by the connections' reconnector in the background
/// or by a health probe.
pub(super) struct Circuit {
    open: AtomicBool,
    /// Why it opened, for the errors answered meanwhile. A std Mutex: held
    /// only to swap a String, never across `.await`.
    reason: Mutex<String>,
    /// Wakes the reconnecting task, and checkouts waiting for a connection
    /// that will not come.
    opened: Notify,
    pub(super) redacted_url: String,
}

// === impl Reachability ===

impl Reachability {
    /// A closed circuit and the first generation of connections to the
    /// server named `redacted_url` in logs.
    pub(super) fn new(redacted_url: String) -> Reachability {
        Reachability {
            epoch: Arc::new(AtomicU64::new(0)),
            last_connect_error: Arc::new(Mutex::new(None)),
            circuit: Arc::new(Circuit::new(redacted_url)),
        }
    }

    /// Opens the circuit (or updates its reason); when it was closed, every
    /// connection made so far is retired: after the outage they may be
    /// dead (a restart) or half-open (a partition), and a pool that saw
    /// nothing of it would otherwise send its next call on one.
    pub(super) fn open(&self, reason: String) {
        if self.circuit.open(reason) {
            self.epoch.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Marks every connection of generation `epoch` and older broken.
    pub(super) fn retire(&self, epoch: u64) {
        self.epoch.fetch_max(epoch + 1, Ordering::SeqCst);
    }
}

// === impl Circuit ===

impl Circuit {
    pub(super) fn new(redacted_url: String) -> Circuit {
        Circuit {
            open: AtomicBool::new(false),
            reason: Mutex::new(String::new()),
            opened: Notify::new(),
            redacted_url,
        }
    }

    pub(super) fn is_open(&self) -> bool {
        self.open.load(Ordering::SeqCst)
    }

    /// Opens the circuit (logged once per outage) or updates its reason;
    /// whether it was closed.
    pub(super) fn open(&self, reason: String) -> bool {
        *self.reason.lock().unwrap_or_else(|it| it.into_inner()) = reason;
        let opened = !self.open.swap(true, Ordering::SeqCst);
        if opened {
            let reason = self.reason.lock().unwrap_or_else(|it| it.into_inner());
            tracing::warn!(
                url = %self.redacted_url,
                reason = %*reason,
                "cannot connect to redis: answering under the failure mode until it is back"
            );
            drop(reason);
            self.opened.notify_waiters();
        }
        opened
    }

    /// Closes the circuit (logged once per outage).
    pub(super) fn close(&self) {
        if self.open.swap(false, Ordering::SeqCst) {
            tracing::info!(url = %self.redacted_url, "connected to redis again: deciding requests");
        }
    }

    /// The error every call gets while the circuit is open.
    pub(super) fn error(&self) -> Error {
        let reason = self.reason.lock().unwrap_or_else(|it| it.into_inner());
        Error::Unavailable(format!(
            "no connection to {} (reconnecting in the background): {reason}",
            self.redacted_url
        ))
    }

    /// Completes once the circuit is open.
    pub(super) async fn wait_open(&self) {
        loop {
            let notified = self.opened.notified();
            tokio::pin!(notified);
            // Registered before the check, so an opening in between is not missed.
            notified.as_mut().enable();
            if self.is_open() {
                return;
            }
            notified.await;
        }
    }
}
