//! The sharing rule: one budget of `L` requests per window split among the
//! proxies reporting a bucket, max-min fair by reported demand, changed
//! only when it must be (a new assignment refills the proxy's bucket).
//!
//! A pool's members are one proxy's view of one bucket each. A member is
//! *active* while its stream is open and it reported within
//! [`STALE_AFTER_US`]; otherwise it is *held*: it gets no new share, but
//! the share it was last sent still counts against the budget until that
//! assignment's time to live has run out, then it is forgotten.
//!
//! The invariant every change keeps: the shares of the active members plus
//! those held add up to at most `L`.

use std::collections::BTreeMap;

use crate::clock::Micros;

/// Envoy reports every bucket about this often, whatever its config asks.
pub const REPORT_INTERVAL_US: Micros = 5_000_000;
/// An assignment's time to live: three report intervals. A proxy that
/// stops reporting keeps enforcing its last share at most this long.
pub const ASSIGNMENT_TTL_US: Micros = 3 * REPORT_INTERVAL_US;
/// A member silent for this long is no longer given a share.
pub const STALE_AFTER_US: Micros = 3 * REPORT_INTERVAL_US;
/// Reports over a shorter time are read as covering this much: a new
/// bucket's first report covers almost no time.
const MIN_ELAPSED_US: Micros = 1_000_000;
/// A member's share is raised only when the new share is at least this
/// fraction (1/N) above the old one: smaller raises are not worth the
/// refill a new assignment causes.
const RAISE_STEP: u64 = 10;

/// One member of a pool: one stream's report of one bucket.
pub type MemberId = u64;

/// `per_window` requests per `window_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub per_window: u64,
    pub window_us: Micros,
}

/// What a proxy reported of one bucket since its previous report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub allowed: u64,
    pub denied: u64,
    pub elapsed_us: Micros,
}

impl Usage {
    /// Requests per window this report shows the proxy wants (allowed or
    /// not), at most `budget.per_window`.
    pub fn demand(&self, budget: Budget) -> u64 {
        let asked = u128::from(self.allowed) + u128::from(self.denied);
        let elapsed = u128::from(self.elapsed_us.max(MIN_ELAPSED_US));
        let per_window = (asked * u128::from(budget.window_us)).div_ceil(elapsed);
        u64::try_from(per_window)
            .unwrap_or(u64::MAX)
            .min(budget.per_window)
    }
}

/// A share sent to a member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Change {
    pub member: MemberId,
    /// Requests per window of the pool's budget.
    pub share: u64,
    /// False when only the assignment's time to live is renewed (the
    /// reporting member is always answered).
    pub changed: bool,
}

#[derive(Debug, Clone)]
struct Member {
    /// Requests per window; `None` until a report covered some time.
    demand: Option<u64>,
    /// The share last sent; `None` before the first.
    share: Option<u64>,
    /// When the last share sent stops being enforced by the proxy.
    expires_at: Micros,
    last_report: Micros,
    /// Its stream is open.
    live: bool,
}

/// One budget and the members sharing it.
#[derive(Debug, Clone)]
pub struct Pool {
    budget: Budget,
    members: BTreeMap<MemberId, Member>,
}

/// What [`Pool::members`] shows of one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemberView {
    pub member: MemberId,
    pub demand: Option<u64>,
    pub share: Option<u64>,
    pub active: bool,
}

impl Pool {
    pub fn new(budget: Budget) -> Pool {
        Pool {
            budget,
            members: BTreeMap::new(),
        }
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// No member left, held ones included.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The shares that still count against the budget.
    pub fn committed(&self) -> u64 {
        self.members.values().filter_map(|it| it.share).sum()
    }

    pub fn members(&self, now: Micros) -> impl Iterator<Item = MemberView> + '_ {
        self.members.iter().map(move |(id, it)| MemberView {
            member: *id,
            demand: it.demand,
            share: it.share,
            active: it.is_active(now),
        })
    }

    /// `member` reported (`usage` is `None` when the report covered no
    /// time to read a demand from). Returns the changes to send: the
    /// reporter's own share first (always), then every other member whose
    /// share changed.
    pub fn report(&mut self, member: MemberId, usage: Option<Usage>, now: Micros) -> Vec<Change> {
        self.forget_expired(now);
        let budget = self.budget;
        let entry = self.members.entry(member).or_insert(Member {
            demand: None,
            share: None,
            expires_at: now,
            last_report: now,
            live: true,
        });
        entry.live = true;
        entry.last_report = now;
        if let Some(usage) = usage.filter(|it| it.elapsed_us > 0) {
            entry.demand = Some(usage.demand(budget));
        }
        self.rebalance(now, Some(member))
    }

    /// A new budget (a reload changed the rule): shares are recomputed at
    /// once, and those that must shrink are returned.
    pub fn set_budget(&mut self, budget: Budget, now: Micros) -> Vec<Change> {
        if budget == self.budget {
            return Vec::new();
        }
        let old = self.budget;
        self.budget = budget;
        if old.window_us != budget.window_us {
            // Numbers per the old window, as numbers per the new one;
            // shares rounded up so what is held is never undercounted.
            for member in self.members.values_mut() {
                let convert = |value: u64, up: bool| {
                    let scaled = u128::from(value) * u128::from(budget.window_us);
                    let per = u128::from(old.window_us.max(1));
                    let out = if up {
                        scaled.div_ceil(per)
                    } else {
                        scaled / per
                    };
                    u64::try_from(out).unwrap_or(u64::MAX)
                };
                member.share = member.share.map(|it| convert(it, true));
                member.demand = member.demand.map(|it| convert(it, false));
            }
        }
        self.rebalance(now, None)
    }

    /// `member`'s stream ended: its share is held until it expires.
    pub fn leave(&mut self, member: MemberId, now: Micros) {
        if let Some(entry) = self.members.get_mut(&member) {
            entry.live = false;
            if entry.share.is_none() || entry.expires_at <= now {
                self.members.remove(&member);
            }
        }
    }

    /// The share last sent to `member`.
    pub fn share_of(&self, member: MemberId) -> Option<u64> {
        self.members.get(&member).and_then(|it| it.share)
    }

    /// Forgets held members whose assignment has expired; true when any
    /// was forgotten (their share is free again).
    pub fn forget_expired(&mut self, now: Micros) -> bool {
        let before = self.members.len();
        self.members
            .retain(|_, it| it.is_active(now) || it.expires_at > now);
        self.members.len() != before
    }

    fn rebalance(&mut self, now: Micros, reporter: Option<MemberId>) -> Vec<Change> {
        let limit = self.budget.per_window;
        let held: u64 = self
            .members
            .values()
            .filter(|it| !it.is_active(now))
            .filter_map(|it| it.share)
            .sum();
        let available = limit.saturating_sub(held);
        let active: Vec<MemberId> = self
            .members
            .iter()
            .filter(|(_, it)| it.is_active(now))
            .map(|(id, _)| *id)
            .collect();
        let demands: Vec<u64> = active
            .iter()
            .map(|id| self.members[id].demand.unwrap_or(limit))
            .collect();
        let targets = max_min(available, &demands);
        let mut next: Vec<u64> = active
            .iter()
            .zip(&targets)
            .zip(&demands)
            .map(|((id, &target), &demand)| match self.members[id].share {
                None => target,
                Some(share) if demand > share && target > share => {
                    if (target - share).saturating_mul(RAISE_STEP) >= share {
                        target
                    } else {
                        share
                    }
                }
                Some(share) => share,
            })
            .collect();
        if next.iter().sum::<u64>() > available {
            // Over the budget: every share above its fair target comes
            // down to it (the targets add up to `available`).
            for (share, &target) in next.iter_mut().zip(&targets) {
                *share = (*share).min(target);
            }
        }
        let mut changes = Vec::new();
        for (id, share) in active.iter().zip(next) {
            let Some(member) = self.members.get_mut(id) else {
                continue;
            };
            let changed = member.share != Some(share);
            if changed || reporter == Some(*id) {
                member.share = Some(share);
                member.expires_at = now + ASSIGNMENT_TTL_US;
                let change = Change {
                    member: *id,
                    share,
                    changed,
                };
                if reporter == Some(*id) {
                    changes.insert(0, change);
                } else {
                    changes.push(change);
                }
            }
        }
        changes
    }
}

impl Member {
    fn is_active(&self, now: Micros) -> bool {
        self.live && now.saturating_sub(self.last_report) <= STALE_AFTER_US
    }
}

/// Max-min fair shares of `capacity` for `demands`: a demand below the
/// fair level gets what it asks, the rest is split among the others; what
/// is left once every demand is met is spread evenly as headroom (the
/// first members in order get the remainder's units). The shares always
/// add up to exactly `capacity` (for at least one demand).
pub fn max_min(capacity: u64, demands: &[u64]) -> Vec<u64> {
    let mut shares = vec![0; demands.len()];
    if demands.is_empty() {
        return shares;
    }
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by_key(|&idx| demands[idx]);
    let mut left = capacity;
    for (pos, &idx) in order.iter().enumerate() {
        let others = (order.len() - pos) as u64;
        let give = demands[idx].min(left / others);
        shares[idx] = give;
        left -= give;
    }
    let count = demands.len() as u64;
    let (each, extra) = (left / count, left % count);
    for (pos, share) in shares.iter_mut().enumerate() {
        *share += each + u64::from((pos as u64) < extra);
    }
    shares
}
