use std::time::Duration;

use futures_util::FutureExt;

use super::*;

#[tokio::test]
async fn beyond_the_permits_and_the_line_calls_are_shed_at_once() {
    let gate = Gate::new(2, 3);
    let deadline = Instant::now() + Duration::from_millis(100);
    let a = gate.enter(deadline).await.expect("first permit");
    let _b = gate.enter(deadline).await.expect("second permit");
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let wait = Box::pin(gate.enter(deadline));
        waiters.push(wait);
    }
    // Poll each waiter once so it takes its place in line.
    for wait in &mut waiters {
        assert!(wait.as_mut().now_or_never().is_none());
    }
    assert_eq!(gate.enter(deadline).await.err(), Some(NotAdmitted::Shed));
    drop(a);
    let mut waiters = waiters.into_iter();
    let first = waiters.next().expect("three waiters");
    let _first = first
        .await
        .expect("the oldest waiter gets the freed permit");
    // Its place in line can be taken again.
    let mut again = Box::pin(gate.enter(deadline));
    assert!(again.as_mut().now_or_never().is_none());
    assert_eq!(gate.enter(deadline).await.err(), Some(NotAdmitted::Shed));
    // No permit is released any more: the others wait until their
    // deadline and are refused as expired, never shed.
    for wait in waiters {
        assert_eq!(wait.await.err(), Some(NotAdmitted::Expired));
    }
    assert_eq!(again.await.err(), Some(NotAdmitted::Expired));
    assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_wait_ends_at_its_deadline() {
    let gate = Gate::new(1, 10);
    let _held = gate.enter(Instant::now()).await.expect("a free permit");
    let started = Instant::now();
    let res = gate.enter(started + Duration::from_millis(50)).await;
    assert_eq!(res.err(), Some(NotAdmitted::Expired));
    assert!(started.elapsed() >= Duration::from_millis(50));
    assert_eq!(gate.waiting.load(Ordering::SeqCst), 0);
}

/// A written call whose caller stops waiting keeps its permit until
/// the reply comes, then gives it back.
#[tokio::test]
async fn a_written_call_keeps_its_place_until_its_reply() {
    let gate = Gate::new(1, 0);
    let permit = gate.enter(Instant::now()).await.expect("a free permit");
    let (reply, replied) = tokio::sync::oneshot::channel::<u32>();
    let lost = Arc::new(AtomicBool::new(false));
    let mut written = Box::pin(Written::new(
        permit,
        replied,
        Some(lost.clone()),
        UNANSWERED_AFTER,
    ));
    assert!(written.as_mut().now_or_never().is_none());
    // The caller gives up.
    drop(written);
    tokio::task::yield_now().await;
    assert_eq!(gate.permits.available_permits(), 0, "given back early");
    reply.send(7).expect("the call still waits for its reply");
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert_eq!(gate.permits.available_permits(), 1);
    assert!(!lost.load(Ordering::SeqCst));
}

/// A reply that never comes frees the place after `unanswered_after`
/// (`UNANSWERED_AFTER` in the service) and marks the connection lost.
#[tokio::test]
async fn a_call_never_answered_frees_its_place_and_loses_its_connection() {
    let gate = Gate::new(1, 0);
    let permit = gate.enter(Instant::now()).await.expect("a free permit");
    let lost = Arc::new(AtomicBool::new(false));
    let within = Duration::from_millis(200);
    let written = Written::new(
        permit,
        std::future::pending::<()>(),
        Some(lost.clone()),
        within,
    );
    drop(written);
    tokio::time::sleep(within / 4).await;
    assert_eq!(gate.permits.available_permits(), 0);
    assert!(!lost.load(Ordering::SeqCst));
    tokio::time::sleep(within * 2).await;
    assert_eq!(gate.permits.available_permits(), 1);
    assert!(lost.load(Ordering::SeqCst));
}

/// The rest of a call whose caller stopped waiting yields its reply
/// when it comes within `unanswered_after` (a late reply, counted),
/// and nothing past it: a reply later than that grace is never seen.
#[tokio::test]
async fn a_late_reply_is_handed_over_within_the_grace_only() {
    let gate = Gate::new(2, 0);
    let within = Duration::from_millis(200);
    let lost = Arc::new(AtomicBool::new(false));
    let (reply, replied) = tokio::sync::oneshot::channel::<u32>();
    let permit = gate.enter(Instant::now()).await.expect("a free permit");
    let in_time = Written::new(permit, replied, Some(lost.clone()), within).outlive();
    let in_time = tokio::spawn(in_time);
    tokio::time::sleep(within / 4).await;
    assert_eq!(gate.permits.available_permits(), 1, "its place is kept");
    reply.send(7).expect("awaited");
    assert_eq!(in_time.await.expect("task").map(Result::ok), Some(Some(7)));
    assert_eq!(gate.permits.available_permits(), 2);

    let (reply, replied) = tokio::sync::oneshot::channel::<u32>();
    let permit = gate.enter(Instant::now()).await.expect("a free permit");
    let too_late =
        tokio::spawn(Written::new(permit, replied, Some(lost.clone()), within).outlive());
    tokio::time::sleep(within * 2).await;
    let _ = reply.send(8);
    assert_eq!(too_late.await.expect("task").map(Result::ok), None);
    assert!(lost.load(Ordering::SeqCst), "the connection is retired");
    assert_eq!(gate.permits.available_permits(), 2);
}

#[test]
fn a_single_server_gate_does_not_depend_on_the_pool() {
    let gate = Gate::for_server();
    assert_eq!(gate.max_in_flight(), MAX_IN_FLIGHT);
    assert_eq!(gate.max_waiting(), MAX_WAITING);
}

#[test]
fn bounds_follow_the_pool_size() {
    let gate = Gate::for_pool(8);
    assert_eq!(gate.max_in_flight(), 8 * IN_FLIGHT_PER_CONNECTION);
    assert_eq!(gate.max_waiting(), 8 * WAITING_PER_CONNECTION);
    assert_eq!(Gate::for_pool(0).max_in_flight(), IN_FLIGHT_PER_CONNECTION);
}
