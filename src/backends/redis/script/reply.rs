//! The decision's replies: the integers a call answers, one request's
//! verdict, a batch's answers, and the receipts a request over several
//! Cluster slots asks for.
//!
//! Invariant: a reply of an unexpected shape is an [`Error::Protocol`],
//! never a verdict.

use super::refund::Receipt;
use crate::algorithms::{Outcome, Provisional, Verdict};
use crate::backends::Error;

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
