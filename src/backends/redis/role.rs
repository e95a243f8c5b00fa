//! Whether a node takes writes: its role, asked when a connection is
//! made, so that a replica (a master demoted by a failover, or a node
//! Sentinel names before its promotion) is never sent a call.
//!
//! Invariant: a connection whose node says it is a replica is refused
//! with READONLY; one whose node does not say is taken at its word.

use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, FromRedisValue, RedisError, ServerErrorKind, Value};

/// Refuses (with a READONLY error) a connection to a node that says it is a
/// replica: asked with `ROLE`, or where the user may not use ROLE (it is
/// an admin command, often refused by ACL) with `HELLO 2`, which every
/// user may send and which names the role too (Redis 6 and later; the
/// connection stays on RESP2). A server that answers neither is taken at
/// its word later: a READONLY reply to a call opens the circuit too.
pub(super) async fn require_writable(conn: &mut MultiplexedConnection) -> Result<(), RedisError> {
    let role = match role_of(conn).await? {
        Some(role) => role,
        None => return Ok(()),
    };
    // Only a replica is refused: other roles (a master, the active
    // replicas of some forks) take writes.
    if role != "slave" && role != "replica" {
        return Ok(());
    }
    Err(RedisError::from((
        ErrorKind::Server(ServerErrorKind::ReadOnly),
        "the redis node is not a master",
        format!("its role is {role}"),
    )))
}

/// The node's role (`master`, `slave`, `replica`...), or `None` when the
/// server does not say.
pub(super) async fn role_of(
    conn: &mut MultiplexedConnection,
) -> Result<Option<String>, RedisError> {
    let refused = |err: &RedisError| matches!(err.code(), Some("NOPERM" | "ERR"));
    match redis::cmd("ROLE").query_async::<Vec<Value>>(conn).await {
        Ok(role) => {
            return match role.into_iter().next() {
                Some(value) => Ok(Some(String::from_redis_value(value)?)),
                None => Ok(None),
            };
        }
        Err(err) if refused(&err) => {}
        Err(err) => return Err(err),
    }
    let hello: Value = match redis::cmd("HELLO").arg(2).query_async(conn).await {
        Ok(hello) => hello,
        Err(err) if refused(&err) => return Ok(None),
        Err(err) => return Err(err),
    };
    let fields: Vec<(&Value, &Value)> = match &hello {
        Value::Array(flat) => flat
            .chunks(2)
            .filter_map(|it| Some((it.first()?, it.get(1)?)))
            .collect(),
        Value::Map(pairs) => pairs.iter().map(|(k, v)| (k, v)).collect(),
        _ => Vec::new(),
    };
    Ok(fields.into_iter().find_map(|(field, value)| {
        let field = String::from_redis_value_ref(field).ok()?;
        (field == "role")
            .then(|| String::from_redis_value_ref(value).ok())
            .flatten()
    }))
}
