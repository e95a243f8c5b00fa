//! The OTLP exporter (opentelemetry-otlp: HTTP protobuf over hyper, or
//! gRPC over tonic) behind the SDK's batch processor, and the resource
//! every span carries (service name, namespace, instance id).
//!
//! The batch processor exports from a thread of its own, blocking on each
//! export; both transports need a tokio runtime for their IO, so each
//! export runs as a task on the service's runtime ([`OnRuntime`]).

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, IdGenerator as _, RandomIdGenerator, Sampler,
    SdkTracerProvider, SpanData, SpanExporter,
};

use super::{OtlpProtocol, TraceSettings};

/// How long one export may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Spans waiting for export; beyond it new spans are dropped.
const MAX_QUEUE: usize = 8192;
/// Spans per export.
const MAX_BATCH: usize = 512;
/// A batch leaves at the latest this long after its first span.
const SCHEDULED_DELAY: Duration = Duration::from_secs(1);

/// Why traces could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("--tracing-endpoint '{0}': {1}")]
    Endpoint(String, String),
    #[error("OTLP exporter: {0}")]
    Exporter(String),
}

/// The tracer provider for `settings`, its exports run on `runtime`.
pub(super) fn provider(
    settings: &TraceSettings,
    runtime: tokio::runtime::Handle,
) -> Result<SdkTracerProvider, Error> {
    let endpoint = endpoint(settings)?;
    let exporter = {
        // tonic's channel spawns its worker where it is built.
        let _entered = runtime.enter();
        match settings.protocol {
            OtlpProtocol::Http => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .with_http_client(
                    opentelemetry_http::hyper::HyperClient::with_default_connector(
                        EXPORT_TIMEOUT,
                        None,
                    ),
                )
                .build(),
            OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .with_timeout(EXPORT_TIMEOUT)
                .build(),
        }
        .map_err(|err| Error::Exporter(err.to_string()))?
    };
    let batch = BatchConfigBuilder::default()
        .with_max_queue_size(MAX_QUEUE)
        .with_max_export_batch_size(MAX_BATCH)
        .with_scheduled_delay(SCHEDULED_DELAY)
        .build();
    let processor = BatchSpanProcessor::builder(OnRuntime::new(exporter, runtime))
        .with_batch_config(batch)
        .build();
    Ok(SdkTracerProvider::builder()
        // Sampling is decided before a span is built (`Tracing::begin`).
        .with_sampler(Sampler::AlwaysOn)
        .with_resource(resource(settings))
        .with_span_processor(processor)
        .build())
}

/// Where spans go: the endpoint as given (`http://` added to a bare
/// `host:port`), and for HTTP its `/v1/traces` path, as
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is read. `https` is refused: neither
/// transport is built with TLS.
fn endpoint(settings: &TraceSettings) -> Result<String, Error> {
    let given = settings.endpoint.trim();
    let refused = |why: &str| Error::Endpoint(given.to_owned(), why.to_owned());
    let url = if given.starts_with("https://") {
        return Err(refused(
            "https is not supported: send to a collector over http (a local agent or sidecar)",
        ));
    } else if given.starts_with("http://") {
        given.to_owned()
    } else if given.contains("://") {
        return Err(refused("only http:// endpoints"));
    } else {
        format!("http://{given}")
    };
    let url = url.trim_end_matches('/').to_owned();
    if url.parse::<http::Uri>().is_err() || url.len() <= "http://".len() {
        return Err(refused("not a URL"));
    }
    Ok(match settings.protocol {
        OtlpProtocol::Http => format!("{url}/v1/traces"),
        OtlpProtocol::Grpc => url,
    })
}

/// `service.name`, `service.namespace` (when given) and
/// `service.instance.id` (given, or a random UUID), as
/// envoyproxy/ratelimit sets them.
fn resource(settings: &TraceSettings) -> Resource {
    let instance = settings
        .service_instance_id
        .clone()
        .unwrap_or_else(random_uuid);
    let mut attributes = vec![
        KeyValue::new("service.name", settings.service_name.clone()),
        KeyValue::new("service.instance.id", instance),
        KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
    ];
    if let Some(namespace) = &settings.service_namespace {
        attributes.push(KeyValue::new("service.namespace", namespace.clone()));
    }
    Resource::builder_empty()
        .with_attributes(attributes)
        .build()
}

/// A version 4 UUID, from the SDK's random trace id generator.
fn random_uuid() -> String {
    let mut bytes = RandomIdGenerator::default().new_trace_id().to_bytes();
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|it| format!("{it:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

/// An exporter whose exports run as tasks on a tokio runtime, awaited
/// from the batch processor's own thread.
#[derive(Debug)]
struct OnRuntime<E> {
    inner: Arc<E>,
    runtime: tokio::runtime::Handle,
}

impl<E> OnRuntime<E> {
    fn new(inner: E, runtime: tokio::runtime::Handle) -> Self {
        OnRuntime {
            inner: Arc::new(inner),
            runtime,
        }
    }
}

impl<E: SpanExporter + 'static> SpanExporter for OnRuntime<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let inner = self.inner.clone();
        match self
            .runtime
            .spawn(async move { inner.export(batch).await })
            .await
        {
            Ok(result) => result,
            Err(err) => Err(OTelSdkError::InternalFailure(err.to_string())),
        }
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        // Called once as the provider is built, before any export.
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.set_resource(resource);
        }
    }
}

#[cfg(test)]
mod tests;
