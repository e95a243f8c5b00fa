//! In-memory backend: the algorithms in process, per instance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::{Backend, CounterKey, Error, KeyedCheck};
use crate::algorithms::{self, Check, State, Verdict};
use crate::clock::Clock;

/// Counters in this process's memory.
#[derive(Debug)]
pub struct MemoryBackend {
    clock: Arc<dyn Clock>,
    // A std Mutex: held only for the synchronous decision, never across `.await`.
    states: Mutex<HashMap<CounterKey, State>>,
}

impl MemoryBackend {
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            clock,
            states: Mutex::new(HashMap::new()),
        }
    }
}

#[async_trait]
impl Backend for MemoryBackend {
    async fn decide(&self, checks: &[KeyedCheck]) -> Result<Verdict, Error> {
        let now = self.clock.now_us();
        let mut states = self.states.lock().unwrap_or_else(|it| it.into_inner());
        let plain: Vec<Check> = checks.iter().map(|it| it.check).collect();
        let mut slots: Vec<Option<State>> =
            checks.iter().map(|it| states.remove(&it.key)).collect();
        let verdict = algorithms::decide(&plain, &mut slots, now);
        for (it, slot) in checks.iter().zip(slots) {
            if let Some(state) = slot {
                states.insert(it.key.clone(), state);
            }
        }
        Ok(verdict)
    }

    async fn probe(&self) -> Result<(), Error> {
        Ok(())
    }

    fn name(&self) -> &'static str {
        "memory"
    }
}
