use super::*;

#[test]
fn lets_one_line_through_per_second_with_the_count_held_back() {
    let gate = LogGate::new();
    let got: Vec<Option<u64>> = [100, 100, 100, 100, 101, 101, 105]
        .into_iter()
        .map(|at| gate.admit_at(at))
        .collect();
    assert_eq!(got, vec![Some(0), None, None, None, Some(3), None, Some(1)]);
}

#[test]
fn gates_of_different_kinds_are_independent() {
    let backend = LogGate::new();
    let cost = LogGate::new();
    assert_eq!(backend.admit_at(7), Some(0));
    assert_eq!(backend.admit_at(7), None);
    assert_eq!(cost.admit_at(7), Some(0));
    assert_eq!(backend.admit_at(8), Some(1));
    assert_eq!(cost.admit_at(8), Some(0));
}

/// 8,000 lines at once in one second: exactly one is let through, and
/// every other one is reported once, by that line or by the next
/// second's (a line held back between the first line's exchange and
/// its reading of the count is reported by the first line).
#[test]
fn concurrent_lines_in_one_second_let_exactly_one_through() {
    let gate = std::sync::Arc::new(LogGate::new());
    let reports: Vec<u64> = (0..8)
        .map(|_| {
            let gate = gate.clone();
            std::thread::spawn(move || {
                (0..1_000)
                    .filter_map(|_| gate.admit_at(42))
                    .collect::<Vec<_>>()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .flat_map(|it| it.join().unwrap())
        .collect();
    assert_eq!(reports.len(), 1, "{reports:?}");
    let next = gate.admit_at(43).expect("the next second's first line");
    assert_eq!(reports[0] + next, 7_999);
}
