//! Redis behind Sentinel: the master's address is asked of the sentinels
//! every time a connection is opened, so a connection made after a
//! failover reaches the promoted replica without a restart.
//!
//! The few commands are written by hand rather than through
//! `redis::sentinel`, so that every sentinel is asked in the configured
//! order within the call's timeout, and the start-up check can tell "no
//! sentinel answered" from "no sentinel knows this master".
//!
//! Invariant: the master's address is never cached: each connection asks
//! the sentinels again, in their configured order.

use std::fmt;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, ErrorKind, IntoConnectionInfo,
    RedisError, ServerErrorKind,
};
use tokio::time::timeout;

use super::failure::redact;
use super::tls::RedisTls;
use crate::backends::Error;

/// The Sentinel flags.
#[derive(Clone)]
pub struct SentinelSettings {
    /// `host:port` of each sentinel, asked in this order.
    pub nodes: Vec<String>,
    /// The name the sentinels monitor the master under.
    pub master: String,
    /// `AUTH` for the sentinels (their `requirepass`), if any.
    pub password: Option<String>,
}

/// Finds the current master through the sentinels and connects to it.
pub(super) struct Sentinel {
    nodes: Vec<(String, u16)>,
    master: String,
    password: Option<String>,
    /// How to reach the master once its address is known: user, password,
    /// db and TLS from the URL (and the TLS flags); its host and port are
    /// replaced. The sentinels themselves are asked over plain TCP.
    template: ConnectionInfo,
    /// Bound on each sentinel's answer, and on connecting to the master.
    timeout: Duration,
}

/// Why no master could be found.
enum Lookup {
    /// No sentinel answered; each one's failure.
    NoSentinel(Vec<String>),
    /// Every sentinel that answered knows no master by this name.
    UnknownMaster,
}

// === impl SentinelSettings ===

impl fmt::Debug for SentinelSettings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SentinelSettings")
            .field("nodes", &self.nodes)
            .field("master", &self.master)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

// === impl Sentinel ===

impl Sentinel {
    /// Checks the addresses and the URL the master is reached with;
    /// nothing is connected yet.
    pub(super) fn new(
        settings: &SentinelSettings,
        url: &str,
        tls: &RedisTls,
        timeout: Duration,
    ) -> Result<Sentinel, Error> {
        if settings.master.is_empty() {
            return Err(Error::Protocol(
                "redis sentinel master name is empty".into(),
            ));
        }
        if settings.nodes.is_empty() {
            return Err(Error::Protocol("no redis sentinel nodes given".into()));
        }
        let nodes = settings
            .nodes
            .iter()
            .map(|it| parse_node(it))
            .collect::<Result<Vec<_>, _>>()?;
        let template = url
            .into_connection_info()
            .map_err(|err| Error::Protocol(format!("invalid redis url {}: {err}", redact(url))))?;
        if matches!(template.addr(), ConnectionAddr::Unix(_)) {
            return Err(Error::Protocol(
                "a redis+unix url cannot be used with sentinel: the master is reached over tcp"
                    .into(),
            ));
        }
        let template = tls.apply(template, &redact(url))?;
        Ok(Sentinel {
            nodes,
            master: settings.master.clone(),
            password: settings.password.clone(),
            template,
            timeout,
        })
    }

    /// How many sentinels are asked.
    pub(super) fn nodes(&self) -> u32 {
        u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)
    }

    /// Where the sentinels are asked, for logs and errors.
    pub(super) fn describe(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|(host, port)| format!("{host}:{port}"))
            .collect();
        format!("sentinel master {} via {}", self.master, nodes.join(","))
    }

    /// The start-up check: some sentinel answers and knows the master.
    /// The master itself may be down (health reports it, and connections
    /// are made when it answers).
    pub(super) async fn check(&self) -> Result<(), Error> {
        match self.lookup().await {
            Ok(_) => Ok(()),
            Err(Lookup::NoSentinel(errors)) => Err(Error::Unavailable(format!(
                "no redis sentinel could be asked: {}",
                errors.join("; ")
            ))),
            Err(Lookup::UnknownMaster) => Err(Error::Protocol(format!(
                "no redis sentinel knows a master named {:?} ({})",
                self.master,
                self.describe()
            ))),
        }
    }

    /// A multiplexed connection to the node the sentinels name master now,
    /// checked with ROLE (or HELLO where ROLE is not allowed): a node not
    /// yet promoted, or already demoted, would answer every script with
    /// READONLY.
    pub(super) async fn connect(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        let (host, port) = self.lookup().await.map_err(|it| self.lookup_error(it))?;
        let addr = match self.template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host: host.clone(),
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host.clone(), port),
        };
        let client = redis::Client::open(self.template.clone().set_addr(addr))?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        // A node that does not say (ROLE and HELLO both refused) is taken
        // at its word: a READONLY reply opens the circuit anyway.
        let role = super::role::role_of(&mut conn).await?;
        if let Some(role) = role.filter(|it| it != "master") {
            return Err(RedisError::from((
                ErrorKind::Server(ServerErrorKind::ReadOnly),
                "the node sentinel names master is not one",
                format!("{host}:{port} is a {role} (failover in progress?)"),
            )));
        }
        Ok(conn)
    }

    fn lookup_error(&self, lookup: Lookup) -> RedisError {
        match lookup {
            Lookup::NoSentinel(errors) => RedisError::from((
                ErrorKind::Io,
                "no redis sentinel could be asked",
                errors.join("; "),
            )),
            Lookup::UnknownMaster => RedisError::from((
                ErrorKind::MasterNameNotFoundBySentinel,
                "no redis sentinel knows the master",
                self.describe(),
            )),
        }
    }

    /// The master's address from the first sentinel that knows it, asking
    /// each in order within the timeout.
    async fn lookup(&self) -> Result<(String, u16), Lookup> {
        let mut errors = Vec::new();
        let mut answered = false;
        for (host, port) in &self.nodes {
            match timeout(self.timeout, self.ask(host, *port)).await {
                Ok(Ok(Some(addr))) => return Ok(addr),
                Ok(Ok(None)) => answered = true,
                Ok(Err(err)) => errors.push(format!("{host}:{port}: {err}")),
                Err(_) => errors.push(format!(
                    "{host}:{port}: no answer within {} ms",
                    self.timeout.as_millis()
                )),
            }
        }
        if answered {
            Err(Lookup::UnknownMaster)
        } else {
            Err(Lookup::NoSentinel(errors))
        }
    }

    /// `SENTINEL get-master-addr-by-name` on one sentinel; `None` when it
    /// knows no master by that name.
    async fn ask(&self, host: &str, port: u16) -> Result<Option<(String, u16)>, RedisError> {
        let mut info = ConnectionAddr::Tcp(host.to_owned(), port).into_connection_info()?;
        if let Some(password) = &self.password {
            let redis = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(redis);
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let mut conn = redis::Client::open(info)?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let addr: Option<(String, String)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master)
            .query_async(&mut conn)
            .await?;
        let Some((host, port)) = addr else {
            return Ok(None);
        };
        let port = port.parse().map_err(|_| {
            RedisError::from((
                ErrorKind::UnexpectedReturnType,
                "sentinel answered an invalid port",
                port.clone(),
            ))
        })?;
        Ok(Some((host, port)))
    }
}

/// `host:port`; a missing or invalid port is refused rather than guessed.
fn parse_node(node: &str) -> Result<(String, u16), Error> {
    let invalid = || {
        Error::Protocol(format!(
            "invalid redis sentinel address {node:?}: expected host:port"
        ))
    };
    let (host, port) = node.trim().rsplit_once(':').ok_or_else(invalid)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(invalid());
    }
    let port = port.parse::<u16>().map_err(|_| invalid())?;
    Ok((host.to_owned(), port))
}

#[cfg(test)]
mod tests;
