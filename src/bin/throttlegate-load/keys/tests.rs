use super::*;

const SAMPLES: u64 = 100_000;

/// H(n, s) = sum over k of 1/k^s.
fn harmonic(n: u64, s: f64) -> f64 {
    (1..=n).map(|k| (k as f64).powf(-s)).sum()
}

/// How often each of the first ranks comes in SAMPLES draws.
fn rank_frequencies(n: u64, s: f64, ranks: usize) -> Vec<f64> {
    let zipf = Zipf::new(n, s);
    let mut rng = Rng::new(42);
    let mut counts = vec![0u64; ranks + 1];
    for _ in 0..SAMPLES {
        let k = zipf.sample(&mut rng);
        assert!((1..=n).contains(&k), "rank {k} outside 1..={n}");
        if let Some(count) = counts.get_mut(k as usize) {
            *count += 1;
        }
    }
    counts.iter().map(|&c| c as f64 / SAMPLES as f64).collect()
}

/// Rank k's frequency is within `tolerance` of 1 / (k^s H(n, s)) for
/// the first three ranks. Over 100,000 samples the standard error of a
/// frequency p is at most 0.0016, so 0.006 is over three of them.
fn check_zipf(n: u64, s: f64) {
    let tolerance = 0.006;
    let frequencies = rank_frequencies(n, s, 3);
    let h = harmonic(n, s);
    for k in 1..=3u64.min(n) {
        let expected = (k as f64).powf(-s) / h;
        let seen = frequencies[k as usize];
        assert!(
            (seen - expected).abs() < tolerance,
            "n {n} s {s}: rank {k} came {seen:.4}, expected {expected:.4}"
        );
    }
}

#[test]
fn zipf_ranks_come_in_proportion_to_one_over_k_to_the_s() {
    check_zipf(1_000, 1.0);
    check_zipf(10_000_000, 1.0);
    check_zipf(100, 0.5);
    check_zipf(1_000, 1.2);
    check_zipf(50, 2.0);
    check_zipf(3, 1.0);
}

#[test]
fn zipf_over_one_key_is_that_key() {
    let zipf = Zipf::new(1, 1.0);
    let mut rng = Rng::new(7);
    assert!((0..1000).all(|_| zipf.sample(&mut rng) == 1));
}

#[test]
fn uniform_draws_cover_every_value_evenly() {
    let source = KeySource::new(10, Distribution::Uniform, 1.0);
    let mut rng = Rng::new(3);
    let mut counts = [0u64; 10];
    for _ in 0..SAMPLES {
        counts[source.draw(&mut rng) as usize] += 1;
    }
    for count in counts {
        let share = count as f64 / SAMPLES as f64;
        assert!((share - 0.1).abs() < 0.005, "{counts:?}");
    }
}

#[test]
fn hot_and_fresh_puts_its_share_on_the_hot_values_and_never_repeats_a_fresh_one() {
    let source = KeySource::hot_and_fresh(4, 0.7);
    let mut rng = Rng::new(11);
    let mut hot = [0u64; 4];
    let mut fresh = std::collections::HashSet::new();
    for _ in 0..SAMPLES {
        match source.draw(&mut rng) {
            value @ 0..4 => hot[value as usize] += 1,
            value => assert!(fresh.insert(value), "fresh value {value} came twice"),
        }
    }
    let hot_share = hot.iter().sum::<u64>() as f64 / SAMPLES as f64;
    assert!((hot_share - 0.7).abs() < 0.006, "{hot_share}");
    for count in hot {
        let share = count as f64 / SAMPLES as f64;
        assert!((share - 0.175).abs() < 0.006, "{hot:?}");
    }
    assert_eq!(fresh.len() as u64 + hot.iter().sum::<u64>(), SAMPLES);
}

#[test]
fn hot_and_fresh_at_the_ends_of_the_share() {
    let mut rng = Rng::new(2);
    let all_hot = KeySource::hot_and_fresh(3, 1.0);
    assert!((0..1000).all(|_| all_hot.draw(&mut rng) < 3));
    let all_fresh = KeySource::hot_and_fresh(3, 0.0);
    let drawn: Vec<u64> = (0..1000).map(|_| all_fresh.draw(&mut rng)).collect();
    assert_eq!(drawn, (3..1003).collect::<Vec<_>>());
}

#[test]
fn fresh_values_stay_unique_across_threads() {
    let source = std::sync::Arc::new(KeySource::hot_and_fresh(1, 0.0));
    let threads: Vec<_> = (0..4)
        .map(|seed| {
            let source = std::sync::Arc::clone(&source);
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed);
                (0..10_000)
                    .map(|_| source.draw(&mut rng))
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<u64> = threads
        .into_iter()
        .flat_map(|it| it.join().unwrap())
        .collect();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 40_000);
}

#[test]
fn one_key_is_always_value_zero() {
    let mut rng = Rng::new(5);
    for distribution in [Distribution::Uniform, Distribution::Zipf] {
        let source = KeySource::new(1, distribution, 1.0);
        assert!((0..100).all(|_| source.draw(&mut rng) == 0));
    }
}
