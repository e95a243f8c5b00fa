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
//!
//! [`library`] holds the code; [`arguments`] the decision's layout and a
//! request's encoding; [`reply`] the decoding of a decision's reply;
//! [`refund`] the refund's layout and reply.
//!
//! Invariant: the field tables here and the Lua read the same names in
//! the same order (a test holds each pair alike).

mod arguments;
mod library;
mod refund;
mod reply;

pub use self::arguments::{
    Arg, BATCH_FIELDS, Field, HEADER_FIELDS, HeaderArgs, LIMIT_FIELDS, REQUEST_FIELDS, ScriptLimit,
    argv, invocation, request_keys, write_request,
};
pub use self::library::{
    DECIDE_BATCH_LUA, DECIDE_LUA, Library, REFUND_LUA, library, refund_script,
};
pub use self::refund::{
    REFUND_FIELDS, REFUND_HEADER_FIELDS, Receipt, RefundArgs, RefundCall, RefundHeader,
    decode_refund_reply, refund_args, refund_argv, refund_invocation,
};
pub use self::reply::{
    ReplyIntegers, decode_provisional, decode_reply_with_receipts, parse_batch_reply, parse_reply,
    reply_integers,
};

#[cfg(test)]
mod tests;
