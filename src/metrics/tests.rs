use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use super::*;
use crate::testing::metrics_text::{assert_samples, sample};

#[test]
fn reloads_in_flight_and_stored_counters() {
    let metrics = Metrics::new();
    let text = metrics.encode();
    assert_samples(
        &text,
        &[("throttlegate_config_reloads_total{result=\"ok\"}", 0.0)],
    );
    assert!(!text.contains("throttlegate_memory_counters"), "{text}");
    assert_samples(
        &text,
        &[("throttlegate_config_last_success_timestamp_seconds", 0.0)],
    );
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    metrics.record_reload(true);
    metrics.record_reload(false);
    metrics.record_reload(false);
    let loaded_at = sample(
        &metrics.encode(),
        "throttlegate_config_last_success_timestamp_seconds",
    )
    .expect("the gauge");
    assert!(loaded_at >= before as f64, "{loaded_at} < {before}");
    metrics.record_config_loaded(UNIX_EPOCH + std::time::Duration::from_secs(1_796_310_000));
    assert_samples(
        &metrics.encode(),
        &[(
            "throttlegate_config_last_success_timestamp_seconds",
            1_796_310_000.0,
        )],
    );
    let stored = Arc::new(std::sync::atomic::AtomicU64::new(7));
    let source = stored.clone();
    metrics.observe_stored_counters(move || source.load(std::sync::atomic::Ordering::Relaxed));
    let guard = metrics.track_in_flight();
    let text = metrics.encode();
    assert_samples(
        &text,
        &[
            ("throttlegate_config_reloads_total{result=\"ok\"}", 1.0),
            ("throttlegate_config_reloads_total{result=\"error\"}", 2.0),
            ("throttlegate_grpc_requests_in_flight", 1.0),
            ("throttlegate_memory_counters", 7.0),
        ],
    );
    drop(guard);
    stored.store(3, std::sync::atomic::Ordering::Relaxed);
    let text = metrics.encode();
    assert_samples(
        &text,
        &[
            ("throttlegate_grpc_requests_in_flight", 0.0),
            ("throttlegate_memory_counters", 3.0),
        ],
    );
}
