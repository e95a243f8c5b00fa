use super::*;

const TEN_PER_SECOND: Scale = Scale {
    limit: 10,
    window_us: 1_000_000,
};

fn times(pattern: &Pattern, duration_us: u64) -> Vec<u64> {
    let arrivals = pattern.arrivals(TEN_PER_SECOND, duration_us).unwrap();
    arrivals.iter().map(|it| it.at_us).collect()
}

#[test]
fn steady_is_one_and_a_half_times_the_limit_at_even_spacing() {
    let at = times(&Pattern::Steady, 10_000_000);
    assert_eq!(at.len(), 150);
    assert_eq!(&at[..3], &[0, 66_666, 133_333]);
    // Every whole second is hit exactly: 15 requests per second.
    assert_eq!(at[15], 1_000_000);
    assert_eq!(at[149], 9_933_333);
}

#[test]
fn burst_sends_twice_the_limit_three_times_around_a_boundary() {
    let at = times(&Pattern::Burst, 4_000_000);
    assert_eq!(at.len(), 60);
    assert!(at[..20].iter().all(|it| *it < 20_000), "{at:?}");
    // The boundary nearest the middle of 4 s is 2 s.
    assert!(
        at[20..40]
            .iter()
            .all(|it| (1_980_000..2_000_000).contains(it))
    );
    assert!(
        at[40..]
            .iter()
            .all(|it| (2_000_000..2_020_000).contains(it))
    );
    assert!(at.windows(2).all(|it| it[0] <= it[1]));
}

#[test]
fn burst_in_a_short_run_keeps_only_what_fits() {
    // A boundary at 1 s; half a window ends before it.
    assert_eq!(times(&Pattern::Burst, 500_000).len(), 20);
}

#[test]
fn ramp_rises_from_nothing_to_three_times_the_limit() {
    let at = times(&Pattern::Ramp, 4_000_000);
    // 3N/W × D / 2 = 60 requests in all, fewer than 1 in the first
    // tenth of a second and about 30 per second at the end.
    assert!((59..=60).contains(&at.len()), "{}", at.len());
    let first_second = at.iter().filter(|it| **it < 1_000_000).count();
    let last_second = at.iter().filter(|it| **it >= 3_000_000).count();
    assert!((3..=4).contains(&first_second), "{first_second}");
    assert!((26..=27).contains(&last_second), "{last_second}");
    assert!(at.windows(2).all(|it| it[0] <= it[1]));
}

#[test]
fn too_many_requests_are_refused_before_any_is_made() {
    let huge = Scale {
        limit: 1_000_000,
        window_us: 1_000_000,
    };
    let err = Pattern::Steady.arrivals(huge, 10_000_000).unwrap_err();
    assert!(err.to_string().contains("more than 200000"), "{err}");
}

#[test]
fn default_durations() {
    assert_eq!(Pattern::Ramp.default_duration_us(TEN_PER_SECOND), 4_000_000);
    let trace = Pattern::Trace(parse_trace("0\n2500\n").unwrap());
    assert_eq!(trace.default_duration_us(TEN_PER_SECOND), 3_000_000);
}

fn check_trace(text: &str, expected: Result<&[(u64, u32)], &str>) {
    let got = parse_trace(text)
        .map(|it| it.iter().map(|a| (a.at_us, a.cost)).collect::<Vec<_>>())
        .map_err(|err| err.to_string());
    match expected {
        Ok(arrivals) => assert_eq!(got, Ok(arrivals.to_vec()), "{text:?}"),
        Err(message) => assert_eq!(got, Err(message.to_owned()), "{text:?}"),
    }
}

#[test]
fn trace_lines() {
    check_trace("", Ok(&[]));
    check_trace(
        "# ms cost\n0\n12.5 3\n\n12.5,2\n1000\t1\n",
        Ok(&[(0, 1), (12_500, 3), (12_500, 2), (1_000_000, 1)]),
    );
    check_trace(
        "0\nsoon\n",
        Err("trace line 2: 'soon' is not a time in milliseconds (a number such as 250 or 12.5)"),
    );
    check_trace(
        "-5\n",
        Err("trace line 1: '-5' is not a time in milliseconds (a number such as 250 or 12.5)"),
    );
    check_trace(
        "1.2345\n",
        Err("trace line 1: '1.2345' is not a time in milliseconds (a number such as 250 or 12.5)"),
    );
    check_trace(
        "10 0\n",
        Err("trace line 1: '0' is not a cost from 1 to 4294967295"),
    );
    check_trace(
        "10 1 2\n",
        Err("trace line 1: unexpected '2': a line is a time and an optional cost"),
    );
    check_trace(
        "10\n9.5\n",
        Err("trace line 2: 9.5 ms is before the previous request"),
    );
    check_trace(
        "99999999999999999999\n",
        Err(
            "trace line 1: '99999999999999999999' is not a time in milliseconds (a number such as 250 or 12.5)",
        ),
    );
}

#[test]
fn pattern_names() {
    assert_eq!(Pattern::from_name("burst", None).unwrap(), Pattern::Burst);
    let err = Pattern::from_name("trace", None).unwrap_err();
    assert_eq!(err.to_string(), "pattern trace needs a file");
    let err = Pattern::from_name("steady", Some("0")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "pattern steady takes no file; only trace does"
    );
    let err = Pattern::from_name("zigzag", None).unwrap_err();
    assert!(err.to_string().starts_with("unknown pattern 'zigzag'"));
}

#[test]
fn isqrt_is_the_floor_of_the_root() {
    for value in [0u128, 1, 2, 3, 4, 15, 16, 17, 1 << 80, (1 << 80) - 1] {
        let root = isqrt(value);
        assert!(
            root * root <= value && (root + 1) * (root + 1) > value,
            "{value}"
        );
    }
}
