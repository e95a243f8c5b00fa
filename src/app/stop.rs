//! The graceful stop: NOT_SERVING for the shutdown delay, then both
//! listeners close and both servers drain within one drain timeout, then
//! the exit code. Invariant: a drain cut short is logged, not a failure;
//! only a server that failed makes the exit code non-zero.

use std::process::ExitCode;
use std::time::Duration;

use tokio::time::error::Elapsed;

use crate::transport::grpc;

use super::Serving;
use super::signals::StopSignals;
use super::traces;

impl Serving {
    /// Serves until SIGTERM or SIGINT, then: NOT_SERVING (gRPC health and
    /// `/healthcheck`) while both servers still answer for the shutdown
    /// delay, so that load balancers stop sending first; then both
    /// listeners close and both servers drain within one drain timeout.
    /// Health Watch streams are ended, not waited for.
    pub(super) async fn stop_gracefully(mut self, mut stop: StopSignals) -> ExitCode {
        // gRPC only stops on its own when it fails.
        let early = tokio::select! {
            res = &mut self.grpc => Some(res),
            name = stop.recv() => {
                tracing::info!("{name}: shutting down");
                None
            }
        };
        let grpc_res = match early {
            Some(res) => Some(res),
            None => self.not_serving(&mut stop).await,
        };
        self.control.close();
        // One deadline for both servers, from the moment the listeners close.
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        let (grpc_res, http_res) = tokio::join!(
            async {
                match grpc_res {
                    Some(res) => Ok(res),
                    None => tokio::time::timeout_at(deadline, &mut self.grpc).await,
                }
            },
            tokio::time::timeout_at(deadline, &mut self.http),
        );
        self.http.abort();
        traces::flush(self.traces.take()).await;
        exit_code(grpc_res, http_res, self.drain_timeout)
    }

    /// Health turns NOT_SERVING for the shutdown delay, which a second
    /// signal cuts short; `Some` if gRPC ended meanwhile.
    async fn not_serving(&mut self, stop: &mut StopSignals) -> Option<Result<(), grpc::Error>> {
        self.control.not_serving();
        if self.shutdown_delay.is_zero() {
            return None;
        }
        tracing::info!(
            delay_ms = self.shutdown_delay.as_millis() as u64,
            "not serving; closing the listeners after the delay"
        );
        tokio::select! {
            res = &mut self.grpc => Some(res),
            () = tokio::time::sleep(self.shutdown_delay) => None,
            name = stop.recv() => {
                tracing::info!("{name} again: closing the listeners now");
                None
            }
        }
    }
}

/// 0 unless a server failed; a drain cut short at its deadline is logged,
/// not a failure.
fn exit_code(
    grpc_res: Result<Result<(), grpc::Error>, Elapsed>,
    http_res: Result<Result<std::io::Result<()>, tokio::task::JoinError>, Elapsed>,
    drain_timeout: Duration,
) -> ExitCode {
    let timeout_ms = drain_timeout.as_millis() as u64;
    let grpc_res = grpc_res.map(|res| res.map_err(|err| err.to_string()));
    let http_res = http_res.map(|res| match res {
        Ok(Ok(())) => Ok(()),
        Ok(Err(err)) => Err(format!("http server failed: {err}")),
        Err(err) => Err(format!("http server task failed: {err}")),
    });
    // Both, so that both outcomes are logged.
    let grpc_ok = ended_well("grpc", grpc_res, timeout_ms);
    let http_ok = ended_well("http", http_res, timeout_ms);
    if !(grpc_ok && http_ok) {
        return ExitCode::FAILURE;
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// Logs how the `server` ended; false if it failed.
fn ended_well(server: &str, res: Result<Result<(), String>, Elapsed>, timeout_ms: u64) -> bool {
    match res {
        Ok(Ok(())) => true,
        Ok(Err(message)) => {
            tracing::error!("{message}");
            false
        }
        Err(_) => {
            tracing::warn!(
                timeout_ms,
                "{server} requests still running at the drain deadline; stopping anyway"
            );
            true
        }
    }
}
