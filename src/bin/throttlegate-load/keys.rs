//! Which value each request carries: one hot key, uniform over K values,
//! Zipf over K values, or a few hot values and a tail of fresh ones, from a
//! small seeded generator per stream.

use std::sync::atomic::{AtomicU64, Ordering};

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

/// Draws value indexes: in 0..keys, or hot and fresh ones.
#[derive(Debug)]
pub enum KeySource {
    Hot,
    Uniform(u64),
    /// Rank k is value k - 1: value 0 is the hottest.
    Zipf(Zipf),
    HotAndFresh(HotAndFresh),
}

impl KeySource {
    /// The source for uniform or Zipf over `keys` values (one value is the
    /// hot key whatever the distribution); hot-and-fresh takes its
    /// numbers from [`KeySource::hot_and_fresh`] instead.
    pub fn new(keys: u64, distribution: Distribution, exponent: f64) -> KeySource {
        match (keys, distribution) {
            (_, Distribution::HotAndFresh) => KeySource::hot_and_fresh(keys, 1.0),
            (0 | 1, _) => KeySource::Hot,
            (keys, Distribution::Uniform) => KeySource::Uniform(keys),
            (keys, Distribution::Zipf) => KeySource::Zipf(Zipf::new(keys, exponent)),
        }
    }

    /// `share` (in [0, 1]) of draws uniform over the `hot` values 0..hot,
    /// the others fresh values from `hot` upwards.
    pub fn hot_and_fresh(hot: u64, share: f64) -> KeySource {
        let hot = hot.max(1);
        KeySource::HotAndFresh(HotAndFresh {
            hot,
            share: share.clamp(0.0, 1.0),
            next_fresh: AtomicU64::new(hot),
        })
    }

    pub fn draw(&self, rng: &mut Rng) -> u64 {
        match self {
            KeySource::Hot => 0,
            KeySource::Uniform(keys) => rng.below(*keys),
            KeySource::Zipf(zipf) => zipf.sample(rng) - 1,
            KeySource::HotAndFresh(mix) => mix.draw(rng),
        }
    }
}

/// A few hot values taking a share of the requests, and a tail of values
/// each used once: the counter of fresh values is shared by every stream
/// of the run (the source lives in the one `Workload`), so no two requests of
/// a run carry the same fresh value, whichever streams send them.
#[derive(Debug)]
pub struct HotAndFresh {
    hot: u64,
    share: f64,
    next_fresh: AtomicU64,
}

impl HotAndFresh {
    fn draw(&self, rng: &mut Rng) -> u64 {
        // next_f64 is in [0, 1): a share of 1 always picks a hot value, a
        // share of 0 never does.
        if rng.next_f64() < self.share {
            rng.below(self.hot)
        } else {
            self.next_fresh.fetch_add(1, Ordering::Relaxed)
        }
    }
}

#[cfg(test)]
mod tests;
