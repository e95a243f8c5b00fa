use super::*;

fn seats() -> Arc<Seats> {
    Seats::new(crate::metrics::Metrics::new().quota().clone())
}

#[tokio::test]
async fn unreported_streams_beyond_their_budget_displace_the_oldest_never_a_reported_one() {
    let seats = seats();
    let proxy = seats.admit(Some(ConnectionTag(0))).unwrap();
    proxy.reported();
    let mut idle = Vec::new();
    for n in 0..MAX_UNREPORTED_STREAMS {
        idle.push(seats.admit(Some(ConnectionTag(1 + n))).unwrap());
    }
    assert_eq!(
        seats.counts(),
        (1 + MAX_UNREPORTED_STREAMS, MAX_UNREPORTED_STREAMS)
    );
    // One more: the oldest unreported stream is told to end and its
    // seat is free at once; the reported one stays.
    let newest = seats.admit(Some(ConnectionTag(usize::MAX))).unwrap();
    assert_eq!(
        seats.counts(),
        (1 + MAX_UNREPORTED_STREAMS, MAX_UNREPORTED_STREAMS)
    );
    tokio::time::timeout(std::time::Duration::from_secs(1), idle[0].displaced())
        .await
        .expect("the oldest is displaced");
    assert!(
        tokio::time::timeout(std::time::Duration::from_millis(10), proxy.displaced())
            .await
            .is_err()
    );
    // Its drop later counts nothing twice.
    drop(idle.remove(0));
    assert_eq!(
        seats.counts(),
        (1 + MAX_UNREPORTED_STREAMS, MAX_UNREPORTED_STREAMS)
    );
    drop(newest);
    drop(idle);
    drop(proxy);
    assert_eq!(seats.counts(), (0, 0));
}

#[test]
fn a_connection_gets_a_few_unreported_streams_then_is_refused() {
    let seats = seats();
    let tag = Some(ConnectionTag(7));
    let mut open: Vec<_> = (0..MAX_UNREPORTED_PER_CONNECTION)
        .map(|_| seats.admit(tag).unwrap())
        .collect();
    let refused = seats.admit(tag).err().expect("refused");
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(refused.message().contains("not reported"), "{refused:?}");
    // Reported streams make room, up to the connection's bound.
    for seat in &open {
        seat.reported();
    }
    while open.len() < MAX_STREAMS_PER_CONNECTION {
        let seat = seats.admit(tag).unwrap();
        seat.reported();
        open.push(seat);
    }
    let refused = seats.admit(tag).err().expect("refused");
    assert!(refused.message().contains("per connection"), "{refused:?}");
}

#[test]
fn a_full_server_of_reported_streams_refuses() {
    let seats = seats();
    let open: Vec<_> = (0..MAX_STREAMS)
        .map(|n| {
            let seat = seats.admit(Some(ConnectionTag(n))).unwrap();
            seat.reported();
            seat
        })
        .collect();
    let refused = seats.admit(None).err().expect("refused");
    assert!(refused.message().contains("already"), "{refused:?}");
    drop(open);
    assert_eq!(seats.counts(), (0, 0));
}
