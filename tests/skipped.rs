//! The last thing `cargo test` prints: which suites did not run for want of
//! a program (Envoy, the Kubernetes schema checker) and why, so a green run
//! never hides them. Cargo runs the test binaries one after another in
//! name order, so this one's name sorts after every other test target's.
//! Under `CI=true` the suites fail instead of skipping, and this says so.

// Only the module that finds the programs, as the skipping tests find them.
#[allow(dead_code, reason = "the tests use the rest")]
mod support {
    pub mod tools;
}

use std::path::Path;

use support::tools::{Tool, under_ci};

/// This binary's name, which must sort last among the test targets.
const NAME: &str = "skipped";

fn main() {
    // `cargo test -- --list` lists tests: this binary has none.
    if std::env::args().any(|arg| arg == "--list") {
        return;
    }
    let later = targets_after(NAME);
    assert!(
        later.is_empty(),
        "tests/{NAME}.rs must run last to be read last, but cargo runs {later:?} after it: \
         rename one of them"
    );
    let missing: Vec<(Tool, String)> = Tool::ALL
        .into_iter()
        .filter_map(|tool| tool.find().err().map(|why| (tool, why)))
        .collect();
    if missing.is_empty() {
        println!("\nEvery suite ran: Envoy and the Kubernetes schema checker were found.\n");
        return;
    }
    if under_ci() {
        println!("\nCI=true: these suites failed instead of being skipped:");
    } else {
        println!("\nSkipped in this run (their tests passed without running):");
    }
    for (tool, why) in &missing {
        println!("- {}: {why}", tool.suites());
    }
    println!(
        "`.ci/run` installs {} and runs every test as CI does.\n",
        if missing.len() == 1 { "it" } else { "them" }
    );
}

/// The integration test targets (`tests/<name>.rs`, `tests/<name>/main.rs`)
/// whose names sort after `name`.
fn targets_after(name: &str) -> Vec<String> {
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let mut later: Vec<String> = std::fs::read_dir(&tests)
        .expect("tests/")
        .map(|entry| entry.expect("an entry of tests/").path())
        .filter_map(|path| {
            let stem = path.file_stem()?.to_str()?.to_owned();
            let is_target = if path.is_dir() {
                path.join("main.rs").is_file()
            } else {
                path.extension().is_some_and(|ext| ext == "rs")
            };
            is_target.then_some(stem)
        })
        .filter(|stem| stem.as_str() > name)
        .collect();
    later.sort();
    later
}
