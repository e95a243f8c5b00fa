//! The fake backend the unit tests use too, for tests that need decisions to fail, lag or follow a script.

use std::sync::Arc;

use throttlegate::algorithms::Verdict;
use throttlegate::backends::{self, Backend, KeyedCheck};
use throttlegate::clock::Clock;

// One file serves both kinds of test; it names what it uses through `super`.
#[path = "../../src/testing/fake_backend.rs"]
mod fake_backend;
#[allow(unused_imports, reason = "only the tests that need a fake use it")]
pub use fake_backend::FakeBackend;
