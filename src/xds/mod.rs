//! Rules pushed by a management server over xDS (`--config-xds-server`):
//! the client of the aggregated discovery stream
//! (`envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources`),
//! state of the world, subscribed to every
//! `ratelimit.config.ratelimit.v3.RateLimitConfig` resource (one per domain),
//! as envoyproxy/ratelimit's `CONFIG_TYPE=GRPC_XDS_SOTW` client is.
//!
//! Each response holds the whole config. Its resources become YAML trees
//! (`resources`) loaded by `config::load_trees` (the loader of files, so the
//! same validation and the same messages) and handed to the
//! [`Reloader`](crate::config::reload::Reloader) with `apply`: a valid config
//! is swapped in atomically, a refused one leaves the last good rules in
//! force; either way the outcome is logged, counted
//! (`throttlegate_config_reloads_total`) and shown by `/rlconfig`. The
//! response is then ACKed (its `version_info` and `nonce`) or NACKed (the
//! version last accepted, its `nonce`, and the loader's message in
//! `error_detail`).
//!
//! A stream that fails or ends, or a server that cannot be reached, is
//! retried after a back-off: `--config-xds-retry-interval-ms` at first,
//! doubled after each failure up to [`MAX_BACKOFF`], with up to half of it
//! added at random; it starts again from the first interval once a stream
//! has carried a response. Every new stream subscribes afresh (no version),
//! so a restarted server sends its whole state.

mod connect;
pub mod resources;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::config::reload::Reloader;
use crate::config::{self, LoadOptions};
use crate::proto::xds::envoy::config::core::v3::Node;
use crate::proto::xds::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use crate::proto::xds::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use crate::proto::xds::google::rpc::Status;

pub use connect::{XdsServerAddress, XdsTls};
pub use resources::RATE_LIMIT_CONFIG_TYPE;

/// The longest wait between two connection attempts (envoyproxy/ratelimit's
/// default cap, `XDS_CLIENT_BACKOFF_MAX_INTERVAL`).
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// The most bytes of a NACK's message: a refused config with thousands of
/// problems is summed up by its first ones.
const MAX_NACK_MESSAGE: usize = 16 * 1024;

/// gRPC's INVALID_ARGUMENT, the code of a NACK's `error_detail`.
const INVALID_ARGUMENT: i32 = 3;

/// Requests waiting to be sent on one stream: one per response at most.
const OUTBOX: usize = 4;

/// How to reach the management server and whom to say we are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsSettings {
    pub server: XdsServerAddress,
    /// The node id the server picks our resources by.
    pub node_id: String,
    /// Node metadata, string values.
    pub node_metadata: Vec<(String, String)>,
    /// `None`: plain HTTP/2.
    pub tls: Option<XdsTls>,
    /// The first wait after a failed connection or stream.
    pub retry_interval: Duration,
}

impl XdsSettings {
    /// Checks what can be checked before connecting: the TLS files and the
    /// server's name. The message names the file or the setting at fault.
    pub fn check(&self) -> Result<(), String> {
        if let Some(tls) = &self.tls {
            connect::client_config(tls)?;
            connect::server_name(&self.server, tls)?;
        }
        Ok(())
    }

    fn node(&self) -> Node {
        let fields = self
            .node_metadata
            .iter()
            .map(|(key, value)| {
                let value = prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(value.clone())),
                };
                (key.clone(), value)
            })
            .collect();
        Node {
            id: self.node_id.clone(),
            metadata: Some(prost_types::Struct { fields }),
            user_agent_name: "throttlegate".to_owned(),
            ..Node::default()
        }
    }
}

/// The subscription's task; dropping it ends the subscription.
#[derive(Debug)]
pub struct Subscription {
    task: JoinHandle<()>,
    accepted: watch::Receiver<bool>,
}

impl Subscription {
    /// Waits until a config has been accepted (at once if one was).
    pub async fn first_config(&mut self) {
        // The sender lives as long as the task, which never ends on its own.
        let _ = self.accepted.wait_for(|it| *it).await;
    }

    /// Whether a config has been accepted.
    pub fn has_config(&self) -> bool {
        *self.accepted.borrow()
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Subscribes to the server in `settings` from now on, installing each
/// config it sends through `reloader` (loaded with `options`).
pub fn subscribe(
    settings: XdsSettings,
    reloader: Arc<Reloader>,
    options: LoadOptions,
) -> Subscription {
    let (accepted_tx, accepted) = watch::channel(false);
    let client = Client {
        node: settings.node(),
        settings,
        reloader,
        options,
        accepted_version: String::new(),
        accepted: accepted_tx,
    };
    Subscription {
        task: tokio::spawn(client.run()),
        accepted,
    }
}

/// The state of the subscription across streams.
struct Client {
    settings: XdsSettings,
    node: Node,
    reloader: Arc<Reloader>,
    options: LoadOptions,
    /// The version of the config in force, sent with every NACK.
    accepted_version: String,
    accepted: watch::Sender<bool>,
}

impl Client {
    async fn run(mut self) {
        let server = format!(
            "{}:{}",
            self.settings.server.host, self.settings.server.port
        );
        let mut backoff = Backoff::new(self.settings.retry_interval);
        loop {
            tracing::info!(%server, node = %self.settings.node_id, "xDS: connecting");
            let (responses, why) =
                match connect::connect(&self.settings.server, self.settings.tls.as_ref()).await {
                    Ok(channel) => self.stream(channel).await,
                    Err(err) => (0, format!("cannot connect: {err}")),
                };
            if responses > 0 {
                backoff.reset();
            }
            let wait = backoff.next();
            tracing::warn!(
                %server,
                retry_in_ms = wait.as_millis() as u64,
                "xDS: {why}; the rules in force stay"
            );
            tokio::time::sleep(wait).await;
        }
    }

    /// One stream: subscribes, then answers each response until the stream
    /// ends. Returns how many responses it carried and why it ended.
    async fn stream(&mut self, channel: tonic::transport::Channel) -> (u64, String) {
        let (outbox, requests) = mpsc::channel(OUTBOX);
        let subscribe = DiscoveryRequest {
            node: Some(self.node.clone()),
            type_url: RATE_LIMIT_CONFIG_TYPE.to_owned(),
            ..DiscoveryRequest::default()
        };
        if outbox.send(subscribe).await.is_err() {
            return (0, "the stream closed".to_owned());
        }
        let limit = usize::try_from(self.options.limits.max_total_bytes)
            .unwrap_or(usize::MAX)
            .saturating_add(1 << 20);
        let mut client =
            AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(limit);
        let mut inbound = match client
            .stream_aggregated_resources(ReceiverStream::new(requests))
            .await
        {
            Ok(it) => it.into_inner(),
            Err(status) => return (0, format!("the stream was refused: {status}")),
        };
        let mut responses = 0;
        loop {
            let response = match inbound.message().await {
                Ok(Some(it)) => it,
                Ok(None) => return (responses, "the server ended the stream".to_owned()),
                Err(status) => return (responses, format!("the stream failed: {status}")),
            };
            responses += 1;
            let answer = self.answer(response).await;
            if outbox.send(answer).await.is_err() {
                return (responses, "the stream closed".to_owned());
            }
        }
    }

    /// Installs the config in `response` and returns its ACK, or its NACK.
    async fn answer(&mut self, response: DiscoveryResponse) -> DiscoveryRequest {
        let DiscoveryResponse {
            version_info,
            resources,
            type_url,
            nonce,
            ..
        } = response;
        let loaded = if type_url == RATE_LIMIT_CONFIG_TYPE {
            self.install(resources).await
        } else {
            Err(format!(
                "type '{type_url}' was not subscribed to (only '{RATE_LIMIT_CONFIG_TYPE}')"
            ))
        };
        let mut answer = DiscoveryRequest {
            type_url,
            response_nonce: nonce,
            ..DiscoveryRequest::default()
        };
        match loaded {
            Ok(domains) => {
                tracing::info!(version = %version_info, domains, "xDS: config accepted");
                self.accepted_version = version_info.clone();
                self.accepted.send_replace(true);
                answer.version_info = version_info;
            }
            Err(message) => {
                tracing::warn!(version = %version_info, "xDS: config refused (NACK)");
                answer.version_info = self.accepted_version.clone();
                answer.error_detail = Some(Status {
                    code: INVALID_ARGUMENT,
                    message: capped(message),
                    details: Vec::new(),
                });
            }
        }
        answer
    }

    /// Loads `resources` and hands the result to the reloader, on a
    /// blocking thread; the number of domains in force, or the message of
    /// the refusal.
    async fn install(&self, resources: Vec<prost_types::Any>) -> Result<usize, String> {
        let reloader = self.reloader.clone();
        let options = self.options;
        let installed = tokio::task::spawn_blocking(move || {
            let loaded = resources::trees(&resources, &options.limits)
                .and_then(|trees| config::load_trees(trees, &options));
            reloader.apply(loaded)
        })
        .await;
        match installed {
            Ok(Ok(summary)) => Ok(summary.domains),
            Ok(Err(err)) => Err(err.to_string()),
            Err(err) => Err(format!("config load failed: {err}")),
        }
    }
}

/// `message` cut to [`MAX_NACK_MESSAGE`] bytes at a character boundary.
fn capped(mut message: String) -> String {
    if message.len() > MAX_NACK_MESSAGE {
        let mut end = MAX_NACK_MESSAGE;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str("...");
    }
    message
}

/// Waits between connection attempts: doubling from the first interval up
/// to [`MAX_BACKOFF`], each with up to half of it again added at random,
/// so that many instances restarted together do not reconnect in step.
#[derive(Debug)]
struct Backoff {
    first: Duration,
    current: Duration,
}

impl Backoff {
    fn new(first: Duration) -> Backoff {
        let first = first.clamp(Duration::from_millis(1), MAX_BACKOFF);
        Backoff {
            first,
            current: first,
        }
    }

    fn reset(&mut self) {
        self.current = self.first;
    }

    /// The next wait.
    fn next(&mut self) -> Duration {
        let base = self.current;
        self.current = (self.current * 2).min(MAX_BACKOFF);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |it| it.subsec_nanos());
        base + base.mul_f64(f64::from(nanos % 1_000) / 2_000.0)
    }
}

#[cfg(test)]
mod tests;
