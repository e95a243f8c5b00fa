//! Counter keys and checks for driving a backend directly.

use std::sync::Arc;

use throttlegate::algorithms::{Algorithm, Check, LimitParams, Mode};
use throttlegate::backends::{CounterKey, KeyEntry, KeyValue, KeyedCheck};

/// A counter key for descriptor entries given as (key, value).
pub fn counter_key(algorithm: Algorithm, window_s: u64, entries: &[(&str, &str)]) -> CounterKey {
    CounterKey {
        domain: Arc::from("test"),
        rule: Arc::from("rule"),
        algorithm,
        window_s,
        is_override: false,
        entries: entries
            .iter()
            .map(|(key, value)| KeyEntry {
                key: (*key).into(),
                value: KeyValue::Value((*value).into()),
            })
            .collect(),
    }
}

/// One enforcing check of `limit` per `window_s` seconds on `key`.
pub fn check(key: CounterKey, limit: u64, cost: u64) -> KeyedCheck {
    check_with_burst(key, limit, cost, None)
}

/// [`check`] with a burst other than the limit (token bucket, GCRA).
pub fn check_with_burst(key: CounterKey, limit: u64, cost: u64, burst: Option<u64>) -> KeyedCheck {
    let params = LimitParams::new(key.algorithm, limit, key.window_s * 1_000_000, burst)
        .expect("valid params");
    KeyedCheck {
        key,
        check: Check {
            params,
            cost,
            mode: Mode::Enforce,
        },
    }
}

/// One enforcing check of `limit` per `window_s` seconds on the counter of
/// `entries` under `algorithm`.
pub fn check_on(
    algorithm: Algorithm,
    window_s: u64,
    entries: &[(&str, &str)],
    limit: u64,
    cost: u64,
) -> KeyedCheck {
    check(counter_key(algorithm, window_s, entries), limit, cost)
}

/// One check of a fixed window of an hour on `user`, a limit never
/// reached, cost 1.
pub fn hourly_check(user: &str) -> Vec<KeyedCheck> {
    vec![check(
        counter_key(Algorithm::FixedWindow, 3600, &[("user", user)]),
        1_000_000,
        1,
    )]
}
