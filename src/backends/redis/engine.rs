//! How a call of our Lua reaches a server: FCALL of the function library
//! where the server has functions (Redis 7), EVALSHA of the same code as
//! scripts where it has not (Redis 6), and the one retry after the server
//! said it does not have the code.
//!
//! Which of the two a server speaks is found once per connection (or per
//! cluster), by loading the library: FUNCTION LOAD answered (or "already
//! exists") means functions; an unknown command (Redis 6, or FUNCTION
//! renamed away) means scripts on a cluster. The engine is then settled
//! per command, on a single server ([`run_adapting`]) as on each node of a
//! cluster (`cluster::routing`): with FUNCTION refused, FCALL is still tried (the
//! library may be there already, loaded by an operator or replicated), and
//! a server that refuses FCALL (unknown, renamed away, or refused by ACL),
//! or lacks the library and refuses to load it, gets the same call as
//! EVALSHA; the connection (or the cluster slot) then keeps to scripts.
//!
//! A missing function (`ERR Function not found`: after a restart, FLUSHALL
//! or FUNCTION FLUSH, a failover to a node that never saw it) and a
//! missing script (NOSCRIPT) prove the call did not run: the code is
//! loaded and the call sent once more. Nothing else is ever retried here;
//! after a timeout or a dropped connection the call may have run.
//!
//! Invariant: a call is sent again only after an answer that proves it did
//! not run.

use std::future::Future;

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, ServerErrorKind, Value};

use super::script::{self, DECIDE_BATCH_LUA, DECIDE_LUA, REFUND_LUA};

/// How a server runs our code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// FUNCTION LOAD once, FCALL per call.
    Functions,
    /// SCRIPT LOAD when missing, EVALSHA per call.
    Scripts,
}

/// Which of our entry points a call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LuaEntry {
    /// One request ([`script::HEADER_FIELDS`], [`script::LIMIT_FIELDS`]).
    Decide,
    /// Several requests ([`script::BATCH_FIELDS`]).
    DecideBatch,
    /// A refund ([`script::REFUND_HEADER_FIELDS`], [`script::REFUND_FIELDS`]).
    Refund,
}

/// Room reserved in a command per key: the key and one limit's fields.
const BYTES_PER_KEY: usize = 160;

/// The scripts by entry, made once: `redis::Script` hashes the text.
fn scripts() -> &'static [redis::Script; 3] {
    static SCRIPTS: std::sync::LazyLock<[redis::Script; 3]> = std::sync::LazyLock::new(|| {
        [
            redis::Script::new(DECIDE_LUA),
            redis::Script::new(DECIDE_BATCH_LUA),
            redis::Script::new(REFUND_LUA),
        ]
    });
    &SCRIPTS
}

impl LuaEntry {
    fn script(self) -> &'static redis::Script {
        &scripts()[self as usize]
    }

    fn lua(self) -> &'static str {
        match self {
            LuaEntry::Decide => DECIDE_LUA,
            LuaEntry::DecideBatch => DECIDE_BATCH_LUA,
            LuaEntry::Refund => REFUND_LUA,
        }
    }

    fn function(self) -> &'static str {
        let library = script::library();
        match self {
            LuaEntry::Decide => &library.decide,
            LuaEntry::DecideBatch => &library.decide_batch,
            LuaEntry::Refund => &library.refund,
        }
    }
}

impl Engine {
    /// The start of a call of `entry` over `n_keys` keys: `FCALL name n`
    /// or `EVALSHA sha n`; the caller adds the keys, then the arguments.
    /// Sized for a decision's keys and arguments, so that writing them
    /// does not grow the command step by step.
    pub fn command(self, entry: LuaEntry, n_keys: usize) -> Cmd {
        let (name, target) = match self {
            Engine::Functions => ("FCALL", entry.function()),
            Engine::Scripts => ("EVALSHA", entry.script().get_hash()),
        };
        let args = 3 + script::HEADER_FIELDS.len() + n_keys.saturating_mul(2);
        let bytes = 32 + target.len() + n_keys.saturating_mul(BYTES_PER_KEY);
        let mut cmd = Cmd::with_capacity(args, bytes);
        cmd.arg(name).arg(target).arg(n_keys);
        cmd
    }

    /// The command that gives a server the code of `entry`.
    pub fn load_command(self, entry: LuaEntry) -> Cmd {
        match self {
            Engine::Functions => library_load(),
            Engine::Scripts => {
                let mut cmd = redis::cmd("SCRIPT");
                cmd.arg("LOAD").arg(entry.lua());
                cmd
            }
        }
    }

    /// Reads the answer to [`Engine::load_command`]: loaded, or already
    /// there (another replica of the service loaded it first).
    pub fn loaded(res: RedisResult<Value>) -> RedisResult<()> {
        match res.and_then(Value::extract_error) {
            Ok(_) => Ok(()),
            Err(err) if already_exists(&err) => Ok(()),
            Err(err) => Err(err),
        }
    }

    /// Which engine the server behind `conn` speaks, found by loading the
    /// library (so a server with functions has it loaded afterwards). An
    /// error other than those that mean "no functions here" is returned
    /// and nothing is decided: the next call asks again.
    pub async fn detect(conn: &mut impl ConnectionLike) -> RedisResult<Engine> {
        let res = conn.req_packed_command(&library_load()).await;
        Engine::from_load(res)
    }

    /// The engine a FUNCTION LOAD's answer shows.
    pub fn from_load(res: RedisResult<Value>) -> RedisResult<Engine> {
        match Engine::loaded(res) {
            Ok(()) => Ok(Engine::Functions),
            Err(err) if lacks_functions(&err) => Ok(Engine::Scripts),
            Err(err) => Err(err),
        }
    }
}

/// FUNCTION LOAD of the library.
pub fn library_load() -> Cmd {
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg(&script::library().source);
    cmd
}

/// What a single-server connection knows of how its server runs our code:
/// the engine found by loading the library, and whether a refusal since
/// moved it to scripts for good. Shared by the clones of a connection.
#[derive(Debug, Default)]
pub struct Learnt {
    detected: tokio::sync::OnceCell<Engine>,
    scripts_only: std::sync::atomic::AtomicBool,
}

impl Learnt {
    /// The engine to start a call with: found once by `detect` (FUNCTION
    /// LOAD; a refusal still tries FCALL), unless a call has since shown
    /// that only scripts work here.
    pub async fn engine<F>(&self, detect: F) -> RedisResult<Engine>
    where
        F: Future<Output = RedisResult<Engine>>,
    {
        if self.scripts_only.load(std::sync::atomic::Ordering::Relaxed) {
            return Ok(Engine::Scripts);
        }
        self.detected.get_or_try_init(|| detect).await.copied()
    }

    /// Remembers the engine a call ended up answered by.
    fn settle(&self, engine: Engine) {
        if engine == Engine::Scripts {
            self.scripts_only
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The engine of a single server from its answer to FUNCTION LOAD: a
/// refusal (no FUNCTION command, or not allowed) still means functions,
/// to try FCALL with: the library may be loaded already. See
/// [`run_adapting`] for what follows when it is not.
pub fn from_load_on_server(res: RedisResult<Value>) -> RedisResult<Engine> {
    match Engine::loaded(res) {
        Ok(()) => Ok(Engine::Functions),
        Err(err) if lacks_functions(&err) => Ok(Engine::Functions),
        Err(err) => Err(err),
    }
}

/// The engine a Cluster's calls start with from a primary's answer to
/// FUNCTION LOAD: a refusal by ACL still means functions (the library may
/// be loaded, as on a single server), an unknown command (before Redis 7,
/// or renamed away) scripts. Either way a node refusing what it is sent
/// gets EVALSHA for its slots (`cluster::routing`).
pub fn from_load_on_cluster(res: RedisResult<Value>) -> RedisResult<Engine> {
    match Engine::loaded(res) {
        Ok(()) => Ok(Engine::Functions),
        Err(err) if err.code() == Some("NOPERM") => Ok(Engine::Functions),
        Err(err) if lacks_functions(&err) => Ok(Engine::Scripts),
        Err(err) => Err(err),
    }
}

/// [`run`] on a single server whose engine is `learnt`: `cmd` (made by
/// `engine.command(entry, ..)`) is sent as it is; when the server refuses
/// FCALL itself (unknown or not allowed) or lacks the library and cannot
/// load it, the same call is sent as EVALSHA, and the connection keeps to
/// scripts. Each refusal proves the call did not run, so nothing runs
/// twice.
pub async fn run_adapting(
    conn: &mut impl ConnectionLike,
    learnt: &Learnt,
    engine: Engine,
    entry: LuaEntry,
    cmd: &Cmd,
) -> RedisResult<Value> {
    if engine == Engine::Scripts {
        return run(conn, engine, entry, cmd).await;
    }
    let refused = match conn
        .req_packed_command(cmd)
        .await
        .and_then(Value::extract_error)
    {
        Err(err) if lacks_functions(&err) => err,
        Err(err) if is_missing_code(&err) => {
            match Engine::loaded(conn.req_packed_command(&library_load()).await) {
                Ok(()) => {
                    return conn
                        .req_packed_command(cmd)
                        .await
                        .and_then(Value::extract_error);
                }
                Err(err) if lacks_functions(&err) => err,
                Err(err) => return Err(err),
            }
        }
        res => return res,
    };
    tracing::info!(
        "redis cannot run the function library here ({refused}): deciding with EVALSHA \
         on this connection"
    );
    learnt.settle(Engine::Scripts);
    run(conn, Engine::Scripts, entry, &as_script(cmd, entry)).await
}

/// `cmd`, an FCALL of `entry`, as the EVALSHA of the same code with the
/// same keys and arguments.
pub fn as_script(cmd: &Cmd, entry: LuaEntry) -> Cmd {
    let mut script = Cmd::with_capacity(cmd.args_iter().len(), 64);
    script.arg("EVALSHA").arg(entry.script().get_hash());
    for arg in cmd.args_iter().skip(2) {
        if let redis::Arg::Simple(bytes) = arg {
            script.arg(bytes);
        }
    }
    script
}

/// The library names in a `FUNCTION LIST` reply (RESP2: each library a flat
/// list of field names and values; RESP3: a map).
pub fn library_names(listed: &Value) -> Vec<String> {
    let Value::Array(libraries) = listed else {
        return Vec::new();
    };
    let name_in = |fields: Vec<(&Value, &Value)>| {
        fields.into_iter().find_map(|(field, value)| {
            let field = String::from_redis_value_ref(field).ok()?;
            (field == "library_name")
                .then(|| String::from_redis_value_ref(value).ok())
                .flatten()
        })
    };
    libraries
        .iter()
        .filter_map(|library| match library {
            Value::Array(flat) => name_in(
                flat.chunks(2)
                    .filter_map(|it| Some((it.first()?, it.get(1)?)))
                    .collect(),
            ),
            Value::Map(pairs) => name_in(pairs.iter().map(|(k, v)| (k, v)).collect()),
            _ => None,
        })
        .collect()
}

/// Whether `name` is the name of a library of some version of the
/// service: `throttlegate_` and a hex digest of its code.
pub fn is_library_name(name: &str) -> bool {
    name.strip_prefix("throttlegate_")
        .is_some_and(|digest| !digest.is_empty() && digest.bytes().all(|it| it.is_ascii_hexdigit()))
}

/// Sends `cmd` (made by `engine.command(entry, ..)`); when the server lacks
/// the code, loads it and sends `cmd` once more.
pub async fn run(
    conn: &mut impl ConnectionLike,
    engine: Engine,
    entry: LuaEntry,
    cmd: &Cmd,
) -> RedisResult<Value> {
    match conn
        .req_packed_command(cmd)
        .await
        .and_then(Value::extract_error)
    {
        Err(err) if is_missing_code(&err) => {
            Engine::loaded(conn.req_packed_command(&engine.load_command(entry)).await)?;
            conn.req_packed_command(cmd)
                .await
                .and_then(Value::extract_error)
        }
        res => res,
    }
}

/// NOSCRIPT, or a function the server does not have: the call did not run.
pub fn is_missing_code(err: &RedisError) -> bool {
    matches!(err.kind(), ErrorKind::Server(ServerErrorKind::NoScript))
        || (err.code() == Some("ERR")
            && err
                .detail()
                .is_some_and(|it| it.starts_with("Function not found")))
}

/// FUNCTION LOAD refused because that very library is loaded.
fn already_exists(err: &RedisError) -> bool {
    err.detail().is_some_and(|it| it.contains("already exists"))
}

/// The server has no FUNCTION command (before Redis 7, or renamed away),
/// or this user may not use it.
pub fn lacks_functions(err: &RedisError) -> bool {
    let unknown = err.code() == Some("ERR")
        && err
            .detail()
            .is_some_and(|it| it.to_ascii_lowercase().starts_with("unknown command"));
    unknown || err.code() == Some("NOPERM")
}

#[cfg(test)]
mod tests;
