//! The rules of a request's verdict, in one place: which limits decide it
//! ([`allows`]), what a limit takes when it is allowed ([`consumes`]), and,
//! for limits decided before the request's verdict is known (the slot
//! groups of a Redis Cluster request), what each reports either way
//! ([`settle`]). [`super::decide`] (the memory backend) rules with these
//! functions; `lua/decide.lua` is their port for a request decided whole in
//! one script (a single Redis, a batch, one Cluster slot), held to them by
//! `tests/cluster_sentinel/differential.rs`.

use super::{Check, Mode, Outcome, Verdict};

/// Whether a request is allowed, from each limit's mode and whether it had
/// room for its cost: iff every enforcing limit has room and, when there
/// are quota-mode limits, at least one of them has. Shadow limits never
/// decide.
pub fn allows(limits: impl IntoIterator<Item = (Mode, bool)>) -> bool {
    let mut enforced_ok = true;
    let mut quota_seen = false;
    let mut quota_ok = false;
    for (mode, has_room) in limits {
        match mode {
            Mode::Enforce => enforced_ok &= has_room,
            Mode::Quota => {
                quota_seen = true;
                quota_ok |= has_room;
            }
            Mode::Shadow => {}
        }
    }
    enforced_ok && (quota_ok || !quota_seen)
}

/// Whether a limit takes its cost as part of an allowed request: the
/// request allowed, the limit with room, a cost above 0; whatever its mode.
/// A limit charged always records its cost otherwise too (see
/// [`super::decide`]), and that charge is never given back.
pub fn consumes(allowed: bool, has_room: bool, cost: u64) -> bool {
    allowed && has_room && cost > 0
}

/// One limit decided before its request's verdict was known: what it
/// reports if the request is allowed (having taken its cost when it had
/// room), and if it is denied (what it took given back, a charge that
/// stands whatever the verdict kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Provisional {
    pub if_allowed: Outcome,
    pub if_denied: Outcome,
}

/// The verdict on a request whose limits were decided provisionally, one
/// [`Provisional`] per check in order: allowed as [`allows`] rules from
/// each limit's room, each limit reporting its outcome for that verdict.
/// When it is denied, whatever the limits took as allowed must be given
/// back (on a Cluster, the refund of every group that took something).
pub fn settle(checks: &[Check], provisional: &[Provisional]) -> Verdict {
    let allowed = allows(
        checks
            .iter()
            .zip(provisional)
            .map(|(check, it)| (check.mode, it.if_allowed.has_room)),
    );
    let outcomes = checks
        .iter()
        .zip(provisional)
        .map(|(check, it)| {
            if allowed {
                Outcome {
                    consumed: consumes(true, it.if_allowed.has_room, check.cost),
                    ..it.if_allowed
                }
            } else {
                Outcome {
                    consumed: false,
                    ..it.if_denied
                }
            }
        })
        .collect();
    Verdict { allowed, outcomes }
}

#[cfg(test)]
mod tests;
