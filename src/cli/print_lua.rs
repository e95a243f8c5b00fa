//! `throttlegate print-lua` (hidden): the Lua the Redis backend sends,
//! for measuring it by hand. Invariant: prints the very text the backend
//! loads, nothing added.

use std::process::ExitCode;

use clap::{Args, ValueEnum};

#[derive(Debug, Args)]
pub(super) struct PrintLuaArgs {
    /// Which text to print.
    #[arg(value_enum)]
    what: LuaText,
}

/// What `print-lua` prints.
#[derive(Debug, Clone, Copy, ValueEnum)]
enum LuaText {
    /// The function library's source (FUNCTION LOAD), and nothing else.
    Library,
    /// The library's name and its functions' names, one a line (decide,
    /// decide_batch, refund).
    Names,
    /// The EVALSHA script deciding one request.
    Decide,
    /// The EVALSHA script deciding a batch.
    DecideBatch,
    /// The EVALSHA script of a refund.
    Refund,
}

pub(super) fn print_lua(args: &PrintLuaArgs) -> ExitCode {
    use crate::backends::redis::script;
    let library = script::library();
    match args.what {
        LuaText::Library => print!("{}", library.source),
        LuaText::Names => println!(
            "{}\n{}\n{}\n{}",
            library.name, library.decide, library.decide_batch, library.refund
        ),
        LuaText::Decide => print!("{}", script::DECIDE_LUA),
        LuaText::DecideBatch => print!("{}", script::DECIDE_BATCH_LUA),
        LuaText::Refund => print!("{}", script::REFUND_LUA),
    }
    ExitCode::SUCCESS
}
