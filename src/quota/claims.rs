//! How many pools each client keeps alive: a client (a peer address, so
//! across its reconnects and streams) claims a pool with its first report
//! of a bucket in it, and the claim lasts until [`CLAIM_HOLD_US`] after its
//! last report of one, as long as the pool outlives it (in Redis and in
//! this instance's view of it). At most [`MAX_POOLS_PER_CLIENT`] claims per
//! client and [`MAX_POOL_CLAIMS`] in all: a bucket that would need one
//! more is answered DENY_ALL and its pool is never made, so the pools a
//! client can make, and the memory they take here and in Redis, stay
//! bounded however often it reopens streams.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::{Mutex, MutexGuard};

use super::mapping::{PoolKey, Resolution};
use super::share::ASSIGNMENT_TTL_US;
use crate::log_gate::LogGate;

/// Pools one client address may keep alive at once.
pub const MAX_POOLS_PER_CLIENT: usize = 8192;
/// Pools all clients together may keep alive at once.
pub const MAX_POOL_CLAIMS: usize = 131_072;
/// A claim outlives the client's last report of the pool by this much:
/// the time a pool is kept after its last write.
pub const CLAIM_HOLD_US: u64 = 4 * ASSIGNMENT_TTL_US;

/// Every client's claims.
#[derive(Debug, Default)]
pub(super) struct PoolClaims {
    state: Mutex<ClaimsByClient>,
    /// Keyed at random: nobody can make two pools share a claim.
    hasher: RandomState,
}

/// The claims under one lock.
#[derive(Debug, Default)]
struct ClaimsByClient {
    /// By client, the pools claimed (by their key's hash) and when each
    /// was last reported.
    clients: HashMap<Option<IpAddr>, HashMap<u64, u64>>,
    total: usize,
}

impl PoolClaims {
    /// Whether `client` may report to `pool` at `now` (its claim made or
    /// renewed), or is past its bound or the server's.
    pub(super) fn claim(&self, client: Option<IpAddr>, pool: &PoolKey, now: u64) -> bool {
        let hash = self.hasher.hash_one(pool);
        let mut state = lock(&self.state);
        let full = state.total >= MAX_POOL_CLAIMS;
        let claims = state.clients.entry(client).or_default();
        if let Some(at) = claims.get_mut(&hash) {
            *at = now;
            return true;
        }
        if full || claims.len() >= MAX_POOLS_PER_CLIENT {
            if claims.is_empty() {
                state.clients.remove(&client);
            }
            return false;
        }
        claims.insert(hash, now);
        state.total += 1;
        true
    }

    /// `resolution`, or DENY_ALL when its pool would be one more than
    /// `client` may keep alive (logged through `log`).
    pub(super) fn bound(
        &self,
        client: Option<IpAddr>,
        resolution: Resolution,
        now: u64,
        log: &LogGate,
    ) -> Resolution {
        match resolution {
            Resolution::Shared { rule, pool, .. } if !self.claim(client, &pool, now) => {
                if let Some(suppressed) = log.admit() {
                    tracing::warn!(
                        client = ?client,
                        suppressed,
                        "a client reported more pools than it may keep alive; the bucket is denied"
                    );
                }
                Resolution::Blocked { rule }
            }
            other => other,
        }
    }

    /// Forgets claims older than [`CLAIM_HOLD_US`], and gives back the
    /// memory of those forgotten.
    pub(super) fn sweep(&self, now: u64) {
        let mut state = lock(&self.state);
        let mut total = 0;
        state.clients.retain(|_, claims| {
            claims.retain(|_, at| now.saturating_sub(*at) < CLAIM_HOLD_US);
            if claims.capacity() > 4 * claims.len().max(8) {
                claims.shrink_to_fit();
            }
            total += claims.len();
            !claims.is_empty()
        });
        if state.clients.capacity() > 4 * state.clients.len().max(8) {
            state.clients.shrink_to_fit();
        }
        state.total = total;
    }

    /// Claims held, in all.
    #[cfg(test)]
    fn total(&self) -> usize {
        lock(&self.state).total
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
