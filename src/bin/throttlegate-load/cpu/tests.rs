use super::*;

#[test]
fn utime_and_stime_are_fields_14_and_15() {
    let stat = "1234 (redis-server) S 1 1234 1234 0 -1 4194560 389 0 0 0 \
                    250 37 0 0 20 0 5 0 12345 1000 200 18446744073709551615";
    assert_eq!(parse_stat_ticks(stat), Some(287));
}

#[test]
fn a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields() {
    let stat = "77 (a) b (c d) R 1 77 77 0 -1 0 0 0 0 0 5 6 0 0 20 0 1 0 1 1 1";
    assert_eq!(parse_stat_ticks(stat), Some(11));
}

#[test]
fn a_truncated_or_garbled_line_gives_nothing() {
    assert_eq!(parse_stat_ticks(""), None);
    assert_eq!(parse_stat_ticks("1 (x) S 1 2 3"), None);
    assert_eq!(parse_stat_ticks("1 (x) S 1 1 1 0 -1 0 0 0 0 0 x 6"), None);
    assert_eq!(
        parse_stat_ticks("no parenthesis 1 2 3 4 5 6 7 8 9 10 11 12 13"),
        None
    );
}

#[test]
fn this_process_has_a_readable_stat_and_clock() {
    assert!(own_ticks().is_some());
    assert!(process_ticks(std::process::id()).is_some());
    assert!(clock_ticks_per_second() >= 1);
}

#[test]
fn the_clock_tick_rate_is_read_from_its_auxv_entry() {
    let words = [6usize, 4096, 17, 250, 0, 0];
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    assert_eq!(clock_ticks_from_auxv(&bytes), Some(250));
    let without: Vec<u8> = [6usize, 4096, 0, 0]
        .iter()
        .flat_map(|w| w.to_ne_bytes())
        .collect();
    assert_eq!(clock_ticks_from_auxv(&without), None);
}
