//! The built binary's `simulate`: its summary, its SVG, and its refusals.

use std::path::Path;
use std::process::Output;

use crate::support::config::write_file as write;
use crate::support::process::command;

const TEN_PER_SECOND: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: open
    rate_limit: {unlimited: true}
";

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_window_counter",
    "sliding_window_log",
    "token_bucket",
    "gcra",
];

fn run(args: &[&str]) -> Output {
    command()
        .arg("simulate")
        .args(args)
        .output()
        .expect("run the binary")
}

/// `simulate` on the ten-per-second config for `user=alice`, with `args`
/// after it; the output and the SVG's text.
fn simulate(args: &[&str]) -> (Output, String) {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "api.yaml", TEN_PER_SECOND);
    let svg = dir.path().join("out.svg");
    let svg_arg = svg.display().to_string();
    let mut all = vec![
        "--config",
        &config,
        "--domain",
        "api",
        "--descriptor",
        "user=alice",
        "--svg",
        &svg_arg,
    ];
    all.extend_from_slice(args);
    let out = run(&all);
    assert!(out.status.success(), "{out:?}");
    let text = std::fs::read_to_string(&svg).expect("the SVG is written");
    (out, text)
}

/// One algorithm's counts: allowed, denied, most allowed in a window.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Counts {
    algorithm: String,
    allowed: u64,
    denied: u64,
    most_in_window: u64,
}

/// The counts of the summary's table (the lines after its header).
fn stdout_counts(out: &Output) -> Vec<Counts> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let mut lines = stdout.lines().skip_while(|it| !it.starts_with("algorithm"));
    assert!(lines.next().is_some(), "no table in {stdout}");
    lines
        .map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(fields.len(), 4, "{line}");
            Counts {
                algorithm: fields[0].to_owned(),
                allowed: fields[1].parse().unwrap(),
                denied: fields[2].parse().unwrap(),
                most_in_window: fields[3].parse().unwrap(),
            }
        })
        .collect()
}

/// The counts each lane of the SVG carries, after checking it is
/// well-formed XML with an `svg` root.
fn svg_counts(svg: &str) -> Vec<Counts> {
    let elements = xml::parse(svg).unwrap_or_else(|err| panic!("{err}\n{svg}"));
    assert_eq!(elements[0].name, "svg");
    let number = |element: &xml::Element, name: &str| -> u64 {
        element.attr(name).expect(name).parse().expect(name)
    };
    elements
        .iter()
        .filter(|it| it.name == "g" && it.attr("class") == Some("lane"))
        .map(|lane| Counts {
            algorithm: lane.attr("data-algorithm").unwrap().to_owned(),
            allowed: number(lane, "data-allowed"),
            denied: number(lane, "data-denied"),
            most_in_window: number(lane, "data-most-in-window"),
        })
        .collect()
}

fn lane<'a>(counts: &'a [Counts], algorithm: &str) -> &'a Counts {
    counts.iter().find(|it| it.algorithm == algorithm).unwrap()
}

/// What a sliding-window log of 10 per second allows of requests at
/// `times` (µs), counted without the service: a request passes when fewer
/// than 10 passed in the second up to it, `(t - 1 s, t]`.
fn sliding_log_allows(times: &[u64]) -> u64 {
    let mut passed: Vec<u64> = Vec::new();
    for at in times {
        let recent = passed.iter().filter(|it| **it + 1_000_000 > *at).count();
        if recent < 10 {
            passed.push(*at);
        }
    }
    passed.len() as u64
}

#[test]
fn steady_counts_agree_in_stdout_svg_and_an_independent_count() {
    let (out, svg) = simulate(&["--pattern", "steady", "--duration", "10"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("10 s, 150 requests"), "{stdout}");
    let printed = stdout_counts(&out);
    assert_eq!(printed, svg_counts(&svg));
    let names: Vec<&str> = printed.iter().map(|it| it.algorithm.as_str()).collect();
    assert_eq!(names, ALGORITHMS);
    for counts in &printed {
        assert_eq!(counts.allowed + counts.denied, 150, "{counts:?}");
    }
    // 1.5 per tenth of the limit: 15 requests a second, every 1/15 s.
    let times: Vec<u64> = (0..150).map(|k| k * 2_000_000 / 30).collect();
    let expected = sliding_log_allows(&times);
    assert_eq!(expected, 100);
    let log = lane(&printed, "sliding_window_log");
    assert_eq!((log.allowed, log.denied, log.most_in_window), (100, 50, 10));
    // Windows start on whole seconds: 10 of each second's 15.
    assert_eq!(lane(&printed, "fixed_window").allowed, 100);
}

#[test]
fn the_burst_pattern_shows_the_fixed_windows_double_burst() {
    let (out, svg) = simulate(&[]);
    let printed = stdout_counts(&out);
    assert_eq!(printed, svg_counts(&svg));
    // 20 at the start, 20 before and 20 after the boundary at 2 s.
    for counts in &printed {
        assert_eq!(counts.allowed + counts.denied, 60, "{counts:?}");
    }
    let fixed = lane(&printed, "fixed_window");
    assert_eq!((fixed.allowed, fixed.most_in_window), (30, 20));
    let log = lane(&printed, "sliding_window_log");
    assert_eq!((log.allowed, log.most_in_window), (20, 10));
}

#[test]
fn a_trace_is_replayed_with_its_costs() {
    let dir = tempfile::tempdir().unwrap();
    let trace = write(
        dir.path(),
        "trace.txt",
        "# ms cost\n0 4\n10 4\n20 4\n1010 8\n",
    );
    let (out, svg) = simulate(&["--pattern", "trace", &trace, "--only-configured"]);
    let printed = stdout_counts(&out);
    assert_eq!(printed, svg_counts(&svg));
    // Only the rule's own algorithm; 4 + 4 fit in 10, the third 4 does
    // not, and once both 4s are a second old, 8 fits.
    assert_eq!(
        printed,
        [Counts {
            algorithm: "sliding_window_log".to_owned(),
            allowed: 3,
            denied: 1,
            most_in_window: 8,
        }]
    );
}

fn check_refused(args: &[&str], expected: &str) {
    let dir = tempfile::tempdir().unwrap();
    let config = write(dir.path(), "api.yaml", TEN_PER_SECOND);
    let bad_line = write(dir.path(), "bad.txt", "0\n5 x\n");
    let missing = dir.path().join("missing.txt").display().to_string();
    let args: Vec<String> = args
        .iter()
        .map(|it| {
            it.replace("CONFIG", &config)
                .replace("BAD_TRACE", &bad_line)
                .replace("MISSING", &missing)
        })
        .collect();
    let out = command().arg("simulate").args(&args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    let expected = expected
        .replace("BAD_TRACE", &bad_line)
        .replace("MISSING", &missing);
    assert!(stderr.contains(&expected), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(out.stdout.is_empty(), "{out:?}");
}

#[test]
fn bad_arguments_are_refused_with_exit_code_2() {
    let base = ["--config", "CONFIG", "--domain"];
    let with = |rest: &[&'static str]| -> Vec<&'static str> {
        base.iter().copied().chain(rest.iter().copied()).collect()
    };
    check_refused(
        &with(&["web", "--descriptor", "user=a"]),
        "error: unknown domain 'web' (the config has: api)",
    );
    check_refused(
        &with(&["api", "--descriptor", "team=a"]),
        "error: descriptor team=a matches no rule in domain 'api'",
    );
    check_refused(
        &with(&["api", "--descriptor", "open=a"]),
        "which is unlimited: nothing to simulate",
    );
    check_refused(
        &with(&[
            "api",
            "--descriptor",
            "user=a",
            "--pattern",
            "trace",
            "MISSING",
        ]),
        "error: MISSING: cannot read the trace:",
    );
    check_refused(
        &with(&[
            "api",
            "--descriptor",
            "user=a",
            "--pattern",
            "trace",
            "BAD_TRACE",
        ]),
        "error: BAD_TRACE: trace line 2: 'x' is not a cost from 1 to 4294967295",
    );
    check_refused(
        &with(&["api", "--descriptor", "user"]),
        "error: --descriptor 'user' is not key=value",
    );
    check_refused(
        &with(&["api", "--descriptor", "user=a", "--pattern", "zigzag"]),
        "error: unknown pattern 'zigzag'",
    );
    check_refused(
        &with(&["api", "--descriptor", "user=a", "--duration", "0"]),
        "error: --duration '0' is not a number of seconds above 0",
    );
    check_refused(
        &[
            "--config",
            "MISSING",
            "--domain",
            "api",
            "--descriptor",
            "user=a",
        ],
        "error: MISSING: error reading config:",
    );
    // Clap's own refusals use the same code.
    check_refused(&["--config", "CONFIG"], "--domain");
}

#[test]
fn the_xml_check_refuses_what_is_not_well_formed() {
    for bad in [
        "<svg><g></svg>",
        "<svg a=\"1\" a=\"2\"/>",
        "<svg a=1/>",
        "<svg>&nbsp;</svg>",
        "<svg>a < b</svg>",
        "<svg/><svg/>",
        "<svg>",
        "text",
    ] {
        assert!(xml::parse(bad).is_err(), "{bad}");
    }
    let good = xml::parse("<svg x=\"&lt;1&gt;\"><g/><text>a &amp; b</text></svg>\n").unwrap();
    assert_eq!(good.len(), 3);
    assert_eq!(good[0].attr("x"), Some("&lt;1&gt;"));
}

/// Every SVG under docs/img that `simulate` drew is well-formed and its
/// lanes say what they count.
#[test]
fn the_committed_pictures_are_well_formed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/img");
    let mut drawn = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.starts_with("simulate-") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let lanes = svg_counts(&text);
        assert_eq!(lanes.len(), 5, "{name}");
        drawn += 1;
    }
    assert!(drawn >= 3, "pictures in {}", dir.display());
}

/// A strict check of the XML the writer produces: elements nest and close,
/// attributes are quoted and unique, every `&` starts a known entity, and
/// there is one root. Enough for SVG without a DTD, comments or CDATA.
mod xml {
    #[derive(Debug)]
    pub struct Element {
        pub name: String,
        pub attrs: Vec<(String, String)>,
    }

    impl Element {
        pub fn attr(&self, name: &str) -> Option<&str> {
            let found = self.attrs.iter().find(|(it, _)| it == name);
            found.map(|(_, value)| value.as_str())
        }
    }

    /// Every element in document order, or what is wrong.
    pub fn parse(text: &str) -> Result<Vec<Element>, String> {
        let mut elements = Vec::new();
        let mut open: Vec<String> = Vec::new();
        let mut roots = 0;
        let mut rest = text;
        while !rest.is_empty() {
            let next = rest.find('<').unwrap_or(rest.len());
            check_text(&rest[..next], !open.is_empty())?;
            rest = &rest[next..];
            if rest.is_empty() {
                break;
            }
            let end = rest.find('>').ok_or("unclosed tag")?;
            let tag = &rest[1..end];
            rest = &rest[end + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                match open.pop() {
                    Some(it) if it == name => continue,
                    other => return Err(format!("</{name}> closes {other:?}")),
                }
            }
            if open.is_empty() {
                roots += 1;
            }
            let (tag, empty) = match tag.strip_suffix('/') {
                Some(tag) => (tag, true),
                None => (tag, false),
            };
            let element = parse_tag(tag)?;
            if !empty {
                open.push(element.name.clone());
            }
            elements.push(element);
        }
        if !open.is_empty() || roots != 1 {
            return Err(format!("{roots} roots, unclosed {open:?}"));
        }
        Ok(elements)
    }

    fn check_text(text: &str, inside: bool) -> Result<(), String> {
        if !inside && !text.trim().is_empty() {
            return Err(format!("text outside the root: {text:?}"));
        }
        if text.contains('>') {
            return Err(format!("unescaped > in {text:?}"));
        }
        check_entities(text)
    }

    fn check_entities(text: &str) -> Result<(), String> {
        for (at, _) in text.match_indices('&') {
            let entity = &text[at..];
            let known = ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"];
            if !known.iter().any(|it| entity.starts_with(it)) {
                return Err(format!("unknown entity in {text:?}"));
            }
        }
        Ok(())
    }

    fn is_name(text: &str) -> bool {
        let mut chars = text.chars();
        chars.next().is_some_and(|it| it.is_ascii_alphabetic())
            && chars.all(|it| it.is_ascii_alphanumeric() || "-_:.".contains(it))
    }

    fn parse_tag(tag: &str) -> Result<Element, String> {
        let name_end = tag.find(char::is_whitespace).unwrap_or(tag.len());
        let name = &tag[..name_end];
        if !is_name(name) {
            return Err(format!("bad element name in <{tag}>"));
        }
        let mut attrs: Vec<(String, String)> = Vec::new();
        let mut rest = tag[name_end..].trim_start();
        while !rest.is_empty() {
            let (attr, after) = rest
                .split_once("=\"")
                .ok_or(format!("bad attribute in <{tag}>"))?;
            let (value, after) = after
                .split_once('"')
                .ok_or(format!("unquoted in <{tag}>"))?;
            if !is_name(attr) || value.contains('<') {
                return Err(format!("bad attribute {attr:?} in <{tag}>"));
            }
            check_entities(value)?;
            if attrs.iter().any(|(it, _)| it == attr) {
                return Err(format!("duplicate {attr} in <{tag}>"));
            }
            attrs.push((attr.to_owned(), value.to_owned()));
            if !after.is_empty() && !after.starts_with(char::is_whitespace) {
                return Err(format!("no space between attributes in <{tag}>"));
            }
            rest = after.trim_start();
        }
        Ok(Element {
            name: name.to_owned(),
            attrs,
        })
    }
}
