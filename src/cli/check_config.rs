//! `throttlegate check-config`: loads a config as `serve` would and prints
//! its summary. Invariant: exit code 0 only for a config `serve` accepts.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use crate::config;

use super::config_options::{ConfigArgs, load_options};

#[derive(Debug, Args)]
pub(super) struct CheckConfigArgs {
    /// A YAML file, or a directory of `*.yaml`/`*.yml` files.
    path: PathBuf,
    #[command(flatten)]
    config: ConfigArgs,
}

pub(super) fn check_config(args: &CheckConfigArgs) -> ExitCode {
    match config::load(&args.path, &load_options(&args.config)) {
        Ok(loaded) => {
            for warning in &loaded.warnings {
                eprintln!("warning: {warning}");
            }
            print!("{}", config::summary(&loaded.rules));
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("{err:#}");
            ExitCode::FAILURE
        }
    }
}
