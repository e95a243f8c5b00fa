use std::time::{Duration, UNIX_EPOCH};

use super::*;

fn at(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(seconds)
}

#[test]
fn shows_the_source_and_the_load_time() {
    let status = ConfigStatus::new(Some(PathBuf::from("/etc/rules")), at(1_796_310_000));
    assert_eq!(
        status.render(),
        "source: /etc/rules\nloaded: Thu, 03 Dec 2026 15:00:00 GMT\n\n"
    );
    let none = ConfigStatus::new(None, at(0));
    assert!(
        none.render()
            .starts_with("source: none (no --config given)\n")
    );
}

#[test]
fn a_refusal_shows_until_a_good_reload_and_keeps_the_load_time() {
    let status = ConfigStatus::new(Some(PathBuf::from("c.yaml")), at(100));
    status.record_refused(
        at(200),
        "c.yaml: unknown key 'ratelimit'\nsecond line".into(),
    );
    assert_eq!(status.loaded_at(), at(100));
    let text = status.render();
    assert!(
        text.contains("last reload refused: Thu, 01 Jan 1970 00:03:20 GMT"),
        "{text}"
    );
    assert!(
        text.contains("\n  c.yaml: unknown key 'ratelimit'\n  second line\n"),
        "{text}"
    );

    // Valid but unchanged: the refusal is gone, the load time stays.
    status.record_loaded(at(300), false);
    assert_eq!(status.refused(), None);
    assert_eq!(status.loaded_at(), at(100));
    status.record_loaded(at(400), true);
    assert_eq!(status.loaded_at(), at(400));
}
