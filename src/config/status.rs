//! What `/rlconfig` says about the config in force besides its rules:
//! where it was read from, when it was loaded, and the error of the last
//! reload if that reload was refused.
//!
//! The reloader records every outcome here; a refused reload leaves the
//! rules (and their load time) as they were and only adds its error, which
//! the next good reload clears.

use std::fmt::Write;
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

/// The config's source, load time and last refusal, shared by the
/// reloader (which writes it) and the HTTP server (which shows it).
#[derive(Debug)]
pub struct ConfigStatus {
    /// `None`: no `--config` was given.
    source: Option<PathBuf>,
    record: Mutex<ReloadRecord>,
}

/// When the rules in force were loaded, and the refusal of the last
/// reload unless a good one came since.
#[derive(Debug, Clone)]
struct ReloadRecord {
    loaded_at: SystemTime,
    refused: Option<Refusal>,
}

/// A reload that was refused: when, and the error as the log gave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub at: SystemTime,
    pub error: String,
}

impl ConfigStatus {
    /// The rules in force came from `source` (or from no file) at `loaded_at`.
    pub fn new(source: Option<PathBuf>, loaded_at: SystemTime) -> ConfigStatus {
        ConfigStatus {
            source,
            record: Mutex::new(ReloadRecord {
                loaded_at,
                refused: None,
            }),
        }
    }

    /// A reload validated. `changed`: its rules were stored at `at`, so they
    /// are the ones in force from then on. Either way the files are good
    /// again, so an earlier refusal no longer applies.
    pub fn record_loaded(&self, at: SystemTime, changed: bool) {
        let mut record = self.lock();
        if changed {
            record.loaded_at = at;
        }
        record.refused = None;
    }

    /// A reload was refused at `at` with `error`; the rules in force stay.
    pub fn record_refused(&self, at: SystemTime, error: String) {
        self.lock().refused = Some(Refusal { at, error });
    }

    /// When the rules in force were loaded.
    pub fn loaded_at(&self) -> SystemTime {
        self.lock().loaded_at
    }

    /// The last reload's refusal, unless a good reload came since.
    pub fn refused(&self) -> Option<Refusal> {
        self.lock().refused.clone()
    }

    /// The lines `/rlconfig` shows above the rules.
    pub fn render(&self) -> String {
        let record = self.lock().clone();
        let mut out = String::new();
        match &self.source {
            Some(path) => {
                let _ = writeln!(out, "source: {}", path.display());
            }
            None => out.push_str("source: none (no --config given)\n"),
        }
        let _ = writeln!(out, "loaded: {}", httpdate::fmt_http_date(record.loaded_at));
        if let Some(refused) = &record.refused {
            let _ = writeln!(
                out,
                "last reload refused: {} (the rules below stay in force)",
                httpdate::fmt_http_date(refused.at)
            );
            for line in refused.error.lines() {
                let _ = writeln!(out, "  {line}");
            }
        }
        out.push('\n');
        out
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReloadRecord> {
        self.record.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests;
