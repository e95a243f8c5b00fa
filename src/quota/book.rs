//! The shares of one instance: every pool (in memory, or in Redis and
//! shared with other instances), which stream each local member belongs
//! to, and the outbox of each stream, through which a change to a
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
use super::redis::{Error, RedisPools};
use super::share::{Budget, Change, MemberId, MemberView, Pool, ProxyKey, Usage};

/// A bucket of one stream, numbered by that stream (from 0, in the
/// order it first reported them).
pub type BucketNumber = u32;

/// What waits to be written to one stream.
#[derive(Debug, Default)]
pub struct Outbox {
    unsent: Mutex<UnsentGrants>,
    notify: Notify,
}

/// The grants the stream's writer has not taken yet, by bucket.
#[derive(Debug, Default)]
struct UnsentGrants {
    grants: BTreeMap<BucketNumber, Grant>,
    /// When the oldest grant still waiting was put here.
    since: Option<Micros>,
    /// The latest decision put for each bucket decided by a pool.
    latest: HashMap<BucketNumber, Order>,
}

/// Where a grant was decided: the pool (by its key's hash), its
/// incarnation and its epoch. Two reports decided concurrently can reach
/// an outbox in either order; an older decision of the same incarnation
/// of the same pool never replaces a newer one. Epochs of different
/// incarnations are never compared: a pool lost and rebuilt starts its
/// epochs again, and its first grant replaces whatever the lost one sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    pub pool: u64,
    pub incarnation: u64,
    pub epoch: u64,
}

impl Outbox {
    pub fn new() -> Arc<Outbox> {
        Arc::new(Outbox::default())
    }

    /// Puts `grant` for `bucket`, replacing one not yet taken, unless it
    /// was decided before the last one put by the same pool (`order`;
    /// `None` for a grant no pool decided).
    pub fn put(&self, bucket: BucketNumber, grant: Grant, order: Option<Order>, now: Micros) {
        {
            let mut unsent = lock(&self.unsent);
            match order {
                Some(order) => {
                    if let Some(latest) = unsent.latest.get(&bucket)
                        && latest.pool == order.pool
                        && latest.incarnation == order.incarnation
                        && latest.epoch > order.epoch
                    {
                        return;
                    }
                    unsent.latest.insert(bucket, order);
                }
                None => {
                    unsent.latest.remove(&bucket);
                }
            }
            unsent.grants.insert(bucket, grant);
            unsent.since.get_or_insert(now);
        }
        self.notify.notify_one();
    }

    /// Everything waiting, once there is something.
    pub async fn take(&self) -> BTreeMap<BucketNumber, Grant> {
        loop {
            let notified = self.notify.notified();
            {
                let mut unsent = lock(&self.unsent);
                if !unsent.grants.is_empty() {
                    unsent.since = None;
                    return std::mem::take(&mut unsent.grants);
                }
            }
            notified.await;
        }
    }

    /// Since when grants have waited unread; `None` when nothing waits.
    pub fn waiting_since(&self) -> Option<Micros> {
        lock(&self.unsent).since
    }
}

/// A member's place: the stream it answers through and the pool it is in.
#[derive(Debug)]
struct Subscriber {
    outbox: Arc<Outbox>,
    bucket: BucketNumber,
    pool: PoolKey,
    /// The pool's budget when it last reported (for leaving it in Redis).
    budget: Budget,
}

/// Where pools live.
#[derive(Debug)]
enum Store {
    /// In this process: every member is local.
    Memory(Mutex<HashMap<PoolKey, Pool>>),
    /// In Redis, shared with other instances; the last state seen of each
    /// pool kept for `/rlconfig`.
    Redis {
        pools: Box<RedisPools>,
        seen: Mutex<HashMap<PoolKey, (Pool, Micros)>>,
    },
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
    /// Where the reporter's grant was decided (for [`Outbox::put`]).
    pub order: Order,
    /// The instances sharing the pool have rules giving it different
    /// budgets; the lowest is applied.
    pub disagree: bool,
}

/// What one report changed in its pool: the changes to send, the shares
/// counted against the budget, the budget's window and whether the
/// instances' rules disagree on it.
struct Decided {
    changes: Vec<Change>,
    committed: u64,
    window_us: Micros,
    disagree: bool,
}

/// What `/rlconfig` shows of one pool.
#[derive(Debug, Clone)]
pub struct PoolView {
    pub pool: PoolKey,
    pub budget: Budget,
    pub members: Vec<MemberView>,
}

/// The pools this instance's streams report to.
#[derive(Debug)]
pub struct QuotaBook {
    clock: Arc<dyn Clock>,
    store: Store,
    subscribers: Mutex<HashMap<MemberId, Subscriber>>,
    /// The high 32 bits of every member id this instance makes.
    instance: u64,
    next_member: AtomicU64,
}

impl QuotaBook {
    /// Pools in memory: budgets shared among this instance's streams.
    pub fn new(clock: Arc<dyn Clock>) -> QuotaBook {
        QuotaBook::with_store(clock, Store::Memory(Mutex::default()))
    }

    /// Pools in Redis: budgets shared with every instance on it.
    pub fn with_redis(clock: Arc<dyn Clock>, pools: RedisPools) -> QuotaBook {
        QuotaBook::with_store(
            clock,
            Store::Redis {
                pools: Box::new(pools),
                seen: Mutex::default(),
            },
        )
    }

    fn with_store(clock: Arc<dyn Clock>, store: Store) -> QuotaBook {
        use std::hash::{BuildHasher, Hasher};
        // Random, so that instances sharing Redis make distinct ids.
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        QuotaBook {
            clock,
            store,
            subscribers: Mutex::default(),
            instance: (random >> 32).max(1) << 32,
            next_member: AtomicU64::new(1),
        }
    }

    pub fn now(&self) -> Micros {
        self.clock.now_us()
    }

    /// A new member id, for one bucket of one stream.
    pub fn member_id(&self) -> MemberId {
        self.instance | (self.next_member.fetch_add(1, Ordering::Relaxed) & 0xffff_ffff)
    }

    /// Whether `member` is on this instance.
    fn is_local(&self, member: MemberId) -> bool {
        member & !0xffff_ffff == self.instance
    }

    /// `member` (the bucket `bucket` of the stream writing to `outbox`, of
    /// the proxy `proxy`) reported `usage` of a bucket in `pool` with
    /// `budget`. Its own grant is returned; every other local member
    /// whose share changed gets its new grant in its outbox.
    #[allow(clippy::too_many_arguments)]
    pub async fn report(
        &self,
        member: MemberId,
        proxy: ProxyKey,
        bucket: BucketNumber,
        outbox: &Arc<Outbox>,
        pool: &PoolKey,
        budget: Budget,
        usage: Option<Usage>,
    ) -> Result<Reported, Error> {
        // A bucket whose rule changed (a reload) leaves its old pool.
        let previous = lock(&self.subscribers).insert(
            member,
            Subscriber {
                outbox: outbox.clone(),
                bucket,
                pool: pool.clone(),
                budget,
            },
        );
        if let Some(old) = previous.filter(|it| &it.pool != pool) {
            self.leave_pool(&old.pool, old.budget, member).await?;
        }
        let is_local = |id: MemberId| self.is_local(id);
        let apply = |entry: &mut Pool, now: Micros| {
            let (mut changes, disagree) = entry.claim_budget(self.instance, budget, now, &is_local);
            changes.extend(entry.report_by(member, proxy, usage, now, &is_local));
            Decided {
                changes,
                committed: entry.committed(),
                window_us: entry.budget().window_us,
                disagree,
            }
        };
        let decided = match &self.store {
            Store::Memory(pools) => {
                let now = self.now();
                let mut pools = lock(pools);
                let entry = pools
                    .entry(pool.clone())
                    .or_insert_with(|| Pool::new(budget));
                apply(entry, now)
            }
            Store::Redis { pools, seen } => {
                let (out, state, now) = pools
                    .update(pool, budget, |entry, now| {
                        (apply(entry, now), entry.clone(), now)
                    })
                    .await?;
                lock(seen).insert(pool.clone(), (state, now));
                out
            }
        };
        Ok(self.deliver(member, pool, decided))
    }

    /// What `member`'s report `decided`: its own grant (returned), and
    /// each other local member's changed grant put in its outbox.
    fn deliver(&self, member: MemberId, pool: &PoolKey, decided: Decided) -> Reported {
        let now = self.now();
        let pool_id = {
            use std::hash::{BuildHasher, BuildHasherDefault};
            BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default()
                .hash_one(pool)
        };
        let mut reported = Reported {
            share: 0,
            grant: Grant::DenyAll,
            changed: false,
            pushed: 0,
            committed: decided.committed,
            order: Order {
                pool: pool_id,
                incarnation: 0,
                epoch: 0,
            },
            disagree: decided.disagree,
        };
        let subscribers = lock(&self.subscribers);
        for Change {
            member: id,
            share,
            changed,
            incarnation,
            epoch,
        } in decided.changes
        {
            let grant = Grant::for_share(share, decided.window_us);
            let order = Order {
                pool: pool_id,
                incarnation,
                epoch,
            };
            if id == member {
                reported.share = share;
                reported.grant = grant;
                reported.changed |= changed;
                reported.order = order;
            } else if let Some(subscriber) = subscribers.get(&id) {
                subscriber
                    .outbox
                    .put(subscriber.bucket, grant, Some(order), now);
                reported.pushed += 1;
            }
        }
        reported
    }

    /// `member`'s stream ended, or its bucket no longer has a shared
    /// budget: its share is held until it expires.
    pub async fn leave(&self, member: MemberId) -> Result<(), Error> {
        let subscriber = lock(&self.subscribers).remove(&member);
        match subscriber {
            Some(it) => self.leave_pool(&it.pool, it.budget, member).await,
            None => Ok(()),
        }
    }

    async fn leave_pool(
        &self,
        key: &PoolKey,
        budget: Budget,
        member: MemberId,
    ) -> Result<(), Error> {
        match &self.store {
            Store::Memory(pools) => {
                let now = self.now();
                let mut pools = lock(pools);
                if let Some(pool) = pools.get_mut(key) {
                    pool.leave(member, now);
                    if pool.is_empty() {
                        pools.remove(key);
                    }
                }
                Ok(())
            }
            Store::Redis { pools, .. } => {
                pools
                    .update(key, budget, |pool, now| pool.leave(member, now))
                    .await
            }
        }
    }

    /// Forgets expired held shares and empty pools (in memory; Redis
    /// forgets them at each write and expires idle pools).
    pub fn sweep(&self) {
        let now = self.now();
        match &self.store {
            Store::Memory(pools) => lock(pools).retain(|_, pool| {
                pool.forget_expired(now);
                !pool.is_empty()
            }),
            Store::Redis { seen, .. } => lock(seen).retain(|_, (pool, at)| {
                now.saturating_sub(*at) < 4 * super::share::ASSIGNMENT_TTL_US && !pool.is_empty()
            }),
        }
    }

    /// Every pool with its members, sorted by pool (with Redis: as this
    /// instance last saw them).
    pub fn pools(&self) -> Vec<PoolView> {
        let now = self.now();
        let view = |key: &PoolKey, pool: &Pool, now: Micros| PoolView {
            pool: key.clone(),
            budget: pool.budget(),
            members: pool.members(now).collect(),
        };
        let mut views: Vec<PoolView> = match &self.store {
            Store::Memory(pools) => lock(pools)
                .iter()
                .map(|(key, pool)| view(key, pool, now))
                .collect(),
            Store::Redis { seen, .. } => lock(seen)
                .iter()
                .map(|(key, (pool, at))| view(key, pool, *at))
                .collect(),
        };
        views.sort_by(|a, b| a.pool.cmp(&b.pool));
        views
    }
}

/// A poisoned lock still holds consistent data here (every change is made
/// whole under it), so it is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
