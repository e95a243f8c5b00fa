//! `throttlegate simulate`: its flags, handed to [`crate::simulate`].
//! Invariant: exit code 2 when nothing could be simulated.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::simulate;

use super::config_options::{ConfigArgs, load_options};

#[derive(Debug, Args)]
pub(super) struct SimulateArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files.
    #[arg(long)]
    config: PathBuf,
    #[command(flatten)]
    config_options: ConfigArgs,
    /// The request's domain.
    #[arg(long)]
    domain: String,
    /// One entry of the request's descriptor, `key=value`; repeat for
    /// nested entries, outermost first.
    #[arg(long = "descriptor", value_name = "KEY=VALUE", required = true)]
    descriptors: Vec<String>,
    /// burst: 2x the limit within the first fiftieth of a window, then 2x in
    /// the fiftieth before and 2x in the fiftieth after the window boundary
    /// nearest the middle of the run.
    /// steady: 1.5x the limit, evenly spaced. ramp: a rate rising from 0 to
    /// 3x the limit over the run. trace FILE: one request per line, `<offset
    /// ms> [cost]`. Scaled to the rule's first limit.
    #[arg(long, num_args = 1..=2, value_names = ["NAME", "FILE"], default_value = "burst")]
    pattern: Vec<String>,
    /// Length of the run in seconds [default: four windows; a trace: up to
    /// its last request, rounded up to a window].
    #[arg(long, value_name = "SECONDS")]
    duration: Option<String>,
    /// Only the rule's own algorithm, instead of one lane per algorithm.
    #[arg(long)]
    only_configured: bool,
    /// Where to write the picture (SVG), one lane per algorithm.
    #[arg(long, value_name = "OUT")]
    svg: Option<PathBuf>,
}

/// `simulate`: the summary on stdout, the picture in `--svg`; exit code 2
/// when nothing could be simulated.
pub(super) fn simulate(args: SimulateArgs) -> ExitCode {
    let options = simulate::Simulation {
        load: load_options(&args.config_options),
        config: args.config,
        domain: args.domain,
        descriptor: args.descriptors,
        pattern: args.pattern,
        duration: args.duration,
        only_configured: args.only_configured,
    };
    let written = simulate::run(&options).and_then(|report| {
        for warning in &report.warnings {
            eprintln!("warning: {warning}");
        }
        if let Some(path) = &args.svg {
            simulate::write_svg(&report, path)?;
        }
        print!("{report}");
        Ok(())
    });
    match written {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            ExitCode::from(2)
        }
    }
}
