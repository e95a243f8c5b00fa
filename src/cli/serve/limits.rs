//! The flags bounding what one client may hold of either server:
//! connections, streams, and time. Invariant: a connection cap not given
//! stays unset here; `app` derives it from the file descriptor limit.

use std::time::Duration;

use clap::Args;

use crate::app::ServerLimits;
use crate::transport::grpc::GrpcLimits;
use crate::transport::http::HttpLimits;

/// What one client may hold of the servers.
#[derive(Debug, Args)]
pub(super) struct LimitArgs {
    /// Most gRPC connections open at once [default: from the descriptor
    /// limit, see docs/configuration.md].
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    grpc_max_connections: Option<u32>,
    /// Streams one gRPC connection may have open (advertised as
    /// SETTINGS_MAX_CONCURRENT_STREAMS; more are refused).
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONCURRENT_STREAMS", default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..))]
    grpc_max_concurrent_streams: u32,
    /// A gRPC connection that has not sent the HTTP/2 preface and one
    /// complete request's headers within this time is closed.
    #[arg(long, env = "THROTTLEGATE_GRPC_HANDSHAKE_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_handshake_timeout_ms: u64,
    /// An HTTP/2 PING is sent to a gRPC peer silent for this long.
    #[arg(long, env = "THROTTLEGATE_GRPC_KEEPALIVE_INTERVAL_MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_keepalive_interval_ms: u64,
    /// A gRPC connection whose PING is not acknowledged within this is closed.
    #[arg(long, env = "THROTTLEGATE_GRPC_KEEPALIVE_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_keepalive_timeout_ms: u64,
    /// A gRPC connection older than this gets GOAWAY (clients reconnect;
    /// running requests finish).
    #[arg(long, env = "THROTTLEGATE_GRPC_MAX_CONNECTION_AGE_MS", default_value_t = 3_600_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_max_connection_age_ms: u64,
    /// How long after its GOAWAY a gRPC connection with streams still open
    /// is closed.
    #[arg(
        long,
        env = "THROTTLEGATE_GRPC_MAX_CONNECTION_AGE_GRACE_MS",
        default_value_t = 30_000
    )]
    grpc_max_connection_age_grace_ms: u64,
    /// A gRPC request not answered within this (its body included) is ended
    /// with CANCELLED.
    #[arg(long, env = "THROTTLEGATE_GRPC_REQUEST_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    grpc_request_timeout_ms: u64,
    /// Threads serving gRPC connections, each with its own single-threaded
    /// runtime; connections are dealt to them in turn and stay on theirs. 0
    /// serves them on the shared runtime with everything else.
    #[arg(long, env = "THROTTLEGATE_GRPC_THREADS", default_value_t = 0)]
    grpc_threads: u16,
    /// Most HTTP connections open at once [default: from the descriptor
    /// limit, see docs/configuration.md].
    #[arg(long, env = "THROTTLEGATE_HTTP_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    http_max_connections: Option<u32>,
    /// An HTTP request head must arrive whole within this of its first
    /// byte (of the accept, for a connection's first request).
    #[arg(long, env = "THROTTLEGATE_HTTP_HEADER_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_header_timeout_ms: u64,
    /// An HTTP request body must arrive whole within this of its head.
    #[arg(long, env = "THROTTLEGATE_HTTP_BODY_TIMEOUT_MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_body_timeout_ms: u64,
    /// An HTTP keep-alive connection is closed after this long without a
    /// request.
    #[arg(long, env = "THROTTLEGATE_HTTP_IDLE_TIMEOUT_MS", default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1..))]
    http_idle_timeout_ms: u64,
}

/// The flags as [`ServerLimits`], the milliseconds as durations.
pub(super) fn server_limits(args: &LimitArgs) -> ServerLimits {
    ServerLimits {
        grpc_max_connections: args.grpc_max_connections.map(|it| it as usize),
        http_max_connections: args.http_max_connections.map(|it| it as usize),
        grpc: GrpcLimits {
            max_concurrent_streams: args.grpc_max_concurrent_streams,
            handshake_timeout: Duration::from_millis(args.grpc_handshake_timeout_ms),
            keepalive_interval: Duration::from_millis(args.grpc_keepalive_interval_ms),
            keepalive_timeout: Duration::from_millis(args.grpc_keepalive_timeout_ms),
            max_connection_age: Duration::from_millis(args.grpc_max_connection_age_ms),
            max_connection_age_grace: Duration::from_millis(args.grpc_max_connection_age_grace_ms),
            request_timeout: Duration::from_millis(args.grpc_request_timeout_ms),
            threads: usize::from(args.grpc_threads),
            ..GrpcLimits::standard()
        },
        http: HttpLimits {
            header_timeout: Duration::from_millis(args.http_header_timeout_ms),
            body_timeout: Duration::from_millis(args.http_body_timeout_ms),
            idle_timeout: Duration::from_millis(args.http_idle_timeout_ms),
            ..HttpLimits::standard()
        },
    }
}
