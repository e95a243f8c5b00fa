//! The `throttlegate` command line: the subcommands and their flags (each
//! flag with its environment variable), parsed and run.
//! envoyproxy/ratelimit's environment variables ([`crate::compat`]) become
//! flag defaults. Invariant: `serve`'s flags are accepted with or without
//! the subcommand, and a flag given or one of our variables always wins
//! over envoyproxy/ratelimit's.

mod check;
mod check_config;
mod config_options;
mod envoyproxy_defaults;
mod print_lua;
mod serve;
mod simulate;

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::compat;

use self::check::CheckArgs;
use self::check_config::CheckConfigArgs;
use self::envoyproxy_defaults::{compat_flags, log_level_filter, with_defaults};
use self::print_lua::PrintLuaArgs;
use self::serve::ServeArgs;
use self::simulate::SimulateArgs;

// No `Debug` on `Cli`, `Command` or `ServeArgs`: they hold Redis URLs and
// passwords, and nothing may print them whole.

/// Rate-limit decision service for Envoy's global rate-limit filter.
#[derive(Parser)]
#[command(
    name = "throttlegate",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// `serve` is the default: its flags are accepted without the subcommand.
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Serve rate limits over gRPC and HTTP (the default).
    Serve(Box<ServeArgs>),
    /// Load and validate a config file or directory, print a summary.
    CheckConfig(CheckConfigArgs),
    /// Replay a traffic pattern through one rule with each algorithm (on the
    /// memory backend and a simulated clock); print the counts, draw an SVG.
    Simulate(SimulateArgs),
    /// Print the Lua the Redis backend sends (for measuring it by hand).
    #[command(hide = true)]
    PrintLua(PrintLuaArgs),
    /// Ask a running service over gRPC (one ShouldRateLimit call) and print
    /// its answer as JSON. Exit code 0: OK; 3: OVER_LIMIT; 1: no answer
    /// (connection, TLS or RPC error); 2: bad arguments.
    Check(CheckArgs),
}

/// Parses `args` (envoyproxy/ratelimit's variables in `vars` as flag
/// defaults), runs the subcommand they name, and returns the process's
/// exit code; bad arguments print clap's message and exit with 2.
pub fn run(vars: &HashMap<String, String>, args: Vec<OsString>) -> ExitCode {
    let (flags, mut warnings) = compat_flags(vars, &args);
    let log_filter = log_level_filter(vars).unwrap_or_else(|warning| {
        warnings.push(warning);
        None
    });
    let takes_redis_url = vars.get("REDIS_URL").is_some_and(|it| !it.contains("://"));
    let matches = with_defaults(Cli::command(), &flags, takes_redis_url).get_matches_from(args);
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|err| err.exit());
    let refusals = compat::refusals(vars);
    match cli.command {
        Some(Command::CheckConfig(args)) => check_config::check_config(&args),
        Some(Command::Simulate(args)) => simulate::simulate(args),
        Some(Command::PrintLua(args)) => print_lua::print_lua(&args),
        Some(Command::Check(args)) => check::check(args),
        Some(Command::Serve(args)) => serve::serve(*args, log_filter, &warnings, &refusals),
        None => serve::serve(cli.serve, log_filter, &warnings, &refusals),
    }
}
