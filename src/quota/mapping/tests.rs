use super::*;
use crate::testing::rules_from;

const PER_TENANT: &str = "
domain: rlqs
descriptors:
  - key: tenant
    rate_limit: {unit: minute, requests_per_unit: 10}
";

fn pool_of(tenant: &str) -> PoolKey {
    let rules = rules_from("rlqs.yaml", PER_TENANT);
    match resolve(&rules, "rlqs", &[("tenant", tenant)]) {
        Resolution::Shared { pool, .. } => pool,
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_pool_key_of_long_values_is_bounded_and_still_one_per_value() {
    let short = pool_of("acme");
    assert_eq!(short.as_str(), "rlqs|tenant|tenant=acme");
    // A 60 KB value (every byte escaped would triple it) gives a key
    // of the domain, the path and 67 bytes.
    let long = "|".repeat(60_000);
    let key = pool_of(&long);
    assert_eq!(key.as_str().len(), "rlqs|tenant".len() + 3 + 64, "{key:?}");
    assert!(key.as_str().starts_with("rlqs|tenant|%#"), "{key:?}");
    // Distinct values stay distinct pools; the same value the same.
    let other = pool_of(&format!("{long}x"));
    assert_ne!(key, other);
    assert_eq!(key, pool_of(&long));
    // The longest value kept as it is, and the shortest digested.
    let inline = "a".repeat(MAX_INLINE_ENTRIES_BYTES - "|tenant=".len());
    assert!(pool_of(&inline).as_str().ends_with(&inline));
    let digested = format!("{inline}a");
    assert!(pool_of(&digested).as_str().contains("|%#"));
}
