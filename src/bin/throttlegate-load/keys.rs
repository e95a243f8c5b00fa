//! Which value each request carries: one hot key, uniform over K values, or
//! Zipf over K values, from a small seeded generator per stream.

use crate::args::Distribution;

/// SplitMix64: tiny, fast, and good enough to pick keys (not for secrets).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n) for n >= 1 (Lemire's multiply-high; the bias is
    /// below n / 2^64, nothing a benchmark can see).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// Zipf over ranks 1..=n with exponent s > 0, by rejection-inversion
/// (Hörmann and Derflinger, "Rejection-inversion to generate variates from
/// monotone discrete distributions", 1996): constant memory and time per
/// sample for any n, where a table of n probabilities would need 80 MB at
/// ten million keys.
#[derive(Debug, Clone)]
pub struct Zipf {
    n: f64,
    s: f64,
    h_integral_x1: f64,
    h_integral_n: f64,
    threshold: f64,
}

impl Zipf {
    /// `n >= 1`, `s > 0` (the flags' parsers guarantee both).
    pub fn new(n: u64, s: f64) -> Zipf {
        let mut zipf = Zipf {
            n: n.max(1) as f64,
            s,
            h_integral_x1: 0.0,
            h_integral_n: 0.0,
            threshold: 0.0,
        };
        zipf.h_integral_x1 = zipf.h_integral(1.5) - 1.0;
        zipf.h_integral_n = zipf.h_integral(zipf.n + 0.5);
        zipf.threshold = 2.0 - zipf.h_integral_inverse(zipf.h_integral(2.5) - zipf.h(2.0));
        zipf
    }

    /// A rank in 1..=n.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        loop {
            let u = self.h_integral_n + rng.next_f64() * (self.h_integral_x1 - self.h_integral_n);
            let x = self.h_integral_inverse(u);
            let k = (x + 0.5).floor().clamp(1.0, self.n);
            if k - x <= self.threshold || u >= self.h_integral(k + 0.5) - self.h(k) {
                return k as u64;
            }
        }
    }

    /// h(x) = 1/x^s, the density the ranks' probabilities are taken from.
    fn h(&self, x: f64) -> f64 {
        (-self.s * x.ln()).exp()
    }

    /// H(x), an antiderivative of h: (x^(1-s) - 1) / (1 - s), or ln x at
    /// s = 1, written so that it stays exact near s = 1.
    fn h_integral(&self, x: f64) -> f64 {
        let log_x = x.ln();
        expm1_over_x((1.0 - self.s) * log_x) * log_x
    }

    fn h_integral_inverse(&self, x: f64) -> f64 {
        let t = (x * (1.0 - self.s)).max(-1.0);
        (ln1p_over_x(t) * x).exp()
    }
}

/// ln(1 + x) / x, continuous at 0.
fn ln1p_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.ln_1p() / x
    } else {
        1.0 - x * (0.5 - x * (1.0 / 3.0 - 0.25 * x))
    }
}

/// (e^x - 1) / x, continuous at 0.
fn expm1_over_x(x: f64) -> f64 {
    if x.abs() > 1e-8 {
        x.exp_m1() / x
    } else {
        1.0 + x * 0.5 * (1.0 + x * (1.0 / 3.0) * (1.0 + 0.25 * x))
    }
}

/// Draws value indexes in 0..keys.
#[derive(Debug, Clone)]
pub enum KeySource {
    Hot,
    Uniform(u64),
    /// Rank k is value k - 1: value 0 is the hottest.
    Zipf(Zipf),
}

impl KeySource {
    pub fn new(keys: u64, distribution: Distribution, exponent: f64) -> KeySource {
        match (keys, distribution) {
            (0 | 1, _) => KeySource::Hot,
            (keys, Distribution::Uniform) => KeySource::Uniform(keys),
            (keys, Distribution::Zipf) => KeySource::Zipf(Zipf::new(keys, exponent)),
        }
    }

    pub fn draw(&self, rng: &mut Rng) -> u64 {
        match self {
            KeySource::Hot => 0,
            KeySource::Uniform(keys) => rng.below(*keys),
            KeySource::Zipf(zipf) => zipf.sample(rng) - 1,
        }
    }
}

#[cfg(test)]
mod tests {
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
    fn one_key_is_always_value_zero() {
        let mut rng = Rng::new(5);
        for distribution in [Distribution::Uniform, Distribution::Zipf] {
            let source = KeySource::new(1, distribution, 1.0);
            assert!((0..100).all(|_| source.draw(&mut rng) == 0));
        }
    }
}
