use super::*;
use clap::Parser;

#[test]
fn requests_carry_the_prefix_entries_then_the_value_in_every_descriptor() {
    let args = Args::parse_from([
        "throttlegate-load",
        "--domain",
        "d",
        "--key",
        "user",
        "--prefix-entry",
        "method=GET",
        "--descriptors",
        "2",
    ]);
    let request = Workload::new(&args).request(17);
    assert_eq!(request.domain, "d");
    let entries: Vec<Vec<(&[u8], &[u8])>> = request
        .descriptors
        .iter()
        .map(|d| {
            d.entries
                .iter()
                .map(|e| (e.key.as_slice(), e.value.as_slice()))
                .collect()
        })
        .collect();
    assert_eq!(
        entries,
        vec![
            vec![(&b"method"[..], &b"GET"[..]), (b"user", b"17")],
            vec![(b"method", b"GET"), (b"user_1", b"17")],
        ]
    );
}

#[test]
fn a_phase_with_a_budget_lets_exactly_that_many_start() {
    let phase = Phase::new(Some(3), None, 0);
    let started: Vec<u64> = (0..10).filter_map(|_| phase.take(None)).collect();
    assert_eq!(started, [0, 1, 2]);
}

#[test]
fn a_phase_past_its_deadline_lets_none_start() {
    let phase = Phase::new(None, Some(Duration::ZERO), 0);
    assert_eq!(phase.take(None), None);
    assert_eq!(phase.take(Some(100.0)), None);
}

#[test]
fn paced_requests_are_planned_at_start_plus_index_over_rate() {
    let phase = Phase::new(None, None, 0);
    assert_eq!(phase.planned(0, 200.0), phase.start);
    assert_eq!(
        phase.planned(3, 200.0) - phase.start,
        Duration::from_millis(15)
    );
    assert_eq!(
        phase.planned(2_000, 200.0) - phase.start,
        Duration::from_secs(10)
    );
}

#[test]
fn a_paced_phase_stops_at_the_first_request_planned_at_its_deadline() {
    // 10 s at 100/s: requests 0..999 are planned before the deadline,
    // request 1000 exactly at it.
    let phase = Phase::new(None, Some(Duration::from_secs(10)), 0);
    let started: Vec<u64> = std::iter::from_fn(|| phase.take(Some(100.0)))
        .take(5_000)
        .collect();
    assert_eq!(started.len(), 1_000);
    assert_eq!(started.last(), Some(&999));
}
