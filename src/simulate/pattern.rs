//! Traffic patterns: when each simulated request arrives, and its cost.
//!
//! Every pattern is deterministic (integer arithmetic from the limit's
//! number and window, or a trace read from a file), so two runs draw the
//! same picture.

use std::fmt;

use super::Error;

/// Most requests one simulation replays, so a run stays quick and small.
pub const MAX_ARRIVALS: usize = 200_000;

/// A traffic pattern, as named on the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// Twice the limit within the first fiftieth of a window, then twice
    /// the limit just before a window boundary and twice again just after.
    Burst,
    /// A constant rate of 1.5 times the limit.
    Steady,
    /// A rate rising evenly from 0 to 3 times the limit over the run.
    Ramp,
    /// The requests of a file: one per line, `<offset ms> [cost]`.
    Trace(Vec<Arrival>),
}

/// One request of a pattern: its offset from the start and its cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    pub at_us: u64,
    pub cost: u32,
}

/// The limit a pattern is scaled to: `limit` requests per `window_us`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scale {
    pub limit: u64,
    pub window_us: u64,
}

impl Pattern {
    /// The pattern `name` (`burst`, `steady`, `ramp`), or `trace` with the
    /// text of its file.
    pub fn from_name(name: &str, trace: Option<&str>) -> Result<Pattern, Error> {
        match (name, trace) {
            ("burst", None) => Ok(Pattern::Burst),
            ("steady", None) => Ok(Pattern::Steady),
            ("ramp", None) => Ok(Pattern::Ramp),
            ("trace", Some(text)) => Ok(Pattern::Trace(parse_trace(text)?)),
            ("trace", None) => Err(Error::Usage("pattern trace needs a file".to_owned())),
            ("burst" | "steady" | "ramp", Some(_)) => Err(Error::Usage(format!(
                "pattern {name} takes no file; only trace does"
            ))),
            _ => Err(Error::Usage(format!(
                "unknown pattern '{name}', expected burst, steady, ramp or trace FILE"
            ))),
        }
    }

    /// The run's length when none is asked for: four windows, or a trace
    /// up to its last request, rounded up to a whole window.
    pub fn default_duration_us(&self, scale: Scale) -> u64 {
        match self {
            Pattern::Trace(arrivals) => {
                let last = arrivals.last().map_or(0, |it| it.at_us);
                (last / scale.window_us + 1).saturating_mul(scale.window_us)
            }
            _ => scale.window_us.saturating_mul(4),
        }
    }

    /// The requests of this pattern that arrive before `duration_us`, in
    /// time order; an error past [`MAX_ARRIVALS`].
    pub fn arrivals(&self, scale: Scale, duration_us: u64) -> Result<Vec<Arrival>, Error> {
        // A limit of 0 still gets traffic: the picture shows it all denied.
        let limit = scale.limit.max(1);
        let expected = match self {
            Pattern::Burst => 6 * u128::from(limit),
            Pattern::Steady => 3 * u128::from(limit) * u128::from(duration_us) / window(scale),
            Pattern::Ramp => 3 * u128::from(limit) * u128::from(duration_us) / window(scale) / 2,
            Pattern::Trace(arrivals) => arrivals.len() as u128,
        };
        if expected > MAX_ARRIVALS as u128 {
            return Err(Error::Usage(format!(
                "the pattern makes {expected} requests, more than {MAX_ARRIVALS}; use a shorter --duration or a smaller limit"
            )));
        }
        let scale = Scale { limit, ..scale };
        let mut arrivals = match self {
            Pattern::Burst => burst(scale, duration_us),
            Pattern::Steady => steady(scale, duration_us),
            Pattern::Ramp => ramp(scale, duration_us),
            Pattern::Trace(arrivals) => arrivals.clone(),
        };
        arrivals.retain(|it| it.at_us < duration_us);
        Ok(arrivals)
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::Burst => f.write_str("burst (2x the limit, then around a boundary)"),
            Pattern::Steady => f.write_str("steady (1.5x the limit)"),
            Pattern::Ramp => f.write_str("ramp (0 to 3x the limit)"),
            Pattern::Trace(arrivals) => write!(f, "trace ({} requests)", arrivals.len()),
        }
    }
}

fn window(scale: Scale) -> u128 {
    u128::from(scale.window_us.max(1))
}

/// `2N` requests at the start, then `2N` in the fiftieth of a window before
/// the window boundary nearest the middle of the run, and `2N` in the
/// fiftieth after it. Each burst is spread evenly over its fiftieth so
/// that its requests stay distinct in time.
fn burst(scale: Scale, duration_us: u64) -> Vec<Arrival> {
    let window_us = scale.window_us;
    let windows_to_middle = (duration_us / 2 + window_us / 2) / window_us;
    let boundary = windows_to_middle.max(1) * window_us;
    let span = window_us / 50;
    let count = 2 * scale.limit;
    let mut arrivals = Vec::new();
    for start in [0, boundary - span, boundary] {
        arrivals.extend((0..count).map(|idx| Arrival {
            at_us: start + spread(idx, count, span),
            cost: 1,
        }));
    }
    arrivals
}

/// Offset of the `idx`-th of `count` requests spread over `span`.
fn spread(idx: u64, count: u64, span: u64) -> u64 {
    (u128::from(idx) * u128::from(span) / u128::from(count)) as u64
}

/// One request every `W / 1.5N`, from the start.
fn steady(scale: Scale, duration_us: u64) -> Vec<Arrival> {
    let per = 3 * u128::from(scale.limit);
    let mut arrivals = Vec::new();
    for idx in 0u128.. {
        // At `idx × 2W / 3N`, floored: exact at every whole multiple.
        let at_us = idx * 2 * window(scale) / per;
        if at_us >= u128::from(duration_us) {
            break;
        }
        arrivals.push(Arrival {
            at_us: at_us as u64,
            cost: 1,
        });
    }
    arrivals
}

/// A rate rising evenly from 0 to `3N / W` at `duration`: the `k`-th
/// request arrives when the requests so far, `3N t² / (2 W D)`, reach `k`,
/// that is at `t = sqrt(2 k W D / 3N)`.
fn ramp(scale: Scale, duration_us: u64) -> Vec<Arrival> {
    let per = 3 * u128::from(scale.limit);
    let mut arrivals = Vec::new();
    for idx in 1u128.. {
        let at_us = isqrt(2 * idx * window(scale) * u128::from(duration_us) / per);
        if at_us >= u128::from(duration_us) {
            break;
        }
        arrivals.push(Arrival {
            at_us: at_us as u64,
            cost: 1,
        });
    }
    arrivals
}

/// The integer square root, rounded down.
fn isqrt(value: u128) -> u128 {
    if value < 2 {
        return value;
    }
    // Newton's method from above converges down to the floor.
    let mut x = value;
    let mut y = x.div_ceil(2);
    while y < x {
        x = y;
        y = (x + value / x) / 2;
    }
    x
}

/// The requests of a trace: one per line, `<offset ms>` or `<offset ms>
/// <cost>` (separated by spaces, a tab or a comma), offsets in
/// milliseconds (fractions down to the microsecond) that never go back;
/// blank lines and lines starting with `#` are skipped.
pub fn parse_trace(text: &str) -> Result<Vec<Arrival>, Error> {
    let mut arrivals: Vec<Arrival> = Vec::new();
    for (idx, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |message: String| Error::Trace {
            line: idx + 1,
            message,
        };
        let arrival = parse_trace_line(line).map_err(bad)?;
        if let Some(previous) = arrivals.last()
            && arrival.at_us < previous.at_us
        {
            return Err(bad(format!(
                "{} ms is before the previous request",
                millis(arrival.at_us)
            )));
        }
        arrivals.push(arrival);
    }
    Ok(arrivals)
}

fn parse_trace_line(line: &str) -> Result<Arrival, String> {
    let mut fields = line
        .split(|it: char| it == ',' || it.is_ascii_whitespace())
        .filter(|it| !it.is_empty());
    let at = fields.next().unwrap_or_default();
    let at_us = parse_millis(at).ok_or_else(|| {
        format!("'{at}' is not a time in milliseconds (a number such as 250 or 12.5)")
    })?;
    let cost = match fields.next() {
        None => 1,
        Some(cost) => match cost.parse::<u32>() {
            Ok(cost) if cost >= 1 => cost,
            _ => return Err(format!("'{cost}' is not a cost from 1 to {}", u32::MAX)),
        },
    };
    if let Some(extra) = fields.next() {
        return Err(format!(
            "unexpected '{extra}': a line is a time and an optional cost"
        ));
    }
    Ok(Arrival { at_us, cost })
}

/// Milliseconds, with at most three decimals, as microseconds; `None` for
/// anything else (signs, exponents, more than 10 years).
fn parse_millis(text: &str) -> Option<u64> {
    const MAX_US: u64 = 10 * 365 * 86_400 * 1_000_000;
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |it: &str| it.bytes().all(|byte| byte.is_ascii_digit());
    if whole.is_empty() || !digits(whole) || !digits(fraction) || fraction.len() > 3 {
        return None;
    }
    let whole: u64 = whole.parse().ok()?;
    let fraction: u64 = format!("{fraction:0<3}").parse().ok()?;
    let at_us = whole.checked_mul(1_000)?.checked_add(fraction)?;
    (at_us <= MAX_US).then_some(at_us)
}

/// Microseconds as milliseconds, for messages.
fn millis(us: u64) -> String {
    if us.is_multiple_of(1_000) {
        (us / 1_000).to_string()
    } else {
        let fraction = format!("{:03}", us % 1_000);
        format!("{}.{}", us / 1_000, fraction.trim_end_matches('0'))
    }
}

#[cfg(test)]
mod tests;
