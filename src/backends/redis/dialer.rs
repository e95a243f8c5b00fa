//! How a connection to one Redis server is made: to the server a URL
//! names, or to whichever node the sentinels name master at that moment.
//!
//! Invariant: every connection made here is to a node that takes writes
//! ([`role`](super::role)), so a failover is followed by reconnecting.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisError};

use super::role::require_writable;
use super::sentinel::Sentinel;

/// Where connections go: one server, or whichever node the sentinels name
/// master when the connection is made (so every reconnect asks them again).
#[derive(Clone)]
pub(super) enum Dialer {
    Direct(Box<redis::Client>),
    Sentinel(Arc<Sentinel>),
}

impl Dialer {
    /// A fresh multiplexed connection to a node that takes writes; through
    /// Sentinel, to the node named master now. A replica (`ROLE` says
    /// so) is refused with a READONLY error, as every call would be: the
    /// failed connect opens the circuit, and nothing (no library) is sent.
    pub(super) async fn connect(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        match self {
            Dialer::Direct(client) => {
                let mut conn = client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?;
                require_writable(&mut conn).await?;
                Ok(conn)
            }
            Dialer::Sentinel(sentinel) => sentinel.connect(config).await,
        }
    }

    /// How long one [`Dialer::connect`] may take when every step uses its
    /// whole `timeout`: through Sentinel, each sentinel in turn, then the
    /// master. A dead first sentinel then delays a reconnect without
    /// preventing it.
    pub(super) fn bound(&self, timeout: Duration) -> Duration {
        match self {
            Dialer::Direct(_) => timeout,
            Dialer::Sentinel(sentinel) => timeout * (sentinel.nodes() + 1),
        }
    }
}
