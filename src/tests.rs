mod codebase;

/// The crate map above names every module, and only those.
#[test]
fn the_crate_map_lists_every_module() {
    let source = include_str!("lib.rs");
    let modules: Vec<&str> = source
        .lines()
        .filter_map(|line| line.strip_prefix("pub mod ")?.strip_suffix(';'))
        .collect();
    let mut mapped: Vec<&str> = source
        .lines()
        .filter_map(|line| line.strip_prefix("//! - `")?.split('`').next())
        .collect();
    assert!(!modules.is_empty());
    mapped.sort_unstable();
    assert_eq!(mapped, modules, "rustfmt keeps the declarations sorted");
}

/// Which module may use which (the one list; ARCHITECTURE.md points
/// here): production code (comments and everything after a file's
/// first `#[cfg(test)]` left out) names no module outside its module's
/// allowed set.
#[test]
fn modules_use_only_what_the_architecture_allows() {
    let allowed: &[(&str, &[&str])] = &[
        (
            "app",
            &[
                "transport",
                "decision",
                "rules",
                "backends",
                "algorithms",
                "config",
                "metrics",
                "log_gate",
                "clock",
                "quota",
                "xds",
                "traces",
            ],
        ),
        (
            "cli",
            &[
                "app",
                "algorithms",
                "backends",
                "clock",
                "compat",
                "config",
                "decision",
                "metrics",
                "simulate",
                "traces",
                "transport",
                "xds",
            ],
        ),
        (
            "transport",
            &[
                "decision",
                "backends",
                "rules",
                "config",
                "metrics",
                "log_gate",
                "proto",
                "pem",
                "serving_thread",
                "quota",
                "traces",
            ],
        ),
        (
            "decision",
            &[
                "rules",
                "backends",
                "algorithms",
                "metrics",
                "log_gate",
                "clock",
            ],
        ),
        ("config", &["rules", "algorithms"]),
        ("quota", &["rules", "clock", "metrics", "log_gate"]),
        (
            "backends",
            &["algorithms", "clock", "log_gate", "pem", "serving_thread"],
        ),
        ("metrics", &["backends"]),
        ("rules", &["algorithms"]),
        ("algorithms", &[]),
        ("clock", &[]),
        ("compat", &[]),
        (
            "simulate",
            &[
                "config",
                "rules",
                "algorithms",
                "decision",
                "backends",
                "metrics",
                "clock",
            ],
        ),
        ("log_gate", &[]),
        (
            "fuzzing",
            &[
                "algorithms",
                "backends",
                "clock",
                "config",
                "decision",
                "metrics",
                "proto",
                "rules",
                "transport",
            ],
        ),
        ("pem", &[]),
        ("serving_thread", &[]),
        ("xds", &["config", "rules", "proto", "pem"]),
        ("traces", &[]),
        (
            "testing",
            &[
                "algorithms",
                "backends",
                "clock",
                "config",
                "decision",
                "metrics",
                "rules",
            ],
        ),
    ];
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for (module, may_use) in allowed {
        let mut files = Vec::new();
        collect_sources(&src.join(module), &mut files);
        files.push(src.join(format!("{module}.rs")));
        let mut read = 0;
        for file in files.iter().filter(|it| it.is_file()) {
            read += 1;
            for used in crate_paths(&std::fs::read_to_string(file).unwrap()) {
                assert!(
                    used == *module || may_use.contains(&used.as_str()),
                    "{} uses crate::{used}, which `{module}` may not use",
                    file.display()
                );
            }
        }
        assert!(read > 0, "no source found for `{module}`");
    }
}

/// Every `.rs` file under `dir`, except test-only files and folders.
fn collect_sources(dir: &std::path::Path, files: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name == "tests" || name == "tests.rs" {
            continue;
        }
        if path.is_dir() {
            collect_sources(&path, files);
        } else if name.ends_with(".rs") {
            files.push(path);
        }
    }
}

/// The top-level modules a file's production code names as `crate::x`.
fn crate_paths(source: &str) -> Vec<String> {
    let mut used = Vec::new();
    for line in source.lines() {
        let line = line.trim_start();
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        if line.starts_with("//") {
            continue;
        }
        for (at, _) in line.match_indices("crate::") {
            let rest = &line[at + "crate::".len()..];
            assert!(
                !rest.starts_with('{'),
                "write `use crate::x::..` once per module, not `crate::{{..}}`: {line}"
            );
            let name: String = rest
                .chars()
                .take_while(|it| it.is_ascii_alphanumeric() || *it == '_')
                .collect();
            if !name.is_empty() {
                used.push(name);
            }
        }
    }
    used
}
