//! In-memory backend: the algorithms in process, sharded, with expiry of idle keys.
//!
//! Counters are spread over a power-of-two number of shards, each a hash
//! table behind its own lock. A request locks every shard it touches in
//! ascending shard order (so two requests can never wait on each other in a
//! cycle) and holds them all while [`algorithms::decide`] runs: the request
//! is atomic across all its keys, exactly as one Redis script call is.
//!
//! Every entry carries the time at which its state becomes indistinguishable
//! from a fresh one ([`State::lifetime`]). An entry past that time is
//! treated as absent, and is reclaimed by [`MemoryBackend::purge_expired`],
//! by the background sweeper ([`MemoryBackend::spawn_sweeper`]), and by a
//! shard itself when it has doubled in size since its last sweep, so memory
//! stays proportional to the keys that are live even without a sweeper.

use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use hashbrown::HashTable;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};

use super::{Backend, CounterKey, Error, KeyValue, KeyedCheck, PerRequest};
use crate::algorithms::{self, Check, State, Verdict};
use crate::clock::{Clock, Micros};
use crate::log_gate::LogGate;

/// Shards of [`MemoryBackend::new`]: enough that 64 concurrent requests on
/// distinct keys rarely share a lock, few enough that a sweep is cheap.
pub const DEFAULT_SHARDS: usize = 64;

/// Smallest shard length that triggers a sweep on insert; below it a shard
/// is too small for expired entries to matter.
const MIN_SWEEP_LEN: usize = 1024;

/// Default of `--memory-max-counters`: see docs/operations.md ("Memory backend bound")
/// for the measured bytes per counter it is chosen from.
pub const DEFAULT_MAX_COUNTERS: usize = 1_000_000;

/// Key bytes per unit of the bound: a counter whose key text (domain,
/// rule, entries) is longer counts once more per this many bytes, so that
/// clients sending long descriptors cannot hold more memory per counter.
const KEY_BYTES_PER_COUNTER: usize = 1024;

/// Least time between two whole-table sweeps made because the table is
/// full: a flood of new keys must not turn every refusal into a sweep.
const FULL_SWEEP_EVERY_US: u64 = 1_000_000;

/// Shortest sweeper period; a zero period would spin.
const MIN_SWEEP_PERIOD: Duration = Duration::from_millis(1);

/// Counters in this process's memory.
pub struct MemoryBackend {
    clock: Arc<dyn Clock>,
    /// Seeded per process: descriptor values come from clients, and a fixed
    /// seed would let them aim every key at one bucket.
    hasher: foldhash::fast::RandomState,
    shards: Box<[CounterShard]>,
    /// Most entries held, expired ones not yet swept included, each
    /// weighted by [`weight`].
    max_counters: usize,
    /// Weight of the entries held plus of the new ones requests in
    /// progress reserved: never above `max_counters`.
    len: AtomicUsize,
    /// When the table was last swept because it was full (clock µs).
    full_sweep_us: AtomicU64,
    full_log: LogGate,
}

/// Why a request got no verdict; only inside this module.
enum Undecided {
    Error(Error),
    /// New keys needed and no room for them.
    Full,
}

/// Stops the background sweeper when dropped.
#[must_use = "dropping the guard stops the sweeper"]
#[derive(Debug)]
pub struct SweeperGuard {
    task: JoinHandle<()>,
}

/// One lock's share of the counters.
struct CounterShard {
    // A std Mutex, not tokio's: it is held only for the synchronous decision
    // over a request's few entries or a sweep of one shard, never across an
    // `.await`, so a blocking lock is both correct and cheaper.
    table: Mutex<CounterTable>,
}

/// The counters of one shard, by hash.
#[derive(Default)]
struct CounterTable {
    entries: HashTable<StoredCounter>,
    /// Length at which the next insert first sweeps this shard.
    sweep_at: usize,
}

/// Where one check of a request lives: its hash, its shard, and its
/// shard's guard among the ones the request locked.
struct CheckPlace {
    hash: u64,
    shard: usize,
    /// Index of the shard's guard among the locked ones.
    guard: usize,
    /// The key as stored, reused on write-back instead of a clone.
    stored_key: Option<CounterKey>,
}

/// The entries a request took out of their tables, once room for its new
/// keys is reserved: only [`MemoryBackend::reserve`] makes one, so no
/// request decides before the bound has admitted it. Borrowed: the
/// entries stay where they were taken into, not copied on each step.
struct Reserved<'t>(&'t mut [Option<StoredCounter>]);

/// One counter as held: its key and its algorithm's state.
struct StoredCounter {
    /// The key's hash, kept so that growing the table never rehashes keys.
    hash: u64,
    key: CounterKey,
    state: State,
    /// From this time on the state equals a fresh one: treat it as absent.
    expires_us: Micros,
}

// === impl MemoryBackend ===

impl MemoryBackend {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_shards(clock, DEFAULT_SHARDS)
    }

    /// A backend with `shards` shards, rounded up to a power of two (at least 1).
    pub fn with_shards(clock: Arc<dyn Clock>, shards: usize) -> Self {
        let count = shards.max(1).next_power_of_two();
        Self {
            clock,
            hasher: foldhash::fast::RandomState::default(),
            shards: (0..count)
                .map(|_| CounterShard {
                    table: Mutex::new(CounterTable::default()),
                })
                .collect(),
            max_counters: usize::MAX,
            len: AtomicUsize::new(0),
            full_sweep_us: AtomicU64::new(0),
            full_log: LogGate::new(),
        }
    }

    /// Holds at most `max` counters (one whose key text is over 1 KiB
    /// counts once per KiB): a request that needs a new one beyond that
    /// fails with [`Error::Full`] (answered under `--failure-mode`), while
    /// requests on existing counters keep working. Room comes back as
    /// counters expire.
    pub fn with_max_counters(mut self, max: usize) -> Self {
        self.max_counters = max;
        self
    }

    /// Decides one request at the clock's current time; what
    /// [`Backend::decide`] runs, callable without an executor.
    pub fn decide_sync(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        let now = self.clock.now_us();
        let refused = match self.decide_at(checks, now) {
            Ok(verdict) => return Ok(verdict),
            Err(Undecided::Error(error)) => return Err(error),
            Err(Undecided::Full) => Error::Full(self.max_counters),
        };
        // Full: expired entries may be holding the room. Sweep everything
        // (one shard at a time, no lock of this request held) and try once
        // more, at most once a second.
        let last = self.full_sweep_us.load(Ordering::Relaxed);
        if now >= last.saturating_add(FULL_SWEEP_EVERY_US)
            && self
                .full_sweep_us
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
            && self.purge_expired() > 0
        {
            match self.decide_at(checks, now) {
                Ok(verdict) => return Ok(verdict),
                Err(Undecided::Error(error)) => return Err(error),
                Err(Undecided::Full) => {}
            }
        }
        if let Some(suppressed) = self.full_log.admit() {
            tracing::warn!(
                max_counters = self.max_counters,
                suppressed,
                "memory backend full: a request needing a new counter is refused"
            );
        }
        Err(refused)
    }

    /// Decides one request at `now`: locates its keys, locks their shards,
    /// takes what is stored, reserves room for new keys, decides, and
    /// stores the states back.
    fn decide_at(&self, checks: &[KeyedCheck], now: Micros) -> Result<Verdict, Undecided> {
        let mut places = self.locate(checks)?;
        let locked = lock_order(&mut places);
        // Ascending order: any two requests take their common shards in the
        // same order, so they cannot deadlock.
        let mut guards: PerRequest<MutexGuard<'_, CounterTable>> =
            locked.iter().map(|&idx| self.shards[idx].lock()).collect();

        // One lookup per key: what is stored comes out of its table here.
        // The scratch vectors are borrowed from here on, never moved: each
        // is a few hundred bytes even when it holds a single check.
        let mut taken: PerRequest<Option<StoredCounter>> = places
            .iter()
            .zip(checks)
            .map(|(place, it)| guards[place.guard].take(place.hash, &it.key))
            .collect();
        let taken = self.reserve(&mut guards, &places, checks, &mut taken)?;
        let mut states = live_states(&mut places, taken, now);

        let plain: PerRequest<Check> = checks.iter().map(|it| it.check).collect();
        let verdict = algorithms::decide(&plain, &mut states, now);
        self.store(&mut guards, &mut places, checks, &mut states, now);
        Ok(verdict)
    }

    /// Hashes every key to its shard. Refuses a repeated key: `decide`
    /// needs distinct keys, and a repeated one would be read twice and
    /// written twice, losing one of the writes.
    fn locate(&self, checks: &[KeyedCheck]) -> Result<PerRequest<CheckPlace>, Undecided> {
        let places: PerRequest<CheckPlace> = checks
            .iter()
            .map(|it| {
                let hash = self.hasher.hash_one(&it.key);
                CheckPlace {
                    hash,
                    shard: self.shard_index(hash),
                    guard: 0,
                    stored_key: None,
                }
            })
            .collect();
        for idx in 1..checks.len() {
            let repeated = (0..idx).any(|prev| {
                places[prev].hash == places[idx].hash && checks[prev].key == checks[idx].key
            });
            if repeated {
                return Err(Undecided::Error(Error::Protocol(format!(
                    "counter key repeated in one request: {:?}",
                    checks[idx].key
                ))));
            }
        }
        Ok(places)
    }

    /// Reserves room for the keys not stored yet, before deciding: a
    /// request refused as full puts back what it took and changes nothing.
    fn reserve<'t>(
        &self,
        guards: &mut [MutexGuard<'_, CounterTable>],
        places: &[CheckPlace],
        checks: &[KeyedCheck],
        taken: &'t mut [Option<StoredCounter>],
    ) -> Result<Reserved<'t>, Undecided> {
        let new: usize = checks
            .iter()
            .zip(taken.iter())
            .filter(|(_, entry)| entry.is_none())
            .map(|(it, _)| weight(&it.key))
            .sum();
        if new == 0 {
            return Ok(Reserved(taken));
        }
        let before = self.len.fetch_add(new, Ordering::Relaxed);
        if before.saturating_add(new) <= self.max_counters {
            return Ok(Reserved(taken));
        }
        self.len.fetch_sub(new, Ordering::Relaxed);
        for (place, entry) in places.iter().zip(taken) {
            if let Some(entry) = entry.take() {
                guards[place.guard].restore(entry);
            }
        }
        Err(Undecided::Full)
    }

    /// Writes the decided states back; a state equal to a fresh one is not
    /// stored, and gives back its weight.
    fn store(
        &self,
        guards: &mut [MutexGuard<'_, CounterTable>],
        places: &mut [CheckPlace],
        checks: &[KeyedCheck],
        states: &mut [Option<State>],
        now: Micros,
    ) {
        for ((place, it), state) in places.iter_mut().zip(checks).zip(states) {
            let Some(mut state) = state.take() else {
                // Equal to a fresh state: its entry (or reservation) goes.
                self.len.fetch_sub(weight(&it.key), Ordering::Relaxed);
                continue;
            };
            let params = &it.check.params;
            // `decide` left the state advanced to its effective time; this
            // advance changes nothing and returns that time, which can be
            // later than `now` when the clock went backwards.
            let at = state.advance(params, now);
            let expires_us = at + state.lifetime(params, at);
            let entry = StoredCounter {
                hash: place.hash,
                key: place.stored_key.take().unwrap_or_else(|| it.key.clone()),
                state,
                expires_us,
            };
            let swept = guards[place.guard].insert(entry, now);
            self.len.fetch_sub(swept, Ordering::Relaxed);
        }
    }

    /// The state stored for `key` and the time (clock µs) from which it
    /// equals a fresh one, while it differs from a fresh one; `None` when
    /// the key is absent or expired. For tests and diagnostics: it locks the
    /// key's shard like a request does.
    pub fn stored(&self, key: &CounterKey) -> Option<(State, Micros)> {
        let now = self.clock.now_us();
        let hash = self.hasher.hash_one(key);
        let table = self.shards[self.shard_index(hash)].lock();
        let entry = table.entries.find(hash, |it| it.key == *key)?;
        (entry.expires_us > now).then(|| (entry.state.clone(), entry.expires_us))
    }

    /// Most counters held, as set by [`MemoryBackend::with_max_counters`].
    pub fn max_counters(&self) -> usize {
        self.max_counters
    }

    /// Removes every expired entry, locking one shard at a time; returns how
    /// many were removed.
    pub fn purge_expired(&self) -> usize {
        (0..self.shards.len())
            .map(|idx| self.purge_shard(idx))
            .sum()
    }

    /// Entries whose state still differs from a fresh one.
    pub fn live_entries(&self) -> usize {
        let now = self.clock.now_us();
        self.shards
            .iter()
            .map(|shard| {
                let table = shard.lock();
                table
                    .entries
                    .iter()
                    .filter(|it| it.expires_us > now)
                    .count()
            })
            .sum()
    }

    /// Entries held in memory, expired ones not yet swept included.
    pub fn stored_entries(&self) -> usize {
        self.shards
            .iter()
            .map(|shard| shard.lock().entries.len())
            .sum()
    }

    /// Starts a task that purges expired entries every `every` (at least
    /// 1 ms), one shard at a time, yielding between shards. The task holds
    /// only a weak reference: it ends when the backend is dropped, or when
    /// the guard is.
    ///
    /// Must be called within a Tokio runtime.
    pub fn spawn_sweeper(self: &Arc<Self>, every: Duration) -> SweeperGuard {
        let every = every.max(MIN_SWEEP_PERIOD);
        let backend = Arc::downgrade(self);
        let task = tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(Instant::now() + every, every);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(backend) = backend.upgrade() else {
                    return;
                };
                let mut removed = 0;
                for idx in 0..backend.shards.len() {
                    removed += backend.purge_shard(idx);
                    tokio::task::yield_now().await;
                }
                tracing::debug!(removed, "swept expired counters");
            }
        });
        SweeperGuard { task }
    }

    fn purge_shard(&self, idx: usize) -> usize {
        let now = self.clock.now_us();
        let (removed, weight) = self.shards[idx].lock().purge(now);
        self.len.fetch_sub(weight, Ordering::Relaxed);
        removed
    }

    /// Takes the shard from bits of the hash that the shard's own table
    /// does not use: hashbrown indexes buckets with the low bits and tags
    /// them with the top 7, so bits 32.. stay independent of both.
    fn shard_index(&self, hash: u64) -> usize {
        ((hash >> 32) as usize) & (self.shards.len() - 1)
    }
}

impl fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Not the entries: there can be millions.
        f.debug_struct("MemoryBackend")
            .field("clock", &self.clock)
            .field("shards", &self.shards.len())
            .field("max_counters", &self.max_counters)
            .finish_non_exhaustive()
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        self.decide_sync(checks)
    }

    async fn probe(&self) -> Result<(), Error> {
        Ok(())
    }

    /// Decided under its shards' locks, with no IO: ready when first polled.
    fn answers_at_once(&self) -> bool {
        true
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}

// === impl SweeperGuard ===

impl SweeperGuard {
    /// Whether the sweeper task still runs: false once its backend is gone.
    pub fn is_running(&self) -> bool {
        !self.task.is_finished()
    }
}

impl Drop for SweeperGuard {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// === impl CounterShard ===

impl CounterShard {
    fn lock(&self) -> MutexGuard<'_, CounterTable> {
        // A panic while locked can only have happened between taking a
        // request's states and putting them back: those keys start fresh,
        // and the table itself is intact, so serving on is safe.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

// === impl CounterTable ===

impl CounterTable {
    /// Removes and returns the entry of `key`, expired or not.
    fn take(&mut self, hash: u64, key: &CounterKey) -> Option<StoredCounter> {
        let found = self.entries.find_entry(hash, |it| it.key == *key).ok()?;
        Some(found.remove().0)
    }

    /// Puts back an entry `take` removed, as it was (no sweep: its weight
    /// never left the count).
    fn restore(&mut self, entry: StoredCounter) {
        self.entries.insert_unique(entry.hash, entry, |it| it.hash);
    }

    /// Inserts an entry whose key is absent, sweeping first when the shard
    /// has doubled since its last sweep (amortised O(1) per insert);
    /// returns the weight of the expired entries the sweep removed.
    fn insert(&mut self, entry: StoredCounter, now: Micros) -> usize {
        let mut removed = 0;
        if self.entries.len() >= self.sweep_at {
            removed = self.purge(now).1;
            self.sweep_at = (self.entries.len() * 2).max(MIN_SWEEP_LEN);
        }
        self.entries.insert_unique(entry.hash, entry, |it| it.hash);
        removed
    }

    /// Removes the expired entries; returns how many, and their weight.
    fn purge(&mut self, now: Micros) -> (usize, usize) {
        let before = self.entries.len();
        let mut removed_weight = 0;
        self.entries.retain(|it| {
            let live = it.expires_us > now;
            if !live {
                removed_weight += weight(&it.key);
            }
            live
        });
        let after = self.entries.len();
        // Give memory back after a wave of distinct keys has passed.
        if self.entries.capacity() > MIN_SWEEP_LEN && after * 4 < self.entries.capacity() {
            self.entries.shrink_to(after * 2, |it| it.hash);
        }
        (before - after, removed_weight)
    }
}

/// What a counter counts against the bound: 1, plus 1 per
/// [`KEY_BYTES_PER_COUNTER`] bytes of key text.
fn weight(key: &CounterKey) -> usize {
    let bytes = key.domain.len()
        + key.rule.len()
        + key
            .entries
            .iter()
            .map(|it| {
                it.key.len()
                    + match &it.value {
                        KeyValue::Value(value) => value.len(),
                        KeyValue::Shared(pattern) => pattern.len(),
                    }
            })
            .sum::<usize>();
    1 + bytes / KEY_BYTES_PER_COUNTER
}

/// The shards `places` touch, ascending and each once; every place learns
/// the index of its shard's guard among them.
fn lock_order(places: &mut [CheckPlace]) -> PerRequest<usize> {
    let mut locked: PerRequest<usize> = places.iter().map(|it| it.shard).collect();
    if locked.len() > 1 {
        locked.sort_unstable();
        locked.dedup();
    }
    for place in places {
        place.guard = locked
            .binary_search(&place.shard)
            .expect("every shard is in the list");
    }
    locked
}

/// The states `decide` starts from: a taken entry's, unless it has expired
/// (then, like an absent key, none). Each place keeps its stored key for the
/// write-back.
fn live_states(
    places: &mut [CheckPlace],
    taken: Reserved<'_>,
    now: Micros,
) -> PerRequest<Option<State>> {
    places
        .iter_mut()
        .zip(taken.0)
        .map(|(place, entry)| {
            let entry = entry.take()?;
            place.stored_key = Some(entry.key);
            (entry.expires_us > now).then_some(entry.state)
        })
        .collect()
}

#[cfg(test)]
mod tests;
