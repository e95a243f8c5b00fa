//! What the tests share: a fake backend, and builders of load options,
//! rule sets, requests and limiters.
//!
//! [`FakeBackend`] fails, lags or follows a script; the integration tests
//! reach it through the `testing` feature, which only the crate's
//! dev-dependency on itself enables, so the service's build never holds
//! it. The rest is for the unit tests: [`builders`] makes what `serve`
//! makes by default, [`rules`] builds rule trees in code, [`decision`]
//! builds requests and limiters and reads what they answer,
//! [`metrics_text`] reads what they count.

mod fake_backend;
pub use fake_backend::FakeBackend;

#[cfg(test)]
pub(crate) mod builders;
#[cfg(test)]
pub(crate) mod decision;
#[cfg(test)]
pub(crate) mod metrics_text;
#[cfg(test)]
pub(crate) mod rules;

#[cfg(test)]
pub(crate) use builders::*;
