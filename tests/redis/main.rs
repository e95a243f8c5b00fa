//! One real `redis-server` per test: the Lua scripts, the Redis backend,
//! batching, connections, deadlines and faults, the service on Redis.

#[path = "../support/mod.rs"]
mod support;

mod backend;
mod batch;
mod connections;
mod costs;
mod deadlines;
mod engines;
mod faults;
mod functions;
mod grpc;
mod isolation;
mod late_replies;
mod layouts;
mod lua_refund;
mod lua_scripts;
mod memory;
mod outage;
mod parity;
mod restart;
mod stalled_charges;
mod tls;
mod wire_bytes;
