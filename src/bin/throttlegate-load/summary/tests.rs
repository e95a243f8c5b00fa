use super::*;

fn answer(code: Code) -> Result<tonic::Response<RateLimitResponse>, Status> {
    Ok(tonic::Response::new(RateLimitResponse {
        overall_code: code as i32,
        ..Default::default()
    }))
}

fn sample_tally() -> Tally {
    let mut tally = Tally::new();
    for us in [100, 200, 300] {
        tally.record(&answer(Code::Ok), us);
    }
    tally.record(&answer(Code::OverLimit), 400);
    tally.record(&Err(Status::unavailable("down")), 5_000);
    tally.record(&Err(Status::unavailable("down")), 5_000);
    tally.record(&Err(Status::deadline_exceeded("slow")), 9_000);
    tally
}

#[test]
fn the_summary_line_is_one_line_of_json_with_the_counts() {
    let tally = sample_tally();
    let processes = [CpuUse {
        label: "service".into(),
        pid: 42,
        seconds: Some(0.5),
    }];
    let labels = [("system".to_owned(), "memory".to_owned())];
    let measured = MeasuredRun {
        tally: &tally,
        seconds: 2.0,
        connections: 2,
        streams: 3,
        processes: &processes,
        generator_cpu_seconds: None,
        labels: &labels,
        target_rate: None,
    };
    let line = measured.summary_line();
    assert!(!line.contains('\n'), "{line}");
    let json = line.strip_prefix("summary ").expect("prefix");
    let parsed: Value = serde_json::from_str(json).expect("valid JSON");
    assert_eq!(parsed["requests"], 7);
    assert_eq!(parsed["ok"], 3);
    assert_eq!(parsed["over_limit"], 1);
    assert_eq!(parsed["errors"], 3);
    assert_eq!(parsed["errors_by_code"]["Unavailable"], 2);
    assert_eq!(parsed["errors_by_code"]["DeadlineExceeded"], 1);
    assert_eq!(parsed["rate"], 2.0, "4 decisions in 2 s");
    assert_eq!(parsed["concurrency"], 6);
    assert_eq!(parsed["cpu"][0]["label"], "service");
    assert_eq!(
        parsed["cpu"][0]["us_per_decision"], 125_000.0,
        "0.5 s over 4"
    );
    assert_eq!(parsed["generator_us_per_decision"], Value::Null);
    assert_eq!(parsed["labels"]["system"], "memory");
    // The histogram keeps 3 significant digits: 9,000 µs reads back
    // as the top of its bucket.
    assert!(
        parsed["max_us"]
            .as_u64()
            .is_some_and(|max| (9_000..9_010).contains(&max))
    );
    assert!(
        parsed["p50_us"]
            .as_u64()
            .is_some_and(|p| (200..=500).contains(&p))
    );
}

#[test]
fn merged_tallies_add_up() {
    let mut total = Tally::new();
    total.add(&sample_tally()).unwrap();
    total.add(&sample_tally()).unwrap();
    assert_eq!((total.ok, total.over_limit, total.error_count()), (6, 2, 6));
    assert_eq!(total.errors["Unavailable"], 4);
    assert_eq!(total.latency_us.len(), 14);
}

#[test]
fn an_empty_run_reports_zeros_not_a_panic() {
    let tally = Tally::new();
    let measured = MeasuredRun {
        tally: &tally,
        seconds: 0.0,
        connections: 1,
        streams: 1,
        processes: &[],
        generator_cpu_seconds: Some(0.0),
        labels: &[],
        target_rate: Some(10.0),
    };
    let parsed = measured.json();
    assert_eq!(parsed["rate"], 0.0);
    assert_eq!(parsed["p99_us"], 0);
    assert!(measured.text().contains("requests 0"));
    assert!(measured.interval_text(0.0).contains("p99 0"));
}

#[test]
fn an_interval_line_is_the_summary_of_the_interval_with_its_end() {
    let mut tally = sample_tally();
    tally.late = 2;
    let processes = [CpuUse {
        label: "service".into(),
        pid: 42,
        seconds: Some(0.25),
    }];
    let measured = MeasuredRun {
        tally: &tally,
        seconds: 0.5,
        connections: 1,
        streams: 1,
        processes: &processes,
        generator_cpu_seconds: None,
        labels: &[],
        target_rate: Some(100.0),
    };
    let line = measured.interval_line(30.5);
    let parsed: Value =
        serde_json::from_str(line.strip_prefix("interval ").expect("prefix")).unwrap();
    assert_eq!(parsed["elapsed"], 30.5);
    assert_eq!(parsed["seconds"], 0.5);
    assert_eq!(parsed["rate"], 8.0, "4 decisions in 0.5 s");
    assert_eq!(
        (parsed["ok"].as_u64(), parsed["errors"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(parsed["late"], 2);
    assert_eq!(parsed["target_rate"], 100.0);
    let text = measured.interval_text(30.5);
    assert!(text.starts_with("[   30.5s] 8 decisions/s"), "{text}");
    assert!(text.contains("late 2"), "{text}");
    assert!(text.contains("cpu service 50.0%"), "{text}");
}

#[test]
fn a_reset_tally_is_empty() {
    let mut tally = sample_tally();
    tally.late = 1;
    tally.reset();
    assert_eq!(
        (
            tally.requests(),
            tally.late,
            tally.errors.len(),
            tally.latency_us.len()
        ),
        (0, 0, 0, 0)
    );
}
