//! YAML rate-limit config (envoyproxy/ratelimit's format plus extensions) loaded and validated into [`RuleSet`](crate::rules::RuleSet).
//!
//! Two layers: the file is parsed into a generic YAML tree (syntax errors
//! carry a line and column), then walked by hand into `rules` types. The
//! walk goes on after a problem so that one pass reports every problem of
//! every file; messages use envoyproxy/ratelimit's wording where it has one.
//!
//! Deliberate differences from envoyproxy/ratelimit, all stricter:
//! - keys are checked per level (a `unit` directly on a descriptor is an
//!   error, where envoyproxy silently ignores it);
//! - `*` makes a wildcard only in `value`; the pattern is matched against the
//!   entry's value, never across the key.
//!
//! Files: `load` reads files and directories and assembles their rules;
//! `walk` turns one file's YAML tree into rule nodes; `position` finds
//! where a problem is written; `summary` renders a rule set for people;
//! `reload` swaps the rule set in force when the files change.

mod limits;
mod load;
mod position;
pub mod reload;
mod status;
mod summary;
mod walk;

use std::fmt::{self, Write as _};
use std::path::PathBuf;

use crate::algorithms::Algorithm;
use crate::rules::RuleSet;

pub use limits::{ALIAS_NODE_ALLOWANCE, ConfigLimits};
pub(crate) use load::config_entries;
pub use load::{load, load_trees, parse_str};
pub use position::Location;
pub use status::{ConfigStatus, Refusal};
pub use summary::summary;

pub use crate::rules::DEFAULT_MAX_LOG_ENTRIES;

/// How to load a config. Deliberately no `Default`: callers say what they
/// want (it comes from the command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Merge files that name the same domain instead of refusing them.
    pub merge_domains: bool,
    /// Algorithm of limits where neither the limit nor its file names one.
    pub default_algorithm: Algorithm,
    /// Most requests per window of a sliding-window log (it keeps one
    /// entry per request): a limit over it that inherits the log uses the
    /// sliding-window counter, one that names the log is refused.
    pub max_log_entries: u32,
    /// Bounds on bytes and descriptors, so no config can take unbounded
    /// memory or time to load.
    pub limits: ConfigLimits,
}

/// A validated config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub rules: RuleSet,
    /// Things worth an operator's attention that do not make the config
    /// invalid, each `<file>: <message>`; the caller logs or prints them.
    pub warnings: Vec<String>,
    /// The files read, in load order (empty for [`parse_str`]).
    pub files: Vec<PathBuf>,
}

/// Why a config was refused: every problem found, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    pub problems: Vec<Problem>,
}

/// One reason a config was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file as named to the loader.
    pub file: String,
    /// What is wrong (syntax errors include the line and column).
    pub message: String,
    /// Where in the YAML tree, such as `descriptors[0].rate_limit`; empty
    /// when the problem concerns the whole file.
    pub path: String,
    /// Line and column in the file: of the syntax error, or of the deepest
    /// part of `path` that exists (an unknown key points at the key, a
    /// missing one at the mapping that lacks it).
    pub location: Option<Location>,
}

/// `<file>: <message>`, exactly as envoyproxy/ratelimit words it where it
/// has a message for the case. The alternate form (`{:#}`), for people,
/// adds the position and the YAML path, as in
/// `a.yaml:5:5: config error, unknown key 'ratelimit' (at descriptors[0].ratelimit)`.
impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.file)?;
        if let (true, Some(location)) = (f.alternate(), self.location) {
            write!(f, ":{}:{}", location.line, location.column)?;
        }
        write!(f, ": {}", self.message)?;
        if f.alternate() && !self.path.is_empty() {
            write!(f, " (at {})", self.path)?;
        }
        Ok(())
    }
}

/// One problem per line; `{:#}` uses each problem's alternate form.
impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (idx, problem) in self.problems.iter().enumerate() {
            if idx > 0 {
                f.write_char('\n')?;
            }
            if f.alternate() {
                write!(f, "{problem:#}")?;
            } else {
                write!(f, "{problem}")?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests;
