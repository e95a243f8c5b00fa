//! A `ShouldRateLimit` call's trace ended from what the RLS service knows
//! once it answers: the domain, the overall code or the status of a
//! refusal, and the backend call the decision recorded.

use crate::decision::{self, BackendCall, Decision};
use crate::traces::{BackendSpan, DecisionTrace, Ending};
use crate::transport::grpc::service::to_status;
use crate::transport::wire;

/// The trace of a decided call (or of one the limiter refused).
pub(super) fn decided(
    trace: DecisionTrace,
    domain: &str,
    decided: &Result<Decision, decision::Error>,
    call: &BackendCall,
) {
    let backend = call.take();
    let backend_span = backend.as_ref().map(|it| BackendSpan {
        backend: it.backend,
        started: it.started,
        took: it.took,
        error: it.error.as_deref(),
    });
    match decided {
        Ok(decision) => trace.end(
            domain,
            Ending::Answered(wire::code_name(decision.overall)),
            backend_span,
        ),
        Err(error) => {
            let status = to_status(error.clone());
            trace.end(
                domain,
                Ending::Failed(code_name(status.code()), status.message()),
                backend_span,
            );
        }
    }
}

/// The trace of a call refused before a decision (its body unreadable).
pub(super) fn refused(trace: DecisionTrace, status: &tonic::Status) {
    trace.end(
        "",
        Ending::Failed(code_name(status.code()), status.message()),
        None,
    );
}

/// A gRPC status code by its name in the gRPC spec (`UNAVAILABLE`).
fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}
