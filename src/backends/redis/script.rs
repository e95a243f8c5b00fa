//! The decision script: its argument layout, the encoding of a request into
//! KEYS and ARGV, and the decoding of its reply.
//!
//! [`HEADER_FIELDS`] and [`LIMIT_FIELDS`] are the one description of ARGV:
//! the encoder builds the arguments from them, `lua/decide.lua` reads its
//! arguments by the same names in the same order (a test holds the two
//! alike), and the documentation points here.

use std::collections::HashSet;

use redis::{RedisWrite, ToRedisArgs};

use super::super::{Error, KeyedCheck, keys};
use crate::algorithms::{Check, Mode, Outcome, Verdict};

/// The decision script, embedded at build time.
pub const DECIDE_LUA: &str = include_str!("../../../lua/decide.lua");

/// One argument of the script: text, or an integer sent in decimal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    Text(&'static str),
    Int(u64),
}

/// One field of the argument layout: its name (the script reads the
/// argument under it), what it holds, and where the encoder takes it from.
pub struct Field<T> {
    pub name: &'static str,
    pub doc: &'static str,
    pub value: fn(&T) -> Arg,
}

impl<T> Field<T> {
    const fn new(name: &'static str, doc: &'static str, value: fn(&T) -> Arg) -> Field<T> {
        Field { name, doc, value }
    }
}

/// What a call sends once, before the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderArgs {
    /// The service's time, or `None` for the server's.
    pub now_us: Option<u64>,
    pub grace_ms: u64,
}

/// One limit as the script receives it. Not validated here: the script
/// checks every field itself, and its tests send fields it must refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitArgs {
    pub algorithm: &'static str,
    pub limit: u64,
    pub window_us: u64,
    pub capacity: u64,
    pub per_us: u64,
    pub scale: u64,
    pub cost: u64,
    pub mode: &'static str,
}

/// ARGV[1..=2], in this order.
pub const HEADER_FIELDS: [Field<HeaderArgs>; 2] = [
    Field::new(
        "now_us",
        "now in µs since the Unix epoch (decimal), or \"\" to read the server's TIME \
         so that replicas with skewed clocks agree",
        |it| it.now_us.map_or(Arg::Text(""), Arg::Int),
    ),
    Field::new(
        "grace_ms",
        "ms added to every key's TTL (0: a key expires exactly when its state \
         becomes equal to a fresh one)",
        |it| Arg::Int(it.grace_ms),
    ),
];

/// The fields of one limit, in this order, once per key after the header.
pub const LIMIT_FIELDS: [Field<LimitArgs>; 8] = [
    Field::new(
        "algorithm",
        "the algorithm's name (`Algorithm::name`)",
        |it| Arg::Text(it.algorithm),
    ),
    Field::new("limit", "requests per window", |it| Arg::Int(it.limit)),
    Field::new("window_us", "the window in µs", |it| {
        Arg::Int(it.window_us)
    }),
    Field::new(
        "capacity",
        "the most a request may take: the burst, or the limit",
        |it| Arg::Int(it.capacity),
    ),
    Field::new(
        "per_us",
        "scaled tokens refilled per µs (`LimitParams::rate`)",
        |it| Arg::Int(it.per_us),
    ),
    Field::new(
        "scale",
        "scaled units per token (`LimitParams::rate`)",
        |it| Arg::Int(it.scale),
    ),
    Field::new(
        "cost",
        "units the request takes: any non-negative integer, 2^53 and above included",
        |it| Arg::Int(it.cost),
    ),
    Field::new("mode", "enforce, shadow or quota", |it| Arg::Text(it.mode)),
];

/// Integers per limit in the reply, after `{allowed, now_us}`:
/// has_room, consumed, remaining, reset_us.
const REPLY_PER_LIMIT: usize = 4;

/// ARGV of one call: the header's fields, then every limit's, each in the
/// order of its table.
pub fn argv(header: &HeaderArgs, limits: &[LimitArgs]) -> Vec<Arg> {
    let mut out = Vec::with_capacity(HEADER_FIELDS.len() + LIMIT_FIELDS.len() * limits.len());
    out.extend(HEADER_FIELDS.iter().map(|field| (field.value)(header)));
    for limit in limits {
        out.extend(LIMIT_FIELDS.iter().map(|field| (field.value)(limit)));
    }
    out
}

impl LimitArgs {
    pub fn of(check: &Check) -> LimitArgs {
        let params = &check.params;
        let rate = params.rate();
        LimitArgs {
            algorithm: params.algorithm().name(),
            limit: params.limit(),
            window_us: params.window_us(),
            capacity: params.capacity(),
            per_us: rate.per_us,
            scale: rate.scale,
            cost: check.cost,
            mode: mode_name(check.mode),
        }
    }
}

fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Enforce => "enforce",
        Mode::Shadow => "shadow",
        Mode::Quota => "quota",
    }
}

impl ToRedisArgs for Arg {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        match self {
            Arg::Text(text) => out.write_arg(text.as_bytes()),
            Arg::Int(n) => n.write_redis_args(out),
        }
    }
}

/// The call of the script for `checks`: their keys under `prefix`, and
/// ARGV. Refuses a request naming one counter twice, which the script would
/// read and write twice.
pub(super) fn invocation<'a>(
    script: &'a redis::Script,
    prefix: &str,
    header: &HeaderArgs,
    checks: &[KeyedCheck],
) -> Result<redis::ScriptInvocation<'a>, Error> {
    let mut invocation = script.prepare_invoke();
    let mut seen = HashSet::with_capacity(checks.len());
    for it in checks {
        let key = keys::encode(prefix, &it.key);
        if !seen.insert(key.clone()) {
            return Err(Error::Protocol(format!(
                "counter {key} appears twice in one request"
            )));
        }
        invocation.key(key);
    }
    let limits: Vec<LimitArgs> = checks.iter().map(|it| LimitArgs::of(&it.check)).collect();
    invocation.arg(argv(header, &limits));
    Ok(invocation)
}

/// Reads `{allowed, now, (has_room, consumed, remaining, reset_us)*n}`.
pub(super) fn parse_reply(reply: &[i64], n_checks: usize) -> Result<Verdict, Error> {
    let bad = || Error::Protocol(format!("unexpected script reply {reply:?}"));
    if reply.len() != 2 + REPLY_PER_LIMIT * n_checks {
        return Err(bad());
    }
    let flag = |value: i64| match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad()),
    };
    let count = |value: i64| u64::try_from(value).map_err(|_| bad());
    let allowed = flag(reply[0])?;
    let outcomes = reply[2..]
        .chunks_exact(REPLY_PER_LIMIT)
        .map(|it| {
            Ok(Outcome {
                has_room: flag(it[0])?,
                consumed: flag(it[1])?,
                remaining: count(it[2])?,
                reset_us: count(it[3])?,
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    Ok(Verdict { allowed, outcomes })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{Algorithm, LimitParams};

    /// The quoted names of the Lua table `local {name} = { ... }`.
    fn lua_table(name: &str) -> Vec<String> {
        let start = format!("local {name} = {{");
        let (_, rest) = DECIDE_LUA
            .split_once(&start)
            .unwrap_or_else(|| panic!("lua/decide.lua declares {name}"));
        let (body, _) = rest.split_once('}').expect("the table closes");
        body.split(',')
            .map(str::trim)
            .filter(|it| !it.is_empty())
            .map(|it| it.trim_matches('\'').to_owned())
            .collect()
    }

    fn names<T>(fields: &[Field<T>]) -> Vec<String> {
        fields.iter().map(|it| it.name.to_owned()).collect()
    }

    #[test]
    fn the_script_reads_the_fields_of_the_layout_in_order() {
        assert_eq!(lua_table("HEADER_FIELDS"), names(&HEADER_FIELDS));
        assert_eq!(lua_table("LIMIT_FIELDS"), names(&LIMIT_FIELDS));
    }

    #[test]
    fn argv_is_the_header_then_each_limit_in_field_order() {
        let params = LimitParams::new(Algorithm::TokenBucket, 10, 60_000_000, Some(20)).unwrap();
        let check = Check {
            params,
            cost: 3,
            mode: Mode::Quota,
        };
        let rate = params.rate();
        let header = HeaderArgs {
            now_us: None,
            grace_ms: 7,
        };
        let args = argv(&header, &[LimitArgs::of(&check)]);
        assert_eq!(
            args,
            [
                Arg::Text(""),
                Arg::Int(7),
                Arg::Text("token_bucket"),
                Arg::Int(10),
                Arg::Int(60_000_000),
                Arg::Int(20),
                Arg::Int(rate.per_us),
                Arg::Int(rate.scale),
                Arg::Int(3),
                Arg::Text("quota"),
            ]
        );
    }

    #[test]
    fn replies_are_checked() {
        assert!(parse_reply(&[1, 5, 1, 1, 3, 10], 1).is_ok());
        assert!(parse_reply(&[1, 5, 1, 1, 3], 1).is_err());
        assert!(parse_reply(&[2, 5, 1, 1, 3, 10], 1).is_err());
        assert!(parse_reply(&[1, 5, 1, 1, -3, 10], 1).is_err());
    }
}
