use super::*;
use crate::backends::keys::{HashTag, KeyFormat};
use crate::backends::redis::{ClockSource, RedisTls};

/// Only where every request is one slot is the over-limit cache
/// offered a clock: the domain tag, or a prefix tagged by the operator.
#[test]
fn the_over_limit_cache_is_offered_only_where_nothing_is_refunded() {
    let with = |prefix: &str, hash_tag| {
        ClusterBackend::connect(ClusterSettings {
            nodes: vec!["127.0.0.1:7000".to_owned()],
            pool_size: 1,
            timeout_ms: 100,
            keys: KeyFormat::new(prefix, hash_tag),
            clock: ClockSource::Redis,
            expiry_grace_ms: 0,
            tls: RedisTls::default(),
        })
        .expect("settings")
    };
    for (prefix, hash_tag, cached) in [
        ("tg", HashTag::Domain, true),
        ("{tg}", HashTag::None, true),
        ("a{tg}b", HashTag::Descriptor, true),
        ("tg", HashTag::None, false),
        ("tg", HashTag::Descriptor, false),
        ("{}tg", HashTag::None, false),
        ("{tg", HashTag::None, false),
    ] {
        let backend = with(prefix, hash_tag);
        assert_eq!(backend.never_refunds(), cached, "{prefix} {hash_tag:?}");
        assert_eq!(
            backend.local_clock().is_some(),
            cached,
            "{prefix} {hash_tag:?}"
        );
    }
}

#[test]
fn settings_without_seeds_or_with_a_zero_bound_are_refused() {
    let settings = ClusterSettings {
        nodes: vec!["127.0.0.1:7000".to_owned()],
        pool_size: 1,
        timeout_ms: 100,
        keys: KeyFormat::default(),
        clock: ClockSource::Redis,
        expiry_grace_ms: 0,
        tls: RedisTls::default(),
    };
    assert!(ClusterBackend::connect(settings.clone()).is_ok());
    for bad in [
        ClusterSettings {
            nodes: Vec::new(),
            ..settings.clone()
        },
        ClusterSettings {
            pool_size: 0,
            ..settings.clone()
        },
        ClusterSettings {
            timeout_ms: 0,
            ..settings.clone()
        },
    ] {
        let err = ClusterBackend::connect(bad).expect_err("refused");
        assert!(matches!(err, Error::Protocol(_)), "{err:?}");
    }
}
