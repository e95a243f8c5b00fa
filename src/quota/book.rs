//! The shares of one instance: every pool, which stream each member
//! belongs to, and the outbox of each stream, through which a change to a
//! member's share reaches its proxy.
//!
//! An outbox keeps only the latest grant per bucket (a later change
//! replaces one not yet written), so pushing never blocks and never
//! grows past the stream's buckets; the stream writes what it holds when
//! its proxy reads.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;

use crate::clock::{Clock, Micros};

use super::bucket::Grant;
use super::mapping::PoolKey;
use super::share::{Budget, Change, MemberId, MemberView, Pool, Usage};

/// A stream's bucket, numbered by the stream.
pub type Slot = u32;

/// What waits to be written to one stream.
#[derive(Debug, Default)]
pub struct Outbox {
    pending: Mutex<Pending>,
    notify: Notify,
}

#[derive(Debug, Default)]
struct Pending {
    grants: BTreeMap<Slot, Grant>,
    /// When the oldest grant still waiting was put here.
    since: Option<Micros>,
}

impl Outbox {
    pub fn new() -> Arc<Outbox> {
        Arc::new(Outbox::default())
    }

    /// Puts `grant` for `slot`, replacing one not yet taken.
    pub fn put(&self, slot: Slot, grant: Grant, now: Micros) {
        {
            let mut pending = lock(&self.pending);
            pending.grants.insert(slot, grant);
            pending.since.get_or_insert(now);
        }
        self.notify.notify_one();
    }

    /// Everything waiting, once there is something.
    pub async fn take(&self) -> BTreeMap<Slot, Grant> {
        loop {
            let notified = self.notify.notified();
            {
                let mut pending = lock(&self.pending);
                if !pending.grants.is_empty() {
                    pending.since = None;
                    return std::mem::take(&mut pending.grants);
                }
            }
            notified.await;
        }
    }

    /// Since when grants have waited unread; `None` when nothing waits.
    pub fn waiting_since(&self) -> Option<Micros> {
        lock(&self.pending).since
    }
}

/// A member's place: the stream it answers through and the pool it is in.
#[derive(Debug)]
struct Subscriber {
    outbox: Arc<Outbox>,
    slot: Slot,
    pool: PoolKey,
}

#[derive(Debug, Default)]
struct Inner {
    pools: HashMap<PoolKey, Pool>,
    subscribers: HashMap<MemberId, Subscriber>,
}

/// What a report led to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    /// The reporter's share, and as a grant.
    pub share: u64,
    pub grant: Grant,
    /// The reporter's share is not the one it had.
    pub changed: bool,
    /// Other members sent a changed share.
    pub pushed: usize,
    /// The pool's shares that count against its budget, summed.
    pub committed: u64,
}

/// What `/rlconfig` shows of one pool.
#[derive(Debug, Clone)]
pub struct PoolView {
    pub pool: PoolKey,
    pub budget: Budget,
    pub members: Vec<MemberView>,
}

/// The pools of this instance (budgets shared by the proxies connected to
/// it).
#[derive(Debug)]
pub struct QuotaBook {
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    next_member: AtomicU64,
}

impl QuotaBook {
    pub fn new(clock: Arc<dyn Clock>) -> QuotaBook {
        QuotaBook {
            clock,
            inner: Mutex::new(Inner::default()),
            next_member: AtomicU64::new(1),
        }
    }

    pub fn now(&self) -> Micros {
        self.clock.now_us()
    }

    /// A new member id, for one bucket of one stream.
    pub fn member_id(&self) -> MemberId {
        self.next_member.fetch_add(1, Ordering::Relaxed)
    }

    /// `member` (the bucket `slot` of the stream writing to `outbox`)
    /// reported `usage` of a bucket in `pool` with `budget`. Its own grant
    /// is returned; every other member whose share changed gets its new
    /// grant in its outbox.
    pub fn report(
        &self,
        member: MemberId,
        slot: Slot,
        outbox: &Arc<Outbox>,
        pool: &PoolKey,
        budget: Budget,
        usage: Option<Usage>,
    ) -> Reported {
        let now = self.now();
        let mut inner = lock(&self.inner);
        let inner = &mut *inner;
        // A bucket whose rule changed (a reload) leaves its old pool.
        if let Some(old) = inner.subscribers.get(&member).map(|it| it.pool.clone())
            && &old != pool
        {
            leave_pool(&mut inner.pools, &old, member, now);
        }
        inner.subscribers.insert(
            member,
            Subscriber {
                outbox: outbox.clone(),
                slot,
                pool: pool.clone(),
            },
        );
        let entry = inner
            .pools
            .entry(pool.clone())
            .or_insert_with(|| Pool::new(budget));
        let mut changes = entry.set_budget(budget, now);
        changes.extend(entry.report(member, usage, now));
        let window_us = entry.budget().window_us;
        let mut reported = Reported {
            share: 0,
            grant: Grant::DenyAll,
            changed: false,
            pushed: 0,
            committed: entry.committed(),
        };
        for Change {
            member: id,
            share,
            changed,
        } in changes
        {
            let grant = Grant::for_share(share, window_us);
            if id == member {
                reported.share = share;
                reported.grant = grant;
                reported.changed |= changed;
            } else if let Some(subscriber) = inner.subscribers.get(&id) {
                subscriber.outbox.put(subscriber.slot, grant, now);
                reported.pushed += 1;
            }
        }
        reported
    }

    /// `member`'s stream ended, or its bucket no longer has a shared
    /// budget: its share is held until it expires.
    pub fn leave(&self, member: MemberId) {
        let now = self.now();
        let mut inner = lock(&self.inner);
        if let Some(subscriber) = inner.subscribers.remove(&member) {
            leave_pool(&mut inner.pools, &subscriber.pool, member, now);
        }
    }

    /// Forgets expired held shares and empty pools.
    pub fn sweep(&self) {
        let now = self.now();
        let mut inner = lock(&self.inner);
        inner.pools.retain(|_, pool| {
            pool.forget_expired(now);
            !pool.is_empty()
        });
    }

    /// Every pool with its members, sorted by pool.
    pub fn pools(&self) -> Vec<PoolView> {
        let now = self.now();
        let inner = lock(&self.inner);
        let mut views: Vec<PoolView> = inner
            .pools
            .iter()
            .map(|(key, pool)| PoolView {
                pool: key.clone(),
                budget: pool.budget(),
                members: pool.members(now).collect(),
            })
            .collect();
        views.sort_by(|a, b| a.pool.cmp(&b.pool));
        views
    }
}

fn leave_pool(pools: &mut HashMap<PoolKey, Pool>, key: &PoolKey, member: MemberId, now: Micros) {
    if let Some(pool) = pools.get_mut(key) {
        pool.leave(member, now);
        if pool.is_empty() {
            pools.remove(key);
        }
    }
}

/// A poisoned lock still holds consistent data here (every change is made
/// whole under it), so it is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
