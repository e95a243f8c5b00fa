//! The over-limit cache: requests on counters the backend reported full
//! are answered OVER_LIMIT locally, without a backend call, until the time
//! the backend said room comes back.
//!
//! Exact, not approximate: a counter whose limit had no room for one unit
//! at time `t`, with room again only after `t + reset`, cannot have room
//! earlier, since time only frees room and other requests only take it.
//! So a request costing at most one unit on that counter before then is
//! denied by the backend too; answering it here changes nothing but the
//! backend's load. Only what is certain is cached:
//!
//! - enforcing limits (a shadow limit never denies; a quota limit denies
//!   only with the others of its request) charged only when allowed (a
//!   limit charged always must see every cost, and each charge moves its
//!   reset later, which a cached time would not know);
//! - costs of 0 or 1 (for a cost of 1 the backend reports when one unit
//!   is back, and "no room for one unit" means 0 remaining: the answer is
//!   the same until then); a cost above 1 may have fewer units than it
//!   needs and still a few left, which a local answer could not report;
//! - the same limit (algorithm, number, window, burst) as when it was
//!   cached, and the same rule set: every reload starts an empty cache;
//! - a request is answered here only when **every** counter it reaches is
//!   known full, since its answer reports each limit's remaining quota.
//!
//! The time is measured on the backend's clock (the Redis server's time,
//! seen through a local monotonic clock, or the service's own clock when it
//! decides), from just before the call: the backend decided later than
//! that, so the cached time is never past the true one.
//!
//! Bounded: at most `capacity` counters, spread over shards; when a shard
//! is full, its expired entries are dropped and, if none had expired, the
//! new one is not cached (the backend keeps answering for it).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use arc_swap::ArcSwap;
use hashbrown::HashMap;

use crate::algorithms::{Charge, LimitParams, Mode, Outcome, Verdict};
use crate::backends::{CounterKey, KeyedCheck};
use crate::clock::Clock;
use crate::rules::RuleSet;

/// Shards of the table: requests on different counters rarely wait for
/// one another.
const SHARDS: usize = 16;

/// Counters known to have no room until a given time.
#[derive(Debug)]
pub struct OverLimitCache {
    table: ArcSwap<Table>,
    capacity: usize,
    clock: Arc<dyn Clock>,
}

/// The entries recorded under one rule set.
#[derive(Debug)]
struct Table {
    /// Weak, so that the cache does not keep a replaced rule set alive;
    /// its allocation stays until this is dropped, so a new rule set can
    /// never be mistaken for it.
    rules: Weak<RuleSet>,
    shards: [Mutex<Shard>; SHARDS],
    /// Most entries per shard: the capacity spread evenly.
    shard_capacity: usize,
    hasher: foldhash::fast::RandomState,
    len: AtomicUsize,
}

#[derive(Debug)]
struct Shard {
    entries: HashMap<CounterKey, Full, foldhash::fast::RandomState>,
    /// No entry expires before this; `u64::MAX` when empty.
    earliest_us: u64,
}

/// No room for one unit of `params` until `until_us`.
#[derive(Debug, Clone, Copy)]
struct Full {
    params: LimitParams,
    until_us: u64,
}

impl OverLimitCache {
    /// A cache of at most `capacity` counters (`None` for 0: no cache),
    /// timed by `clock`.
    pub fn new(capacity: usize, clock: Arc<dyn Clock>) -> Option<OverLimitCache> {
        if capacity == 0 {
            return None;
        }
        Some(OverLimitCache {
            table: ArcSwap::from_pointee(Table::new(Weak::new(), capacity)),
            capacity,
            clock,
        })
    }

    /// The time the caller must pass to [`Self::record`]: now, on the
    /// cache's clock, before the backend call.
    pub fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// The denial the backend would give, when every check is on a counter
    /// known full under `rules`; `None` otherwise.
    pub fn lookup(&self, rules: &Arc<RuleSet>, checks: &[KeyedCheck]) -> Option<Verdict> {
        let table = self.table.load();
        if table.len.load(Ordering::Relaxed) == 0 || !table.is_for(rules) {
            return None;
        }
        let now = self.clock.now_us();
        let mut outcomes = Vec::with_capacity(checks.len());
        for check in checks {
            if !cacheable(check) {
                return None;
            }
            let until_us = table.until(check, now)?;
            outcomes.push(Outcome {
                has_room: false,
                consumed: false,
                remaining: 0,
                overdraft: 0,
                reset_us: until_us - now,
            });
        }
        Some(Verdict {
            allowed: false,
            outcomes,
        })
    }

    /// Remembers the counters `verdict` found full, for a backend call
    /// made at `sent_us` (from [`Self::now_us`]) under `rules`.
    pub fn record(
        &self,
        rules: &Arc<RuleSet>,
        checks: &[KeyedCheck],
        verdict: &Verdict,
        sent_us: u64,
    ) {
        if verdict.allowed {
            return;
        }
        let full = checks
            .iter()
            .zip(&verdict.outcomes)
            .filter(|(check, outcome)| cacheable(check) && !outcome.has_room);
        let mut table = None;
        for (check, outcome) in full {
            let table = table.get_or_insert_with(|| self.table_for(rules));
            let entry = Full {
                params: check.check.params,
                until_us: sent_us.saturating_add(outcome.reset_us),
            };
            table.insert(&check.key, entry, self.clock.now_us());
        }
    }

    /// Counters cached now (expired ones included until they are dropped).
    pub fn len(&self) -> usize {
        self.table.load().len.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The table of `rules`, replacing the table of an earlier rule set by
    /// an empty one.
    fn table_for(&self, rules: &Arc<RuleSet>) -> Arc<Table> {
        let current = self.table.load_full();
        if current.is_for(rules) {
            return current;
        }
        let fresh = Arc::new(Table::new(Arc::downgrade(rules), self.capacity));
        // Another request may have replaced it meanwhile; either table is
        // for `rules` or will be replaced again by the next reload.
        let previous = self.table.compare_and_swap(&current, fresh.clone());
        if Arc::ptr_eq(&previous, &current) {
            fresh
        } else {
            arc_swap::Guard::into_inner(previous)
        }
    }
}

/// Whether a check's answer can be known without the backend while its
/// counter is full. Never for a limit charged always: a request answered
/// here would lose its charge, and a charge made since the entry was
/// stored (here or through another replica) moves the time room comes
/// back later than the entry says.
fn cacheable(check: &KeyedCheck) -> bool {
    check.check.mode == Mode::Enforce
        && check.check.cost <= 1
        && check.check.params.charge() == Charge::IfAllowed
}

impl Table {
    fn new(rules: Weak<RuleSet>, capacity: usize) -> Table {
        Table {
            rules,
            shards: std::array::from_fn(|_| Mutex::new(Shard::default())),
            shard_capacity: capacity.div_ceil(SHARDS),
            hasher: foldhash::fast::RandomState::default(),
            len: AtomicUsize::new(0),
        }
    }

    fn is_for(&self, rules: &Arc<RuleSet>) -> bool {
        std::ptr::eq(self.rules.as_ptr(), Arc::as_ptr(rules))
    }

    fn shard(&self, key: &CounterKey) -> MutexGuard<'_, Shard> {
        let hash = BuildHasher::hash_one(&self.hasher, key);
        self.shards[(hash % SHARDS as u64) as usize]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// When `check`'s counter has room again, if it is cached as full for
    /// the same limit and still is at `now`. An expired entry is dropped.
    fn until(&self, check: &KeyedCheck, now: u64) -> Option<u64> {
        let mut shard = self.shard(&check.key);
        let full = *shard.entries.get(&check.key)?;
        if full.until_us <= now {
            shard.entries.remove(&check.key);
            self.len.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        (full.params == check.check.params).then_some(full.until_us)
    }

    fn insert(&self, key: &CounterKey, full: Full, now: u64) {
        let mut shard = self.shard(key);
        shard.earliest_us = shard.earliest_us.min(full.until_us);
        if let Some(entry) = shard.entries.get_mut(key) {
            *entry = full;
            return;
        }
        if shard.entries.len() >= self.shard_capacity {
            let dropped = shard.drop_expired(now);
            self.len.fetch_sub(dropped, Ordering::Relaxed);
            if shard.entries.len() >= self.shard_capacity {
                return;
            }
        }
        shard.entries.insert(key.clone(), full);
        self.len.fetch_add(1, Ordering::Relaxed);
    }
}

impl Default for Shard {
    fn default() -> Shard {
        Shard {
            entries: HashMap::default(),
            earliest_us: u64::MAX,
        }
    }
}

impl Shard {
    /// Drops the entries expired at `now`, at most once per expiry: a full
    /// shard of live entries costs one comparison per refused insert.
    fn drop_expired(&mut self, now: u64) -> usize {
        if now < self.earliest_us {
            return 0;
        }
        let before = self.entries.len();
        self.entries.retain(|_, entry| entry.until_us > now);
        self.earliest_us = self
            .entries
            .values()
            .map(|entry| entry.until_us)
            .min()
            .unwrap_or(u64::MAX);
        before - self.entries.len()
    }
}
