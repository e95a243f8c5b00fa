//! The `--tracing*` flags: OpenTelemetry traces of decisions over OTLP.
//! Invariant: off unless `--tracing on` (or `TRACING_ENABLED`); the
//! endpoint's default follows the protocol.

use clap::{Args, ValueEnum};

use crate::traces::{OtlpProtocol, TraceSettings};

use super::Switch;

/// OpenTelemetry traces of decisions (envoyproxy/ratelimit's TRACING_*
/// variables and OTEL_EXPORTER_OTLP_ENDPOINT become their defaults).
#[derive(Debug, Args)]
pub(super) struct TraceArgs {
    /// Trace ShouldRateLimit decisions over OTLP: a span per decision (its
    /// domain and verdict) with the backend call as its child, continuing
    /// the caller's trace (W3C traceparent, or B3).
    #[arg(long, env = "THROTTLEGATE_TRACING", value_enum, default_value_t = Switch::Off)]
    tracing: Switch,
    /// The OTLP collector, `http://host:port`; over HTTP spans go to its
    /// /v1/traces [default: http://localhost:4318, with --tracing-protocol
    /// grpc http://localhost:4317].
    #[arg(long, env = "THROTTLEGATE_TRACING_ENDPOINT", value_name = "URL")]
    tracing_endpoint: Option<String>,
    /// OTLP over HTTP (protobuf) or over gRPC.
    #[arg(long, env = "THROTTLEGATE_TRACING_PROTOCOL", value_enum, default_value_t = TraceProtocolArg::Http)]
    tracing_protocol: TraceProtocolArg,
    /// Share of the traces started here that are sampled, from 0 to 1; a
    /// caller's own sampling decision (traceparent or B3) is followed.
    #[arg(
        long,
        env = "THROTTLEGATE_TRACING_SAMPLING_RATE",
        default_value = "1",
        value_parser = parse_sampling_rate
    )]
    tracing_sampling_rate: f64,
    /// The `service.name` of the spans.
    #[arg(
        long,
        env = "THROTTLEGATE_TRACING_SERVICE_NAME",
        default_value = "throttlegate"
    )]
    tracing_service_name: String,
    /// The `service.namespace` of the spans [default: none].
    #[arg(long, env = "THROTTLEGATE_TRACING_SERVICE_NAMESPACE")]
    tracing_service_namespace: Option<String>,
    /// The `service.instance.id` of the spans [default: a random UUID].
    #[arg(long, env = "THROTTLEGATE_TRACING_SERVICE_INSTANCE_ID")]
    tracing_service_instance_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TraceProtocolArg {
    Http,
    Grpc,
}

pub(super) fn parse_sampling_rate(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(rate) if (0.0..=1.0).contains(&rate) => Ok(rate),
        _ => Err(format!("'{text}' is not a number from 0 to 1")),
    }
}

/// The `--tracing*` flags as [`crate::app::Settings`] takes them; `None`: off.
pub(super) fn trace_settings(args: TraceArgs) -> Option<TraceSettings> {
    if args.tracing == Switch::Off {
        return None;
    }
    let (protocol, default_endpoint) = match args.tracing_protocol {
        TraceProtocolArg::Http => (OtlpProtocol::Http, "http://localhost:4318"),
        TraceProtocolArg::Grpc => (OtlpProtocol::Grpc, "http://localhost:4317"),
    };
    Some(TraceSettings {
        endpoint: args
            .tracing_endpoint
            .unwrap_or_else(|| default_endpoint.to_owned()),
        protocol,
        sampling_rate: args.tracing_sampling_rate,
        service_name: args.tracing_service_name,
        service_namespace: args.tracing_service_namespace,
        service_instance_id: args.tracing_service_instance_id,
    })
}
