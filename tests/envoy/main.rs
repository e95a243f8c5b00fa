//! A real Envoy 1.40.0 in front of the service (HTTP filter, RLQS filter,
//! the `deploy/local` example). Skipped without `ENVOY_BIN`, failed under
//! `CI=true`.

#[path = "../support/mod.rs"]
mod support;

mod costs;
mod deploy_local;
mod failures;
mod limits;
mod rlqs;
