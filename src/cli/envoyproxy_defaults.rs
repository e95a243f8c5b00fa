//! envoyproxy/ratelimit's environment variables installed as the defaults
//! of the `serve` flags, before parsing. Invariant: a flag on the command
//! line or one of our `THROTTLEGATE_*` variables always wins over them.

use std::collections::HashMap;
use std::ffi::OsString;

use clap::Arg;

use crate::compat::{self, FlagValue};

/// Flags whose presence on the command line says where Redis is: then
/// envoyproxy/ratelimit's `REDIS_URL` is not translated.
const REDIS_TARGET_FLAGS: &[&str] = &[
    "redis-url",
    "redis-cluster-nodes",
    "redis-sentinel-nodes",
    "redis-sentinel-master",
];

/// [`compat::from_envoyproxy_env`], less the Redis target when the
/// command line names one.
pub(super) fn compat_flags(
    vars: &HashMap<String, String>,
    args: &[OsString],
) -> (Vec<FlagValue>, Vec<String>) {
    let (mut flags, warnings) = compat::from_envoyproxy_env(vars);
    let named_on_command_line = |flag: &str| {
        let long = format!("--{flag}");
        args.iter().filter_map(|it| it.to_str()).any(|it| {
            it == long
                || it
                    .strip_prefix(long.as_str())
                    .is_some_and(|rest| rest.starts_with('='))
        })
    };
    if REDIS_TARGET_FLAGS
        .iter()
        .any(|it| named_on_command_line(it))
    {
        flags.retain(|(flag, _)| !REDIS_TARGET_FLAGS.contains(flag));
    }
    (flags, warnings)
}

/// envoyproxy/ratelimit's `LOG_LEVEL` as the log filter used when
/// `RUST_LOG` is not set, or a warning when the level is unknown.
pub(super) fn log_level_filter(vars: &HashMap<String, String>) -> Result<Option<String>, String> {
    let Some(level) = vars.get("LOG_LEVEL") else {
        return Ok(None);
    };
    if vars.contains_key("RUST_LOG") {
        return Ok(None);
    }
    match compat::log_filter(level) {
        Some(filter) => Ok(Some(filter.to_owned())),
        None => Err(format!(
            "LOG_LEVEL={level} is not a log level; RUST_LOG applies"
        )),
    }
}

/// `command` with `flags` as the defaults of its `serve` flags (both at the
/// top level and under `serve`), so that a flag given or one of our
/// variables still wins. With `takes_redis_url`, `REDIS_URL` is not read
/// as `--redis-url`: it is envoyproxy/ratelimit's, translated in `flags`.
pub(super) fn with_defaults(
    mut command: clap::Command,
    flags: &[FlagValue],
    takes_redis_url: bool,
) -> clap::Command {
    let mut grouped: Vec<(&str, Vec<&'static str>)> = Vec::new();
    for (flag, value) in flags {
        // Leaked once at start-up: clap keeps defaults as 'static strings.
        let value: &'static str = Box::leak(value.clone().into_boxed_str());
        match grouped.iter_mut().find(|(it, _)| it == flag) {
            Some((_, values)) => values.push(value),
            None => grouped.push((flag, vec![value])),
        }
    }
    if takes_redis_url && !grouped.iter().any(|(flag, _)| *flag == "redis-url") {
        grouped.push(("redis-url", Vec::new()));
    }
    for (flag, values) in grouped {
        let id = flag.replace('-', "_");
        let change = |arg: Arg| {
            let arg = if values.is_empty() {
                arg
            } else {
                arg.default_values(values.clone())
            };
            if takes_redis_url && flag == "redis-url" {
                arg.env(None)
            } else {
                arg
            }
        };
        command = command
            .mut_arg(&id, change)
            .mut_subcommand("serve", |serve| serve.mut_arg(&id, change));
    }
    command
}
