//! Counting answers and latencies, and the report: lines for people and one
//! `summary {json}` line for scripts.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde_json::{Value, json};
use throttlegate::proto::envoy::service::ratelimit::v3::RateLimitResponse;
use throttlegate::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use tonic::Status;

/// The answers of one stream, or of the whole run once merged.
#[derive(Debug)]
pub struct Tally {
    pub ok: u64,
    pub over_limit: u64,
    /// Failed calls by gRPC code name (`Unavailable`, `DeadlineExceeded`).
    pub errors: BTreeMap<String, u64>,
    /// Paced requests sent more than `run::LATE_AFTER` after their planned
    /// time.
    pub late: u64,
    pub latency_us: Histogram<u64>,
}

impl Tally {
    pub fn new() -> Tally {
        Tally {
            ok: 0,
            over_limit: 0,
            errors: BTreeMap::new(),
            late: 0,
            // 1 µs .. 60 s at 3 significant digits: valid bounds, cannot
            // fail; a slower answer is saturated to 60 s.
            latency_us: Histogram::new_with_bounds(1, 60_000_000, 3).expect("valid bounds"),
        }
    }

    /// Counts one answer and its latency. An answer whose overall code is
    /// neither OK nor OVER_LIMIT (UNKNOWN) counts as an error.
    pub fn record(&mut self, res: &Result<tonic::Response<RateLimitResponse>, Status>, us: u64) {
        self.latency_us.saturating_record(us.max(1));
        match res {
            Ok(response) => match Code::try_from(response.get_ref().overall_code) {
                Ok(Code::Ok) => self.ok += 1,
                Ok(Code::OverLimit) => self.over_limit += 1,
                _ => *self.errors.entry("UnknownOverallCode".into()).or_default() += 1,
            },
            Err(status) => {
                *self
                    .errors
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1
            }
        }
    }

    pub fn add(&mut self, other: &Tally) -> Result<(), hdrhistogram::AdditionError> {
        self.ok += other.ok;
        self.over_limit += other.over_limit;
        self.late += other.late;
        for (code, n) in &other.errors {
            *self.errors.entry(code.clone()).or_default() += n;
        }
        self.latency_us.add(&other.latency_us)
    }

    /// Empties the tally, keeping its histogram's memory.
    pub fn reset(&mut self) {
        self.ok = 0;
        self.over_limit = 0;
        self.errors.clear();
        self.late = 0;
        self.latency_us.reset();
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Every answered call: decisions and errors.
    pub fn requests(&self) -> u64 {
        self.decisions() + self.error_count()
    }

    /// Calls answered with a decision (OK or OVER_LIMIT).
    pub fn decisions(&self) -> u64 {
        self.ok + self.over_limit
    }
}

/// One process's CPU time over the measured part.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuUse {
    pub label: String,
    pub pid: u32,
    /// None when its `/proc/PID/stat` could not be read at both ends.
    pub seconds: Option<f64>,
}

/// The measured part: its answers, its length, and CPU.
#[derive(Debug)]
pub struct MeasuredRun<'a> {
    pub tally: &'a Tally,
    pub seconds: f64,
    pub connections: usize,
    pub streams: usize,
    pub processes: &'a [CpuUse],
    pub generator_cpu_seconds: Option<f64>,
    pub labels: &'a [(String, String)],
    /// `--rate`, when paced.
    pub target_rate: Option<f64>,
}

impl MeasuredRun<'_> {
    /// Decisions per second (errors are not decisions).
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tally.decisions() as f64 / self.seconds
        } else {
            0.0
        }
    }

    /// CPU µs per decision for `seconds` of CPU.
    fn per_decision_us(&self, seconds: Option<f64>) -> Option<f64> {
        let decisions = self.tally.decisions();
        seconds
            .filter(|_| decisions > 0)
            .map(|it| it * 1e6 / decisions as f64)
    }

    fn percentiles(&self) -> [(&'static str, u64); 5] {
        let latency = &self.tally.latency_us;
        let at = |q| {
            if latency.is_empty() {
                0
            } else {
                latency.value_at_quantile(q)
            }
        };
        [
            ("p50_us", at(0.50)),
            ("p90_us", at(0.90)),
            ("p99_us", at(0.99)),
            ("p99_9_us", at(0.999)),
            ("max_us", latency.max()),
        ]
    }

    /// The report for people, one line per topic.
    pub fn text(&self) -> String {
        let t = self.tally;
        let mut out = format!(
            "requests {} in {:.2}s over {} connections x {} streams: {:.0} decisions/s\n\
             answers: ok {} over_limit {} errors {}\n",
            t.requests(),
            self.seconds,
            self.connections,
            self.streams,
            self.rate(),
            t.ok,
            t.over_limit,
            t.error_count()
        );
        for (code, n) in &t.errors {
            out += &format!("  error {code}: {n}\n");
        }
        if let Some(rate) = self.target_rate {
            out += &format!(
                "paced at {rate} requests/s: {} sent more than {} ms late\n",
                t.late,
                crate::run::LATE_AFTER.as_millis()
            );
        }
        let [p50, p90, p99, p999, max] = self.percentiles().map(|(_, us)| us);
        out += &format!("latency µs: p50 {p50} p90 {p90} p99 {p99} p99.9 {p999} max {max}\n");
        let generator = CpuUse {
            label: "generator".into(),
            pid: std::process::id(),
            seconds: self.generator_cpu_seconds,
        };
        for process in self.processes.iter().chain([&generator]) {
            out += &match (process.seconds, self.per_decision_us(process.seconds)) {
                (Some(s), Some(us)) => format!(
                    "cpu {} (pid {}): {s:.3}s, {us:.2} µs per decision\n",
                    process.label, process.pid
                ),
                (Some(s), None) => {
                    format!("cpu {} (pid {}): {s:.3}s\n", process.label, process.pid)
                }
                (None, _) => format!("cpu {} (pid {}): unreadable\n", process.label, process.pid),
            };
        }
        out
    }

    /// The summary as one JSON object.
    pub fn json(&self) -> Value {
        let t = self.tally;
        let mut summary = json!({
            "rate": self.rate(),
            "seconds": self.seconds,
            "requests": t.requests(),
            "ok": t.ok,
            "over_limit": t.over_limit,
            "errors": t.error_count(),
            "errors_by_code": t.errors,
            "late": t.late,
            "target_rate": self.target_rate,
            "connections": self.connections,
            "streams": self.streams,
            "concurrency": self.connections * self.streams,
            "cpu": self.processes.iter().map(|p| json!({
                "label": p.label,
                "pid": p.pid,
                "seconds": p.seconds,
                "us_per_decision": self.per_decision_us(p.seconds),
            })).collect::<Vec<_>>(),
            "generator_cpu_seconds": self.generator_cpu_seconds,
            "generator_us_per_decision": self.per_decision_us(self.generator_cpu_seconds),
            "labels": self.labels.iter().cloned().collect::<BTreeMap<_, _>>(),
        });
        for (name, us) in self.percentiles() {
            summary[name] = json!(us);
        }
        summary
    }

    /// One interval's line for people: where it ends, its rate, answers,
    /// late requests, latency and the watched processes' CPU share.
    pub fn interval_text(&self, elapsed: f64) -> String {
        let t = self.tally;
        let [p50, _, p99, p999, max] = self.percentiles().map(|(_, us)| us);
        let mut out = format!(
            "[{elapsed:>7.1}s] {:.0} decisions/s ok {} over_limit {} errors {} late {} \
             latency µs p50 {p50} p99 {p99} p99.9 {p999} max {max}",
            self.rate(),
            t.ok,
            t.over_limit,
            t.error_count(),
            t.late
        );
        for process in self.processes {
            out += &match process.seconds {
                Some(s) if self.seconds > 0.0 => {
                    format!(" cpu {} {:.1}%", process.label, s * 100.0 / self.seconds)
                }
                _ => format!(" cpu {} -", process.label),
            };
        }
        out
    }

    /// `interval {json}` on one line: the summary's fields for this
    /// interval alone, with `elapsed`, the seconds from the measured
    /// part's start to the interval's end.
    pub fn interval_line(&self, elapsed: f64) -> String {
        let mut json = self.json();
        json["elapsed"] = json!(elapsed);
        format!("interval {json}")
    }

    /// `summary {json}` on one line.
    pub fn summary_line(&self) -> String {
        format!("summary {}", self.json())
    }
}

#[cfg(test)]
mod tests;
