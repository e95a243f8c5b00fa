use super::*;

fn limit(requests_per_unit: u32, unit: Unit, algorithm: Algorithm) -> RateLimit {
    RateLimit::new(unit, 1, requests_per_unit, algorithm, None).unwrap()
}

#[test]
fn names_and_the_log_cap_leave_the_numbers_alone() {
    let counter = limit(5, Unit::Minute, Algorithm::SlidingWindowCounter);
    let named = counter
        .clone()
        .named(Some("n".into()), vec!["other".into()])
        .log_capped();
    assert_eq!(named.name().map(|it| &**it), Some("n"));
    assert_eq!(named.replaces(), [Arc::<str>::from("other")]);
    assert!(named.is_log_capped());
    assert_eq!(named.params(), counter.params());
    assert_eq!(named.window_seconds(), 60);
    let log = limit(5, Unit::Minute, Algorithm::SlidingWindowLog).log_capped();
    assert!(!log.is_log_capped(), "only the counter stands in for a log");
}

#[test]
fn limits_are_never_empty_nor_on_one_counter() {
    assert_eq!(Limits::new(Vec::new()), Err(LimitsError::Empty));
    let minute = |n| limit(n, Unit::Minute, Algorithm::FixedWindow);
    let refused = Limits::new(vec![
        minute(1),
        limit(2, Unit::Minute, Algorithm::Gcra),
        minute(3),
        limit(4, Unit::Second, Algorithm::FixedWindow),
        minute(5),
    ]);
    let shared = |position| SharedCounter {
        position,
        window_seconds: 60,
        algorithm: Algorithm::FixedWindow,
    };
    assert_eq!(
        refused,
        Err(LimitsError::SharedCounter(vec![shared(2), shared(4)]))
    );
    let limits = Limits::new(vec![
        minute(1),
        limit(1, Unit::Hour, Algorithm::FixedWindow),
    ])
    .expect("distinct windows");
    assert_eq!(limits.len(), 2);
    assert_eq!(limits[1].window_seconds(), 3_600);
}
