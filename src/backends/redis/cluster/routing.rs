//! Routing by hash slot: a request's checks grouped by the slot of their
//! keys, and one call to a slot's primary that follows only the answers
//! proving the script did not run (see the `cluster` module doc), all of
//! it within the call's terms.
//!
//! Invariant: an attempt is sent again only after an answer that proves
//! it did not run, never after a timeout or a lost connection; a
//! decision's attempt is never written after its `send_by`.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, Slot, SlotAddr};
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::{sleep, timeout_at};

use super::super::call::{CallTerms, Replied};
use super::super::engine::{self, Engine, LuaEntry};
use super::super::failure::classify;
use super::super::gate::{self, Written};
use super::nodes::{Cluster, single};
use crate::backends::{Error, KeyedCheck};

/// Most redirects (MOVED, ASK, NOSCRIPT) of one call in a row: each
/// follows an answer that proves the script did not run, so the bound only
/// stops a loop between nodes that disagree.
const MAX_REDIRECTS: usize = 8;

/// Pause before routing again after TRYAGAIN, CLUSTERDOWN and the like,
/// while the client refreshes its slot map.
const REROUTE_PAUSE: Duration = Duration::from_millis(20);

/// Where one attempt of a group's call goes.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Destination {
    /// The primary serving the slot, as the client's map says.
    Slot(Slot),
    /// The node a MOVED named.
    Moved(String, u16),
    /// The node an ASK named: ASKING first.
    Ask(String, u16),
}

/// The checks of one slot, by their positions in the request.
#[derive(Clone)]
pub(super) struct Group {
    pub(super) slot: Slot,
    pub(super) positions: Vec<usize>,
    pub(super) keys: Vec<String>,
}
/// A decision's attempt that got no reply by its `answer_by`, holding a
/// share of its request's place in the gate until the reply comes.
pub(super) type LateAttempt = Written<RedisResult<Value>, Arc<OwnedSemaphorePermit>>;

/// Why a routed call has no reply.
pub(super) enum Unanswered {
    /// It failed (or was never written): the classified error.
    Failed(Error),
    /// A decision's attempt still on its way at its `answer_by`.
    Late(LateAttempt),
}

impl From<Error> for Unanswered {
    fn from(err: Error) -> Unanswered {
        Unanswered::Failed(err)
    }
}

impl Cluster {
    /// The checks grouped by slot, groups in the order of their first check.
    /// Refuses a request naming one counter twice.
    pub(super) fn groups(&self, checks: &[KeyedCheck]) -> Result<Vec<Group>, Error> {
        let mut seen = HashSet::with_capacity(checks.len());
        let mut groups: Vec<Group> = Vec::new();
        for (position, check) in checks.iter().enumerate() {
            let key = self.keys.encode(&check.key);
            if !seen.insert(key.clone()) {
                return Err(Error::Protocol(format!(
                    "counter {key} appears twice in one request"
                )));
            }
            let slot = Slot::for_key(key.as_bytes());
            match groups.iter_mut().find(|it| it.slot == slot) {
                Some(group) => {
                    group.positions.push(position);
                    group.keys.push(key);
                }
                None => groups.push(Group {
                    slot,
                    positions: vec![position],
                    keys: vec![key],
                }),
            }
        }
        Ok(groups)
    }

    /// Runs the script command, following only the answers that prove it
    /// did not run (see the `cluster` module doc); at most
    /// [`MAX_REDIRECTS`] redirects or loads in a row without a pause. With
    /// a `decision` (its terms, and its request's place in the gate), no
    /// attempt (the first, or one after a redirect, a load or a pause) is
    /// written once its `send_by` has passed, and each written attempt
    /// holds a share of the place until its reply comes; one unanswered at
    /// `answer_by` is handed back ([`Unanswered::Late`]).
    ///
    /// The engine is settled per node, as on a single server: an FCALL the
    /// node refuses (unknown, renamed away, or not allowed), or one that
    /// finds no library where FUNCTION LOAD is refused, is sent again as
    /// EVALSHA, and the slot keeps to scripts.
    pub(super) async fn route<L>(
        &self,
        conn: &mut ClusterConnection,
        (mut engine, entry): (Engine, LuaEntry),
        cmd: &Cmd,
        slot: Slot,
        decision: Option<(&CallTerms<L>, &Arc<OwnedSemaphorePermit>)>,
    ) -> Result<Value, Unanswered> {
        let mut target = Destination::Slot(slot);
        let mut redirects = 0;
        let mut as_script = None;
        loop {
            if let Some((terms, _)) = decision {
                terms.still_sendable()?;
            }
            let sent = as_script.as_ref().unwrap_or(cmd);
            let replied = match decision {
                Some((terms, place)) => {
                    let (mut conn, sent, target) = (conn.clone(), sent.clone(), target.clone());
                    let reply = async move { attempt(&mut conn, &sent, &target).await };
                    let written = Written::new(place.clone(), reply, None, gate::UNANSWERED_AFTER);
                    match terms.reply(written).await {
                        Replied::InTime(reply) => reply,
                        Replied::Late(written) => return Err(Unanswered::Late(written)),
                    }
                }
                None => attempt(conn, sent, &target).await,
            };
            let err = match replied {
                Ok(value) => return Ok(value),
                Err(err) => err,
            };
            let mut step = next_step(&err);
            if engine == Engine::Functions && engine::lacks_functions(&err) {
                step = Next::Scripts;
            }
            if matches!(step, Next::Load | Next::Scripts | Next::Go(_)) {
                redirects += 1;
                if redirects > MAX_REDIRECTS {
                    return Err(classify(&err, self.timeout_ms).into());
                }
            }
            target = match step {
                Next::Load => match bounded(decision, self.load(conn, (engine, entry), &target))
                    .await
                    .ok_or(Unanswered::Failed(Error::Timeout(self.timeout_ms)))?
                {
                    Err(err) if engine == Engine::Functions && engine::lacks_functions(&err) => {
                        self.keep_to_scripts(slot, &err);
                        engine = Engine::Scripts;
                        as_script = Some(engine::as_script(cmd, entry));
                        target
                    }
                    res => {
                        res.map_err(|err| Unanswered::from(classify(&err, self.timeout_ms)))?;
                        target
                    }
                },
                Next::Scripts => {
                    self.keep_to_scripts(slot, &err);
                    engine = Engine::Scripts;
                    as_script = Some(engine::as_script(cmd, entry));
                    target
                }
                Next::Go(next) => next,
                Next::Pause => {
                    redirects = 0;
                    bounded(decision, sleep(REROUTE_PAUSE))
                        .await
                        .ok_or(Unanswered::Failed(Error::Timeout(self.timeout_ms)))?;
                    Destination::Slot(slot)
                }
                Next::Fail => return Err(classify(&err, self.timeout_ms).into()),
            };
        }
    }

    /// SCRIPT LOAD or FUNCTION LOAD of `code` on the node `target` names.
    async fn load(
        &self,
        conn: &mut ClusterConnection,
        (engine, entry): (Engine, LuaEntry),
        target: &Destination,
    ) -> RedisResult<()> {
        let cmd = engine.load_command(entry);
        let routing = match target {
            Destination::Slot(slot) => single(Route::with_slot(*slot, SlotAddr::Master)),
            Destination::Moved(host, port) | Destination::Ask(host, port) => {
                by_address(host, *port)
            }
        };
        Engine::loaded(conn.route_command(cmd, routing).await)
    }
}
/// What to do after a failed attempt.
enum Next {
    /// NOSCRIPT or a missing function: load the code on that node, then
    /// the same target again.
    Load,
    /// FCALL refused by the node: the same call as EVALSHA, same target.
    Scripts,
    /// MOVED or ASK: the node named.
    Go(Destination),
    /// The script did not run and the slot's owner may be changing.
    Pause,
    /// The script may have run, or it can never succeed: no retry.
    Fail,
}

fn next_step(err: &RedisError) -> Next {
    let named = || {
        err.redirect_node().and_then(|(addr, _)| {
            let (host, port) = addr.rsplit_once(':')?;
            Some((host.to_owned(), port.parse::<u16>().ok()?))
        })
    };
    if engine::is_missing_code(err) {
        return Next::Load;
    }
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => named().map_or(Next::Pause, |(host, port)| {
            Next::Go(Destination::Moved(host, port))
        }),
        ErrorKind::Server(ServerErrorKind::Ask) => named().map_or(Next::Pause, |(host, port)| {
            Next::Go(Destination::Ask(host, port))
        }),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly
            | ServerErrorKind::BusyLoading,
        )
        | ErrorKind::ClusterConnectionNotFound => Next::Pause,
        _ => Next::Fail,
    }
}

/// One attempt on one node; a server error reply is an `Err`.
async fn attempt(
    conn: &mut ClusterConnection,
    cmd: &Cmd,
    target: &Destination,
) -> RedisResult<Value> {
    match target {
        Destination::Slot(slot) => {
            let routing = single(Route::with_slot(*slot, SlotAddr::Master));
            conn.route_command(cmd.clone(), routing)
                .await
                .and_then(Value::extract_error)
        }
        Destination::Moved(host, port) => conn
            .route_command(cmd.clone(), by_address(host, *port))
            .await
            .and_then(Value::extract_error),
        Destination::Ask(host, port) => {
            let mut pipe = redis::pipe();
            pipe.cmd("ASKING").add_command(cmd.clone());
            let routing = SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            };
            let values = conn.route_pipeline(pipe, 1, 1, routing).await?;
            values
                .into_iter()
                .next()
                .ok_or_else(|| RedisError::from((ErrorKind::Parse, "empty reply to ASKING")))
                .and_then(Value::extract_error)
        }
    }
}

fn by_address(host: &str, port: u16) -> RoutingInfo {
    RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port,
    })
}

/// `wait`, ended by a decision's `answer_by` (`None` then); a refund's
/// waits are bounded by its caller.
async fn bounded<L, T>(
    decision: Option<(&CallTerms<L>, &Arc<OwnedSemaphorePermit>)>,
    wait: impl std::future::Future<Output = T>,
) -> Option<T> {
    match decision {
        Some((terms, _)) => timeout_at(terms.answer_by, wait).await.ok(),
        None => Some(wait.await),
    }
}
