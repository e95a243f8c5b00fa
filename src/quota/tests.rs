use proptest::prelude::*;

use super::mapping::{Resolution, descriptor, resolve};
use super::share::{
    ASSIGNMENT_TTL_US, Budget, DEMAND_REPORTS, GONE_AFTER_US, MemberId, Pool, REPORT_INTERVAL_US,
    Usage, max_min,
};
use crate::testing::rules_from;

const MINUTE: u64 = 60_000_000;
const BUDGET: Budget = Budget {
    per_window: 300,
    window_us: MINUTE,
};

/// A report of `per_minute` requests asked over one report interval.
fn asked(per_minute: u64) -> Option<Usage> {
    Some(Usage {
        allowed: per_minute * REPORT_INTERVAL_US / MINUTE,
        denied: 0,
        elapsed_us: REPORT_INTERVAL_US,
    })
}

fn share(pool: &Pool, member: MemberId) -> u64 {
    pool.share_of(member).unwrap_or_default()
}

#[test]
fn max_min_meets_small_demands_and_splits_the_rest() {
    assert_eq!(max_min(300, &[60, 240, 480]), vec![60, 120, 120]);
    assert_eq!(max_min(300, &[50, 100, 60]), vec![80, 130, 90]);
    assert_eq!(max_min(300, &[300]), vec![300]);
    assert_eq!(max_min(2, &[5, 5, 5]), vec![0, 1, 1]);
    assert_eq!(max_min(0, &[5, 5]), vec![0, 0]);
    assert_eq!(max_min(10, &[]), Vec::<u64>::new());
}

proptest! {
    #[test]
    fn max_min_hands_out_exactly_the_capacity_fairly(
        capacity in 0u64..10_000,
        demands in proptest::collection::vec(0u64..5_000, 1..12),
    ) {
        let shares = max_min(capacity, &demands);
        prop_assert_eq!(shares.iter().sum::<u64>(), capacity);
        let total: u64 = demands.iter().sum();
        for (idx, (&share, &demand)) in shares.iter().zip(&demands).enumerate() {
            if total <= capacity {
                prop_assert!(share >= demand, "demand {} of {:?} got {}", idx, demands, share);
            } else if share < demand {
                // An unmet demand gets at least what anyone else gets
                // (less one unit of rounding).
                let most = shares.iter().max().copied().unwrap_or(0);
                prop_assert!(most <= share + 1, "{:?} -> {:?}", demands, shares);
            }
        }
    }

    /// Whatever the members report, join or leave, the shares that count
    /// (held ones included) never add up to more than the budget, unless
    /// what proxies that left still hold is over it already.
    #[test]
    fn shares_never_add_up_to_more_than_the_budget(
        steps in proptest::collection::vec((0u64..6, 0u64..1_000, 0u8..10, 0u64..4_000_000), 1..80),
        limit in 1u64..1_000,
    ) {
        let mut pool = Pool::new(Budget { per_window: limit, window_us: MINUTE });
        let mut now = 1_000_000_000;
        for (member, per_minute, action, step) in steps {
            now += step;
            match action {
                0 => pool.leave(member, now),
                1 => {
                    let lower = Budget { per_window: limit / 2, window_us: MINUTE };
                    pool.set_budget(lower, now);
                }
                _ => {
                    pool.report(member, asked(per_minute), now);
                }
            }
            // Shares held by proxies that left cannot be taken back: after
            // a lower budget they may exceed it alone, and then every
            // active member gets nothing until they expire.
            let active: u64 = pool.members(now).filter(|it| it.active).filter_map(|it| it.share).sum();
            prop_assert!(pool.committed() <= pool.budget().per_window || active == 0,
                "{} committed of {}", pool.committed(), pool.budget().per_window);
        }
    }
}

#[test]
fn three_proxies_share_by_demand() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    // First reports carry no demand yet: equal shares, never over.
    for member in [1, 2, 3] {
        pool.report(member, None, now);
        assert!(pool.committed() <= 300);
    }
    for _ in 0..4 {
        now += REPORT_INTERVAL_US;
        for (member, demand) in [(1, 60), (2, 240), (3, 480)] {
            pool.report(member, asked(demand), now);
            assert!(pool.committed() <= 300);
        }
    }
    assert_eq!(
        [share(&pool, 1), share(&pool, 2), share(&pool, 3)],
        [60, 120, 120]
    );
}

#[test]
fn steady_demand_changes_no_share() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    for _ in 0..3 {
        for (member, demand) in [(1, 60), (2, 240), (3, 480)] {
            pool.report(member, asked(demand), now);
        }
        now += REPORT_INTERVAL_US;
    }
    for _ in 0..10 {
        for (member, demand) in [(1, 60), (2, 240), (3, 480)] {
            let changes = pool.report(member, asked(demand), now);
            assert_eq!(changes.len(), 1, "{changes:?}");
            assert!(!changes[0].changed, "{changes:?}");
        }
        now += REPORT_INTERVAL_US;
    }
}

/// A report of exactly `per_minute` requests over a minute.
fn per_minute(per_minute: u64) -> Option<Usage> {
    Some(Usage {
        allowed: per_minute,
        denied: 0,
        elapsed_us: MINUTE,
    })
}

/// Member 1 wants 600 a minute; member 2 alternates between 100 and 130.
/// Read report by report, member 2's raise to 130 takes from member 1,
/// and its fall back to 100 gives it back (a raise of at least 10 %): two
/// new assignments at every report. Its demand being the highest of its
/// recent reports, the shares settle instead; a lasting fall still frees
/// the share within [`DEMAND_REPORTS`] reports.
#[test]
fn a_jittering_demand_does_not_change_shares_at_every_report() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    let mut changed = Vec::new();
    for round in 0..12 {
        let jitter = if round % 2 == 0 { 100 } else { 130 };
        let mut count = 0;
        for (member, demand) in [(1, 600), (2, jitter)] {
            let changes = pool.report(member, per_minute(demand), now);
            count += changes.iter().filter(|it| it.changed).count();
            assert!(pool.committed() <= 300);
        }
        changed.push(count);
        now += REPORT_INTERVAL_US;
    }
    // Round 0: both assigned; round 1: member 2 raised to 130, member 1
    // lowered; then nothing.
    assert_eq!(changed[2..], [0; 10], "{changed:?}");
    assert_eq!([share(&pool, 1), share(&pool, 2)], [170, 130]);
    // A fall that lasts: member 1 gets the room back once member 2's
    // reports of 130 are out of its recent ones.
    let mut rounds = 0;
    while share(&pool, 1) != 250 {
        rounds += 1;
        assert!(
            rounds <= DEMAND_REPORTS,
            "{:?}",
            pool.members(now).collect::<Vec<_>>()
        );
        pool.report(2, per_minute(50), now);
        pool.report(1, per_minute(600), now);
        now += REPORT_INTERVAL_US;
    }
    assert_eq!(share(&pool, 2), 50);
}

#[test]
fn a_proxy_that_stops_reporting_loses_its_share_after_the_ttl() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    for _ in 0..3 {
        pool.report(1, asked(600), now);
        pool.report(2, asked(600), now);
        now += REPORT_INTERVAL_US;
    }
    assert_eq!([share(&pool, 1), share(&pool, 2)], [150, 150]);
    pool.leave(2, now);
    // Held: still counted until its assignment expires.
    pool.report(1, asked(600), now);
    assert_eq!(share(&pool, 1), 150);
    now += ASSIGNMENT_TTL_US + 1;
    let changes = pool.report(1, asked(600), now);
    assert_eq!(share(&pool, 1), 300, "{changes:?}");
    assert_eq!(pool.share_of(2), None);
}

#[test]
fn a_lower_budget_shrinks_every_share_at_once() {
    let mut pool = Pool::new(BUDGET);
    let now = 1_000_000_000;
    pool.report(1, asked(600), now);
    pool.report(2, asked(600), now);
    let lower = Budget {
        per_window: 100,
        window_us: MINUTE,
    };
    let changes = pool.set_budget(lower, now + 1);
    assert_eq!(changes.len(), 2, "{changes:?}");
    assert!(pool.committed() <= 100);
}

fn resolved(yaml: &str, bucket: &[(&str, &str)]) -> Resolution {
    let rules = rules_from("rlqs.yaml", yaml);
    let owned: Vec<(String, String)> = bucket
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let entries = descriptor(owned.iter().map(|(k, v)| (k, v)));
    resolve(&rules, "rlqs", &entries)
}

const RULES: &str = "
domain: rlqs
descriptors:
  - key: name
    value: tenant-bucket
    descriptors:
      - key: tenant
        value: blocked
        rate_limit: {unit: minute, requests_per_unit: 0}
      - key: tenant
        value: free
        rate_limit: {unlimited: true}
      - key: tenant
        value: dry
        shadow_mode: true
        rate_limit: {unit: minute, requests_per_unit: 10}
      - key: tenant
        rate_limit: {unit: minute, requests_per_unit: 300}
";

#[test]
fn a_bucket_is_its_entries_sorted_by_key_then_matched_as_a_descriptor() {
    // The order given does not matter: `name` comes before `tenant`.
    let a = resolved(RULES, &[("tenant", "a"), ("name", "tenant-bucket")]);
    let b = resolved(RULES, &[("name", "tenant-bucket"), ("tenant", "b")]);
    let (
        Resolution::Shared {
            pool: pool_a,
            budget,
            ..
        },
        Resolution::Shared { pool: pool_b, .. },
    ) = (&a, &b)
    else {
        panic!("{a:?} {b:?}");
    };
    assert_eq!(*budget, BUDGET);
    // Each tenant its own budget (the key-only rule counts per value).
    assert_ne!(pool_a, pool_b);
    assert!(matches!(
        resolved(RULES, &[("name", "tenant-bucket"), ("tenant", "blocked")]),
        Resolution::Blocked { .. }
    ));
    assert!(matches!(
        resolved(RULES, &[("name", "tenant-bucket"), ("tenant", "free")]),
        Resolution::Unlimited { .. }
    ));
    assert!(matches!(
        resolved(RULES, &[("name", "tenant-bucket"), ("tenant", "dry")]),
        Resolution::Shadow { .. }
    ));
    assert_eq!(resolved(RULES, &[("name", "other")]), Resolution::Unmatched);
    // Depth must match, as in RLS.
    assert_eq!(
        resolved(RULES, &[("name", "tenant-bucket")]),
        Resolution::Unmatched
    );
}

/// `path` nested under `tenant`: sorted, `path` would come first and
/// match nothing.
const ORDERED: &str = "
domain: rlqs
bucket_key_order: [tenant, path]
descriptors:
  - key: tenant
    descriptors:
      - key: path
        descriptors:
          - key: method
            rate_limit: {unit: minute, requests_per_unit: 300}
      - key: path
        value: /free
        rate_limit: {unlimited: true}
";

#[test]
fn bucket_key_order_puts_its_keys_first_then_the_others_sorted() {
    let keys = ["tenant".into(), "path".into()];
    assert_eq!(
        super::mapping::ordered(
            &keys,
            &[("a", "1"), ("path", "/x"), ("tenant", "t"), ("z", "2")]
        ),
        [("tenant", "t"), ("path", "/x"), ("a", "1"), ("z", "2")]
    );
    // A listed key the bucket lacks is skipped.
    assert_eq!(
        super::mapping::ordered(&keys, &[("method", "GET"), ("path", "/x")]),
        [("path", "/x"), ("method", "GET")]
    );
    // Listed keys first (tenant, path), then method: matches, whatever
    // order the bucket gave.
    let a = resolved(
        ORDERED,
        &[("method", "GET"), ("path", "/x"), ("tenant", "acme")],
    );
    let b = resolved(
        ORDERED,
        &[("tenant", "acme"), ("method", "GET"), ("path", "/x")],
    );
    let Resolution::Shared { pool, budget, .. } = &a else {
        panic!("{a:?}");
    };
    assert_eq!(*budget, BUDGET);
    assert_eq!(a, b);
    assert_eq!(
        pool.as_str(),
        "rlqs|tenant.path.method|tenant=acme|path=/x|method=GET"
    );
    assert!(matches!(
        resolved(ORDERED, &[("path", "/free"), ("tenant", "acme")]),
        Resolution::Unlimited { .. }
    ));
    // The same rules without the order: sorted, `path` comes first and
    // nothing matches.
    let sorted = ORDERED.replace("bucket_key_order: [tenant, path]\n", "");
    assert_eq!(
        resolved(&sorted, &[("path", "/free"), ("tenant", "acme")]),
        Resolution::Unmatched
    );
}

#[test]
fn the_most_restrictive_limit_is_the_budget() {
    let yaml = "
domain: rlqs
descriptors:
  - key: k
    rate_limits:
      - {unit: second, requests_per_unit: 10}
      - {unit: minute, requests_per_unit: 120}
";
    let Resolution::Shared { budget, .. } = resolved(yaml, &[("k", "v")]) else {
        panic!("not shared");
    };
    assert_eq!(
        budget,
        Budget {
            per_window: 120,
            window_us: MINUTE
        }
    );
}

proptest! {
    /// Two instances share one pool through its stored fields (as in
    /// Redis): each delivers shares only to its own members, and the
    /// shares that count never add up to more than the budget.
    #[test]
    fn instances_sharing_a_stored_pool_stay_within_the_budget(
        steps in proptest::collection::vec((0u64..6, 0u64..1_000, 0u8..10, 0u64..4_000_000), 1..80),
        limit in 1u64..1_000,
    ) {
        let budget = Budget { per_window: limit, window_us: MINUTE };
        let mut stored = Pool::new(budget).to_fields();
        let mut now = 1_000_000_000;
        for (member, per_minute, action, step) in steps {
            now += step;
            let fields = stored.iter().map(|(k, v)| (k.as_str(), v.as_str()));
            let mut pool = Pool::from_fields(fields, budget).expect("stored fields read back");
            let instance = member % 2;
            let is_local = move |id: MemberId| id % 2 == instance;
            if action == 0 {
                pool.leave(member, now);
            } else {
                let changes = pool.report_from(member, asked(per_minute), now, &is_local);
                prop_assert!(changes.iter().all(|it| is_local(it.member)), "{:?}", changes);
            }
            prop_assert!(pool.committed() <= limit, "{} committed of {}", pool.committed(), limit);
            stored = pool.to_fields();
        }
    }
}

#[test]
fn a_share_lowered_by_another_instance_counts_until_delivered() {
    let mut pool = Pool::new(BUDGET);
    let now = 1_000_000_000;
    let even = |id: MemberId| id.is_multiple_of(2);
    let odd = |id: MemberId| id % 2 == 1;
    // Member 1 (odd instance) alone: the whole budget.
    pool.report_from(1, asked(600), now, &odd);
    assert_eq!(pool.committed(), 300);
    // Member 2 joins through the even instance: member 1's share is
    // lowered but not delivered, so it still counts whole and member 2
    // gets nothing yet.
    let changes = pool.report_from(2, asked(600), now + 1, &even);
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].share, 0);
    assert!(pool.committed() <= 300);
    // Member 1's instance delivers its lower share; member 2 gets its
    // own at its next report.
    pool.report_from(1, asked(600), now + 2, &odd);
    let changes = pool.report_from(2, asked(600), now + 3, &even);
    assert_eq!(changes[0].share, 150, "{changes:?}");
    assert_eq!(pool.committed(), 300);
}

// === reconnects, reloads on some instances, lost pools ===

#[test]
fn a_reconnected_proxy_takes_over_its_departed_member() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    let all = |_: MemberId| true;
    for _ in 0..3 {
        pool.report_by(1, 7, asked(600), now, &all);
        now += REPORT_INTERVAL_US;
    }
    assert_eq!(share(&pool, 1), 300);
    // Its stream ends; the proxy reconnects as member 2: it is answered
    // with the share its proxy holds, not DENY_ALL behind its own.
    pool.leave(1, now);
    let changes = pool.report_by(2, 7, asked(600), now + 1, &all);
    assert_eq!(changes[0].member, 2);
    assert_eq!(changes[0].share, 300, "{changes:?}");
    assert_eq!(pool.share_of(1), None, "the departed member is forgotten");
    assert_eq!(pool.committed(), 300);
}

#[test]
fn a_member_that_missed_a_report_is_taken_over_and_a_live_one_never() {
    let mut pool = Pool::new(BUDGET);
    let now = 1_000_000_000;
    let all = |_: MemberId| true;
    pool.report_by(1, 7, asked(600), now, &all);
    // Another stream of the same proxy key while member 1 still reports:
    // both count.
    pool.report_by(2, 7, asked(600), now + REPORT_INTERVAL_US, &all);
    assert!(pool.share_of(1).is_some());
    assert!(pool.committed() <= 300);
    // Member 1's instance died: it stops reporting, its stream still
    // marked open. Once it missed a report, member 2 takes it over.
    let later = now + REPORT_INTERVAL_US + GONE_AFTER_US + 1;
    pool.report_by(2, 7, asked(600), later, &all);
    assert_eq!(pool.share_of(1), None);
    pool.report_by(2, 7, asked(600), later + REPORT_INTERVAL_US, &all);
    assert_eq!(share(&pool, 2), 300);
}

#[test]
fn a_flapping_proxy_cannot_push_a_steady_one_below_its_fair_share() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    let all = |_: MemberId| true;
    // Proxy 7 steady at 120 a minute, proxy 9 reconnecting every second
    // (a new member each time) asking 240.
    let mut flapper = 100;
    for second in 0..60u64 {
        if second % 5 == 0 {
            pool.report_by(1, 7, asked(120), now, &all);
        }
        pool.leave(flapper, now);
        flapper += 1;
        pool.report_by(flapper, 9, asked(240), now, &all);
        assert!(pool.committed() <= 300);
        if second >= 15 {
            assert!(
                share(&pool, 1) >= 120,
                "second {second}: {}",
                share(&pool, 1)
            );
        }
        now += 1_000_000;
    }
    assert_eq!(pool.members(now).count(), 2, "one member per proxy");
}

#[test]
fn instances_whose_rules_disagree_apply_the_lowest_until_they_agree() {
    let mut pool = Pool::new(BUDGET);
    let mut now = 1_000_000_000;
    let odd = |id: MemberId| id % 2 == 1;
    let even = |id: MemberId| id.is_multiple_of(2);
    let lower = Budget {
        per_window: 60,
        window_us: MINUTE,
    };
    let (_, disagree) = pool.claim_budget(1, BUDGET, now, &odd);
    assert!(!disagree);
    pool.report_from(1, asked(600), now, &odd);
    // Instance 2 reloaded to 60 a minute; instance 1 still says 300.
    let (_, disagree) = pool.claim_budget(2, lower, now + 1, &even);
    assert!(disagree);
    assert_eq!(pool.budget(), lower);
    let (_, disagree) = pool.claim_budget(1, BUDGET, now + 2, &odd);
    assert!(disagree, "still disagreeing");
    assert_eq!(pool.budget(), lower, "the lowest wins, whoever reports");
    let changes = pool.report_from(1, asked(600), now + 2, &odd);
    assert!(changes[0].share <= 60, "{changes:?}");
    // A lower rate over a longer window is lower: 300 an hour.
    let hourly = Budget {
        per_window: 300,
        window_us: 60 * MINUTE,
    };
    pool.claim_budget(1, hourly, now + 3, &odd);
    assert_eq!(pool.budget(), hourly);
    // Both at 60 a minute: they agree.
    pool.claim_budget(1, lower, now + 4, &odd);
    let (_, disagree) = pool.claim_budget(2, lower, now + 5, &even);
    assert!(!disagree);
    // A claim not renewed for a while no longer counts.
    now += super::share::STALE_AFTER_US + 10;
    let (_, disagree) = pool.claim_budget(1, BUDGET, now, &odd);
    assert!(!disagree);
    assert_eq!(pool.budget(), BUDGET);
}

#[test]
fn the_stored_pool_keeps_claims_incarnation_and_proxy_keys() {
    let mut pool = Pool::new(BUDGET);
    let now = 1_000_000_000;
    let all = |_: MemberId| true;
    pool.claim_budget(3, BUDGET, now, &all);
    let changes = pool.report_by(1, 7, asked(600), now, &all);
    assert_ne!(changes[0].incarnation, 0);
    let fields = pool.to_fields();
    let read = Pool::from_fields(fields.iter().map(|(k, v)| (k.as_str(), v.as_str())), BUDGET)
        .expect("read back");
    assert_eq!(read, pool);
    // A member stored before members had a proxy key still reads.
    let old = [("budget", "300:60000000"), ("5", "-:-:-:1:1:1")];
    assert!(Pool::from_fields(old, BUDGET).is_some());
}

#[test]
fn a_rebuilt_pool_starts_another_incarnation() {
    let all = |_: MemberId| true;
    let mut lost = Pool::new(BUDGET);
    let mut last = None;
    for step in 0..150 {
        last = lost
            .report_from(1, asked(600), 1_000_000_000 + step, &all)
            .pop();
    }
    let last = last.expect("a change");
    let mut rebuilt = Pool::new(BUDGET);
    let first = rebuilt.report_from(1, asked(600), 2_000_000_000, &all)[0];
    assert!(first.epoch < last.epoch);
    assert_ne!(first.incarnation, last.incarnation);
}

#[test]
fn an_outbox_takes_a_grant_of_a_new_incarnation_whatever_its_epoch() {
    use super::book::{Order, Outbox};
    use super::bucket::Grant;
    let outbox = Outbox::new();
    let old = Order {
        pool: 1,
        incarnation: 11,
        epoch: 150,
    };
    outbox.put(0, Grant::DenyAll, Some(old), 0);
    // An older decision of the same incarnation is dropped...
    let older = Order { epoch: 149, ..old };
    outbox.put(0, Grant::AllowAll, Some(older), 0);
    let rebuilt = Order {
        pool: 1,
        incarnation: 12,
        epoch: 1,
    };
    let taken = futures_util::FutureExt::now_or_never(outbox.take()).expect("waiting");
    assert_eq!(taken[&0], Grant::DenyAll);
    // ...one of a rebuilt pool is taken, though its epoch is lower.
    outbox.put(0, Grant::AllowAll, Some(rebuilt), 0);
    let taken = futures_util::FutureExt::now_or_never(outbox.take()).expect("waiting");
    assert_eq!(taken[&0], Grant::AllowAll);
}
