use super::*;
use crate::simulate::Event;

fn report() -> Report {
    let event = |at_us, allowed, remaining| Event {
        at_us,
        cost: 1,
        allowed,
        remaining,
    };
    Report {
        rule: "domain a<b, descriptor k=\"v\"&: 2/second (fixed_window)".to_owned(),
        pattern: "steady (1.5x the limit)".to_owned(),
        duration_us: 2_000_000,
        window_us: 1_000_000,
        requests: 4,
        lanes: vec![Lane {
            label: "fixed_window".to_owned(),
            quota: vec![
                (0, 1),
                (400_000, 0),
                (800_000, 0),
                (1_000_000, 2),
                (1_200_000, 1),
            ],
            events: vec![
                event(0, true, 1),
                event(400_000, true, 0),
                event(800_000, false, 0),
                event(1_200_000, true, 1),
            ],
            capacity: 2,
            allowed: 3,
            denied: 1,
            most_in_window: 2,
        }],
        warnings: Vec::new(),
    }
}

#[test]
fn lanes_carry_their_counts_and_one_tick_per_request() {
    let svg = render(&report());
    assert!(svg.contains(
        r#"<g class="lane" data-algorithm="fixed_window" data-allowed="3" data-denied="1" data-most-in-window="2" data-capacity="2">"#
    ), "{svg}");
    let allowed = svg
        .lines()
        .find(|it| it.contains(r#"class="allowed""#))
        .unwrap();
    assert_eq!(allowed.matches(" v12").count(), 3, "{allowed}");
    let denied = svg
        .lines()
        .find(|it| it.contains(r#"class="denied""#))
        .unwrap();
    assert_eq!(denied.matches(" v12").count(), 1, "{denied}");
    // One boundary at 1 s, in the middle of the plot.
    assert!(
        svg.contains(r##"<path d="M542.5 74.0 V174.0" stroke="#999999""##),
        "{svg}"
    );
}

#[test]
fn text_is_escaped() {
    let svg = render(&report());
    assert!(
        svg.contains("domain a&lt;b, descriptor k=&quot;v&quot;&amp;:"),
        "{svg}"
    );
    assert!(!svg.contains("a<b"));
    assert_eq!(escape("a\u{1}b'"), "a\u{fffd}b&apos;");
}

#[test]
fn the_quota_line_steps_from_capacity_to_zero() {
    let svg = render(&report());
    let quota = svg
        .lines()
        .find(|it| it.contains(r#"class="quota""#))
        .unwrap();
    // Lane top 70 + 8: capacity 2 at y 78, 1 at 106, 0 at 134; 2 s
    // over x 205 to 880.
    let path = "M205.0 106.0 H340.0 V134.0 H475.0 H542.5 V78.0 H610.0 V106.0 H880.0";
    assert!(quota.contains(&format!(r#"d="{path}""#)), "{quota}");
}

#[test]
fn axis_ticks_are_round_seconds() {
    assert_eq!(tick_step_us(4_000_000), 500_000);
    assert_eq!(tick_step_us(10_000_000), 1_000_000);
    assert_eq!(tick_step_us(240_000_000), 50_000_000);
    assert_eq!(tick_step_us(1), 1);
}
