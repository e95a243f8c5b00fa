use super::*;

#[test]
fn reported_requests_saturate_instead_of_wrapping() {
    let mut registry = Registry::default();
    let metrics = QuotaMetrics::register(&mut registry);
    let (domain, rule): (Arc<str>, Arc<str>) = (Arc::from("d"), Arc::from("r"));
    metrics.record_reported(&domain, &rule, u64::MAX, 1);
    metrics.record_reported(&domain, &rule, 5, u64::MAX);
    let read = |kind| {
        metrics
            .reported
            .get_or_create(&KindLabels {
                domain: domain.clone(),
                rule: rule.clone(),
                kind,
            })
            .get()
    };
    assert_eq!(read("allowed"), u64::MAX);
    assert_eq!(read("denied"), u64::MAX);
}
