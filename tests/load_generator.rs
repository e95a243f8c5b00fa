//! The built `throttlegate-load` against the built service: its summary
//! line's counts add up, and what it reports matches what the rules allow.
// Cargo builds `throttlegate-load` for the tests (and sets
// CARGO_BIN_EXE_throttlegate-load) only with its required feature.
#![cfg(feature = "load-generator")]

mod support;

use std::process::{Command, Output};

use serde_json::Value;
use support::process::{Serve, ServiceProcess, free_addr};

const LOAD: &str = env!("CARGO_BIN_EXE_throttlegate-load");

const HOT_KEY: &str = "domain: loadgen\ndescriptors:\n  - key: client\n    rate_limit: {unit: minute, requests_per_unit: 50}\n";

const NESTED: &str = "domain: bench\ndescriptors:\n  - key: method\n    value: GET\n    descriptors:\n      - key: user\n        rate_limit: {unit: minute, requests_per_unit: 1}\n";

const NEVER_REACHED: &str = "domain: loadgen\ndescriptors:\n  - key: client\n    rate_limit: {unit: second, requests_per_unit: 1000000000}\n";

fn run_load(args: &[&str]) -> Output {
    Command::new(LOAD)
        .args(args)
        .output()
        .expect("run throttlegate-load")
}

/// Runs the generator against `server` and returns its summary line's JSON,
/// after checking that the counts add up.
async fn summary(server: &mut ServiceProcess, args: &[&str]) -> Value {
    server.connect().await;
    let addr = format!("http://{}", server.grpc);
    let out = run_load(&[&["--addr", addr.as_str()][..], args].concat());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{out:?}\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout
        .lines()
        .filter(|it| it.starts_with("summary "))
        .collect();
    assert_eq!(lines.len(), 1, "one summary line: {stdout}");
    let json: Value = serde_json::from_str(&lines[0]["summary ".len()..]).expect("valid JSON");
    let count = |name: &str| json[name].as_u64().expect(name);
    assert_eq!(
        count("ok") + count("over_limit") + count("errors"),
        count("requests"),
        "{json}"
    );
    json
}

#[tokio::test]
async fn a_hot_key_limited_to_n_per_minute_gets_exactly_n_ok() {
    let mut server = Serve::yaml(HOT_KEY).spawn();
    let service = format!("service={}", server.pid());
    let json = summary(
        &mut server,
        &[
            "--requests",
            "300",
            "--connections",
            "2",
            "--streams",
            "4",
            "--pid",
            service.as_str(),
            "--label",
            "case=hot",
        ],
    )
    .await;
    assert_eq!(json["requests"], 300, "{json}");
    assert_eq!(json["ok"], 50, "{json}");
    assert_eq!(json["over_limit"], 250, "{json}");
    assert_eq!(json["errors"], 0, "{json}");
    assert_eq!(json["concurrency"], 8, "{json}");
    assert_eq!(json["labels"]["case"], "hot", "{json}");
    assert_eq!(json["cpu"][0]["label"], "service", "{json}");
    assert!(json["cpu"][0]["seconds"].is_f64(), "{json}");
    assert!(json["generator_cpu_seconds"].is_f64(), "{json}");
}

#[tokio::test]
async fn zipf_keys_under_a_fixed_prefix_entry_reach_the_nested_rule() {
    let mut server = Serve::yaml(NESTED).spawn();
    let json = summary(
        &mut server,
        &[
            "--domain",
            "bench",
            "--prefix-entry",
            "method=GET",
            "--key",
            "user",
            "--keys",
            "1000",
            "--distribution",
            "zipf",
            "--zipf-exponent",
            "1.0",
            "--requests",
            "400",
            "--connections",
            "1",
            "--streams",
            "2",
        ],
    )
    .await;
    // One OK per distinct value (1 per minute each): the hottest values
    // repeat, so some are refused, and many values are drawn.
    let (ok, over) = (
        json["ok"].as_u64().unwrap(),
        json["over_limit"].as_u64().unwrap(),
    );
    assert_eq!(ok + over, 400, "{json}");
    assert!(
        over >= 40,
        "rank 1 alone comes about 53 times in 400: {json}"
    );
    assert!(ok >= 100, "{json}");
}

#[tokio::test]
async fn a_timed_run_after_a_warm_up_counts_only_the_measured_part() {
    let mut server = Serve::yaml(NEVER_REACHED).spawn();
    let json = summary(
        &mut server,
        &[
            "--duration",
            "1s",
            "--warmup",
            "300ms",
            "--keys",
            "100000",
            "--connections",
            "2",
            "--streams",
            "2",
        ],
    )
    .await;
    let seconds = json["seconds"].as_f64().unwrap();
    assert!((1.0..5.0).contains(&seconds), "{json}");
    assert!(json["requests"].as_u64().unwrap() > 0, "{json}");
    assert_eq!(json["ok"], json["requests"], "{json}");
}

#[test]
fn an_address_nobody_listens_on_is_an_error_exit() {
    let addr = format!("http://{}", free_addr());
    let out = run_load(&["--addr", addr.as_str(), "--requests", "1"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot connect"), "{stderr}");
}
