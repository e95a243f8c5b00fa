//! Decision, hit and overdraft counters by `(domain, rule)`, and the cap on
//! per-value `rule` labels.
//!
//! Invariant: a decision never waits for a scrape. The counters live in a
//! sharded map of their own; a decision takes one shard's read lock (its
//! write lock only for a label's first decision), and a scrape copies each
//! shard's entries out under a brief read lock, then formats without any
//! lock a decision takes. A rule's per-value labels never exceed its cap:
//! the excess is counted under the rule's overflow label.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use super::{Metrics, OVERFLOW_SUFFIX, OVERRIDE_RULE};

/// How one descriptor's decision was answered: the `result` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricResult {
    /// Allowed, with no more of the most restrictive limit used than
    /// [`Options::near_limit_ratio`](crate::decision::Options::near_limit_ratio).
    Ok,
    /// Allowed, with more of the most restrictive limit used than
    /// [`Options::near_limit_ratio`](crate::decision::Options::near_limit_ratio)
    /// (as envoyproxy/ratelimit's near_limit).
    NearLimit,
    /// OVER_LIMIT.
    OverLimit,
    /// Would have been over, but a shadow-mode rule (or `--shadow-mode`)
    /// let it pass.
    Shadow,
}

impl MetricResult {
    pub const ALL: [MetricResult; 4] = [
        MetricResult::Ok,
        MetricResult::NearLimit,
        MetricResult::OverLimit,
        MetricResult::Shadow,
    ];

    /// This result's index in [`MetricResult::ALL`].
    pub(super) fn slot(self) -> usize {
        match self {
            MetricResult::Ok => 0,
            MetricResult::NearLimit => 1,
            MetricResult::OverLimit => 2,
            MetricResult::Shadow => 3,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MetricResult::Ok => "ok",
            MetricResult::NearLimit => "near_limit",
            MetricResult::OverLimit => "over_limit",
            MetricResult::Shadow => "shadow",
        }
    }
}

/// The `rule` label of one descriptor's decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetricRule {
    /// The matched node's path (`tenant.path_/expensive`): shared, no
    /// allocation.
    Path(Arc<str>),
    /// Built from the descriptor's values: the rule has `detailed_metric`
    /// (every level `key_value`) or some level has `value_to_metric` (that
    /// level `key_value`, the others as in the path). `rule` is the matched
    /// node's path: the cap on per-value series counts per path.
    Values { rule: Arc<str>, label: String },
    /// A RateLimitOverride: [`OVERRIDE_RULE`].
    Override,
}

impl MetricRule {
    pub fn as_str(&self) -> &str {
        match self {
            MetricRule::Path(path) => path,
            MetricRule::Values { label, .. } => label,
            MetricRule::Override => OVERRIDE_RULE,
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    domain: Arc<str>,
    rule: Arc<str>,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    domain: Arc<str>,
    rule: Arc<str>,
}

/// The counters of one `(domain, rule)`, resolved once.
#[derive(Debug, Default)]
pub(super) struct RuleCounters {
    /// Indexed like [`MetricResult::ALL`].
    decisions: [AtomicU64; 4],
    /// Hits by result, indexed like [`MetricResult::ALL`]: their sum is the
    /// rule's hits, and envoyproxy/ratelimit's statistics count hits per
    /// result.
    hits: [AtomicU64; 4],
    /// Units charged past the limit's room (limits charged always).
    overdraft: AtomicU64,
    /// Label built from request values: a result's series appears only
    /// once it is non-zero (a value seen once makes one series, not four).
    per_value: bool,
}

impl RuleCounters {
    /// Hits of every result together.
    pub(super) fn total_hits(&self) -> u64 {
        self.hits
            .iter()
            .map(|it| it.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// Hits answered with `result`.
    pub(super) fn hits(&self, result: MetricResult) -> u64 {
        self.hits[result.slot()].load(Ordering::Relaxed)
    }

    fn record(&self, slot: usize, hits: u64, overdraft: u64) {
        self.decisions[slot].fetch_add(1, Ordering::Relaxed);
        self.hits[slot].fetch_add(hits, Ordering::Relaxed);
        if overdraft > 0 {
            self.overdraft.fetch_add(overdraft, Ordering::Relaxed);
        }
    }
}

/// One domain's counters by `rule` label (foldhash: looked up per
/// decision, keyed by configured names or labels the per-rule cap bounds).
type DomainCounters = foldhash::HashMap<Arc<str>, Arc<RuleCounters>>;

/// One shard of [`Series`]: `domain → rule → counters`, looked up by `&str`
/// without allocating.
type SeriesShard = RwLock<foldhash::HashMap<Arc<str>, DomainCounters>>;

/// Per-value series budgets by `(domain, rule path)`.
type Budgets = foldhash::HashMap<(Arc<str>, Arc<str>), ValueBudget>;

/// Shards of the decision series: a new label locks one shard for an insert,
/// and a scrape holds each shard only while copying its entries out.
const SHARDS: usize = 32;

/// `domain → rule → counters`, split over [`SHARDS`] by a hash of both.
#[derive(Debug)]
pub(super) struct Series {
    shards: Box<[SeriesShard]>,
    hasher: foldhash::fast::FixedState,
}

/// One series as copied out of [`Series`] for a scrape.
pub(super) type SeriesEntry = (Arc<str>, Arc<str>, Arc<RuleCounters>);

impl Series {
    fn new() -> Series {
        Series {
            shards: (0..SHARDS)
                .map(|_| RwLock::new(foldhash::HashMap::default()))
                .collect(),
            hasher: foldhash::fast::FixedState::default(),
        }
    }

    fn shard(&self, domain: &str, rule: &str) -> &SeriesShard {
        let hash = self.hasher.hash_one((domain, rule));
        &self.shards[(hash % SHARDS as u64) as usize]
    }

    /// Every series, sorted by domain and rule. Holds one shard's read lock
    /// at a time, only to clone `Arc`s.
    pub(super) fn snapshot(&self) -> Vec<SeriesEntry> {
        let mut entries = Vec::new();
        for shard in &self.shards {
            let shard = shard.read().unwrap_or_else(PoisonError::into_inner);
            for (domain, rules) in shard.iter() {
                for (rule, counters) in rules {
                    entries.push((domain.clone(), rule.clone(), counters.clone()));
                }
            }
        }
        entries.sort_unstable_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        entries
    }
}

/// Per-value series created so far by one rule, against the cap.
#[derive(Debug)]
struct ValueBudget {
    created: usize,
    /// Decisions folded into the overflow series; resolved on the first.
    overflowed: Option<Counter>,
}

/// Encodes `throttlegate_decisions_total`, `throttlegate_hits_total` and
/// `throttlegate_overdraft_units_total` from a snapshot of [`Series`] at
/// each scrape.
#[derive(Debug)]
struct SeriesCollector(Arc<Series>);

impl Collector for SeriesCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let entries = self.0.snapshot();
        if entries.is_empty() {
            return Ok(());
        }
        // The counters keep moving after the snapshot; each is read once.
        let mut family =
            encoder.encode_descriptor("decisions", DECISIONS_HELP, None, MetricType::Counter)?;
        for (domain, rule, counters) in &entries {
            for (slot, result) in MetricResult::ALL.iter().enumerate() {
                let value = counters.decisions[slot].load(Ordering::Relaxed);
                if counters.per_value && value == 0 {
                    continue;
                }
                let labels = DecisionLabels {
                    domain: domain.clone(),
                    rule: rule.clone(),
                    result: result.name(),
                };
                family
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
            }
        }
        let mut family = encoder.encode_descriptor("hits", HITS_HELP, None, MetricType::Counter)?;
        for (domain, rule, counters) in &entries {
            let value = counters.total_hits();
            if counters.per_value && value == 0 {
                continue;
            }
            let labels = RuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            };
            family
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
        }
        // Only rules that ever went past their room: most never do.
        let mut family = encoder.encode_descriptor(
            "overdraft_units",
            OVERDRAFT_HELP,
            None,
            MetricType::Counter,
        )?;
        for (domain, rule, counters) in &entries {
            let value = counters.overdraft.load(Ordering::Relaxed);
            if value == 0 {
                continue;
            }
            let labels = RuleLabels {
                domain: domain.clone(),
                rule: rule.clone(),
            };
            family
                .encode_family(&labels)?
                .encode_counter::<NoLabelSet, _, u64>(&value, None)?;
        }
        Ok(())
    }
}

const DECISIONS_HELP: &str =
    "Descriptor decisions by domain, rule and result (ok, near_limit, over_limit, shadow)";
const HITS_HELP: &str = "Hits (sum of request costs) by domain and rule";
const OVERDRAFT_HELP: &str = "Units charged past the limit's room by limits with charge: always \
     (usage recorded after the fact), by domain and rule";

/// The decision series, and the per-value budgets of each rule.
#[derive(Debug)]
pub(super) struct DecisionMetrics {
    /// Decision and hit counters by `(domain, rule)`, encoded by a
    /// [`SeriesCollector`].
    pub(super) series: Arc<Series>,
    max_values_per_rule: usize,
    /// `(domain, rule path) →` per-value series created; taken only when a
    /// per-value label is seen for the first time.
    value_budgets: Mutex<Budgets>,
    value_overflows: Family<RuleLabels, Counter>,
}

impl DecisionMetrics {
    /// Registers the decision series and the overflow counter; each rule
    /// creates at most `max_values_per_rule` per-value labels.
    pub(super) fn register(registry: &mut Registry, max_values_per_rule: usize) -> Self {
        let series = Arc::new(Series::new());
        registry.register_collector(Box::new(SeriesCollector(series.clone())));
        let value_overflows = Family::<RuleLabels, Counter>::default();
        registry.register(
            "metric_value_overflows",
            "Decisions of rules with per-value metrics counted under the rule's overflow label because the rule reached its maximum of series",
            value_overflows.clone(),
        );
        DecisionMetrics {
            series,
            max_values_per_rule,
            value_budgets: Mutex::new(Budgets::default()),
            value_overflows,
        }
    }

    /// `path`: set for a per-value label, the rule whose budget it uses.
    fn record(
        &self,
        domain: &str,
        label: &str,
        path: Option<&Arc<str>>,
        result: MetricResult,
        hits: u64,
        overdraft: u64,
    ) {
        let slot = result.slot();
        let shard = self.series.shard(domain, label);
        {
            let rules = shard.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(counters) = rules.get(domain).and_then(|it| it.get(label)) {
                counters.record(slot, hits, overdraft);
                return;
            }
        }
        // First decision under this label: create its series once.
        {
            let mut rules = shard.write().unwrap_or_else(PoisonError::into_inner);
            let by_rule = match rules.get_mut(domain) {
                Some(it) => it,
                None => rules.entry(Arc::from(domain)).or_default(),
            };
            if let Some(counters) = by_rule.get(label) {
                counters.record(slot, hits, overdraft);
                return;
            }
            if path.is_none_or(|path| self.take_value_budget(domain, path)) {
                let counters = Arc::new(RuleCounters {
                    per_value: path.is_some(),
                    ..RuleCounters::default()
                });
                counters.record(slot, hits, overdraft);
                by_rule.insert(Arc::from(label), counters);
                return;
            }
        }
        // Over the cap: the shard lock is released before recording the
        // overflow label, which may live in another shard.
        if let Some(path) = path {
            let overflow = format!("{path}:{OVERFLOW_SUFFIX}");
            self.record(domain, &overflow, None, result, hits, overdraft);
        }
    }

    /// Whether the rule `path` may create one more per-value series (and
    /// then counts it); if not, counts the overflow, and logs the rule's
    /// first one.
    fn take_value_budget(&self, domain: &str, path: &Arc<str>) -> bool {
        let mut budgets = self
            .value_budgets
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let budget = budgets
            .entry((Arc::from(domain), path.clone()))
            .or_insert(ValueBudget {
                created: 0,
                overflowed: None,
            });
        if budget.created < self.max_values_per_rule {
            budget.created += 1;
            return true;
        }
        let counter = budget.overflowed.get_or_insert_with(|| {
            tracing::warn!(
                domain,
                rule = %path,
                max = self.max_values_per_rule,
                "rule reached its maximum of per-value metric series; further values are counted under {path}:{OVERFLOW_SUFFIX}"
            );
            self.value_overflows.get_or_create_owned(&RuleLabels {
                domain: Arc::from(domain),
                rule: path.clone(),
            })
        });
        counter.inc();
        false
    }
}

impl Metrics {
    /// Counts one descriptor decision of cost `hits` under the fixed
    /// label `rule` (a rule path, or one of the `_` labels).
    pub fn record_decision(&self, domain: &str, rule: &str, result: MetricResult, hits: u64) {
        self.decisions.record(domain, rule, None, result, hits, 0);
    }

    /// Counts one descriptor decision of cost `hits`, `overdraft` of
    /// them charged past the limit's room, under its rule's label; a
    /// per-value label past its rule's cap is folded into the rule's
    /// overflow label.
    pub fn record(
        &self,
        domain: &str,
        rule: &MetricRule,
        result: MetricResult,
        hits: u64,
        overdraft: u64,
    ) {
        let path = match rule {
            MetricRule::Values { rule, .. } => Some(rule),
            MetricRule::Path(_) | MetricRule::Override => None,
        };
        self.decisions
            .record(domain, rule.as_str(), path, result, hits, overdraft);
    }
}

#[cfg(test)]
mod tests;
