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
//! With several instances sharing a pool (through Redis), a member is
//! *local* to the instance its stream is on, which alone can deliver it a
//! new share: a share another instance decides is *pending* until then
//! (and decided again when delivered), and the member counts with the
//! share its proxy holds (`enforced`).
//!
//! The invariant every change keeps: the shares the proxies hold (active
//! members and held ones) add up to at most `L`.
//!
//! A reconnected proxy reports from a new stream, as a new member; Envoy
//! sends nothing naming itself, so a member carries a *proxy key* (made
//! by the transport from the peer address and the bucket) and takes over
//! a *departed* member of its key (stream closed, or silent for
//! [`GONE_AFTER_US`]) that last reported before it joined: its demands,
//! and the share its proxy holds until the new one's is delivered.
//! Instances *claim* the budget their rules give a pool at each report;
//! the lowest claim of the last [`STALE_AFTER_US`] applies. A pool's
//! epochs count its decisions within its random *incarnation*: a pool
//! lost in Redis is rebuilt with a new one. docs/rlqs.md explains each.

use std::collections::BTreeMap;

use crate::clock::Micros;

mod fields;

pub use fields::{BUDGET_FIELD, CLAIM_PREFIX, EPOCH_FIELD, INCARNATION_FIELD};

/// Envoy reports every bucket about this often, whatever its config asks.
pub const REPORT_INTERVAL_US: Micros = 5_000_000;
/// An assignment's time to live: three report intervals. A proxy that
/// stops reporting keeps enforcing its last share at most this long.
pub const ASSIGNMENT_TTL_US: Micros = 3 * REPORT_INTERVAL_US;
/// A member silent for this long is no longer given a share.
pub const STALE_AFTER_US: Micros = 3 * REPORT_INTERVAL_US;
/// A member whose stream is open but that has not reported for this long
/// (one and a half report intervals: it missed a report) has departed:
/// a new member of the same proxy key takes it over.
pub const GONE_AFTER_US: Micros = 3 * REPORT_INTERVAL_US / 2;
/// Reports over a shorter time are read as covering this much: a new
/// bucket's first report covers almost no time.
const MIN_ELAPSED_US: Micros = 1_000_000;
/// A member's share is raised only when the new share is at least this
/// fraction (1/N) above the old one: smaller raises are not worth the
/// refill a new assignment causes.
const RAISE_STEP: u64 = 10;
/// A member's demand is the highest of its last this many reports (15 s
/// of Envoy's reports): a demand that jitters from report to report does
/// not move the shares each time, and one that falls frees its share
/// within this many reports.
pub const DEMAND_REPORTS: usize = 3;

/// One member of a pool: one stream's report of one bucket.
pub type MemberId = u64;

/// What recognises one proxy's bucket across its streams (0: unknown,
/// never taken over).
pub type ProxyKey = u64;

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
    /// The pool's incarnation and epoch when it was decided: of two
    /// grants to one member of one incarnation, the one of the later
    /// epoch is the one to enforce.
    pub incarnation: u64,
    pub epoch: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    /// Requests per window of its last [`DEMAND_REPORTS`] reports that
    /// covered some time, oldest first; empty before the first.
    demands: Vec<u64>,
    /// The share decided last; `None` before the first.
    share: Option<u64>,
    /// The share last delivered to the proxy (what it may enforce).
    enforced: Option<u64>,
    /// When the last share sent stops being enforced by the proxy.
    expires_at: Micros,
    last_report: Micros,
    /// Its stream is open.
    live: bool,
    /// Its proxy's key (0: unknown).
    proxy: ProxyKey,
    /// Its first report.
    joined: Micros,
}

/// The budget one instance's rules give a pool, and when it last said so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Claim {
    budget: Budget,
    at: Micros,
}

/// One budget and the members sharing it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    budget: Budget,
    /// Counts the pool's decisions within its incarnation.
    epoch: u64,
    /// Random and nonzero once the pool has decided anything.
    incarnation: u64,
    /// By instance: the budget its rules give the pool.
    claims: BTreeMap<u64, Claim>,
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
            epoch: 0,
            incarnation: 0,
            claims: BTreeMap::new(),
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
        self.members.values().map(Member::counted).sum()
    }

    pub fn members(&self, now: Micros) -> impl Iterator<Item = MemberView> + '_ {
        self.members.iter().map(move |(id, it)| MemberView {
            member: *id,
            demand: it.demand(),
            share: it.share,
            active: it.is_active(now),
        })
    }

    /// `member` reported (`usage` is `None` when the report covered no
    /// time to read a demand from). Returns the changes to send: the
    /// reporter's own share first (always), then every other member whose
    /// share changed.
    pub fn report(&mut self, member: MemberId, usage: Option<Usage>, now: Micros) -> Vec<Change> {
        self.report_from(member, usage, now, &|_| true)
    }

    /// [`Pool::report`] by the instance whose members `is_local` tells:
    /// only they are sent changes (and returned).
    pub fn report_from(
        &mut self,
        member: MemberId,
        usage: Option<Usage>,
        now: Micros,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> Vec<Change> {
        self.report_by(member, 0, usage, now, is_local)
    }

    /// [`Pool::report_from`] by a member of the proxy `proxy`, which
    /// takes over the departed members of that proxy (see the module's
    /// documentation).
    pub fn report_by(
        &mut self,
        member: MemberId,
        proxy: ProxyKey,
        usage: Option<Usage>,
        now: Micros,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> Vec<Change> {
        self.forget_expired(now);
        let budget = self.budget;
        self.members.entry(member).or_insert(Member {
            demands: Vec::new(),
            share: None,
            enforced: None,
            expires_at: now,
            last_report: now,
            live: true,
            proxy,
            joined: now,
        });
        let joined = self.members.get(&member).map_or(now, |it| it.joined);
        if proxy != 0 {
            let departed: Vec<MemberId> = self
                .members
                .iter()
                .filter(|(id, it)| {
                    **id != member
                        && it.proxy == proxy
                        && it.last_report <= joined
                        && it.has_departed(now)
                })
                .map(|(id, _)| *id)
                .collect();
            for id in departed {
                if let Some(old) = self.members.remove(&id)
                    && let Some(entry) = self.members.get_mut(&member)
                {
                    entry.take_over(old);
                }
            }
        }
        let Some(entry) = self.members.get_mut(&member) else {
            return Vec::new();
        };
        entry.live = true;
        entry.proxy = proxy;
        entry.last_report = now;
        if let Some(usage) = usage.filter(|it| it.elapsed_us > 0) {
            if entry.demands.len() >= DEMAND_REPORTS {
                entry.demands.remove(0);
            }
            entry.demands.push(usage.demand(budget));
        }
        self.rebalance(now, Some(member), is_local)
    }

    /// A new budget (a reload changed the rule): shares are recomputed at
    /// once, and those that must shrink are returned.
    pub fn set_budget(&mut self, budget: Budget, now: Micros) -> Vec<Change> {
        self.set_budget_from(budget, now, &|_| true)
    }

    /// Instance `instance` (whose rules give the pool `budget`) reports:
    /// its claim is renewed, and the pool's budget becomes the lowest
    /// claim of the last [`STALE_AFTER_US`] (see the module's
    /// documentation). Returns the changes, and whether the claims
    /// disagree.
    pub fn claim_budget(
        &mut self,
        instance: u64,
        budget: Budget,
        now: Micros,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> (Vec<Change>, bool) {
        self.claims.insert(instance, Claim { budget, at: now });
        self.claims
            .retain(|_, it| now - it.at.min(now) <= STALE_AFTER_US);
        let lowest = self
            .claims
            .values()
            .map(|it| it.budget)
            .min_by(|a, b| {
                let rate = |it: &Budget, other: &Budget| {
                    u128::from(it.per_window) * u128::from(other.window_us.max(1))
                };
                rate(a, b)
                    .cmp(&rate(b, a))
                    .then(a.window_us.cmp(&b.window_us))
                    .then(a.per_window.cmp(&b.per_window))
            })
            .unwrap_or(budget);
        let disagree = self.claims.values().any(|it| it.budget != lowest);
        (self.set_budget_from(lowest, now, is_local), disagree)
    }

    /// [`Pool::set_budget`] by the instance whose members `is_local` tells.
    pub fn set_budget_from(
        &mut self,
        budget: Budget,
        now: Micros,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> Vec<Change> {
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
                member.enforced = member.enforced.map(|it| convert(it, true));
                for demand in &mut member.demands {
                    *demand = convert(*demand, false);
                }
            }
        }
        self.rebalance(now, None, is_local)
    }

    /// `member`'s stream ended: its share is held until it expires.
    pub fn leave(&mut self, member: MemberId, now: Micros) {
        if let Some(entry) = self.members.get_mut(&member) {
            entry.live = false;
            if entry.enforced.is_none() || entry.expires_at <= now {
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

    /// Decides every active member's share again (a new epoch) and
    /// returns the changes to send: to local members only, the
    /// `reporter`'s first (always, changed or not).
    fn rebalance(
        &mut self,
        now: Micros,
        reporter: Option<MemberId>,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> Vec<Change> {
        if self.incarnation == 0 {
            self.incarnation = random_nonzero(now);
        }
        self.epoch += 1;
        let (active, next) = self.next_shares(now, is_local);
        let mut changes = Vec::new();
        for (id, share) in active.iter().zip(next) {
            let Some(member) = self.members.get_mut(id) else {
                continue;
            };
            member.share = Some(share);
            if !is_local(*id) {
                continue;
            }
            let changed = member.enforced != Some(share);
            if changed || reporter == Some(*id) {
                member.enforced = Some(share);
                member.expires_at = now + ASSIGNMENT_TTL_US;
                let change = Change {
                    member: *id,
                    share,
                    changed,
                    incarnation: self.incarnation,
                    epoch: self.epoch,
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

    /// The active members, and the share each is to have: its max-min
    /// fair target (raised only by a step worth a refill), within what
    /// held members and other instances' members leave of the budget.
    fn next_shares(
        &self,
        now: Micros,
        is_local: &dyn Fn(MemberId) -> bool,
    ) -> (Vec<MemberId>, Vec<u64>) {
        let limit = self.budget.per_window;
        let held: u64 = self
            .members
            .values()
            .filter(|it| !it.is_active(now))
            .map(Member::counted)
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
            .map(|id| self.members[id].demand().unwrap_or(limit))
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
        // Members of other instances keep what their proxies hold until
        // their instance delivers the new share: what this instance's own
        // members get must leave room for that.
        let counted = |idx: usize, share: u64| {
            let id = active[idx];
            if is_local(id) {
                share
            } else {
                self.members[&id].counted()
            }
        };
        let total: u64 = next
            .iter()
            .enumerate()
            .map(|(idx, &it)| counted(idx, it))
            .sum();
        let mut excess = total.saturating_sub(available);
        if excess > 0 {
            let mut order: Vec<usize> = (0..active.len())
                .filter(|&idx| is_local(active[idx]))
                .collect();
            order.sort_by_key(|&idx| std::cmp::Reverse(next[idx]));
            for idx in order {
                let cut = next[idx].min(excess);
                next[idx] -= cut;
                excess -= cut;
            }
        }
        (active, next)
    }
}

/// A random nonzero number (for a pool's incarnation).
fn random_nonzero(seed: Micros) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(seed);
    hasher.finish().max(1)
}

impl Member {
    /// Its stream closed, or it missed a report.
    fn has_departed(&self, now: Micros) -> bool {
        !self.live || now.saturating_sub(self.last_report) > GONE_AFTER_US
    }

    /// Takes over `old`, its proxy's departed member: its demands, and
    /// the share the proxy holds until this one's own is delivered.
    fn take_over(&mut self, old: Member) {
        if self.demands.is_empty() {
            self.demands = old.demands;
        }
        if self.enforced.is_none() {
            self.share = old.share;
            self.enforced = old.enforced;
            self.expires_at = old.expires_at;
        }
    }

    /// Requests per window it wants: the highest of its recent reports;
    /// `None` until a report covered some time.
    fn demand(&self) -> Option<u64> {
        self.demands.iter().copied().max()
    }

    fn is_active(&self, now: Micros) -> bool {
        self.live && now.saturating_sub(self.last_report) <= STALE_AFTER_US
    }

    /// What counts against the budget: the share the proxy holds (a
    /// share decided but not delivered is checked again when it is).
    fn counted(&self) -> u64 {
        self.enforced.unwrap_or(0)
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
