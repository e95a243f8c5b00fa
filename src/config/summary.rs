//! The text `check-config` prints and `/rlconfig` shows.

use std::fmt::Write as _;
use std::sync::Arc;

use crate::algorithms::Charge;
use crate::rules::{Domain, Node, NodeLimits, RuleSet};

/// What `check-config` prints and `/rlconfig` shows: each domain (sorted by
/// name) with each rule path in config order, its limits and flags, e.g.
///
/// ```text
/// domain api (default algorithm sliding_window_log, bucket_key_order tenant, path)
///   remote_address  10/second sliding_window_log
///   tenant.path_/expensive  10/minute sliding_window_log name=x replaces=premium  [shadow]
///   api_key  1000/minute fixed_window charge=always
/// ```
pub fn summary(rules: &RuleSet) -> String {
    let mut out = String::new();
    if rules.domains().len() == 0 {
        out.push_str("no domains configured\n");
        return out;
    }
    let mut domains: Vec<&Domain> = rules.domains().collect();
    domains.sort_by(|a, b| a.name().cmp(b.name()));
    for domain in domains {
        let _ = write!(
            out,
            "domain {} (default algorithm {}",
            domain.name(),
            domain.default_algorithm()
        );
        if !domain.bucket_key_order().is_empty() {
            let _ = write!(
                out,
                ", bucket_key_order {}",
                domain.bucket_key_order().join(", ")
            );
        }
        out.push_str(")\n");
        if domain.children().is_empty() {
            out.push_str("  (no rules)\n");
        }
        for node in domain.children() {
            summarize_node(node, rules.max_log_entries(), &mut out);
        }
    }
    out
}

fn summarize_node(node: &Node, max_log_entries: u32, out: &mut String) {
    let _ = write!(out, "  {}  ", node.path());
    match node.limits() {
        NodeLimits::None => out.push_str("(no limit)"),
        NodeLimits::Unlimited { name, replaces } => {
            out.push_str("unlimited");
            write_name_replaces(out, name.as_deref(), replaces);
        }
        NodeLimits::Limited(limits) => {
            for (idx, limit) in limits.iter().enumerate() {
                if idx > 0 {
                    out.push_str("; ");
                }
                let _ = write!(out, "{}/", limit.requests_per_unit());
                if limit.unit_multiplier() > 1 {
                    let _ = write!(out, "{} {}s", limit.unit_multiplier(), limit.unit().name());
                } else {
                    out.push_str(limit.unit().name());
                }
                let _ = write!(out, " {}", limit.algorithm());
                if limit.is_log_capped() {
                    let _ = write!(
                        out,
                        " (not sliding_window_log: over --max-log-entries {max_log_entries})"
                    );
                }
                if limit.algorithm().has_burst()
                    && limit.params().capacity() != limit.params().limit()
                {
                    let _ = write!(out, " burst={}", limit.params().capacity());
                }
                if limit.charge() != Charge::IfAllowed {
                    let _ = write!(out, " charge={}", limit.charge());
                }
                write_name_replaces(out, limit.name().map(|it| &**it), limit.replaces());
            }
        }
    }
    let flags: Vec<&str> = [
        (node.shadow_mode(), "shadow"),
        (node.quota_mode(), "quota"),
        (node.share_threshold(), "share_threshold"),
        (node.detailed_metric(), "detailed_metric"),
        (node.value_to_metric(), "value_to_metric"),
    ]
    .into_iter()
    .filter_map(|(on, flag)| on.then_some(flag))
    .collect();
    if !flags.is_empty() {
        let _ = write!(out, "  [{}]", flags.join(", "));
    }
    out.push('\n');
    for child in node.children() {
        summarize_node(child, max_log_entries, out);
    }
}

fn write_name_replaces(out: &mut String, name: Option<&str>, replaces: &[Arc<str>]) {
    if let Some(name) = name {
        let _ = write!(out, " name={name}");
    }
    if !replaces.is_empty() {
        let names: Vec<&str> = replaces.iter().map(|it| &**it).collect();
        let _ = write!(out, " replaces={}", names.join(","));
    }
}
