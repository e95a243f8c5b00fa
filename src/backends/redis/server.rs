//! Calls to one Redis server (directly or behind Sentinel): its
//! connections, its gate, and one request decided in a call of its own.
//!
//! Invariant: every decision goes the one path of [`call`](super::call), and
//! its command is made at the moment it is written, never earlier.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use redis::Cmd;
use tokio::time::{Instant, timeout_at};

use super::call::{CallTerms, CountLate, LateReply, in_time_or_heard};
use super::connections::ServerConnections;
use super::engine::{self, Engine, LuaEntry};
use super::gate::{self, Gate, Written};
use super::script::{self, HeaderArgs, ScriptLimit};
use crate::algorithms::Verdict;
use crate::backends::{CallContext, Error, Stage};

/// One request, encoded: its keys, header and limits.
pub(super) struct Encoded {
    pub(super) keys: Vec<String>,
    pub(super) header: HeaderArgs,
    pub(super) limits: Vec<ScriptLimit>,
}

/// What sends calls to one server: one per pool of connections (the
/// shared runtime's, and one per serving thread).
pub(super) struct SingleServer {
    pub(super) connections: ServerConnections,
    /// Bounds the calls sent and waiting toward Redis (see `gate`).
    pub(super) gate: Gate,
    pub(super) timeout: Duration,
    pub(super) timeout_ms: u64,
    pub(super) redacted_url: String,
}

impl SingleServer {
    /// One call of `entry` on `terms` (see [`call`](super::call)), the
    /// command made by `compose` at the moment it would be written (it may
    /// refuse: nothing is written, and its error returned); the reply's
    /// integers. Loads the code and sends again only when the server says
    /// it lacks it (the call did not run). `report` hears the stages
    /// before the call is written; `compose` reports [`Stage::Backend`]
    /// for what it writes.
    pub(super) async fn call<L: LateReply>(
        &self,
        terms: CallTerms<L>,
        report: impl Fn(Stage),
        entry: LuaEntry,
        compose: impl FnOnce(Engine) -> Result<Cmd, Error>,
    ) -> Result<Vec<i64>, Error> {
        // Whether the checkout ended before the time did: a slow engine is
        // a timeout, a slow checkout a missing connection.
        let checked_out = AtomicBool::new(false);
        // One timer for the checkout and the engine: both are usually ready
        // at once, and a timer is only registered when they are not.
        let ready = async {
            let conn = self.connections.connection().await?;
            checked_out.store(true, Ordering::Relaxed);
            match conn.engine().await {
                Ok(engine) => Ok((conn, engine)),
                Err(err) => Err(self.connections.fail(&conn, &err)),
            }
        };
        let too_slow = || match checked_out.load(Ordering::Relaxed) {
            true => Error::Timeout(self.timeout_ms),
            false => self.connections.checkout_timeout(),
        };
        let (permit, (conn, engine)) = terms
            .open(&self.gate, self.timeout_ms, report, ready, too_slow)
            .await?;
        let cmd = compose(engine)?;
        let mut multiplexed = conn.conn.clone();
        let learnt = conn.engine.clone();
        let reply = async move {
            engine::run_adapting(&mut multiplexed, &learnt, engine, entry, &cmd).await
        };
        let written = Written::new(
            permit,
            reply,
            Some(conn.lost_flag()),
            gate::UNANSWERED_AFTER,
        );
        let replied = terms.reply(written).await;
        match in_time_or_heard(replied, terms.late, self.timeout_ms)? {
            Ok(value) => script::reply_integers(value),
            Err(err) => Err(self.connections.fail(&conn, &err)),
        }
    }

    /// One request in a call of its own, due within the timeout.
    pub(super) async fn decide_one(
        &self,
        request: &Encoded,
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        self.decide_one_by(Instant::now() + self.timeout, request, call)
            .await
    }

    /// One request in a call of its own, due by `answer_by` (and sent only
    /// before its caller's `send_by`).
    pub(super) async fn decide_one_by(
        &self,
        answer_by: Instant,
        request: &Encoded,
        call: &CallContext,
    ) -> Result<Verdict, Error> {
        let n_keys = request.keys.len();
        let late = call.late.clone().map(|late| CountLate::new(late, n_keys));
        let send_by = call.send_by.map(Instant::from_std);
        let terms = CallTerms::new(answer_by, self.timeout, send_by, late);
        let report = |stage| call.progress.set(stage);
        let compose = |engine: Engine| {
            if !call.progress.enter_backend() {
                // Its caller has gone: nobody would read the answer.
                return Err(Error::Deadline);
            }
            let mut cmd = engine.command(LuaEntry::Decide, n_keys);
            cmd.arg(&request.keys);
            script::write_request(&mut cmd, &request.header, &request.limits);
            Ok(cmd)
        };
        let reply = self.call(terms, report, LuaEntry::Decide, compose).await?;
        script::parse_reply(&reply, n_keys)
    }

    /// The names of the libraries of other versions of the service
    /// (`throttlegate_<digest>`, with another digest than this version's)
    /// on the server, within the timeout.
    pub(super) async fn other_libraries(&self) -> Result<Vec<String>, Error> {
        let deadline = Instant::now() + self.timeout;
        let conn = timeout_at(deadline, self.connections.connection())
            .await
            .map_err(|_| self.connections.checkout_timeout())??;
        let mut multiplexed = conn.conn.clone();
        let mut list = redis::cmd("FUNCTION");
        list.arg("LIST").arg("LIBRARYNAME").arg("throttlegate_*");
        let listed: redis::Value =
            match timeout_at(deadline, list.query_async(&mut multiplexed)).await {
                Err(_) => return Err(Error::Timeout(self.timeout_ms)),
                Ok(res) => res.map_err(|err| self.connections.fail(&conn, &err))?,
            };
        let ours = &script::library().name;
        Ok(engine::library_names(&listed)
            .into_iter()
            .filter(|name| name != ours && engine::is_library_name(name))
            .collect())
    }
}
