//! The parameters a RateLimitOverride is enforced with: a client chooses the
//! number, so every number gets parameters some backend holds exactly.

use crate::algorithms::{Algorithm, Charge, LimitParams, MAX_EXACT, ParamsError};

/// [`override_params`] recording costs as `charge` says (the matched
/// rule's): where the number's twice capacity, which a limit charged
/// always may hold, is not exact, the number asked is halved until it is
/// (a number of 1 always is): smaller, never above the number asked, and
/// always decided.
pub(super) fn charged_override_params(
    algorithm: Algorithm,
    requests: u64,
    window_us: u64,
    max_log_entries: u32,
    charge: Charge,
) -> Result<LimitParams, ParamsError> {
    let mut asked = requests;
    loop {
        let params = override_params(algorithm, asked, window_us, max_log_entries)?;
        match params.with_charge(charge) {
            Ok(params) => return Ok(params),
            Err(err) if params.limit() <= 1 => return Err(err),
            Err(_) => asked = params.limit() / 2,
        }
    }
}

/// The parameters enforced for a RateLimitOverride of `requests` per
/// `window_us` on `algorithm` (the matched rule's, else the domain's
/// default). A client chooses the number, so every number is decided:
///
/// - a sliding-window log over `max_log_entries` uses the sliding-window
///   counter, as a rule that inherits the log does (the log would keep one
///   entry per request);
/// - where the algorithm cannot hold the number exactly in 53 bits (see
///   [`LimitParams::new`]), the largest number below it that it can hold at
///   the same window: the same algorithm with a smaller number admits no
///   more, in any state, than with the number asked.
pub(super) fn override_params(
    algorithm: Algorithm,
    requests: u64,
    window_us: u64,
    max_log_entries: u32,
) -> Result<LimitParams, ParamsError> {
    let algorithm =
        if algorithm == Algorithm::SlidingWindowLog && requests > u64::from(max_log_entries) {
            Algorithm::SlidingWindowCounter
        } else {
            algorithm
        };
    let exact = LimitParams::new(algorithm, requests, window_us, None);
    if exact.is_ok() {
        return exact;
    }
    let fitted = match algorithm {
        Algorithm::TokenBucket | Algorithm::Gcra => largest_exact_rate(requests, window_us),
        // `(N + 1) × W_ms < 2^53`.
        Algorithm::SlidingWindowCounter => ((MAX_EXACT - 1) / (window_us / 1_000))
            .saturating_sub(1)
            .min(requests),
        // Exact for every number a request can carry.
        Algorithm::SlidingWindowLog | Algorithm::FixedWindow => requests,
    };
    LimitParams::new(algorithm, fitted, window_us, None)
}

/// The largest `n <= requests` for which a token bucket or GCRA of `n` per
/// `window_us` (capacity `n`) stays exact: `n × W / gcd(n, W) < 2^53`.
///
/// Write `n = m × g` with `g = gcd(n, W)`: the condition is `m × W < 2^53`,
/// so `m <= M = (2^53 - 1) / W`, and `g` divides `W`. The best `n` for a
/// divisor `g` is `min(requests / g, M) × g` (a larger gcd only helps), so
/// the largest over the divisors of `W` is the answer.
fn largest_exact_rate(requests: u64, window_us: u64) -> u64 {
    let most_m = (MAX_EXACT - 1) / window_us;
    divisors(window_us)
        .into_iter()
        .map(|g| (requests / g).min(most_m) * g)
        .max()
        .unwrap_or(0)
}

/// Every divisor of `n > 0`. Windows are whole seconds of µs (products of
/// 2, 3, 5, 7 and 73 for the units a request can name), so trial division
/// ends quickly.
fn divisors(mut n: u64) -> Vec<u64> {
    let mut primes: Vec<(u64, u32)> = Vec::new();
    let mut p = 2;
    while p * p <= n {
        let mut power = 0;
        while n.is_multiple_of(p) {
            n /= p;
            power += 1;
        }
        if power > 0 {
            primes.push((p, power));
        }
        p += 1;
    }
    if n > 1 {
        primes.push((n, 1));
    }
    let mut out = vec![1u64];
    for (p, power) in primes {
        let mut next = Vec::with_capacity(out.len() * (power as usize + 1));
        for &d in &out {
            let mut it = d;
            for k in 0..=power {
                next.push(it);
                // Never past `d × p^power`, which divides `n`: no overflow.
                if k < power {
                    it *= p;
                }
            }
        }
        out = next;
    }
    out
}

#[cfg(test)]
mod tests;
