//! How a call of our Lua reaches a server: FCALL of the function library
//! where the server has functions (Redis 7), EVALSHA of the same code as
//! scripts where it has not (Redis 6), and the one retry after the server
//! said it does not have the code.
//!
//! Which of the two a server speaks is found once per connection (or per
//! cluster), by loading the library: FUNCTION LOAD answered (or "already
//! exists") means functions; an unknown command (Redis 6, or FUNCTION
//! renamed away) or a refusal by ACL means scripts.
//!
//! A missing function (`ERR Function not found`: after a restart, FLUSHALL
//! or FUNCTION FLUSH, a failover to a node that never saw it) and a
//! missing script (NOSCRIPT) prove the call did not run: the code is
//! loaded and the call sent once more. Nothing else is ever retried here;
//! after a timeout or a dropped connection the call may have run.

use redis::aio::ConnectionLike;
use redis::{Cmd, ErrorKind, RedisError, RedisResult, ServerErrorKind, Value};

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
pub enum Entry {
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

impl Entry {
    fn script(self) -> &'static redis::Script {
        &scripts()[self as usize]
    }

    fn lua(self) -> &'static str {
        match self {
            Entry::Decide => DECIDE_LUA,
            Entry::DecideBatch => DECIDE_BATCH_LUA,
            Entry::Refund => REFUND_LUA,
        }
    }

    fn function(self) -> &'static str {
        let library = script::library();
        match self {
            Entry::Decide => &library.decide,
            Entry::DecideBatch => &library.decide_batch,
            Entry::Refund => &library.refund,
        }
    }
}

impl Engine {
    /// The start of a call of `entry` over `n_keys` keys: `FCALL name n`
    /// or `EVALSHA sha n`; the caller adds the keys, then the arguments.
    /// Sized for a decision's keys and arguments, so that writing them
    /// does not grow the command step by step.
    pub fn command(self, entry: Entry, n_keys: usize) -> Cmd {
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
    pub fn load_command(self, entry: Entry) -> Cmd {
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

/// Sends `cmd` (made by `engine.command(entry, ..)`); when the server lacks
/// the code, loads it and sends `cmd` once more.
pub async fn run(
    conn: &mut impl ConnectionLike,
    engine: Engine,
    entry: Entry,
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
fn lacks_functions(err: &RedisError) -> bool {
    let unknown = err.code() == Some("ERR")
        && err
            .detail()
            .is_some_and(|it| it.to_ascii_lowercase().starts_with("unknown command"));
    unknown || err.code() == Some("NOPERM")
}
