//! The listening sockets and how many connections each server may hold:
//! the caps not given come from the file descriptor limit, less what Redis
//! and the service itself need. Invariant: a port that cannot be bound
//! stops the start.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::transport::grpc::GrpcLimits;
use crate::transport::http::HttpLimits;
use crate::transport::listener::DescriptorBudget;

use super::{Aborted, RedisFlags, ServerLimits};

/// Descriptors kept free of client connections beyond the Redis pool:
/// standard streams, the listening sockets, the config watcher, the
/// runtime's own, and Redis reconnections.
const DESCRIPTOR_RESERVE: u64 = 128;

/// Listens on `addr`; failing stops the start, naming the address.
pub(super) async fn bind(addr: SocketAddr) -> Result<TcpListener, Aborted> {
    TcpListener::bind(addr)
        .await
        .map_err(|err| Aborted::Failed(format!("cannot listen on {addr}: {err}")))
}

// === connection caps ===

/// Raises the soft `RLIMIT_NOFILE` to the hard limit, logs both, and
/// returns the descriptor budget the connection caps come from.
fn descriptor_budget(redis_sockets: u64) -> DescriptorBudget {
    let reserve = DESCRIPTOR_RESERVE + redis_sockets;
    let limit = match rlimit::getrlimit(rlimit::Resource::NOFILE) {
        Ok((soft, hard)) => match rlimit::increase_nofile_limit(hard) {
            Ok(raised) => {
                tracing::info!(
                    soft = raised,
                    hard,
                    previous_soft = soft,
                    "file descriptor limit"
                );
                raised
            }
            Err(err) => {
                tracing::warn!(soft, hard, "cannot raise the file descriptor limit: {err}");
                soft
            }
        },
        Err(err) => {
            tracing::warn!("cannot read the file descriptor limit, assuming 1024: {err}");
            1024
        }
    };
    DescriptorBudget { limit, reserve }
}

/// The most sockets the Redis backend holds: its pool, once more per
/// serving thread (`--grpc-threads`, each has its own), or once per node
/// on a cluster. The primaries are not known before connecting, so the
/// seeds count, and never fewer than the three primaries a cluster has at
/// least (an operator listing a few seeds of a larger cluster sets the
/// caps). The quota pools (RLQS) hold one connection more: two sockets
/// on a server (the one kept and one being opened to replace it, or the
/// Sentinel asked for the master), one per node on a cluster. Without
/// Redis the reserve for it is kept all the same: it is small.
pub(super) fn redis_sockets(flags: &RedisFlags, serving_threads: usize) -> u64 {
    let pool = u64::from(flags.pool_size);
    if flags.cluster_nodes.is_empty() {
        return pool * (1 + serving_threads as u64) + 2;
    }
    let nodes = (flags.cluster_nodes.len() as u64).max(3);
    pool * nodes + nodes
}

/// Both servers' limits, with the connection caps not given derived from
/// the descriptor budget (warned about when the given ones exceed it).
pub(super) fn connection_limits(
    limits: &ServerLimits,
    redis_sockets: u64,
) -> (GrpcLimits, HttpLimits) {
    let budget = descriptor_budget(redis_sockets);
    let (grpc_default, http_default) = budget.default_caps();
    let grpc_max_connections = limits.grpc_max_connections.unwrap_or(grpc_default);
    let http_max_connections = limits.http_max_connections.unwrap_or(http_default);
    let total = (grpc_max_connections + http_max_connections) as u64;
    if total > budget.limit.saturating_sub(budget.reserve) {
        tracing::warn!(
            grpc_max_connections,
            http_max_connections,
            descriptor_limit = budget.limit,
            reserve = budget.reserve,
            "the connection caps exceed the descriptor limit less its reserve: clients can exhaust descriptors"
        );
    }
    tracing::info!(
        grpc_max_connections,
        http_max_connections,
        "connection caps"
    );
    let grpc = GrpcLimits {
        max_connections: grpc_max_connections,
        ..limits.grpc
    };
    let http = HttpLimits {
        max_connections: http_max_connections,
        ..limits.http
    };
    (grpc, http)
}

#[cfg(test)]
mod tests;
