use super::*;

fn queues(
    n: usize,
) -> (
    Vec<mpsc::UnboundedSender<u32>>,
    Vec<mpsc::UnboundedReceiver<u32>>,
) {
    (0..n).map(|_| mpsc::unbounded_channel()).unzip()
}

fn drain(rx: &mut mpsc::UnboundedReceiver<u32>) -> Vec<u32> {
    let mut out = Vec::new();
    while let Ok(item) = rx.try_recv() {
        out.push(item);
    }
    out
}

#[tokio::test]
async fn items_are_dealt_in_turn() {
    let (tx, mut rx) = queues(3);
    deal(futures_util::stream::iter(0..7), tx, std::future::pending()).await;
    assert_eq!(drain(&mut rx[0]), [0, 3, 6]);
    assert_eq!(drain(&mut rx[1]), [1, 4]);
    assert_eq!(drain(&mut rx[2]), [2, 5]);
}

#[tokio::test]
async fn a_queue_without_receiver_is_skipped_and_none_left_ends_dealing() {
    let (tx, mut rx) = queues(3);
    let gone = rx.remove(1);
    drop(gone);
    deal(futures_util::stream::iter(0..4), tx, std::future::pending()).await;
    assert_eq!(drain(&mut rx[0]), [0, 2]);
    assert_eq!(drain(&mut rx[1]), [1, 3]);

    let (tx, rx) = queues(2);
    drop(rx);
    // An endless stream: dealing ends because no queue is left.
    deal(futures_util::stream::iter(0..), tx, std::future::pending()).await;
}

#[tokio::test]
async fn dealing_stops_when_asked_and_drops_the_queues() {
    let (tx, mut rx) = queues(2);
    let (stop, stopped) = oneshot::channel::<()>();
    let items = futures_util::stream::iter(0..2).chain(futures_util::stream::pending());
    let dealing = tokio::spawn(deal(items, tx, async {
        let _ = stopped.await;
    }));
    assert_eq!(rx[0].recv().await, Some(0));
    assert_eq!(rx[1].recv().await, Some(1));
    stop.send(()).unwrap();
    dealing.await.unwrap();
    assert_eq!(rx[0].recv().await, None, "queue closed");
    assert_eq!(rx[1].recv().await, None, "queue closed");
}
