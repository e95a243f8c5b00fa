//! What the command line says of a Redis Cluster, and the cluster clients
//! made from it: the backend's (no retries of its own) and one for calls
//! safe to send twice.
//!
//! Invariant: every seed is reached with the same credentials and TLS, and
//! the backend's client never retries a call on its own.

use std::fmt;
use std::time::Duration;

use redis::TlsMode;
use redis::cluster::{ClusterClient, ClusterClientBuilder};

use super::super::failure::redact;
use super::super::gate;
use super::super::settings::ClockSource;
use super::super::tls::RedisTls;
use crate::backends::Error;
use crate::backends::keys::KeyFormat;

/// Everything needed to reach a cluster, from the command line.
#[derive(Clone)]
pub struct ClusterSettings {
    /// Seed nodes: `host:port`, `redis://` or `rediss://` URLs (with
    /// user:password); any subset of the cluster.
    pub nodes: Vec<String>,
    /// Cluster connections kept (each multiplexed, one socket per node).
    pub pool_size: u32,
    /// Bound on every call, including its redirects; also the probe's.
    pub timeout_ms: u64,
    /// Prefix and hash tag of every key.
    pub keys: KeyFormat,
    pub clock: ClockSource,
    /// As [`RedisSettings::expiry_grace_ms`](crate::backends::redis::RedisSettings::expiry_grace_ms).
    pub expiry_grace_ms: u64,
    /// As [`RedisSettings::tls`](crate::backends::redis::RedisSettings::tls): for every node.
    pub tls: RedisTls,
}

// === impl ClusterSettings ===

impl ClusterSettings {
    pub(super) fn validate(&self) -> Result<(), Error> {
        if self.nodes.is_empty() {
            return Err(Error::Protocol("redis cluster needs a seed node".into()));
        }
        if self.pool_size == 0 {
            return Err(Error::Protocol("redis pool size must be at least 1".into()));
        }
        if self.timeout_ms == 0 {
            return Err(Error::Protocol(
                "redis timeout must be at least 1 ms".into(),
            ));
        }
        Ok(())
    }

    /// The client; nothing is connected yet. No retries (see the `cluster`
    /// module doc); connect bounded by the timeout, a reply awaited for
    /// [`gate::UNANSWERED_AFTER`] beyond it: every call is bounded by its
    /// caller's deadline (`timeout_at`), and a decision that comes after it
    /// is still read (`hear_late`).
    pub(super) fn client(&self) -> Result<ClusterClient, Error> {
        let timeout = Duration::from_millis(self.timeout_ms);
        let builder = self.builder()?.retries(0);
        self.build(builder.response_timeout(timeout.saturating_add(gate::UNANSWERED_AFTER)))
    }

    /// A client for calls that may be sent again (they are safe to run
    /// twice): the client itself follows MOVED and ASK, and tries again
    /// after TRYAGAIN, CLUSTERDOWN, READONLY or a lost connection, at most
    /// `retries` times; same seeds, TLS and bounds as the backend's.
    pub fn redirecting_client(&self, retries: u32) -> Result<ClusterClient, Error> {
        self.validate()?;
        self.build(self.builder()?.retries(retries))
    }

    fn build(&self, builder: ClusterClientBuilder) -> Result<ClusterClient, Error> {
        builder.build().map_err(|err| {
            Error::Protocol(format!(
                "invalid redis cluster nodes {}: {err}",
                redact_nodes(&self.nodes)
            ))
        })
    }

    /// The seeds as URLs, with the TLS settings; connect and response
    /// bounded by the timeout.
    fn builder(&self) -> Result<ClusterClientBuilder, Error> {
        // rustls needs a process-wide crypto provider for `rediss://`.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let timeout = Duration::from_millis(self.timeout_ms);
        let nodes = if self.tls.is_set() {
            // A bare `host:port` is reached the way the TLS settings say.
            let nodes: Vec<String> = self
                .nodes
                .iter()
                .map(|it| match it.contains("://") {
                    true => it.clone(),
                    false => format!("rediss://{}", it.trim()),
                })
                .collect();
            seed_urls(&nodes)
        } else {
            seed_urls(&self.nodes)
        };
        let mut builder = ClusterClientBuilder::new(nodes.clone())
            .connection_timeout(timeout)
            .response_timeout(timeout);
        if self.tls.is_set() {
            if let Some(plain) = nodes.iter().find(|it| !it.starts_with("rediss://")) {
                return Err(Error::Protocol(format!(
                    "redis tls settings need rediss:// cluster nodes, not {}",
                    redact(plain)
                )));
            }
            if let Some(certs) = self.tls.certificates()? {
                builder = builder.certs(certs);
            }
            if self.tls.insecure {
                builder = builder.tls(TlsMode::Insecure);
            }
            if self.tls.skip_hostname_verification {
                builder = builder.danger_accept_invalid_hostnames(true);
            }
        }
        Ok(builder)
    }
}

/// `host:port` as a URL; URLs as given.
fn node_url(node: &str) -> String {
    let node = node.trim();
    if node.contains("://") {
        node.to_owned()
    } else {
        format!("redis://{node}")
    }
}

/// Every seed as a URL. The client needs the same credentials (and TLS)
/// on every seed, so a bare `host:port` takes the scheme and user:password
/// of the first URL that has them: credentials given once apply to all.
fn seed_urls(nodes: &[String]) -> Vec<String> {
    let urls: Vec<String> = nodes.iter().map(|it| node_url(it)).collect();
    let with_credentials = urls.iter().find_map(|url| {
        let (scheme, rest) = url.split_once("://")?;
        let (userinfo, _) = rest.rsplit_once('@')?;
        Some((scheme.to_owned(), userinfo.to_owned()))
    });
    let Some((scheme, userinfo)) = with_credentials else {
        return urls;
    };
    nodes
        .iter()
        .zip(urls)
        .map(|(node, url)| {
            if node.trim().contains("://") {
                url
            } else {
                format!("{scheme}://{userinfo}@{}", node.trim())
            }
        })
        .collect()
}

pub(super) fn redact_nodes(nodes: &[String]) -> String {
    nodes
        .iter()
        .map(|it| redact(it))
        .collect::<Vec<_>>()
        .join(",")
}

impl fmt::Debug for ClusterSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterSettings")
            .field("nodes", &redact_nodes(&self.nodes))
            .field("pool_size", &self.pool_size)
            .field("timeout_ms", &self.timeout_ms)
            .field("keys", &self.keys)
            .field("clock", &self.clock)
            .field("expiry_grace_ms", &self.expiry_grace_ms)
            .field("tls", &self.tls)
            .finish()
    }
}
#[cfg(test)]
mod tests;
