//! A descriptor's `rate_limit` or `rate_limits`, walked into the limits
//! its node enforces.
//!
//! Invariant: a limit is kept only when every field of it is valid (each
//! problem reported, the walk going on); an unlimited limit is never
//! combined with others, and two limits of one node never share a counter.

use std::sync::Arc;

use serde_yaml_ng::Mapping;

use super::{LIMIT_KEYS, REPLACES_KEYS, Walk, get, join};
use crate::algorithms::{Algorithm, Charge};
use crate::rules::{Limits, LimitsError, NodeLimits, RateLimit, Unit};

/// The fields of one `rate_limit` mapping, each as far as it is valid.
struct LimitFields {
    unlimited: bool,
    /// The unit as written, for messages.
    unit_text: Option<String>,
    unit: Option<Unit>,
    requests_per_unit: Option<u32>,
    name: Option<Arc<str>>,
    algorithm: Option<Algorithm>,
    burst: Option<u32>,
    unit_multiplier: Option<u32>,
    charge: Option<Charge>,
}

/// Unit, multiplier and algorithm of a limited `rate_limit`, valid.
struct Window {
    unit: Unit,
    unit_multiplier: u32,
    algorithm: Algorithm,
    /// The limit names its algorithm (it does not inherit the default).
    named: bool,
}

/// A limit as written, before it joins its node.
enum LimitSpec {
    Unlimited {
        name: Option<Arc<str>>,
        replaces: Vec<Arc<str>>,
    },
    Limited(RateLimit),
}

impl Walk<'_> {
    pub(super) fn node_limits(&mut self, map: &Mapping, path: &str, composite: &str) -> NodeLimits {
        let specs = self.limit_specs(map, path, composite);
        let n_unlimited = specs
            .iter()
            .filter(|it| matches!(it, LimitSpec::Unlimited { .. }))
            .count();
        if n_unlimited > 0 && specs.len() > 1 {
            self.problem(
                &join(path, "rate_limits"),
                format!(
                    "descriptor '{composite}': an unlimited limit cannot be combined with other limits"
                ),
            );
            return NodeLimits::None;
        }
        let mut limits = Vec::with_capacity(specs.len());
        for spec in specs {
            match spec {
                LimitSpec::Unlimited { name, replaces } => {
                    return NodeLimits::Unlimited { name, replaces };
                }
                LimitSpec::Limited(limit) => limits.push(limit),
            }
        }
        match Limits::new(limits) {
            Ok(limits) => NodeLimits::Limited(limits),
            Err(LimitsError::Empty) => NodeLimits::None,
            Err(LimitsError::SharedCounter(shared)) => {
                for it in shared {
                    self.problem(
                        &format!("{path}.rate_limits[{}]", it.position),
                        format!(
                            "descriptor '{composite}': two limits with the same window ({}s) and algorithm ({}) would share one counter",
                            it.window_seconds, it.algorithm
                        ),
                    );
                }
                NodeLimits::None
            }
        }
    }

    /// The valid limits of `rate_limit` or `rate_limits`, whichever is set.
    fn limit_specs(&mut self, map: &Mapping, path: &str, composite: &str) -> Vec<LimitSpec> {
        match (get(map, "rate_limit"), get(map, "rate_limits")) {
            (Some(_), Some(_)) => {
                self.problem(
                    path,
                    format!("descriptor '{composite}' cannot have both rate_limit and rate_limits"),
                );
                Vec::new()
            }
            (Some(value), None) => {
                let limit_path = join(path, "rate_limit");
                let Some(limit) = self.mapping(value, &limit_path) else {
                    return Vec::new();
                };
                self.limit(limit, &limit_path, composite)
                    .into_iter()
                    .collect()
            }
            (None, Some(value)) => {
                let list_path = join(path, "rate_limits");
                let limits = self.list(Some(value), &list_path);
                limits
                    .into_iter()
                    .filter_map(|(limit, limit_path)| self.limit(limit, &limit_path, composite))
                    .collect()
            }
            (None, None) => Vec::new(),
        }
    }

    /// One `rate_limit` mapping; `None` when it is invalid (reported).
    fn limit(&mut self, map: &Mapping, path: &str, composite: &str) -> Option<LimitSpec> {
        let before = self.problems.len();
        self.check_keys(map, LIMIT_KEYS, path, "a rate_limit");
        let fields = self.limit_fields(map, path);
        let replaces = self.replaces(map, path, fields.name.as_deref());
        if fields.unlimited {
            self.check_unlimited(&fields, path, composite);
            return (self.problems.len() == before).then_some(LimitSpec::Unlimited {
                name: fields.name,
                replaces,
            });
        }
        let window = self.window(&fields, path, composite)?;
        if self.problems.len() != before {
            return None;
        }
        let requests_per_unit = fields.requests_per_unit.unwrap_or_else(|| {
            // envoyproxy/ratelimit reads an absent number as 0, which blocks
            // everything: keep the meaning, but say so.
            self.warn(format!(
                "descriptor '{composite}': requests_per_unit is absent, so 0: every request is denied"
            ));
            0
        });
        let limit = self.rate_limit(&window, requests_per_unit, fields.burst, path, composite)?;
        let charge = fields.charge.unwrap_or(self.default_charge);
        let limit = match limit.charged(charge) {
            Ok(limit) => limit,
            Err(err) => {
                self.problem(
                    &join(path, "charge"),
                    format!("descriptor '{composite}': {err}"),
                );
                return None;
            }
        };
        Some(LimitSpec::Limited(limit.named(fields.name, replaces)))
    }

    fn limit_fields(&mut self, map: &Mapping, path: &str) -> LimitFields {
        let unlimited = self.flag(map, "unlimited", path);
        let unit_text = self.string(map, "unit", path);
        LimitFields {
            unlimited,
            unit: unit_text.as_deref().and_then(Unit::from_name),
            unit_text,
            requests_per_unit: self.integer(map, "requests_per_unit", path),
            name: self
                .string(map, "name", path)
                .filter(|it| !it.is_empty())
                .map(Arc::<str>::from),
            algorithm: self.algorithm(map, "algorithm", path),
            burst: self.integer(map, "burst", path),
            unit_multiplier: self.integer(map, "unit_multiplier", path),
            charge: self.charge(map, "charge", path),
        }
    }

    /// The `replaces` list of a limit named `name`.
    fn replaces(&mut self, map: &Mapping, path: &str, name: Option<&str>) -> Vec<Arc<str>> {
        let mut replaces = Vec::new();
        let replaces_path = join(path, "replaces");
        for (entry, entry_path) in self.list(get(map, "replaces"), &replaces_path) {
            self.check_keys(entry, REPLACES_KEYS, &entry_path, "a replaces entry");
            let replaced = self.string(entry, "name", &entry_path).unwrap_or_default();
            if replaced.is_empty() {
                self.problem(
                    &entry_path,
                    "should not have an empty replaces entry".to_owned(),
                );
            } else if name == Some(replaced.as_str()) {
                self.problem(
                    &entry_path,
                    "replaces should not contain name of same descriptor".to_owned(),
                );
            } else {
                replaces.push(Arc::<str>::from(replaced));
            }
        }
        replaces
    }

    /// Reports what an unlimited limit must not have.
    fn check_unlimited(&mut self, fields: &LimitFields, path: &str, composite: &str) {
        if fields.unit.is_some() {
            self.problem(
                &join(path, "unit"),
                "should not specify rate limit unit when unlimited".to_owned(),
            );
        } else if let Some(text) = &fields.unit_text {
            // envoyproxy/ratelimit accepts (and ignores) an invalid unit here.
            self.warn(format!(
                "descriptor '{composite}': unit '{text}' is ignored on an unlimited limit"
            ));
        }
        for (field, present) in [
            ("algorithm", fields.algorithm.is_some()),
            ("burst", fields.burst.is_some()),
            ("unit_multiplier", fields.unit_multiplier.is_some()),
            ("charge", fields.charge.is_some()),
        ] {
            if present {
                self.problem(
                    &join(path, field),
                    format!("should not specify {field} when unlimited"),
                );
            }
        }
    }

    /// The window and algorithm of a limited limit; `None` without a valid
    /// unit. Reports a burst or multiplier out of range (the caller checks
    /// for problems).
    fn window(&mut self, fields: &LimitFields, path: &str, composite: &str) -> Option<Window> {
        let Some(unit) = fields.unit else {
            self.problem(
                &join(path, "unit"),
                format!(
                    "invalid rate limit unit '{}'",
                    fields.unit_text.as_deref().unwrap_or_default()
                ),
            );
            return None;
        };
        let algorithm = fields.algorithm.unwrap_or(self.default_algorithm);
        if let Some(burst) = fields.burst {
            if burst < 1 {
                self.problem(
                    &join(path, "burst"),
                    format!("descriptor '{composite}': burst must be at least 1"),
                );
            } else if !algorithm.has_burst() {
                self.problem(
                    &join(path, "burst"),
                    format!(
                        "descriptor '{composite}': burst applies only to token_bucket and gcra, not {algorithm}"
                    ),
                );
            }
        }
        let unit_multiplier = fields.unit_multiplier.unwrap_or(1);
        if unit_multiplier < 1 {
            self.problem(
                &join(path, "unit_multiplier"),
                format!("descriptor '{composite}': unit_multiplier must be at least 1"),
            );
        }
        Some(Window {
            unit,
            unit_multiplier,
            algorithm,
            named: fields.algorithm.is_some(),
        })
    }

    /// The limit of `requests_per_unit` per `window` (unnamed, replacing
    /// nothing), the sliding-window log capped; `None` when it cannot be
    /// enforced exactly (reported).
    fn rate_limit(
        &mut self,
        window: &Window,
        requests_per_unit: u32,
        burst: Option<u32>,
        path: &str,
        composite: &str,
    ) -> Option<RateLimit> {
        let unit_multiplier = window.unit_multiplier;
        if window.unit.window_us(unit_multiplier).is_none() {
            self.problem(
                &join(path, "unit_multiplier"),
                format!("descriptor '{composite}': unit_multiplier {unit_multiplier} makes the window too long"),
            );
            return None;
        }
        let (algorithm, log_capped) = self.log_cap(window, requests_per_unit, path, composite)?;
        let limit = RateLimit::new(
            window.unit,
            unit_multiplier,
            requests_per_unit,
            algorithm,
            burst,
        );
        let cap = self.max_log_entries;
        match limit {
            Ok(limit) if log_capped => {
                self.warn(format!(
                    "descriptor '{composite}': {requests_per_unit} per window is over the sliding_window_log cap of {cap} entries per key (--max-log-entries): using sliding_window_counter; name an algorithm to choose another"
                ));
                Some(limit.log_capped())
            }
            Ok(limit) => Some(limit),
            Err(err) if log_capped => {
                self.problem(
                    path,
                    format!(
                        "descriptor '{composite}': {requests_per_unit} per window is over the sliding_window_log cap of {cap} entries per key (--max-log-entries), and {err}"
                    ),
                );
                None
            }
            Err(err) => {
                self.problem(path, format!("descriptor '{composite}': {err}"));
                None
            }
        }
    }

    /// The algorithm a limit uses, and whether the log cap chose it: a
    /// sliding log keeps one entry per request of its window (in Redis, one
    /// sorted-set member per request, whatever its cost), so its number
    /// bounds the memory of every key. Over the cap, an inherited log
    /// becomes the counter and a named one is refused (`None`, reported).
    fn log_cap(
        &mut self,
        window: &Window,
        requests_per_unit: u32,
        path: &str,
        composite: &str,
    ) -> Option<(Algorithm, bool)> {
        let cap = self.max_log_entries;
        let over = window.algorithm == Algorithm::SlidingWindowLog && requests_per_unit > cap;
        if !over {
            return Some((window.algorithm, false));
        }
        if window.named {
            self.problem(
                &join(path, "algorithm"),
                format!(
                    "descriptor '{composite}': sliding_window_log with {requests_per_unit} per window is over the cap of {cap} entries per key (--max-log-entries); use sliding_window_counter or gcra, or raise the cap"
                ),
            );
            return None;
        }
        Some((Algorithm::SlidingWindowCounter, true))
    }
}
