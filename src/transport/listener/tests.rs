use super::*;

#[test]
fn caps_leave_the_reserve_free_and_favour_grpc() {
    let check = |limit, reserve, expected| {
        assert_eq!(
            DescriptorBudget { limit, reserve }.default_caps(),
            expected,
            "limit {limit}, reserve {reserve}"
        );
    };
    check(1024, 136, (666, 222));
    check(1_048_576, 136, (1_048_576 - 136 - 1024, 1024));
    // Below the reserve every port still gets one connection.
    check(100, 136, (1, 1));
}

#[tokio::test]
async fn watchdog_moves_from_idle_to_head_and_settles_on_a_request() {
    let watchdog = Watchdog::new(Some(Duration::from_secs(5)));
    let first = watchdog.deadline().expect("armed at accept");
    watchdog.request_started();
    assert_eq!(watchdog.deadline(), None);
    watchdog.idle(Duration::from_secs(60), Duration::from_secs(2));
    let idle = watchdog.deadline().expect("idle deadline");
    assert!(idle > first);
    watchdog.bytes_read();
    let head = watchdog.deadline().expect("head deadline");
    assert!(head < idle, "the head deadline replaces the idle one");
    // Further bytes of the same head do not extend it.
    watchdog.bytes_read();
    assert_eq!(watchdog.deadline(), Some(head));
}
