//! The OTLP exporter of decision traces, when `--tracing` is on: started
//! before the servers, flushed after both have stopped. Invariant: a bad
//! endpoint stops the start; a slow collector never holds the exit longer
//! than the flush bound.

use std::sync::Arc;
use std::time::Duration;

use crate::traces::{TraceSettings, Tracing};

use super::Aborted;

/// How long the spans still queued at the stop may take to be sent.
const TRACES_FLUSH: Duration = Duration::from_secs(2);

/// The OTLP exporter, when tracing is on; a bad endpoint stops the start.
pub(super) fn start(settings: Option<&TraceSettings>) -> Result<Option<Arc<Tracing>>, Aborted> {
    let Some(settings) = settings else {
        return Ok(None);
    };
    let traces = Tracing::start(settings, tokio::runtime::Handle::current())
        .map_err(|err| Aborted::Failed(format!("tracing: {err}")))?;
    tracing::info!(
        endpoint = %settings.endpoint,
        protocol = ?settings.protocol,
        sampling_rate = settings.sampling_rate,
        service_name = %settings.service_name,
        "tracing decisions"
    );
    Ok(Some(Arc::new(traces)))
}

/// Sends the spans still queued, off the runtime's workers (the exports
/// themselves run on them).
pub(super) async fn flush(traces: Option<Arc<Tracing>>) {
    if let Some(traces) = traces {
        let _ = tokio::task::spawn_blocking(move || traces.flush(TRACES_FLUSH)).await;
    }
}
