//! Rate-limit algorithms as pure functions of (state, parameters, now).
//!
//! This module is the reference semantics: the memory backend runs it
//! directly and the Lua script in `lua/` mirrors it line for line, so both
//! backends answer identically for the same clock. All arithmetic is on
//! integers (microseconds, scaled token counts); nothing here does IO or
//! reads a clock. `docs/algorithms.md` states the formulas.

mod fixed_window;
mod gcra;
mod sliding_window_counter;
mod sliding_window_log;
mod token_bucket;
mod verdict;

use std::fmt;

use smallvec::SmallVec;

pub use fixed_window::FixedWindow;
pub use gcra::Gcra;
pub use sliding_window_counter::SlidingWindowCounter;
pub use sliding_window_log::SlidingWindowLog;
pub use token_bucket::TokenBucket;
pub use verdict::{Provisional, allows, consumes, settle};

/// Largest integer every step of a script can hold exactly: Redis Lua
/// numbers are IEEE doubles.
pub const MAX_EXACT: u64 = 1 << 53;

/// The longest span of time a limit's state may cover, in µs (2^50, about
/// 35.7 years of 365 days): its window, or for a token bucket and GCRA the
/// time its whole capacity takes to refill. A script keeps times as
/// doubles, exact below 2^53 µs: with every stored time at most `now` plus
/// twice this span (a sliding-window counter's count weighs in for two
/// windows), each stays exact while clocks read before 2^53 - 2^51 µs (the
/// year 2184). Both backends refuse a longer limit alike, at load.
pub const MAX_SPAN_US: u64 = 1 << 50;

/// A rate-limit algorithm, chosen per limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    SlidingWindowLog,
    TokenBucket,
    Gcra,
    SlidingWindowCounter,
    FixedWindow,
}

impl Algorithm {
    pub const ALL: [Algorithm; 5] = [
        Algorithm::SlidingWindowLog,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::SlidingWindowCounter,
        Algorithm::FixedWindow,
    ];

    /// The name used in config files, keys and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::SlidingWindowLog => "sliding_window_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::SlidingWindowCounter => "sliding_window_counter",
            Algorithm::FixedWindow => "fixed_window",
        }
    }

    pub fn from_name(name: &str) -> Option<Algorithm> {
        Algorithm::ALL.into_iter().find(|it| it.name() == name)
    }

    /// Whether `burst` (a capacity distinct from the window's number) applies.
    pub fn has_burst(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// When a limit records a request's cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Charge {
    /// Only when the whole request is allowed: a denied request consumes
    /// nothing (the default).
    #[default]
    IfAllowed,
    /// Whenever the request reaches the limit, allowed or denied: usage
    /// reported after the fact (Envoy's `apply_on_stream_done`) is never
    /// dropped. A cost past the room puts the limit into debt, at most one
    /// capacity of it (see [`LimitParams::debt_capacity`]).
    Always,
}

impl Charge {
    pub const ALL: [Charge; 2] = [Charge::IfAllowed, Charge::Always];

    /// The name used in config files and the config summary.
    pub fn name(self) -> &'static str {
        match self {
            Charge::IfAllowed => "if_allowed",
            Charge::Always => "always",
        }
    }

    pub fn from_name(name: &str) -> Option<Charge> {
        Charge::ALL.into_iter().find(|it| it.name() == name)
    }
}

impl fmt::Display for Charge {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Validated parameters of one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LimitParams {
    algorithm: Algorithm,
    /// `N`: requests per window.
    limit: u64,
    /// `W`: the window in microseconds (unit × multiplier), > 0.
    window_us: u64,
    /// Most cost that can ever pass at once: `burst` for token bucket and
    /// GCRA, `N` otherwise.
    capacity: u64,
    /// When a cost is recorded; [`Charge::IfAllowed`] unless
    /// [`LimitParams::with_charge`] says otherwise.
    charge: Charge,
}

/// Why a limit cannot be represented exactly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamsError {
    #[error("window must be at least one second")]
    ZeroWindow,
    #[error("burst must be at least 1")]
    ZeroBurst,
    #[error(
        "{algorithm} with {limit} per {window_s}s and capacity {capacity} needs more than 53 bits of exact state; use a coarser unit or a smaller number"
    )]
    TooPrecise {
        algorithm: Algorithm,
        limit: u64,
        window_s: u64,
        capacity: u64,
    },
    #[error(
        "charge: always on {algorithm} with {limit} per {window_s}s and capacity {capacity} needs room for a whole capacity of debt, more than 53 bits of exact state; use a coarser unit or a smaller number"
    )]
    DebtTooPrecise {
        algorithm: Algorithm,
        limit: u64,
        window_s: u64,
        capacity: u64,
    },
    #[error(
        "a window of {window_s}s is longer than any backend can decide: at most {max_s}s (2^50 µs, about 35 years); use a shorter unit or a smaller unit_multiplier"
    )]
    WindowTooLong { window_s: u64, max_s: u64 },
    #[error(
        "{algorithm} refilling a capacity of {capacity} at {limit} per {window_s}s takes {refill_s}s, longer than any backend can decide: at most {max_s}s (2^50 µs, about 35 years); use a shorter unit, a smaller burst or a larger number"
    )]
    RefillTooLong {
        algorithm: Algorithm,
        limit: u64,
        window_s: u64,
        capacity: u64,
        refill_s: u64,
        max_s: u64,
    },
}

impl LimitParams {
    /// `burst` is the capacity of a token bucket or GCRA (default `limit`);
    /// it is ignored by the window algorithms.
    pub fn new(
        algorithm: Algorithm,
        limit: u64,
        window_us: u64,
        burst: Option<u64>,
    ) -> Result<LimitParams, ParamsError> {
        if window_us < 1_000_000 || !window_us.is_multiple_of(1_000) {
            return Err(ParamsError::ZeroWindow);
        }
        let capacity = if limit == 0 {
            // `requests_per_unit: 0` blocks everything, whatever the burst.
            0
        } else if algorithm.has_burst() {
            match burst {
                Some(0) => return Err(ParamsError::ZeroBurst),
                Some(burst) => burst,
                None => limit,
            }
        } else {
            limit
        };
        let params = LimitParams {
            algorithm,
            limit,
            window_us,
            capacity,
            charge: Charge::IfAllowed,
        };
        let exact = match algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                let rate = params.rate();
                (capacity as u128) * (rate.scale as u128) < MAX_EXACT as u128
            }
            Algorithm::SlidingWindowCounter => {
                (limit as u128 + 1) * (window_us as u128 / 1_000) < MAX_EXACT as u128
            }
            Algorithm::SlidingWindowLog | Algorithm::FixedWindow => limit < MAX_EXACT,
        };
        if !exact {
            return Err(ParamsError::TooPrecise {
                algorithm,
                limit,
                window_s: window_us / 1_000_000,
                capacity,
            });
        }
        params.check_span()?;
        Ok(params)
    }

    /// Refuses a limit whose state would cover more than [`MAX_SPAN_US`].
    fn check_span(&self) -> Result<(), ParamsError> {
        let max_s = MAX_SPAN_US / 1_000_000;
        let window_s = self.window_us / 1_000_000;
        if self.window_us > MAX_SPAN_US {
            return Err(ParamsError::WindowTooLong { window_s, max_s });
        }
        if self.algorithm.has_burst() && self.limit > 0 {
            // capacity × window / limit, rounded up: the time from empty to full.
            let refill_us = (u128::from(self.capacity) * u128::from(self.window_us))
                .div_ceil(u128::from(self.limit));
            if refill_us > u128::from(MAX_SPAN_US) {
                return Err(ParamsError::RefillTooLong {
                    algorithm: self.algorithm,
                    limit: self.limit,
                    window_s,
                    capacity: self.capacity,
                    refill_s: u64::try_from(refill_us.div_ceil(1_000_000)).unwrap_or(u64::MAX),
                    max_s,
                });
            }
        }
        Ok(())
    }

    /// These parameters recording costs as `charge` says. A limit charged
    /// always carries up to one capacity of debt on top of its capacity,
    /// so its state must hold twice the capacity exactly: refused when it
    /// cannot (every other limit is unchanged).
    pub fn with_charge(self, charge: Charge) -> Result<LimitParams, ParamsError> {
        let params = LimitParams { charge, ..self };
        if charge == Charge::IfAllowed {
            return Ok(params);
        }
        let exact = match self.algorithm {
            Algorithm::TokenBucket | Algorithm::Gcra => {
                2 * (self.capacity as u128) * (self.rate().scale as u128) < MAX_EXACT as u128
            }
            // Counts and running totals reach twice the limit (for the
            // counter, (limit + 1) × window below 2^53 implies it).
            Algorithm::SlidingWindowCounter
            | Algorithm::SlidingWindowLog
            | Algorithm::FixedWindow => 2 * (self.limit as u128) < MAX_EXACT as u128,
        };
        if !exact {
            return Err(ParamsError::DebtTooPrecise {
                algorithm: self.algorithm,
                limit: self.limit,
                window_s: self.window_us / 1_000_000,
                capacity: self.capacity,
            });
        }
        Ok(params)
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// The most debt the limit's state may carry, in units: its capacity
    /// when charged always (usage never counts more than twice the
    /// capacity), 0 otherwise (a state left in debt by an earlier config
    /// is never charged further, and a token bucket's debt is forgiven).
    pub fn debt_capacity(&self) -> u64 {
        match self.charge {
            Charge::IfAllowed => 0,
            Charge::Always => self.capacity,
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn window_us(&self) -> u64 {
        self.window_us
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The refill rate `N / W` as the reduced fraction `per_us / scale`
    /// tokens per microsecond. One token is `scale` scaled units.
    pub fn rate(&self) -> Rate {
        if self.limit == 0 {
            // Nothing ever refills; a scale of 1 keeps the arithmetic finite.
            return Rate {
                per_us: 0,
                scale: 1,
            };
        }
        let divisor = gcd(self.limit, self.window_us);
        Rate {
            per_us: self.limit / divisor,
            scale: self.window_us / divisor,
        }
    }
}

/// Refill rate of a token bucket: `per_us` scaled units are added per µs,
/// and one token is `scale` scaled units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rate {
    pub per_us: u64,
    pub scale: u64,
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// How a limit takes part in a request's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Denies the request when it has no room.
    Enforce,
    /// Evaluated and reported, never denies.
    Shadow,
    /// Denies only when every quota-mode limit of the request is out of room.
    Quota,
}

/// Counter state of one key for one algorithm.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    SlidingWindowLog(SlidingWindowLog),
    TokenBucket(TokenBucket),
    Gcra(Gcra),
    SlidingWindowCounter(SlidingWindowCounter),
    FixedWindow(FixedWindow),
}

impl State {
    /// The state of a key nobody has touched: a full bucket, an empty window.
    pub fn fresh(params: &LimitParams, now: u64) -> State {
        match params.algorithm {
            Algorithm::SlidingWindowLog => State::SlidingWindowLog(SlidingWindowLog::default()),
            Algorithm::TokenBucket => State::TokenBucket(TokenBucket::full(params, now)),
            Algorithm::Gcra => State::Gcra(Gcra::default()),
            Algorithm::SlidingWindowCounter => {
                State::SlidingWindowCounter(SlidingWindowCounter::default())
            }
            Algorithm::FixedWindow => State::FixedWindow(FixedWindow::default()),
        }
    }

    /// Brings the state forward to `now` (drops expired entries, refills)
    /// and returns the effective time, which never moves backwards.
    pub fn advance(&mut self, params: &LimitParams, now: u64) -> u64 {
        match self {
            State::SlidingWindowLog(it) => it.advance(params, now),
            State::TokenBucket(it) => it.advance(params, now),
            State::Gcra(it) => it.advance(params, now),
            State::SlidingWindowCounter(it) => it.advance(params, now),
            State::FixedWindow(it) => it.advance(params, now),
        }
    }

    /// Units of cost that could pass right now. Call after `advance`.
    pub fn available(&self, params: &LimitParams, now: u64) -> u64 {
        match self {
            State::SlidingWindowLog(it) => it.available(params),
            State::TokenBucket(it) => it.available(params),
            State::Gcra(it) => it.available(params, now),
            State::SlidingWindowCounter(it) => it.available(params, now),
            State::FixedWindow(it) => it.available(params),
        }
    }

    /// Units that can be recorded now before the limit carries all the
    /// debt it may ([`LimitParams::debt_capacity`]): at least `available`.
    /// Call after `advance`.
    pub fn debt_room(&self, params: &LimitParams, now: u64) -> u64 {
        match self {
            State::SlidingWindowLog(it) => it.debt_room(params),
            State::TokenBucket(it) => it.debt_room(params),
            State::Gcra(it) => it.debt_room(params, now),
            State::SlidingWindowCounter(it) => it.debt_room(params, now),
            State::FixedWindow(it) => it.debt_room(params),
        }
    }

    /// Takes `cost` units; the caller checked `cost <= debt_room` (past
    /// `available` only for a limit charged always).
    pub fn consume(&mut self, params: &LimitParams, now: u64, cost: u64) {
        match self {
            State::SlidingWindowLog(it) => it.consume(now, cost),
            State::TokenBucket(it) => it.consume(params, cost),
            State::Gcra(it) => it.consume(params, now, cost),
            State::SlidingWindowCounter(it) => it.consume(cost),
            State::FixedWindow(it) => it.consume(cost),
        }
    }

    /// Microseconds the state must be kept: after it the state is
    /// indistinguishable from a fresh one, whatever time later requests
    /// bring (the key's expiry). 0 means it can be dropped now. Equal to
    /// [`State::until_full`] except for the sliding-window counter, whose
    /// counts stay stored until their window boundaries: a request from a
    /// lagging clock is evaluated at the stored window's start, where they
    /// weigh in again.
    pub fn lifetime(&self, params: &LimitParams, now: u64) -> u64 {
        match self {
            State::SlidingWindowCounter(it) => it.lifetime(params, now),
            _ => self.until_full(params, now),
        }
    }

    /// Microseconds until the limit is fully replenished (what a client is
    /// told as the time until reset).
    pub fn until_full(&self, params: &LimitParams, now: u64) -> u64 {
        match self {
            State::SlidingWindowLog(it) => it.until_full(params, now),
            State::TokenBucket(it) => it.until_full(params),
            State::Gcra(it) => it.until_full(params, now),
            State::SlidingWindowCounter(it) => it.until_full(params, now),
            State::FixedWindow(it) => it.until_full(params, now),
        }
    }

    /// Microseconds until `need` units are available, for
    /// `available < need <= capacity`.
    pub fn until_available(&self, params: &LimitParams, now: u64, need: u64) -> u64 {
        match self {
            State::SlidingWindowLog(it) => it.until_available(params, now, need),
            State::TokenBucket(it) => it.until_available(params, need),
            State::Gcra(it) => it.until_available(params, now, need),
            State::SlidingWindowCounter(it) => it.until_available(params, now, need),
            State::FixedWindow(it) => it.until_available(params, now),
        }
    }
}

/// One limit of a request, as the decision sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Check {
    pub params: LimitParams,
    /// Units this request takes; 0 checks without consuming.
    pub cost: u64,
    pub mode: Mode,
}

/// What the decision says about one limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    /// The limit had room for this request's cost (at least 1 for a check).
    pub has_room: bool,
    /// The request was allowed and this limit took its cost.
    pub consumed: bool,
    /// Units available after this request.
    pub remaining: u64,
    /// Units this request recorded past the limit's room: a limit charged
    /// always ([`Charge::Always`]) whose cost was more than it had left.
    /// 0 otherwise.
    pub overdraft: u64,
    /// With room: µs until fully replenished. Without: µs until the same
    /// cost could pass; when it never can (a cost past the capacity), µs
    /// until one unit could pass for a limit charged always left in debt,
    /// else the window.
    pub reset_us: u64,
}

/// The decision on a whole request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub allowed: bool,
    /// One per check, in order.
    pub outcomes: Vec<Outcome>,
}

/// Decides a request atomically over its limits' states: allowed as
/// [`allows`] rules (every enforcing limit has room and, when there are
/// quota-mode limits, at least one of them has room; see `verdict.rs`, the
/// one place of these rules). If allowed, each limit with room consumes its cost;
/// if denied, nothing is consumed by the limits charged
/// [`Charge::IfAllowed`].
///
/// A limit charged [`Charge::Always`] records its whole cost whatever the
/// verdict, past its room when it has too little (its debt), up to its
/// [`LimitParams::debt_capacity`]: what a charge would add past that is not
/// recorded. Its answer stays what the room was (`has_room` false, the
/// request denied when it enforces), and the reset counts from the state
/// after the charge.
///
/// `states[i]` is the state of `checks[i]`'s key (`None` = never seen); keys
/// must be distinct (merge same-key checks by adding their costs first).
/// On return, `states[i]` is the new state, `None` when it equals a fresh one.
pub fn decide(checks: &[Check], states: &mut [Option<State>], now: u64) -> Verdict {
    assert_eq!(checks.len(), states.len(), "one state per check");
    // Nearly every request has a few checks: no heap for these.
    let mut effective_now: SmallVec<[u64; 4]> = SmallVec::with_capacity(checks.len());
    let mut has_room: SmallVec<[bool; 4]> = SmallVec::with_capacity(checks.len());
    let mut available: SmallVec<[u64; 4]> = SmallVec::with_capacity(checks.len());
    for (check, slot) in checks.iter().zip(states.iter_mut()) {
        let state = slot.get_or_insert_with(|| State::fresh(&check.params, now));
        let at = state.advance(&check.params, now);
        let need = check.cost.max(1);
        let room = state.available(&check.params, at);
        has_room.push(need <= room);
        available.push(room);
        effective_now.push(at);
    }

    let allowed = allows(
        checks
            .iter()
            .zip(&has_room)
            .map(|(it, room)| (it.mode, *room)),
    );

    let mut outcomes = Vec::with_capacity(checks.len());
    for (idx, (check, slot)) in checks.iter().zip(states.iter_mut()).enumerate() {
        let params = &check.params;
        let at = effective_now[idx];
        let state = slot.as_mut().expect("filled above");
        let room = has_room[idx];
        let consumed = consumes(allowed, room, check.cost);
        let charged = if consumed {
            check.cost
        } else if params.charge == Charge::Always {
            check.cost.min(state.debt_room(params, at))
        } else {
            0
        };
        if charged > 0 {
            state.consume(params, at, charged);
        }
        let need = check.cost.max(1);
        // Durations are computed from the effective time; a request whose
        // clock lags the stored state waits that much longer.
        let lag = at - now;
        let reset_us = lag
            + if room {
                state.until_full(params, at)
            } else if need > params.capacity {
                // It can never pass. A limit charged always left without
                // room (in debt) says when room for one unit comes back;
                // otherwise (or at a limit of 0, never any room) the window.
                if params.charge == Charge::Always
                    && params.capacity > 0
                    && state.available(params, at) == 0
                {
                    state.until_available(params, at, 1)
                } else {
                    params.window_us
                }
            } else {
                state.until_available(params, at, need)
            };
        let remaining = state.available(params, at);
        if state.lifetime(params, at) == 0 {
            *slot = None;
        }
        outcomes.push(Outcome {
            has_room: room,
            consumed,
            remaining,
            overdraft: charged.saturating_sub(available[idx]),
            reset_us,
        });
    }
    Verdict { allowed, outcomes }
}

#[cfg(test)]
mod tests;
