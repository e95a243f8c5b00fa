//! One request as the transports hand it over, and the bounds it must keep.

use crate::algorithms::MAX_EXACT;
use crate::rules::Unit;

use super::Error;

/// Most descriptors in one request.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries in one descriptor.
pub const MAX_ENTRIES: usize = 32;

/// One request, as the transports hand it over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    pub domain: String,
    pub descriptors: Vec<Descriptor>,
    /// The request's cost; 0 means 1.
    pub hits_addend: u32,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    pub entries: Vec<Entry>,
    /// A per-request limit enforced instead of the config tree, when it
    /// can be (see [`LimitOverride::enforced`]).
    pub limit: Option<LimitOverride>,
    /// When present (even 0) it wins over the request's cost; 0 checks
    /// without consuming.
    pub hits_addend: Option<u64>,
}

/// One key/value pair of a descriptor: any bytes of any length (Envoy
/// copies header values, which need not be UTF-8, into them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Entry {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
}

/// A RateLimitOverride, as the wire carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitOverride {
    pub requests_per_unit: u32,
    /// `None`: the wire said UNKNOWN; the override is then ignored.
    pub unit: Option<Unit>,
}

/// A RateLimitOverride that is enforced: its unit is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnforcedOverride {
    pub requests_per_unit: u32,
    pub unit: Unit,
}

impl LimitOverride {
    /// The override to enforce, if this one can be. An override whose unit
    /// is UNKNOWN says nothing enforceable, so the descriptor is decided by
    /// the rules as if it had none: refusing the request would let it
    /// through Envoy.
    pub fn enforced(&self) -> Option<EnforcedOverride> {
        Some(EnforcedOverride {
            requests_per_unit: self.requests_per_unit,
            unit: self.unit?,
        })
    }
}

impl Request {
    /// The cost of a descriptor without its own `hits_addend`: at least 1.
    pub(super) fn cost(&self) -> u64 {
        u64::from(self.hits_addend.max(1))
    }
}

impl Descriptor {
    /// The override that replaces the rules for this descriptor, if any.
    pub fn enforced_override(&self) -> Option<EnforcedOverride> {
        self.limit.as_ref()?.enforced()
    }

    /// This descriptor's cost in a request whose cost is `request_cost`.
    ///
    /// No capacity reaches 2^53 (exact in a Lua number), so a larger cost
    /// is denied either way; capping keeps every backend exact.
    pub(super) fn cost(&self, request_cost: u64) -> u64 {
        self.hits_addend.unwrap_or(request_cost).min(MAX_EXACT)
    }
}

/// Refuses only what no Envoy sends and no rule could decide: an empty
/// domain, no descriptors, too many of them, a descriptor without entries
/// or with too many, an empty entry key. Keys and values of any length and
/// any bytes are decided (the 64 KiB message cap bounds them).
pub(super) fn validate(request: &Request) -> Result<(), Error> {
    if request.domain.is_empty() {
        return invalid("empty domain".to_owned());
    }
    if request.descriptors.is_empty() {
        return invalid("no descriptors".to_owned());
    }
    if request.descriptors.len() > MAX_DESCRIPTORS {
        return invalid(format!(
            "too many descriptors: {}, at most {MAX_DESCRIPTORS}",
            request.descriptors.len()
        ));
    }
    for (idx, descriptor) in request.descriptors.iter().enumerate() {
        validate_descriptor(idx, descriptor)?;
    }
    Ok(())
}

fn validate_descriptor(idx: usize, descriptor: &Descriptor) -> Result<(), Error> {
    if descriptor.entries.is_empty() {
        return invalid(format!("descriptor {idx} has no entries"));
    }
    if descriptor.entries.len() > MAX_ENTRIES {
        return invalid(format!(
            "descriptor {idx} has too many entries: {}, at most {MAX_ENTRIES}",
            descriptor.entries.len()
        ));
    }
    match descriptor.entries.iter().position(|it| it.key.is_empty()) {
        Some(entry_idx) => invalid(format!(
            "descriptor {idx}, entry {entry_idx}: empty entry key"
        )),
        None => Ok(()),
    }
}

fn invalid(message: String) -> Result<(), Error> {
    Err(Error::InvalidArgument(message))
}

#[cfg(test)]
mod tests;
