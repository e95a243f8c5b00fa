//! A pool as the fields of the Redis hash that keeps it (`quota::redis`).
//!
//! Invariant: [`Pool::from_fields`] reads back exactly the pool
//! [`Pool::to_fields`] wrote; fields written before members carried a
//! proxy key still read.

use super::{Budget, Claim, DEMAND_REPORTS, Member, MemberId, Pool};

/// The hash field of a pool's budget.
pub const BUDGET_FIELD: &str = "budget";
/// The hash field of a pool's epoch.
pub const EPOCH_FIELD: &str = "epoch";
/// The hash field of a pool's incarnation.
pub const INCARNATION_FIELD: &str = "incarnation";
/// The prefix of the hash field of one instance's claim (`rule:<instance>`).
pub const CLAIM_PREFIX: &str = "rule:";

impl Pool {
    /// The pool as hash fields: [`BUDGET_FIELD`] `per_window:window_us`,
    /// [`EPOCH_FIELD`], [`INCARNATION_FIELD`], per instance's claim
    /// [`CLAIM_PREFIX`]`<instance>` `per_window:window_us:at`, and per
    /// member its id (decimal) `demands:share:enforced:expires_at:
    /// last_report:live:proxy:joined`, with `-` for a value not known (`demands`:
    /// its recent demands, oldest first, joined by `,`).
    pub fn to_fields(&self) -> Vec<(String, String)> {
        let show = |it: Option<u64>| it.map_or_else(|| "-".to_owned(), |it| it.to_string());
        let show_all = |it: &[u64]| {
            if it.is_empty() {
                "-".to_owned()
            } else {
                it.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
            }
        };
        let mut fields = vec![
            (
                BUDGET_FIELD.to_owned(),
                format!("{}:{}", self.budget.per_window, self.budget.window_us),
            ),
            (EPOCH_FIELD.to_owned(), self.epoch.to_string()),
            (INCARNATION_FIELD.to_owned(), self.incarnation.to_string()),
        ];
        for (instance, claim) in &self.claims {
            fields.push((
                format!("{CLAIM_PREFIX}{instance}"),
                format!(
                    "{}:{}:{}",
                    claim.budget.per_window, claim.budget.window_us, claim.at
                ),
            ));
        }
        for (id, member) in &self.members {
            fields.push((
                id.to_string(),
                format!(
                    "{}:{}:{}:{}:{}:{}:{}:{}",
                    show_all(&member.demands),
                    show(member.share),
                    show(member.enforced),
                    member.expires_at,
                    member.last_report,
                    u8::from(member.live),
                    member.proxy,
                    member.joined
                ),
            ));
        }
        fields
    }

    /// The pool of [`Pool::to_fields`]' fields (other fields ignored);
    /// `budget` when they hold none. `None` when a field is malformed.
    pub fn from_fields<'a>(
        fields: impl IntoIterator<Item = (&'a str, &'a str)>,
        budget: Budget,
    ) -> Option<Pool> {
        let mut pool = Pool::new(budget);
        let number = |text: &str| text.parse::<u64>().ok();
        let maybe = |text: &str| {
            if text == "-" {
                Some(None)
            } else {
                number(text).map(Some)
            }
        };
        for (name, value) in fields {
            if name == EPOCH_FIELD {
                pool.epoch = number(value)?;
                continue;
            }
            if name == INCARNATION_FIELD {
                pool.incarnation = number(value)?;
                continue;
            }
            if let Some(instance) = name.strip_prefix(CLAIM_PREFIX) {
                let mut parts = value.split(':').map(number);
                let (Some(Some(per_window)), Some(Some(window_us)), Some(Some(at)), None) =
                    (parts.next(), parts.next(), parts.next(), parts.next())
                else {
                    return None;
                };
                let budget = Budget {
                    per_window,
                    window_us,
                };
                pool.claims.insert(number(instance)?, Claim { budget, at });
                continue;
            }
            if name == BUDGET_FIELD {
                let (per_window, window_us) = value.split_once(':')?;
                pool.budget = Budget {
                    per_window: number(per_window)?,
                    window_us: number(window_us)?,
                };
                continue;
            }
            let Ok(id) = name.parse::<MemberId>() else {
                continue;
            };
            let parts: Vec<&str> = value.split(':').collect();
            // Six parts: stored before members carried a proxy key.
            let (demand, share, enforced, expires_at, last_report, live, proxy, joined) =
                match parts[..] {
                    [a, b, c, d, e, f] => (a, b, c, d, e, f, "0", "0"),
                    [a, b, c, d, e, f, g, h] => (a, b, c, d, e, f, g, h),
                    _ => return None,
                };
            let demands = if demand == "-" {
                Vec::new()
            } else {
                demand
                    .split(',')
                    .map(number)
                    .collect::<Option<Vec<u64>>>()?
            };
            if demands.len() > DEMAND_REPORTS {
                return None;
            }
            pool.members.insert(
                id,
                Member {
                    demands,
                    share: maybe(share)?,
                    enforced: maybe(enforced)?,
                    expires_at: number(expires_at)?,
                    last_report: number(last_report)?,
                    live: live == "1",
                    proxy: number(proxy)?,
                    joined: number(joined)?,
                },
            );
        }
        Some(pool)
    }
}
