//! The decision and refund scripts: their argument layouts, the encoding of
//! a request into KEYS and ARGV, and the decoding of their replies.
//!
//! [`HEADER_FIELDS`] and [`LIMIT_FIELDS`] are the one description of the
//! decision's ARGV, [`REFUND_HEADER_FIELDS`] and [`REFUND_FIELDS`] of the
//! refund's: the encoders build the arguments from them, `lua/decide.lua`
//! and `lua/refund.lua` read their arguments by the same names in the same
//! order (a test holds each pair alike), and the documentation points here.
//!
//! # Refunds
//!
//! On a Redis Cluster a request whose keys live in several hash slots is
//! decided by one call of the decision script per slot. Each group takes
//! what an allowed request takes (unless one of its enforcing limits has
//! no room) and tells what each limit reports either way; the service
//! rules on the whole request (`crate::algorithms::settle`). When it is
//! denied, or a slot fails, what the groups took is given back:
//!
//! 1. decide each group with [`HeaderArgs::receipts`] set; read the reply
//!    with [`decode_provisional`] (or [`decode_reply_with_receipts`]): one
//!    [`Receipt`] per check, empty unless the check consumed and is
//!    charged only if allowed;
//! 2. for each group with a receipt, [`refund_invocation`] (or
//!    [`refund_args`] for the raw KEYS and ARGV) with that group's checks
//!    and receipts, run with [`refund_script`] (`lua/refund.lua`,
//!    [`REFUND_LUA`]); `None` when nothing is to be given back;
//!    [`decode_refund_reply`] reads what each limit got back.
//!
//! A refund gives back only this request's share, never more than "as if
//! it had never come" (token buckets and GCRA may give back less when
//! other requests came in between), never past capacity, and nothing once
//! the window rolled or the entry expired. Until it runs, the limits only
//! deny more. It must run **at most once**: a replay of a counter, bucket
//! or GCRA refund gives back other requests' units, so a refund is never
//! retried after a timeout (only after NOSCRIPT, when it did not run); a
//! lost refund costs only room until the window passes.

use std::collections::HashSet;
use std::io::Write;

use redis::{RedisWrite, ToRedisArgs};

use super::super::keys::KeyFormat;
use super::super::{Error, KeyedCheck, keys};
use super::ClockSource;
use crate::algorithms::{Check, Mode, Outcome, Provisional, Verdict};

/// The helpers both scripts share (`lua/common.lua`).
const COMMON_LUA: &str = include_str!("../../../lua/common.lua");
/// The decision's definitions (`lua/decide.lua`): `decide` and `decide_batch`.
const DECIDE_DEFINITIONS: &str = include_str!("../../../lua/decide.lua");
/// The refund's definitions (`lua/refund.lua`): `refund`.
const REFUND_DEFINITIONS: &str = include_str!("../../../lua/refund.lua");

/// The decision of one request as a script (EVALSHA, for servers without
/// functions), embedded at build time after the helpers it shares with the
/// refund. The function library runs the very same text.
pub const DECIDE_LUA: &str = concat!(
    include_str!("../../../lua/common.lua"),
    include_str!("../../../lua/decide.lua"),
    "\nreturn decide(KEYS, ARGV)\n"
);

/// The decision of several requests in one call as a script (see
/// [`BATCH_FIELDS`]).
pub const DECIDE_BATCH_LUA: &str = concat!(
    include_str!("../../../lua/common.lua"),
    include_str!("../../../lua/decide.lua"),
    "\nreturn decide_batch(KEYS, ARGV)\n"
);

/// The refund script, embedded at build time (see the module's "Refunds").
pub const REFUND_LUA: &str = concat!(
    include_str!("../../../lua/common.lua"),
    include_str!("../../../lua/refund.lua"),
    "\nreturn refund(KEYS, ARGV)\n"
);

/// The refund script, invoked by EVALSHA (with SCRIPT LOAD on NOSCRIPT).
pub fn refund_script() -> redis::Script {
    redis::Script::new(REFUND_LUA)
}

/// The decision and the refund as one Redis function library (Redis 7):
/// loaded once per server with FUNCTION LOAD, called with FCALL, so a call
/// runs only the decision, not the definitions of every helper.
///
/// Function names are global in a server, and two versions of the service
/// may share one during a rolling upgrade: the library and its functions
/// carry the first 12 hex digits of the SHA1 of the library's body, so each
/// version calls its own code and loading an identical library again is
/// answered "already exists" (which is success).
///
/// At load time Redis 7.0 lets a library's top level reach only
/// `redis.register_function`: the scripts' text (whose top level reads
/// `string`, `math`, `redis.call`...) is therefore the body of a builder
/// function, run at the first call of the library's functions on that
/// server and kept for every later call.
#[derive(Debug)]
pub struct Library {
    /// The library's name, `throttlegate_<digest>`.
    pub name: String,
    /// One request: the layout of [`HEADER_FIELDS`] and [`LIMIT_FIELDS`].
    pub decide: String,
    /// Several requests: the layout of [`BATCH_FIELDS`].
    pub decide_batch: String,
    /// A refund: the layout of [`REFUND_HEADER_FIELDS`] and [`REFUND_FIELDS`].
    pub refund: String,
    /// What FUNCTION LOAD is sent.
    pub source: String,
}

/// The library, built once.
pub fn library() -> &'static Library {
    static LIBRARY: std::sync::LazyLock<Library> = std::sync::LazyLock::new(Library::build);
    &LIBRARY
}

impl Library {
    fn build() -> Library {
        let definitions = format!(
            "local function decide_functions()\n{COMMON_LUA}{DECIDE_DEFINITIONS}\n\
             return decide, decide_batch\nend\n\
             local function refund_function()\n{COMMON_LUA}{REFUND_DEFINITIONS}\n\
             return refund\nend\n"
        );
        // The digest of the code alone: the names written below derive from it.
        let digest = redis::Script::new(&definitions).get_hash()[..12].to_owned();
        let name = format!("throttlegate_{digest}");
        let decide = format!("throttlegate_decide_{digest}");
        let decide_batch = format!("throttlegate_decide_batch_{digest}");
        let refund = format!("throttlegate_refund_{digest}");
        let source = format!(
            "#!lua name={name}\n{definitions}\
             local decide, decide_batch, refund\n\
             redis.register_function('{decide}', function(keys, args)\n\
             \x20 if not decide then decide, decide_batch = decide_functions() end\n\
             \x20 return decide(keys, args)\nend)\n\
             redis.register_function('{decide_batch}', function(keys, args)\n\
             \x20 if not decide then decide, decide_batch = decide_functions() end\n\
             \x20 return decide_batch(keys, args)\nend)\n\
             redis.register_function('{refund}', function(keys, args)\n\
             \x20 if not refund then refund = refund_function() end\n\
             \x20 return refund(keys, args)\nend)\n"
        );
        Library {
            name,
            decide,
            decide_batch,
            refund,
            source,
        }
    }
}

/// One argument of the script: text, an integer sent in decimal, or a
/// limit (its [`LIMIT_FIELDS`] joined by `:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arg {
    Text(&'static str),
    Int(u64),
    Limit(LimitArgs),
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
pub struct LimitArgs {
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
pub const LIMIT_FIELDS: [Field<LimitArgs>; 9] = [
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

/// The integers of a decision's reply: the script packs them into one
/// string, each a signed 64-bit big-endian integer (one bulk reply to read,
/// where an array would make the client parse every integer as a value of
/// its own). Refuses anything else: an array, a length not a multiple of 8.
pub fn reply_integers(value: redis::Value) -> Result<Vec<i64>, Error> {
    let redis::Value::BulkString(bytes) = value else {
        return Err(Error::Protocol(format!(
            "unexpected script reply {value:?}: not a string"
        )));
    };
    let words = bytes.chunks_exact(8);
    if !words.remainder().is_empty() {
        return Err(Error::Protocol(format!(
            "unexpected script reply of {} bytes: not a multiple of 8",
            bytes.len()
        )));
    }
    Ok(words
        .map(|word| i64::from_be_bytes(word.try_into().unwrap_or_default()))
        .collect())
}

/// A decision's reply as its integers (see [`reply_integers`]), for
/// tools and tests that call the script themselves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyIntegers(pub Vec<i64>);

impl redis::FromRedisValue for ReplyIntegers {
    fn from_redis_value(value: redis::Value) -> Result<Self, redis::ParsingError> {
        reply_integers(value)
            .map(ReplyIntegers)
            .map_err(|err| err.to_string().into())
    }
}

/// Integers a request's reply starts with: allowed.
const REPLY_HEAD: usize = 1;

/// Integers per limit in the reply, after `allowed`: flags (has_room + 2 ×
/// consumed), remaining, reset_us. `remaining` is minus the overdraft
/// (`Outcome::overdraft`, units charged past the room) when there is one:
/// nothing remains then.
const REPLY_PER_LIMIT: usize = 3;

/// Integers a reply with receipts adds per limit: the receipt's at_us and
/// units, then the remaining and reset_us the limit reports if its request
/// is denied after all (see [`decode_provisional`]).
const RECEIPT_LEN: usize = 4;

/// ARGV of one call: the header's fields in the order of its table, then
/// one argument per limit.
pub fn argv(header: &HeaderArgs, limits: &[LimitArgs]) -> Vec<Arg> {
    let mut out = Vec::with_capacity(HEADER_FIELDS.len() + limits.len());
    out.extend(HEADER_FIELDS.iter().map(|field| (field.value)(header)));
    out.extend(limits.iter().copied().map(Arg::Limit));
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
impl ToRedisArgs for LimitArgs {
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
    let limits: Vec<LimitArgs> = checks.iter().map(|it| LimitArgs::of(&it.check)).collect();
    invocation.arg(argv(header, &limits));
    Ok(invocation)
}

/// Appends one request's ARGV to `cmd`: the header's fields, then every
/// limit's, each in the order of its table, written straight into the
/// command (no list of arguments built first).
pub fn write_request(cmd: &mut redis::Cmd, header: &HeaderArgs, limits: &[LimitArgs]) {
    for field in &HEADER_FIELDS {
        cmd.arg((field.value)(header));
    }
    for limit in limits {
        cmd.arg(limit);
    }
}

/// The first integer of a batch member's section when the script refused
/// or failed it; the next integer says why (see [`parse_batch_reply`]).
const REFUSED: i64 = -1;

/// Integers of a refused member's section: [`REFUSED`], then the reason.
const REFUSED_LEN: usize = 2;

/// Reads the reply of a batch whose requests had `sizes` limits each, in
/// order: one answer per request. A member's section is either its reply
/// (as [`parse_reply`] reads it) or, when the script refused or failed it
/// alone, two integers: [`REFUSED`] and the reason, `k` (>= 1) for bad
/// parameters of its limit `k`, 0 for a bad header, -1 for an error while
/// deciding it (a Redis error on one of its keys), `-1 - k` when the key of
/// its limit `k` holds a stored layout the script refuses to read
/// (docs/redis.md, "Stored layouts"). Such a member gets its
/// own [`Error::Protocol`]; the others keep their verdicts. Refuses a
/// reply of any other length or shape.
pub fn parse_batch_reply(
    reply: &[i64],
    sizes: &[usize],
) -> Result<Vec<Result<Verdict, Error>>, Error> {
    let bad = || {
        Error::Protocol(format!(
            "unexpected batch reply of {} integers",
            reply.len()
        ))
    };
    let mut rest = reply;
    let mut out = Vec::with_capacity(sizes.len());
    for &n_checks in sizes {
        if rest.first() == Some(&REFUSED) {
            let (section, after) = rest.split_at_checked(REFUSED_LEN).ok_or_else(bad)?;
            out.push(Err(refusal(section[1], n_checks).ok_or_else(bad)?));
            rest = after;
            continue;
        }
        let len = REPLY_HEAD + REPLY_PER_LIMIT * n_checks;
        let (section, after) = rest.split_at_checked(len).ok_or_else(bad)?;
        out.push(Ok(parse_reply(section, n_checks)?));
        rest = after;
    }
    if !rest.is_empty() {
        return Err(bad());
    }
    Ok(out)
}

/// The error of a batch member the script refused for `reason`; `None` for
/// a reason no script answers.
fn refusal(reason: i64, n_checks: usize) -> Option<Error> {
    let limit = |k: i64| {
        usize::try_from(k)
            .ok()
            .filter(|&k| (1..=n_checks).contains(&k))
    };
    let what = match reason {
        -1 => "failed while deciding it".to_owned(),
        0 => "bad request header".to_owned(),
        k if k > 0 => format!("bad parameters for limit {}", limit(k)?),
        k => format!(
            "the stored state of limit {} is in a layout this version does not read \
             (throttlegate: stored layout refused)",
            limit(-1 - k)?
        ),
    };
    Some(Error::Protocol(format!(
        "the decision script refused this request of its batch: {what}"
    )))
}

/// Reads `{allowed, (flags, remaining, reset_us)*n}`, flags being has_room
/// + 2 × consumed, remaining below 0 the overdraft negated.
pub fn parse_reply(reply: &[i64], n_checks: usize) -> Result<Verdict, Error> {
    let (verdict, _, _) = parse_limits(reply, n_checks, 0)?;
    Ok(verdict)
}

/// Reads the reply of a call made with [`HeaderArgs::receipts`] set:
/// `{taken, (flags, remaining, reset_us, at_us, units, denied_remaining,
/// denied_reset_us)*n}`: the group's outcomes as the request allowed
/// (`taken`: whether the group took what an allowed request takes, which
/// it does unless one of its enforcing limits has no room). One receipt
/// per check, in order; empty where nothing is to be given back (not
/// consumed, cost 0, charged always).
pub fn decode_reply_with_receipts(
    reply: &[i64],
    n_checks: usize,
) -> Result<(Verdict, Vec<Receipt>), Error> {
    let (verdict, _, receipts) = parse_limits(reply, n_checks, RECEIPT_LEN)?;
    Ok((verdict, receipts))
}

/// [`decode_reply_with_receipts`]'s reply as what each limit reports
/// either way, for [`crate::algorithms::settle`] to rule on the request;
/// and the receipts.
pub fn decode_provisional(
    reply: &[i64],
    n_checks: usize,
) -> Result<(Vec<Provisional>, Vec<Receipt>), Error> {
    let (verdict, denied, receipts) = parse_limits(reply, n_checks, RECEIPT_LEN)?;
    let provisional = verdict
        .outcomes
        .into_iter()
        .zip(denied)
        .map(|(if_allowed, if_denied)| Provisional {
            if_allowed,
            if_denied,
        })
        .collect();
    Ok((provisional, receipts))
}

/// The reply with `extra` integers after each limit's three: the verdict,
/// and with receipts, each limit's outcome if denied and its receipt.
fn parse_limits(
    reply: &[i64],
    n_checks: usize,
    extra: usize,
) -> Result<(Verdict, Vec<Outcome>, Vec<Receipt>), Error> {
    let bad = || Error::Protocol(format!("unexpected script reply {reply:?}"));
    let stride = REPLY_PER_LIMIT + extra;
    if reply.len() != REPLY_HEAD + stride * n_checks {
        return Err(bad());
    }
    let flag = |value: i64| match value {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(bad()),
    };
    let count = |value: i64| u64::try_from(value).map_err(|_| bad());
    let allowed = flag(reply[0])?;
    // has_room + 2 × consumed; consumed implies room.
    let flags = |value: i64| match value {
        0 => Ok((false, false)),
        1 => Ok((true, false)),
        3 => Ok((true, true)),
        _ => Err(bad()),
    };
    let mut outcomes = Vec::with_capacity(n_checks);
    let mut receipts = Vec::with_capacity(if extra > 0 { n_checks } else { 0 });
    let mut denied = Vec::with_capacity(receipts.capacity());
    // Units remaining, or minus the units charged past the room.
    let units_left = |value: i64| match u64::try_from(value) {
        Ok(remaining) => Ok((remaining, 0)),
        Err(_) => value.checked_neg().map(|it| (0, it as u64)).ok_or_else(bad),
    };
    for it in reply[REPLY_HEAD..].chunks_exact(stride) {
        let (has_room, consumed) = flags(it[0])?;
        let (remaining, overdraft) = units_left(it[1])?;
        outcomes.push(Outcome {
            has_room,
            consumed,
            remaining,
            overdraft,
            reset_us: count(it[2])?,
        });
        if extra > 0 {
            receipts.push(Receipt {
                at_us: count(it[3])?,
                units: count(it[4])?,
            });
            let (remaining, overdraft) = units_left(it[5])?;
            denied.push(Outcome {
                has_room,
                consumed: false,
                remaining,
                overdraft,
                reset_us: count(it[6])?,
            });
        }
    }
    Ok((Verdict { allowed, outcomes }, denied, receipts))
}

/// What one limit of an allowed request consumed, as the decision script
/// reported it: enough to take exactly that back, and only that. Opaque:
/// made by [`decode_reply_with_receipts`], spent by [`refund_args`].
///
/// Per algorithm (what `lua/refund.lua` reads): fixed window and sliding
/// window counter: the window's start and the cost; sliding log: the
/// member's score and the cost; token bucket and GCRA: the decision's time
/// and the cost × scale.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Receipt {
    at_us: u64,
    /// 0: nothing to give back.
    units: u64,
}

impl Receipt {
    /// The receipt of a limit that took nothing.
    pub const NONE: Receipt = Receipt { at_us: 0, units: 0 };

    /// Whether there is nothing to give back.
    pub fn is_empty(&self) -> bool {
        self.units == 0
    }
}

/// What a refund sends once, before the limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefundHeader {
    /// The service's time, or `None` for the server's: the same clock the
    /// decision used.
    pub now_us: Option<u64>,
}

/// One limit to refund as the script receives it: the limit's parameters
/// (those it was decided with) and its receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefundArgs {
    pub algorithm: &'static str,
    pub window_us: u64,
    pub capacity: u64,
    pub per_us: u64,
    pub scale: u64,
    pub receipt: Receipt,
}

impl RefundArgs {
    pub fn of(check: &Check, receipt: Receipt) -> RefundArgs {
        let params = &check.params;
        let rate = params.rate();
        RefundArgs {
            algorithm: params.algorithm().name(),
            window_us: params.window_us(),
            capacity: params.capacity(),
            per_us: rate.per_us,
            scale: rate.scale,
            receipt,
        }
    }
}

/// The refund's ARGV[1], in this order.
pub const REFUND_HEADER_FIELDS: [Field<RefundHeader>; 1] = [Field::new(
    "now_us",
    "now in µs since the Unix epoch (decimal), or \"\" for the server's TIME; the \
     decision's clock",
    |it| it.now_us.map_or(Arg::Text(""), Arg::Int),
)];

/// The fields of one limit of a refund, in this order, once per key after
/// the header.
pub const REFUND_FIELDS: [Field<RefundArgs>; 7] = [
    Field::new(
        "algorithm",
        "the algorithm's name (`Algorithm::name`)",
        |it| Arg::Text(it.algorithm),
    ),
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
        "at_us",
        "the receipt's time: the window's start (fixed window, sliding window \
         counter), the member's score (sliding log), the decision's effective time \
         (token bucket, GCRA)",
        |it| Arg::Int(it.receipt.at_us),
    ),
    Field::new(
        "units",
        "what was taken: the cost, or cost × scale for token bucket and GCRA; 0 \
         refunds nothing",
        |it| Arg::Int(it.receipt.units),
    ),
];

/// ARGV of one refund: the header's fields, then every limit's, each in
/// the order of its table.
pub fn refund_argv(header: &RefundHeader, limits: &[RefundArgs]) -> Vec<Arg> {
    let mut out =
        Vec::with_capacity(REFUND_HEADER_FIELDS.len() + REFUND_FIELDS.len() * limits.len());
    out.extend(
        REFUND_HEADER_FIELDS
            .iter()
            .map(|field| (field.value)(header)),
    );
    for limit in limits {
        out.extend(REFUND_FIELDS.iter().map(|field| (field.value)(limit)));
    }
    out
}

/// KEYS and ARGV of one refund.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefundCall {
    pub keys: Vec<String>,
    pub argv: Vec<Arg>,
}

/// KEYS and ARGV of the refund of one decided group: `checks` as they were
/// decided (same prefix, same order) and the receipts its reply gave.
/// Limits with an empty receipt are left out; `None` when nothing is to be
/// given back (no call needed).
pub fn refund_args(
    prefix: &str,
    header: &RefundHeader,
    checks: &[KeyedCheck],
    receipts: &[Receipt],
) -> Result<Option<RefundCall>, Error> {
    if checks.len() != receipts.len() {
        return Err(Error::Protocol(format!(
            "{} receipts for {} checks",
            receipts.len(),
            checks.len()
        )));
    }
    let (keys, limits): (Vec<String>, Vec<RefundArgs>) = checks
        .iter()
        .zip(receipts)
        .filter(|(_, receipt)| !receipt.is_empty())
        .map(|(it, receipt)| {
            (
                keys::encode(prefix, &it.key),
                RefundArgs::of(&it.check, *receipt),
            )
        })
        .unzip();
    if keys.is_empty() {
        return Ok(None);
    }
    Ok(Some(RefundCall {
        keys,
        argv: refund_argv(header, &limits),
    }))
}

/// The call of the refund script (from [`refund_script`]) for
/// [`refund_args`]; `None` when nothing is to be given back. Send it at
/// most once: never retry after a timeout.
pub fn refund_invocation<'a>(
    script: &'a redis::Script,
    prefix: &str,
    header: &RefundHeader,
    checks: &[KeyedCheck],
    receipts: &[Receipt],
) -> Result<Option<redis::ScriptInvocation<'a>>, Error> {
    let Some(call) = refund_args(prefix, header, checks, receipts)? else {
        return Ok(None);
    };
    let mut invocation = script.prepare_invoke();
    for key in call.keys {
        invocation.key(key);
    }
    invocation.arg(call.argv);
    Ok(Some(invocation))
}

/// Reads a refund's reply: per limit sent, the units given back (scaled for
/// token bucket and GCRA).
pub fn decode_refund_reply(reply: &[i64], n_limits: usize) -> Result<Vec<u64>, Error> {
    let bad = || Error::Protocol(format!("unexpected refund reply {reply:?}"));
    if reply.len() != n_limits {
        return Err(bad());
    }
    reply
        .iter()
        .map(|it| u64::try_from(*it).map_err(|_| bad()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::{Algorithm, LimitParams};

    /// The quoted names of the Lua table `local {name} = { ... }` in `source`.
    fn lua_table_in(source: &str, name: &str) -> Vec<String> {
        let start = format!("local {name} = {{");
        let (_, rest) = source
            .split_once(&start)
            .unwrap_or_else(|| panic!("the script declares {name}"));
        let (body, _) = rest.split_once('}').expect("the table closes");
        body.split(',')
            .map(str::trim)
            .filter(|it| !it.is_empty())
            .map(|it| it.trim_matches('\'').to_owned())
            .collect()
    }

    fn lua_table(name: &str) -> Vec<String> {
        lua_table_in(DECIDE_LUA, name)
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
    fn the_batch_layout_is_read_by_the_same_names() {
        assert_eq!(lua_table("BATCH_FIELDS"), names(&BATCH_FIELDS));
        assert_eq!(lua_table("REQUEST_FIELDS"), names(&REQUEST_FIELDS));
    }

    #[test]
    fn a_batch_reply_is_one_section_per_request() {
        let verdicts: Vec<_> = parse_batch_reply(&[1, 3, 3, 10, 0, 0, 0, 7, 1, 2, 9], &[1, 2])
            .unwrap()
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(verdicts.len(), 2);
        assert!(verdicts[0].allowed);
        assert!(!verdicts[1].allowed);
        assert!(verdicts[0].outcomes[0].consumed);
        assert!(verdicts[1].outcomes[1].has_room && !verdicts[1].outcomes[1].consumed);
        assert_eq!(verdicts[1].outcomes[1].remaining, 2);
        assert!(parse_batch_reply(&[1, 3, 3, 10], &[1, 1]).is_err());
        assert!(parse_batch_reply(&[1, 3, 3, 10, 1], &[1]).is_err());
    }

    #[test]
    fn a_refused_batch_member_gets_its_own_error_and_the_others_their_verdicts() {
        // Request 1 refused at its limit 2, request 2 decided, request 3
        // failed while deciding, request 4 refused at its header.
        let answers =
            parse_batch_reply(&[-1, 2, 1, 3, 4, 10, -1, -1, -1, 0], &[2, 1, 1, 3]).unwrap();
        assert_eq!(answers.len(), 4);
        let message = |it: &Result<Verdict, Error>| it.as_ref().unwrap_err().to_string();
        assert!(message(&answers[0]).contains("bad parameters for limit 2"));
        let verdict = answers[1].as_ref().unwrap();
        assert!(verdict.allowed);
        assert_eq!(verdict.outcomes[0].remaining, 4);
        assert!(message(&answers[2]).contains("failed while deciding"));
        assert!(message(&answers[3]).contains("bad request header"));
        // The key of its limit 2 holds a layout the script refuses.
        let answers = parse_batch_reply(&[-1, -3], &[2]).unwrap();
        assert!(message(&answers[0]).contains("stored state of limit 2 is in a layout"));
        // A reason no script answers, or a refusal cut short, is no reply.
        assert!(parse_batch_reply(&[-1, 3], &[2]).is_err());
        assert!(parse_batch_reply(&[-1, -3], &[1]).is_err());
        assert!(parse_batch_reply(&[-1], &[1]).is_err());
    }

    #[test]
    fn a_reply_is_read_as_signed_big_endian_64_bit_integers() {
        let mut packed = Vec::new();
        for value in [1_i64, 3, -2, 1_764_899_000_123_456] {
            packed.extend_from_slice(&value.to_be_bytes());
        }
        assert_eq!(
            reply_integers(redis::Value::BulkString(packed.clone())).unwrap(),
            [1, 3, -2, 1_764_899_000_123_456]
        );
        packed.pop();
        assert!(reply_integers(redis::Value::BulkString(packed)).is_err());
        // The integers an older script answered with are not read as a reply.
        let array = redis::Value::Array(vec![redis::Value::Int(1), redis::Value::Int(3)]);
        assert!(reply_integers(array).is_err());
        assert!(reply_integers(redis::Value::Nil).is_err());
    }

    #[test]
    fn the_library_is_named_by_its_digest_and_registers_each_entry() {
        let library = library();
        let digest = library.name.strip_prefix("throttlegate_").unwrap();
        assert_eq!(digest.len(), 12);
        assert!(digest.chars().all(|it| it.is_ascii_hexdigit()));
        assert!(
            library
                .source
                .starts_with(&format!("#!lua name={}\n", library.name))
        );
        for function in [&library.decide, &library.decide_batch, &library.refund] {
            assert!(function.ends_with(digest));
            assert!(
                library
                    .source
                    .contains(&format!("register_function('{function}'"))
            );
        }
    }

    #[test]
    fn the_refund_script_reads_the_fields_of_its_layout_in_order() {
        assert_eq!(
            lua_table_in(REFUND_LUA, "REFUND_HEADER_FIELDS"),
            names(&REFUND_HEADER_FIELDS)
        );
        assert_eq!(
            lua_table_in(REFUND_LUA, "REFUND_FIELDS"),
            names(&REFUND_FIELDS)
        );
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
            receipts: false,
        };
        let limit = LimitArgs::of(&check);
        let args = argv(&header, &[limit]);
        assert_eq!(
            args,
            [Arg::Text(""), Arg::Int(7), Arg::Int(0), Arg::Limit(limit)]
        );
        // A limit is one argument: its fields joined by ':'.
        let mut cmd = redis::Cmd::new();
        cmd.arg(args[3]);
        let written: Vec<_> = cmd
            .args_iter()
            .map(|it| match it {
                redis::Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
                _ => panic!("a limit is a plain argument"),
            })
            .collect();
        assert_eq!(
            written,
            [format!(
                "token_bucket:10:60000000:20:{}:{}:3:quota:if_allowed",
                rate.per_us, rate.scale
            )]
        );
    }

    #[test]
    fn replies_are_checked() {
        let verdict = parse_reply(&[1, 3, 3, 10], 1).unwrap();
        assert!(verdict.allowed);
        assert_eq!(
            verdict.outcomes[0],
            Outcome {
                has_room: true,
                consumed: true,
                remaining: 3,
                overdraft: 0,
                reset_us: 10
            }
        );
        let verdict = parse_reply(&[0, 1, 3, 10, 0, 0, 7], 2).unwrap();
        assert!(verdict.outcomes[0].has_room && !verdict.outcomes[0].consumed);
        assert!(!verdict.outcomes[1].has_room && !verdict.outcomes[1].consumed);
        assert!(parse_reply(&[1, 3, 3], 1).is_err());
        assert!(parse_reply(&[2, 3, 3, 10], 1).is_err());
        assert!(
            parse_reply(&[1, 2, 3, 10], 1).is_err(),
            "consumed without room"
        );
        assert!(parse_reply(&[1, 4, 3, 10], 1).is_err());
        // A negative remaining is the overdraft: nothing remains.
        let verdict = parse_reply(&[0, 0, -3, 10], 1).unwrap();
        assert_eq!(
            (verdict.outcomes[0].remaining, verdict.outcomes[0].overdraft),
            (0, 3)
        );
        assert!(parse_reply(&[0, 0, i64::MIN, 10], 1).is_err());
        assert!(parse_reply(&[1, 3, 3, -10], 1).is_err());
    }

    #[test]
    fn receipts_follow_each_limit_when_asked_for() {
        let (verdict, receipts) =
            decode_reply_with_receipts(&[1, 3, 3, 10, 40, 2, 5, 0, 1, 9, 0, 0, 0, 9, 0], 2)
                .unwrap();
        assert!(verdict.allowed);
        assert_eq!(verdict.outcomes[1].remaining, 9);
        assert_eq!(
            receipts,
            [
                Receipt {
                    at_us: 40,
                    units: 2,
                },
                Receipt::NONE
            ]
        );
        let (provisional, _) =
            decode_provisional(&[1, 3, 3, 10, 40, 2, 5, 0, 1, 9, 0, 0, 0, 9, 0], 2).unwrap();
        assert_eq!(provisional[0].if_denied.remaining, 5);
        assert!(!provisional[0].if_denied.consumed);
        assert_eq!(provisional[1].if_denied, provisional[1].if_allowed);
        assert!(decode_reply_with_receipts(&[1, 3, 3, 10], 1).is_err());
        assert!(decode_reply_with_receipts(&[1, 3, 3, 10, 40, -2, 3, 0], 1).is_err());
    }

    #[test]
    fn a_refund_sends_only_the_limits_with_something_to_give_back() {
        use crate::backends::{CounterKey, KeyEntry, KeyValue};
        let keyed = |window_s: u64| {
            let params = LimitParams::new(Algorithm::FixedWindow, 10, window_s * 1_000_000, None);
            KeyedCheck {
                key: CounterKey {
                    domain: "d".into(),
                    rule: "r".into(),
                    algorithm: Algorithm::FixedWindow,
                    window_s,
                    is_override: false,
                    entries: vec![KeyEntry {
                        key: "k".into(),
                        value: KeyValue::Value("v".into()),
                    }],
                },
                check: Check {
                    params: params.unwrap(),
                    cost: 2,
                    mode: Mode::Enforce,
                },
            }
        };
        let checks = [keyed(1), keyed(60)];
        let taken = Receipt {
            at_us: 60_000_000,
            units: 2,
        };
        let header = RefundHeader { now_us: Some(7) };
        let call = refund_args("tg", &header, &checks, &[Receipt::NONE, taken])
            .unwrap()
            .expect("one limit to refund");
        assert_eq!(call.keys, [keys::encode("tg", &checks[1].key)]);
        assert_eq!(
            call.argv,
            [
                Arg::Int(7),
                Arg::Text("fixed_window"),
                Arg::Int(60_000_000),
                Arg::Int(10),
                Arg::Int(1),
                Arg::Int(6_000_000),
                Arg::Int(60_000_000),
                Arg::Int(2),
            ]
        );
        let none = refund_args("tg", &header, &checks, &[Receipt::NONE, Receipt::NONE]);
        assert!(none.unwrap().is_none());
        assert!(refund_args("tg", &header, &checks, &[taken]).is_err());
    }
}
