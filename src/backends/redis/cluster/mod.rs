//! Redis Cluster backend: a request's counters grouped by hash slot, one
//! call of the decision script per group, the groups sent concurrently and
//! their verdicts merged in check order.
//!
//! The script touches only the keys it declares, and a script's keys must
//! share a slot (CROSSSLOT otherwise), hence the grouping. With
//! `--redis-hash-tag domain` every request is one group, so one call, and
//! the decision is as atomic as on a single server. A request over several
//! groups asks each for receipts: a group takes what an allowed request
//! takes (nothing when one of its enforcing limits has no room) and tells
//! what each limit reports either way; the request is ruled on by
//! `algorithms::settle`, the rules every backend follows (a quota limit
//! with room in one slot allows a request whose other quota limits are
//! full). If it is denied, or a group fails, what the groups took is
//! refunded (`lua/refund.lua`, see `script`'s "Refunds"), so a denied
//! request ends up consuming nothing but the charges of limits charged
//! always, and each limit reports what it has with nothing taken. Between
//! the decision and the refund the counters are only higher: a concurrent
//! request may be denied that would have passed, never allowed over a
//! limit.
//!
//! Routing is ours, not the client's: the cluster client is built with no
//! retries, because it retries after I/O errors and timeouts, when the
//! script may have run (counting a request twice). We follow only the
//! answers that prove the script did not run: MOVED (to the named node),
//! ASK (ASKING then the script, on the named node), NOSCRIPT or a missing
//! function (SCRIPT LOAD or FUNCTION LOAD on that node, then again: each
//! primary gets the library the first time it is called after a start, a
//! flush or a failover), and TRYAGAIN, CLUSTERDOWN, MASTERDOWN,
//! READONLY, LOADING or a node not connected (again after a short pause,
//! routed by slot on the refreshed map). All of it within one deadline.
//!
//! [`backend`] is the backend; [`routing`] groups a request's checks by
//! slot and routes one call; [`merge`] decides the groups and rules on the
//! request; [`refund`] gives back what a denied request's groups took;
//! [`nodes`] holds what every call shares; [`settings`] the flags and
//! clients.
//!
//! Invariant: a request is never counted twice: a call is sent again only
//! after an answer that proves it did not run, and a request over several
//! slots that is not allowed consumes nothing once its refunds ran.

mod backend;
mod merge;
mod nodes;
mod refund;
mod routing;
mod settings;

pub use self::backend::ClusterBackend;
pub use self::settings::ClusterSettings;
