//! The counter key format: `{prefix}:{domain}:{rule}:{algorithm}:{entries}`.

use super::CounterKey;

/// Encodes `key` under `prefix`. Injective over every field.
pub fn encode(prefix: &str, key: &CounterKey) -> String {
    let _ = (prefix, key);
    todo!("injective key encoding")
}
