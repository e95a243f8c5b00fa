//! A backend whose answers a test decides: down, switchable, slow or scripted.
//!
//! The unit tests and, through the `testing` feature, the integration tests
//! drive this one fake.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::algorithms::Verdict;
use crate::backends::{self, Backend, KeyedCheck};
use crate::clock::Clock;

/// A configurable fake: answers scripted results first, then passes
/// decisions to an inner backend if it has one, else fails them as a
/// refused connection would. Probes fail while it is marked down.
#[derive(Debug, Default)]
pub struct FakeBackend {
    script: Mutex<VecDeque<Result<Verdict, backends::Error>>>,
    /// Panic when the script runs out instead of falling through, so a
    /// test that scripted every call notices an unexpected one.
    script_only: bool,
    inner: Option<Arc<dyn Backend>>,
    delay: Duration,
    down: AtomicBool,
    /// What [`Backend::local_clock`] answers: `None` unless set.
    local_clock: Option<Arc<dyn Clock>>,
    /// Decisions asked for so far.
    calls: AtomicUsize,
}

impl FakeBackend {
    /// Every decision fails and probes succeed until [`Self::set_down`].
    pub fn failing() -> Self {
        Self::default()
    }

    /// Every decision and every probe fails.
    pub fn down() -> Self {
        let backend = Self::default();
        backend.set_down(true);
        backend
    }

    /// Answers each decision with the next of `answers`, and panics past
    /// the last; probes succeed.
    pub fn scripted(answers: impl IntoIterator<Item = Result<Verdict, backends::Error>>) -> Self {
        Self {
            script: Mutex::new(answers.into_iter().collect()),
            script_only: true,
            ..Self::default()
        }
    }

    /// Passes every call to `inner`, each decision after `delay`.
    pub fn slow(inner: Arc<dyn Backend>, delay: Duration) -> Self {
        Self {
            inner: Some(inner),
            delay,
            ..Self::default()
        }
    }

    /// Reports `clock` as the clock its answers' durations run on, as a
    /// Redis backend does, so that the limiter caches its denials.
    pub fn with_local_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.local_clock = Some(clock);
        self
    }

    /// Decisions asked for so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Makes probes fail (`true`) or answer again (`false`).
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
}

fn refused() -> backends::Error {
    backends::Error::Unavailable("connection refused".to_owned())
}

#[async_trait::async_trait]
impl Backend for FakeBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, backends::Error> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let scripted = self.script.lock().expect("script lock").pop_front();
        match (scripted, &self.inner) {
            (Some(answer), _) => answer,
            (None, _) if self.script_only => panic!("a scripted answer"),
            (None, Some(inner)) => inner.decide(checks).await,
            (None, None) => Err(refused()),
        }
    }

    async fn probe(&self) -> Result<(), backends::Error> {
        if self.down.load(Ordering::SeqCst) {
            return Err(refused());
        }
        match &self.inner {
            Some(inner) => inner.probe().await,
            None => Ok(()),
        }
    }

    fn name(&self) -> &'static str {
        "fake"
    }

    fn local_clock(&self) -> Option<Arc<dyn Clock>> {
        self.local_clock.clone()
    }
}
