//! The refund's arguments ([`REFUND_HEADER_FIELDS`], [`REFUND_FIELDS`]),
//! built from the receipts of a decision, and its reply (see the
//! `script` module's "Refunds").
//!
//! Invariant: only limits whose receipt says they consumed are sent, so
//! a refund never gives back what its request did not take.

use super::arguments::{Arg, Field};
use crate::algorithms::Check;
use crate::backends::keys;
use crate::backends::{Error, KeyedCheck};

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
    pub(super) at_us: u64,
    /// 0: nothing to give back.
    pub(super) units: u64,
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
