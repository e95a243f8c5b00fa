//! The rule a descriptor reaches, and the rule set rebuilt around it with each algorithm.
//!
//! A variant is the loaded rule set with one change: the reached node's
//! limits are rebuilt by [`RateLimit::new`] with another algorithm (unit,
//! number, name, `burst` and `charge` kept), so every decision still goes through the
//! same matching, planning and backend code as the service's.

use std::sync::Arc;

use crate::algorithms::Algorithm;
use crate::decision::Request;
use crate::rules::{Domain, Limits, Node, NodeLimits, RateLimit, RuleSet};

use super::{Error, Scale};

/// Lanes from the least to the most precise window, then the buckets.
pub const LANE_ORDER: [Algorithm; 5] = [
    Algorithm::FixedWindow,
    Algorithm::SlidingWindowCounter,
    Algorithm::SlidingWindowLog,
    Algorithm::TokenBucket,
    Algorithm::Gcra,
];

/// The reached rule: its domain, its node and the node's limits.
#[derive(Debug, Clone, Copy)]
pub struct ReachedRule<'a> {
    domain: &'a Domain,
    node: &'a Node,
    limits: &'a Limits,
}

/// One rule set to replay the pattern through, and its lane's name.
#[derive(Debug)]
pub struct Variant {
    pub label: String,
    pub rules: RuleSet,
}

/// The rule the request's one descriptor reaches; an error when its domain
/// is unknown or the descriptor reaches no limit.
pub fn find<'a>(rules: &'a RuleSet, request: &Request) -> Result<ReachedRule<'a>, Error> {
    let Some(domain) = rules.domain(&request.domain) else {
        let mut known: Vec<&str> = rules.domains().map(|it| it.name().as_ref()).collect();
        known.sort_unstable();
        return Err(Error::NoRule(format!(
            "unknown domain '{}' (the config has: {})",
            request.domain,
            known.join(", ")
        )));
    };
    let descriptor = describe_entries(request);
    let pairs: Vec<(&[u8], &[u8])> = request.descriptors[0]
        .entries
        .iter()
        .map(|it| (it.key.as_slice(), it.value.as_slice()))
        .collect();
    let Some(found) = domain.find(&pairs) else {
        return Err(Error::NoRule(format!(
            "descriptor {descriptor} matches no rule in domain '{}'",
            domain.name()
        )));
    };
    let node = found.rule();
    match node.limits() {
        NodeLimits::Limited(limits) => Ok(ReachedRule {
            domain,
            node,
            limits,
        }),
        NodeLimits::Unlimited { .. } => Err(Error::NoRule(format!(
            "descriptor {descriptor} reaches rule '{}', which is unlimited: nothing to simulate",
            node.path()
        ))),
        NodeLimits::None => Err(Error::NoRule(format!(
            "descriptor {descriptor} reaches rule '{}', which has no rate_limit",
            node.path()
        ))),
    }
}

impl ReachedRule<'_> {
    /// What the pattern is scaled to: the node's first limit.
    pub fn scale(&self) -> Scale {
        let params = self.limits[0].params();
        Scale {
            limit: params.limit(),
            window_us: params.window_us(),
        }
    }

    /// The longest window among the node's limits.
    pub fn longest_window_us(&self) -> u64 {
        let windows = self.limits.iter().map(|it| it.params().window_us());
        windows.max().unwrap_or(1_000_000)
    }

    /// `domain api, descriptor user=alice: 10 per 1 s (sliding_window_log)`.
    pub fn describe(&self, request: &Request) -> String {
        let limits: Vec<String> = self.limits.iter().map(describe_limit).collect();
        // The service lets every request of a shadow rule through, and so
        // does the simulation: say why nothing is denied.
        let shadow = if self.node.shadow_mode() {
            "; shadow_mode: never denies"
        } else {
            ""
        };
        format!(
            "domain {}, descriptor {}: {}{shadow}",
            self.domain.name(),
            describe_entries(request),
            limits.join(" and ")
        )
    }
}

fn describe_limit(limit: &RateLimit) -> String {
    let params = limit.params();
    let mut text = match limit.unit_multiplier() {
        1 => format!("{}/{}", limit.requests_per_unit(), limit.unit().name()),
        many => format!(
            "{}/{many} {}s",
            limit.requests_per_unit(),
            limit.unit().name()
        ),
    };
    if limit.algorithm().has_burst() && params.capacity() != params.limit() {
        text.push_str(&format!(" burst {}", params.capacity()));
    }
    format!("{text} ({})", limit.algorithm())
}

fn describe_entries(request: &Request) -> String {
    let entries = request.descriptors[0].entries.iter().map(|it| {
        format!(
            "{}={}",
            String::from_utf8_lossy(&it.key),
            String::from_utf8_lossy(&it.value)
        )
    });
    entries.collect::<Vec<String>>().join(",")
}

/// One variant per algorithm in [`LANE_ORDER`], or with `only_configured`
/// the loaded rules as they are.
pub fn variants(
    rules: &RuleSet,
    reached: &ReachedRule<'_>,
    only_configured: bool,
) -> Result<Vec<Variant>, Error> {
    if only_configured {
        let names: Vec<&str> = reached
            .limits
            .iter()
            .map(|it| it.algorithm().name())
            .collect();
        return Ok(vec![Variant {
            label: names.join("+"),
            rules: rules.clone(),
        }]);
    }
    LANE_ORDER
        .iter()
        .map(|algorithm| {
            let limits = with_algorithm(reached.limits, *algorithm)?;
            let children = rebuild(reached.domain.children(), "", reached.node, &limits);
            let domain = Domain::new(
                reached.domain.name().clone(),
                reached.domain.default_algorithm(),
                children,
            );
            let others = rules
                .domains()
                .filter(|it| it.name() != reached.domain.name())
                .cloned();
            Ok(Variant {
                label: algorithm.name().to_owned(),
                rules: RuleSet::new(others.chain([domain]), rules.max_log_entries()),
            })
        })
        .collect()
}

/// `limits` counted by `algorithm`, each with its unit, number and name,
/// and its `burst` where both algorithms have one.
fn with_algorithm(limits: &Limits, algorithm: Algorithm) -> Result<NodeLimits, Error> {
    let mut rebuilt = Vec::with_capacity(limits.len());
    for limit in limits.iter() {
        let params = limit.params();
        let burst = (limit.algorithm().has_burst() && params.capacity() > 0)
            .then(|| u32::try_from(params.capacity()).ok())
            .flatten();
        let changed = RateLimit::new(
            limit.unit(),
            limit.unit_multiplier(),
            limit.requests_per_unit(),
            algorithm,
            burst,
        )
        .and_then(|it| it.charged(limit.charge()))
        .map_err(|err| Error::NoRule(format!("cannot count this rule with {algorithm}: {err}")))?;
        rebuilt.push(changed.named(limit.name().cloned(), limit.replaces().to_vec()));
    }
    let limits = Limits::new(rebuilt)
        .map_err(|err| Error::NoRule(format!("cannot count this rule with {algorithm}: {err}")))?;
    Ok(NodeLimits::Limited(limits))
}

/// `nodes` (below the rule path `parent`) rebuilt as they were, except that
/// `target` enforces `limits`.
fn rebuild(nodes: &[Node], parent: &str, target: &Node, limits: &NodeLimits) -> Vec<Node> {
    nodes
        .iter()
        .map(|node| {
            let own = if std::ptr::eq(node, target) {
                limits.clone()
            } else {
                node.limits().clone()
            };
            let children = rebuild(node.children(), node.path(), target, limits);
            Node::new(parent, Arc::from(node.key()), node.value().clone(), own)
                .with_flags(node.flags())
                .with_children(children)
        })
        .collect()
}

#[cfg(test)]
mod tests;
