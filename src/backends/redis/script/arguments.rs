//! The decision's arguments: the layout of ARGV ([`HEADER_FIELDS`],
//! [`LIMIT_FIELDS`], and for a batch [`BATCH_FIELDS`] and
//! [`REQUEST_FIELDS`]) and the encoding of a request into KEYS and ARGV.
//!
//! Invariant: the encoders build every argument from the field tables, in
//! their order, which is the order the Lua reads them in.

use std::collections::HashSet;
use std::io::Write;

use redis::{RedisWrite, ToRedisArgs};

use super::super::settings::ClockSource;
use crate::algorithms::{Check, Mode};
use crate::backends::keys::KeyFormat;
use crate::backends::{Error, KeyedCheck};

/// One argument of the script: text, an integer sent in decimal, or a
/// limit (its [`LIMIT_FIELDS`] joined by `:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    Text(&'static str),
    Int(u64),
    Limit(ScriptLimit),
}

/// One field of the argument layout: its name (the script reads the
/// argument under it), what it holds, and where the encoder takes it from.
pub struct Field<T> {
    pub name: &'static str,
    pub doc: &'static str,
    pub value: fn(&T) -> Arg,
}

impl<T> Field<T> {
    pub(super) const fn new(
        name: &'static str,
        doc: &'static str,
        value: fn(&T) -> Arg,
    ) -> Field<T> {
        Field { name, doc, value }
    }
}

/// What a call sends once, before the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeaderArgs {
    /// The service's time, or `None` for the server's.
    pub now_us: Option<u64>,
    pub grace_ms: u64,
    /// Whether the reply carries each limit's [`Receipt`] and its outcome
    /// if denied, the script leaving the ruling on quota limits to the
    /// caller: only a request that may have to be refunded (split over
    /// Cluster slots) asks.
    pub receipts: bool,
}

impl HeaderArgs {
    /// The header of a call made now on `clock`: the service's time under
    /// a local clock, none (the server's `TIME`) otherwise.
    pub fn now(clock: &ClockSource, grace_ms: u64, receipts: bool) -> HeaderArgs {
        let now_us = match clock {
            ClockSource::Redis => None,
            ClockSource::Local(clock) => Some(clock.now_us()),
        };
        HeaderArgs {
            now_us,
            grace_ms,
            receipts,
        }
    }
}

/// One limit as the script receives it. Not validated here: the script
/// checks every field itself, and its tests send fields it must refuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScriptLimit {
    pub algorithm: &'static str,
    pub limit: u64,
    pub window_us: u64,
    pub capacity: u64,
    pub per_us: u64,
    pub scale: u64,
    pub cost: u64,
    pub mode: &'static str,
    pub charge: &'static str,
}

/// ARGV[1..=3], in this order.
pub const HEADER_FIELDS: [Field<HeaderArgs>; 3] = [
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
    Field::new(
        "receipts",
        "1 for one slot group of a request over several Cluster slots: take what an \
         allowed request takes unless an enforcing limit has no room, and follow each \
         limit's reply with its receipt (at_us, units: what a refund takes back) and \
         what it reports if the request is denied (remaining, reset_us); 0 to decide \
         the request whole",
        |it| Arg::Int(u64::from(it.receipts)),
    ),
];

/// The fields of one limit, in this order, joined by `:` into one argument
/// per key after the header: one argument rather than eight, which Redis
/// would parse into eight strings and the script join again to look the
/// limit up among those it has parsed before.
pub const LIMIT_FIELDS: [Field<ScriptLimit>; 9] = [
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
    Field::new(
        "charge",
        "if_allowed (the cost is taken only when the request is allowed) or always \
         (taken whatever the verdict, into debt up to one capacity: `Charge`)",
        |it| Arg::Text(it.charge),
    ),
];

/// ARGV[1] of a batch (`decide_batch`); then, per request, its
/// [`REQUEST_FIELDS`], its [`HEADER_FIELDS`] and its [`LIMIT_FIELDS`] once
/// per limit. KEYS are the requests' keys one after the other; the reply
/// is each request's reply (as [`parse_reply`] reads it) one after the
/// other. Requests are decided in order, each all-or-nothing on its own.
pub const BATCH_FIELDS: [Field<usize>; 1] = [Field::new(
    "requests",
    "the number of requests in the call, at least 1",
    |it| Arg::Int(count(*it)),
)];

/// The fields that open each request of a batch, in this order.
pub const REQUEST_FIELDS: [Field<usize>; 1] = [Field::new(
    "limits",
    "the number of the request's limits, at least 1: its keys are the next \
     that many of KEYS",
    |it| Arg::Int(count(*it)),
)];

fn count(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

/// ARGV of one call: the header's fields in the order of its table, then
/// one argument per limit.
pub fn argv(header: &HeaderArgs, limits: &[ScriptLimit]) -> Vec<Arg> {
    let mut out = Vec::with_capacity(HEADER_FIELDS.len() + limits.len());
    out.extend(HEADER_FIELDS.iter().map(|field| (field.value)(header)));
    out.extend(limits.iter().copied().map(Arg::Limit));
    out
}

impl ScriptLimit {
    pub fn of(check: &Check) -> ScriptLimit {
        let params = &check.params;
        let rate = params.rate();
        ScriptLimit {
            algorithm: params.algorithm().name(),
            limit: params.limit(),
            window_us: params.window_us(),
            capacity: params.capacity(),
            per_us: rate.per_us,
            scale: rate.scale,
            cost: check.cost,
            mode: mode_name(check.mode),
            charge: params.charge().name(),
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
            Arg::Limit(limit) => limit.write_redis_args(out),
        }
    }
}

/// One argument: the fields of [`LIMIT_FIELDS`] joined by `:`, written
/// straight into the command.
impl ToRedisArgs for ScriptLimit {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut arg = out.writer_for_next_arg();
        let mut digits = itoa::Buffer::new();
        for (idx, field) in LIMIT_FIELDS.iter().enumerate() {
            let text = match (field.value)(self) {
                Arg::Text(text) => text.as_bytes(),
                Arg::Int(n) => digits.format(n).as_bytes(),
                // No field of a limit is a limit.
                Arg::Limit(_) => b"",
            };
            // Writing into the command's buffer cannot fail.
            if idx > 0 {
                let _ = arg.write_all(b":");
            }
            let _ = arg.write_all(text);
        }
    }
}

/// The keys of `checks`, written by `keys`, in order. Refuses a request
/// naming one counter twice, which the script would read and write twice.
pub fn request_keys(keys: &KeyFormat, checks: &[KeyedCheck]) -> Result<Vec<String>, Error> {
    let encoded: Vec<String> = checks.iter().map(|it| keys.encode(&it.key)).collect();
    if let Some(key) = first_repeated(&encoded) {
        return Err(Error::Protocol(format!(
            "counter {key} appears twice in one request"
        )));
    }
    Ok(encoded)
}

/// The first key that appears twice: by comparing every pair for the few
/// keys of most requests (no set to allocate), with a set beyond.
fn first_repeated(keys: &[String]) -> Option<&String> {
    const PAIRWISE_UP_TO: usize = 16;
    if keys.len() <= PAIRWISE_UP_TO {
        return keys
            .iter()
            .enumerate()
            .find(|(idx, key)| keys[..*idx].contains(key))
            .map(|(_, key)| key);
    }
    let mut seen = HashSet::with_capacity(keys.len());
    keys.iter().find(|it| !seen.insert(it.as_str()))
}

/// The call of `script` for `checks` (the EVALSHA form, for tests and
/// tools): their keys written by `keys`, and ARGV. Refuses a request naming
/// one counter twice.
pub fn invocation<'a>(
    script: &'a redis::Script,
    keys: &KeyFormat,
    header: &HeaderArgs,
    checks: &[KeyedCheck],
) -> Result<redis::ScriptInvocation<'a>, Error> {
    let mut invocation = script.prepare_invoke();
    for key in request_keys(keys, checks)? {
        invocation.key(key);
    }
    let limits: Vec<ScriptLimit> = checks.iter().map(|it| ScriptLimit::of(&it.check)).collect();
    invocation.arg(argv(header, &limits));
    Ok(invocation)
}

/// Appends one request's ARGV to `cmd`: the header's fields, then every
/// limit's, each in the order of its table, written straight into the
/// command (no list of arguments built first).
pub fn write_request(cmd: &mut redis::Cmd, header: &HeaderArgs, limits: &[ScriptLimit]) {
    for field in &HEADER_FIELDS {
        cmd.arg((field.value)(header));
    }
    for limit in limits {
        cmd.arg(limit);
    }
}
