//! How a Redis failure becomes a backend error, and what is safe to say
//! of a server in one (its URL without the password).
//!
//! Invariant: every Redis error reaching a caller went through [`classify`],
//! so the failure mode sees one of the backend's [`Error`] kinds, and no
//! error or log line carries a password.

use std::time::Duration;

use redis::{ErrorKind, RedisError, ServerErrorKind};

use crate::backends::Error;

/// Whether the connection that produced `err` is dead and must be replaced.
/// A timeout is not: the multiplexed connection still serves other calls
/// (redis-rs reports it as an I/O error, hence the explicit exclusion).
pub(super) fn is_broken(err: &RedisError) -> bool {
    !err.is_timeout()
        && (err.is_io_error() || err.is_connection_dropped() || err.is_unrecoverable_error())
}

/// Whether `err` says the node is a replica now (a master demoted by a
/// failover keeps its connections): connections to it must be replaced by
/// ones to the new master, which only a Sentinel target finds.
pub(super) fn is_demoted(err: &RedisError) -> bool {
    matches!(err.kind(), ErrorKind::Server(ServerErrorKind::ReadOnly))
}

/// Maps a Redis failure to a backend error where it arises.
pub(super) fn classify(err: &RedisError, timeout_ms: u64) -> Error {
    if err.is_timeout() {
        return Error::Timeout(timeout_ms);
    }
    if is_broken(err) || err.is_connection_refusal() {
        return Error::Unavailable(err.to_string());
    }
    let unavailable = matches!(
        err.kind(),
        ErrorKind::AuthenticationFailed
            | ErrorKind::MasterNameNotFoundBySentinel
            | ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
    ) || matches!(err.code(), Some("BUSY" | "NOAUTH" | "WRONGPASS"));
    if unavailable {
        Error::Unavailable(err.to_string())
    } else {
        Error::Protocol(err.to_string())
    }
}

/// The URL without its password, for logs and errors.
pub(super) fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    match rest.rsplit_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            format!("{scheme}://{user}:***@{host}")
        }
        None => url.to_owned(),
    }
}
/// A timeout in whole milliseconds, as errors report it.
pub(super) fn timeout_ms(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
