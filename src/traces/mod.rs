//! OpenTelemetry traces of decisions (off by default): one span per
//! `ShouldRateLimit` decision, with its domain and verdict, and the backend
//! call as its child, continuing the caller's trace ([`context`]: W3C
//! `traceparent`, B3), exported over OTLP (HTTP protobuf or gRPC) by the
//! OpenTelemetry SDK's batch processor ([`export`]).
//!
//! Cost: with tracing off the gRPC service holds no [`Tracing`] and does
//! nothing more than test for one. With it on, a request's headers are
//! read and its sampling decided at once ([`Tracing::begin`]: the caller's
//! sampled flag when it sent one, else the sampling rate on the trace id,
//! as the SDK's parent-based ratio sampler decides); an unsampled request
//! costs nothing more. A sampled one's spans are built when its answer is
//! ready, from the times recorded, and queued for export off the request's
//! path; a full queue drops spans, never waits.

pub mod context;
mod export;

use std::time::{Duration, SystemTime};

use opentelemetry::trace::{
    Span as _, SpanBuilder, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags,
    TraceId, TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SdkTracer, SdkTracerProvider};

pub use export::Error;

/// The name of the decision's span.
pub const DECISION_SPAN: &str = "ShouldRateLimit";
/// The name of the backend call's span.
pub const BACKEND_SPAN: &str = "backend decide";

/// How spans are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// OTLP over HTTP, protobuf bodies, to `<endpoint>/v1/traces`.
    Http,
    /// OTLP over gRPC (`TraceService/Export`).
    Grpc,
}

/// What `--tracing*` says.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSettings {
    /// The collector: `http://host:port` (a missing scheme means `http`).
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    /// The share of traces started here that are sampled, 0 to 1.
    pub sampling_rate: f64,
    pub service_name: String,
    pub service_namespace: Option<String>,
    /// `None`: a random one, made at start-up.
    pub service_instance_id: Option<String>,
}

/// Traces in force: the SDK's tracer and the sampling rate.
#[derive(Debug)]
pub struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// Trace ids whose low 63 bits are below this are sampled (the SDK's
    /// `TraceIdRatioBased` rule); likewise a random number for a trace
    /// started here.
    ratio_bound: u64,
    ids: RandomIdGenerator,
}

impl Tracing {
    /// Starts the exporter (its sends run on `runtime`) and the batch
    /// processor. Nothing is sent until a sampled decision ends.
    pub fn start(
        settings: &TraceSettings,
        runtime: tokio::runtime::Handle,
    ) -> Result<Tracing, Error> {
        let provider = export::provider(settings, runtime)?;
        let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "throttlegate");
        Ok(Tracing {
            provider,
            tracer,
            ratio_bound: ratio_bound(settings.sampling_rate),
            ids: RandomIdGenerator::default(),
        })
    }

    /// The trace of one call with these request headers, if sampled: by
    /// the caller's flag, else by the rate on its trace id, or for a trace
    /// started here on a random number (its trace id, random too, is made
    /// by the SDK when the span is).
    pub fn begin(&self, headers: &http::HeaderMap) -> Option<DecisionTrace> {
        let incoming = context::incoming(headers);
        let sampled = incoming.sampled.unwrap_or_else(|| {
            let random = match incoming.parent {
                Some(parent) => parent.trace_id as u64,
                None => u64::from_be_bytes(self.ids.new_span_id().to_bytes()),
            };
            (random >> 1) < self.ratio_bound
        });
        sampled.then(|| DecisionTrace {
            tracer: self.tracer.clone(),
            parent: incoming.parent,
            started: SystemTime::now(),
        })
    }

    /// Sends what is queued, within `timeout` (at a graceful stop).
    pub fn flush(&self, timeout: Duration) {
        if let Err(err) = self.provider.shutdown_with_timeout(timeout) {
            tracing::warn!(error = %err, "traces not all sent at shutdown");
        }
    }
}

/// `rate` of 0..=1 as a bound on a trace id's low 63 bits.
fn ratio_bound(rate: f64) -> u64 {
    if rate >= 1.0 {
        u64::MAX
    } else if rate > 0.0 {
        (rate * (1u64 << 63) as f64) as u64
    } else {
        0
    }
}

/// One sampled decision, from its arrival.
#[derive(Debug)]
pub struct DecisionTrace {
    tracer: SdkTracer,
    parent: Option<context::Parent>,
    started: SystemTime,
}

/// How a decision ended, for its span.
#[derive(Debug, Clone, Copy)]
pub enum Ending<'a> {
    /// The overall code: `OK` or `OVER_LIMIT`.
    Answered(&'static str),
    /// No decision: the gRPC status code's name and its message.
    Failed(&'static str, &'a str),
}

/// The backend call under a decision.
#[derive(Debug, Clone)]
pub struct BackendSpan<'a> {
    pub backend: &'static str,
    pub started: SystemTime,
    pub took: Duration,
    pub error: Option<&'a str>,
}

impl DecisionTrace {
    /// Ends the decision's span now, with the backend call as its child.
    pub fn end(self, domain: &str, ending: Ending<'_>, backend: Option<BackendSpan<'_>>) {
        let parent = match self.parent {
            Some(parent) => Context::new().with_remote_span_context(SpanContext::new(
                TraceId::from_bytes(parent.trace_id.to_be_bytes()),
                SpanId::from_bytes(parent.span_id.to_be_bytes()),
                TraceFlags::SAMPLED,
                true,
                TraceState::NONE,
            )),
            None => Context::new(),
        };
        let (code, status) = match ending {
            Ending::Answered(code) => (code, Status::Unset),
            Ending::Failed(code, message) => (code, Status::error(message.to_owned())),
        };
        let builder = SpanBuilder::from_name(DECISION_SPAN)
            .with_kind(SpanKind::Server)
            .with_start_time(self.started)
            .with_attributes([
                KeyValue::new("rpc.system", "grpc"),
                KeyValue::new("rpc.service", "envoy.service.ratelimit.v3.RateLimitService"),
                KeyValue::new("rpc.method", "ShouldRateLimit"),
                KeyValue::new("ratelimit.domain", domain.to_owned()),
                KeyValue::new("ratelimit.verdict", code),
            ]);
        let mut span = self.tracer.build_with_context(builder, &parent);
        span.set_status(status);
        let decision = parent.with_span(span);
        if let Some(backend) = backend {
            let status = match backend.error {
                Some(error) => Status::error(error.to_owned()),
                None => Status::Unset,
            };
            let mut child = SpanBuilder::from_name(BACKEND_SPAN)
                .with_kind(SpanKind::Client)
                .with_start_time(backend.started)
                .with_attributes([KeyValue::new("ratelimit.backend", backend.backend)])
                .start_with_context(&self.tracer, &decision);
            child.set_status(status);
            child.end_with_timestamp(backend.started + backend.took);
        }
        decision.span().end();
    }
}

#[cfg(test)]
mod tests;
