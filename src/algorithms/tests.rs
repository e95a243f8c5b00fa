//! Algorithm tests with a controlled clock.

use super::*;

const T0: u64 = 1_700_000_000_000_000;

fn run(
    algorithm: Algorithm,
    limit: u64,
    window_s: u64,
    steps: &[(u64, u64)],
) -> Vec<(bool, u64, u64)> {
    let params = LimitParams::new(algorithm, limit, window_s * 1_000_000, None).unwrap();
    let mut state = vec![None];
    steps
        .iter()
        .map(|&(at, cost)| {
            let check = Check {
                params,
                cost,
                mode: Mode::Enforce,
            };
            let verdict = decide(&[check], &mut state, T0 + at);
            let it = verdict.outcomes[0];
            (verdict.allowed, it.remaining, it.reset_us)
        })
        .collect()
}

#[test]
fn burst_of_each_algorithm_admits_exactly_the_limit() {
    for algorithm in Algorithm::ALL {
        let steps: Vec<(u64, u64)> = (0..12).map(|_| (0, 1)).collect();
        let res = run(algorithm, 10, 1, &steps);
        let allowed = res.iter().filter(|it| it.0).count();
        assert_eq!(allowed, 10, "{algorithm}: {res:?}");
    }
}
