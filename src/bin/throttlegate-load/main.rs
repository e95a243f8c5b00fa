//! Load generator: drives ShouldRateLimit on any Envoy RLS v3 server over N
//! connections x M streams, for a count or a duration, as fast as answers
//! come or paced to a rate, with a hot key, uniform or Zipf keys, or hot
//! and fresh ones; prints throughput, answers, errors by code, latency
//! percentiles, CPU per decision of given processes, and one
//! `summary {json}` line; optionally a report line per interval.

mod args;
mod cpu;
mod keys;
mod run;
mod summary;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use crate::args::Args;
use crate::run::{Interval, Phase, Workload};
use crate::summary::{CpuUse, MeasuredRun};

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match drive(&args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("throttlegate-load: {err}");
            ExitCode::from(2)
        }
    }
}

/// Connects, warms up, measures, reports.
async fn drive(args: &Args) -> Result<(), String> {
    let connections = args.connections.max(1);
    let streams = args.streams.max(1);
    let channels = run::connect(&args.addr, connections).await?;
    let workload = Arc::new(Workload::new(args));
    if !args.warmup.is_zero() {
        let warmup = Arc::new(Phase::new(None, Some(args.warmup), 1));
        run::run_phase(&channels, streams, &workload, &warmup, None, |_| {}).await?;
    }
    let before = CpuClock::read(&args.pids);
    let started = Instant::now();
    let measured = Arc::new(Phase::new(args.request_budget(), args.duration, 0));
    let mut interval_start = CpuClock::read(&args.pids);
    let on_interval = |interval: Interval<'_>| {
        let now = CpuClock::read(&args.pids);
        let (processes, generator_cpu_seconds) = interval_start.until(&now, &args.pids);
        interval_start = now;
        let measured = MeasuredRun {
            tally: interval.tally,
            seconds: interval.length.as_secs_f64(),
            connections,
            streams,
            processes: &processes,
            generator_cpu_seconds,
            labels: &args.labels,
            target_rate: args.rate,
        };
        let elapsed = interval.elapsed.as_secs_f64();
        println!("{}", measured.interval_text(elapsed));
        println!("{}", measured.interval_line(elapsed));
    };
    let tally = run::run_phase(
        &channels,
        streams,
        &workload,
        &measured,
        args.report_every,
        on_interval,
    )
    .await?;
    let seconds = started.elapsed().as_secs_f64();
    let after = CpuClock::read(&args.pids);
    let (processes, generator_cpu_seconds) = before.until(&after, &args.pids);
    let measured = MeasuredRun {
        tally: &tally,
        seconds,
        connections,
        streams,
        processes: &processes,
        generator_cpu_seconds,
        labels: &args.labels,
        target_rate: args.rate,
    };
    print!("{}", measured.text());
    println!("{}", measured.summary_line());
    Ok(())
}

/// CPU ticks of the watched processes and of the generator at one moment.
struct CpuClock {
    watched: Vec<Option<u64>>,
    own: Option<u64>,
}

impl CpuClock {
    fn read(pids: &[(String, u32)]) -> CpuClock {
        CpuClock {
            watched: pids
                .iter()
                .map(|(_, pid)| cpu::process_ticks(*pid))
                .collect(),
            own: cpu::own_ticks(),
        }
    }

    /// CPU seconds of each watched process, then the generator's, from
    /// `self` to `later`.
    fn until(&self, later: &CpuClock, pids: &[(String, u32)]) -> (Vec<CpuUse>, Option<f64>) {
        let hz = cpu::clock_ticks_per_second() as f64;
        let seconds =
            |from: Option<u64>, to: Option<u64>| Some(to?.checked_sub(from?)? as f64 / hz);
        let processes = pids
            .iter()
            .zip(self.watched.iter().zip(&later.watched))
            .map(|((label, pid), (from, to))| CpuUse {
                label: label.clone(),
                pid: *pid,
                seconds: seconds(*from, *to),
            })
            .collect();
        (processes, seconds(self.own, later.own))
    }
}
