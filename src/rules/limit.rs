//! A configured limit ([`RateLimit`]) and what a node enforces
//! ([`NodeLimits`], [`Limits`]).
//!
//! Invariant: every field is private and set only by a constructor or a
//! consuming builder, so a limit's params always agree with its unit,
//! multiplier, number and algorithm, a capped log is always on the
//! sliding-window counter, and a node's [`Limits`] are never empty and
//! never two on one counter.

use std::fmt;
use std::sync::Arc;

use crate::algorithms::{Algorithm, Charge, LimitParams, ParamsError};

/// A time unit of a configured limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unit {
    Second,
    Minute,
    Hour,
    Day,
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    pub const ALL: [Unit; 7] = [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ];

    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// Lowercase name as written in config files.
    pub fn name(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// `multiplier` units in microseconds; `None` when that overflows.
    pub fn window_us(self, multiplier: u32) -> Option<u64> {
        self.seconds()
            .checked_mul(u64::from(multiplier))
            .and_then(|it| it.checked_mul(1_000_000))
    }

    /// Case-insensitive parse of a config unit name.
    pub fn from_name(name: &str) -> Option<Unit> {
        Unit::ALL
            .into_iter()
            .find(|it| it.name().eq_ignore_ascii_case(name))
    }
}

/// One configured limit (a `rate_limit`, or one entry of `rate_limits`).
///
/// Built by [`RateLimit::new`], which derives `params` from the other
/// numbers: no field can be set on its own, so they never disagree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimit {
    unit: Unit,
    /// Window = `unit × unit_multiplier`; at least 1.
    unit_multiplier: u32,
    requests_per_unit: u32,
    /// `name`: reported in `current_limit`, and what `replaces` refers to.
    name: Option<Arc<str>>,
    /// Names of limits this one replaces when both match one request.
    replaces: Vec<Arc<str>>,
    /// Algorithm, window and capacity, validated for exact arithmetic.
    params: LimitParams,
    /// The rule inherited `sliding_window_log` with a number over the log
    /// cap, and uses `sliding_window_counter` instead.
    log_capped: bool,
}

/// Why [`RateLimit::new`] refused a limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RateLimitError {
    #[error("unit_multiplier must be at least 1")]
    ZeroMultiplier,
    #[error("unit_multiplier {0} makes the window too long")]
    WindowTooLong(u32),
    #[error(transparent)]
    Params(#[from] ParamsError),
}

impl RateLimit {
    /// `requests_per_unit` per `unit × unit_multiplier`, counted by
    /// `algorithm` (`burst` as in [`LimitParams::new`]), unnamed and
    /// replacing nothing: its params agree with its unit and multiplier.
    pub fn new(
        unit: Unit,
        unit_multiplier: u32,
        requests_per_unit: u32,
        algorithm: Algorithm,
        burst: Option<u32>,
    ) -> Result<RateLimit, RateLimitError> {
        if unit_multiplier < 1 {
            return Err(RateLimitError::ZeroMultiplier);
        }
        let window_us = unit
            .window_us(unit_multiplier)
            .ok_or(RateLimitError::WindowTooLong(unit_multiplier))?;
        let requests = u64::from(requests_per_unit);
        let params = LimitParams::new(algorithm, requests, window_us, burst.map(u64::from))?;
        Ok(RateLimit {
            unit,
            unit_multiplier,
            requests_per_unit,
            name: None,
            replaces: Vec::new(),
            params,
            log_capped: false,
        })
    }

    /// This limit under `name` (none when `None`), replacing the limits
    /// named `replaces`; its numbers are unchanged.
    pub fn named(self, name: Option<Arc<str>>, replaces: Vec<Arc<str>>) -> RateLimit {
        RateLimit {
            name,
            replaces,
            ..self
        }
    }

    /// This limit recording costs as `charge` says (its params validated
    /// for the debt a limit charged always carries); its numbers are
    /// unchanged.
    pub fn charged(self, charge: Charge) -> Result<RateLimit, RateLimitError> {
        let params = self.params.with_charge(charge)?;
        Ok(RateLimit { params, ..self })
    }

    /// This limit marked as counting with the sliding-window counter in
    /// place of an inherited sliding-window log over the log cap. Only a
    /// limit on the counter can stand in for a log: any other is returned
    /// unchanged.
    pub fn log_capped(self) -> RateLimit {
        RateLimit {
            log_capped: self.algorithm() == Algorithm::SlidingWindowCounter,
            ..self
        }
    }

    pub fn unit(&self) -> Unit {
        self.unit
    }

    /// At least 1: the window is `unit × unit_multiplier`.
    pub fn unit_multiplier(&self) -> u32 {
        self.unit_multiplier
    }

    pub fn requests_per_unit(&self) -> u32 {
        self.requests_per_unit
    }

    /// Reported in `current_limit`, and what `replaces` of other limits
    /// refers to.
    pub fn name(&self) -> Option<&Arc<str>> {
        self.name.as_ref()
    }

    /// Names of the limits this one replaces when both match one request.
    pub fn replaces(&self) -> &[Arc<str>] {
        &self.replaces
    }

    /// Algorithm, window and capacity, validated for exact arithmetic.
    pub fn params(&self) -> LimitParams {
        self.params
    }

    /// Whether the rule inherited `sliding_window_log` with a number over
    /// the log cap, and uses `sliding_window_counter` instead.
    pub fn is_log_capped(&self) -> bool {
        self.log_capped
    }

    pub fn window_seconds(&self) -> u64 {
        self.unit.seconds() * u64::from(self.unit_multiplier)
    }

    pub fn algorithm(&self) -> Algorithm {
        self.params.algorithm()
    }

    /// When the limit records a request's cost.
    pub fn charge(&self) -> Charge {
        self.params.charge()
    }
}

/// What a node enforces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeLimits {
    /// No `rate_limit`: the node only leads to children.
    None,
    /// `unlimited: true`: always OK, nothing counted. It still replaces the
    /// limits it names, as in envoyproxy/ratelimit.
    Unlimited {
        name: Option<Arc<str>>,
        replaces: Vec<Arc<str>>,
    },
    /// One or more limits; all must pass.
    Limited(Limits),
}

/// The limits of one node: at least one, and no two on one counter (a
/// counter is keyed by window and algorithm, so two limits sharing both
/// would count each request twice against whichever is smaller). The
/// limiter merges checks by counter key and relies on this.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits(Vec<RateLimit>);

/// Why [`Limits::new`] refused a list of limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitsError {
    Empty,
    /// Each limit that shares window and algorithm with an earlier one.
    SharedCounter(Vec<SharedCounter>),
}

/// A limit with the window and algorithm of an earlier one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedCounter {
    /// Its position in the list.
    pub position: usize,
    pub window_seconds: u64,
    pub algorithm: Algorithm,
}

impl Limits {
    pub fn new(limits: Vec<RateLimit>) -> Result<Limits, LimitsError> {
        if limits.is_empty() {
            return Err(LimitsError::Empty);
        }
        let shared: Vec<SharedCounter> = limits
            .iter()
            .enumerate()
            .filter(|(idx, limit)| {
                limits[..*idx].iter().any(|earlier| {
                    earlier.window_seconds() == limit.window_seconds()
                        && earlier.algorithm() == limit.algorithm()
                })
            })
            .map(|(position, limit)| SharedCounter {
                position,
                window_seconds: limit.window_seconds(),
                algorithm: limit.algorithm(),
            })
            .collect();
        if !shared.is_empty() {
            return Err(LimitsError::SharedCounter(shared));
        }
        Ok(Limits(limits))
    }
}

impl std::ops::Deref for Limits {
    type Target = [RateLimit];

    fn deref(&self) -> &[RateLimit] {
        &self.0
    }
}

impl fmt::Display for LimitsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitsError::Empty => f.write_str("no limits"),
            LimitsError::SharedCounter(shared) => {
                let first = &shared[0];
                write!(
                    f,
                    "limit {} has the window ({}s) and algorithm ({}) of an earlier one",
                    first.position, first.window_seconds, first.algorithm
                )
            }
        }
    }
}

impl std::error::Error for LimitsError {}

#[cfg(test)]
mod tests;
