use super::*;
use crate::testing::rules_from;

fn pool(tenant: &str) -> PoolKey {
    thread_local! {
        static RULES: crate::rules::RuleSet = rules_from(
            "claims.yaml",
            "domain: d\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 10}\n",
        );
    }
    RULES.with(
        |rules| match crate::quota::resolve(rules, "d", &[("tenant", tenant)]) {
            Resolution::Shared { pool, .. } => pool,
            other => panic!("{other:?}"),
        },
    )
}

#[test]
fn a_client_keeps_at_most_its_bound_of_pools_alive_and_gets_them_back() {
    let claims = PoolClaims::default();
    let client = Some(IpAddr::from([10, 0, 0, 1]));
    for n in 0..MAX_POOLS_PER_CLIENT {
        assert!(claims.claim(client, &pool(&n.to_string()), 0));
    }
    // Once more: refused, whichever stream or connection it comes on.
    assert!(!claims.claim(client, &pool("one more"), 1));
    // A pool it holds is renewed; another client is not affected.
    assert!(claims.claim(client, &pool("0"), CLAIM_HOLD_US));
    assert!(claims.claim(Some(IpAddr::from([10, 0, 0, 2])), &pool("x"), 1));
    assert_eq!(claims.total(), MAX_POOLS_PER_CLIENT + 1);
    // Claims not renewed for the hold are forgotten: the renewed one
    // and the other client's younger one stay.
    claims.sweep(CLAIM_HOLD_US);
    assert_eq!(claims.total(), 2);
    assert!(claims.claim(client, &pool("one more"), CLAIM_HOLD_US));
    claims.sweep(3 * CLAIM_HOLD_US);
    assert_eq!(claims.total(), 0);
    assert!(lock(&claims.state).clients.is_empty());
}

#[test]
fn all_clients_together_are_bounded() {
    let claims = PoolClaims::default();
    let mut n = 0usize;
    'fill: for client in 0..=255u8 {
        for _ in 0..MAX_POOLS_PER_CLIENT {
            if !claims.claim(
                Some(IpAddr::from([10, 0, 1, client])),
                &pool(&n.to_string()),
                0,
            ) {
                break 'fill;
            }
            n += 1;
        }
    }
    assert_eq!(n, MAX_POOL_CLAIMS);
    assert_eq!(claims.total(), MAX_POOL_CLAIMS);
    assert!(!claims.claim(Some(IpAddr::from([192, 0, 2, 1])), &pool("new"), 0));
    // Refused: nothing is kept for that client.
    assert_eq!(
        lock(&claims.state).clients.len(),
        MAX_POOL_CLAIMS / MAX_POOLS_PER_CLIENT
    );
}
