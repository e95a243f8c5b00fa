//! Listener metrics: connections open, failed accepts, failed TLS
//! handshakes and TLS file reloads, by listener (`grpc`, `http`).
//!
//! Invariant: labels are the listeners' fixed names, never anything a
//! client sends; both TLS reload series exist once TLS is on.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Metrics, ReloadLabels};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AcceptErrorLabels {
    listener: &'static str,
    kind: &'static str,
}

/// The pre-resolved metrics of one listener (`grpc`, `http`).
#[derive(Debug, Clone)]
pub struct ListenerMetrics {
    /// Connections open now.
    pub open: Gauge,
    /// `accept` failures for lack of file descriptors (EMFILE, ENFILE).
    pub accept_errors_descriptors: Counter,
    /// Other `accept` failures (ENOBUFS, ENOMEM...).
    pub accept_errors_other: Counter,
}

/// The metrics of every listener, by label.
#[derive(Debug)]
pub(super) struct ListenerFamilies {
    open_connections: Family<ListenerLabels, Gauge>,
    accept_errors: Family<AcceptErrorLabels, Counter>,
    tls_handshake_errors: Family<ListenerLabels, Counter>,
    tls_reloads: Family<ReloadLabels, Counter>,
}

impl ListenerFamilies {
    /// Registers `open_connections`, `accept_errors`,
    /// `tls_handshake_errors` and `tls_reloads`.
    pub(super) fn register(registry: &mut Registry) -> Self {
        let open_connections = Family::<ListenerLabels, Gauge>::default();
        registry.register(
            "open_connections",
            "Client connections open, by listener (grpc, http)",
            open_connections.clone(),
        );
        let accept_errors = Family::<AcceptErrorLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts by listener and kind (descriptors: out of file descriptors, other)",
            accept_errors.clone(),
        );
        let tls_handshake_errors = Family::<ListenerLabels, Counter>::default();
        registry.register(
            "tls_handshake_errors",
            "TLS handshakes that failed, by listener (refused or missing client certificates, plain text on a TLS port, deadlines)",
            tls_handshake_errors.clone(),
        );
        let tls_reloads = Family::<ReloadLabels, Counter>::default();
        registry.register(
            "tls_reloads",
            "Reloads of the TLS certificate, key and client CA files by result (ok; error: the certificate in force stays)",
            tls_reloads.clone(),
        );
        ListenerFamilies {
            open_connections,
            accept_errors,
            tls_handshake_errors,
            tls_reloads,
        }
    }
}

impl Metrics {
    /// The connection gauge and accept error counters of the listener `name`.
    pub fn listener(&self, name: &'static str) -> ListenerMetrics {
        let error = |kind| {
            self.listeners
                .accept_errors
                .get_or_create_owned(&AcceptErrorLabels {
                    listener: name,
                    kind,
                })
        };
        ListenerMetrics {
            open: self
                .listeners
                .open_connections
                .get_or_create_owned(&ListenerLabels { listener: name }),
            accept_errors_descriptors: error("descriptors"),
            accept_errors_other: error("other"),
        }
    }

    /// The counter of failed TLS handshakes on the listener `name`.
    pub fn tls_handshake_errors(&self, name: &'static str) -> Counter {
        self.listeners
            .tls_handshake_errors
            .get_or_create_owned(&ListenerLabels { listener: name })
    }

    /// Counts one reload of the TLS files, swapped in or refused. Both
    /// series exist once TLS is on, so `increase()` sees the first one.
    pub fn record_tls_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.listeners
            .tls_reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// Creates both TLS reload series at 0 (TLS is on).
    pub fn enable_tls_reloads(&self) {
        for result in ["ok", "error"] {
            self.listeners
                .tls_reloads
                .get_or_create_owned(&ReloadLabels { result });
        }
    }
}
