use std::time::Duration;

use super::*;
use crate::backends::Progress;
use crate::backends::redis::script::HeaderArgs;

type Answer = oneshot::Receiver<Result<Verdict, Error>>;

fn waiting(send_by: Option<Instant>) -> (QueuedRequest, Answer) {
    queued("k", Duration::ZERO, send_by)
}

/// A request for `key` that has waited `age` of its 1 s timeout.
fn queued(key: &str, age: Duration, send_by: Option<Instant>) -> (QueuedRequest, Answer) {
    let (answer, receiver) = oneshot::channel();
    let call = CallContext {
        send_by: send_by.map(Instant::into_std),
        progress: Progress::new(Stage::Queue),
        late: None,
    };
    let request = Encoded {
        keys: vec![key.to_owned()],
        header: HeaderArgs {
            now_us: None,
            grace_ms: 0,
            receipts: false,
        },
        limits: Vec::new(),
    };
    let answer_by = Instant::now() + Duration::from_secs(1) - age;
    let it = QueuedRequest {
        request,
        terms: CallTerms::new(answer_by, Duration::from_secs(1), send_by, None),
        call,
        answer,
    };
    (it, receiver)
}

/// At the moment a batch is written, each request is looked at on its
/// own: one whose caller has left (its stage given up, or its answer
/// dropped) is never written, nor one whose own moment has passed;
/// the others are, and only they reach `Backend`.
#[tokio::test]
async fn a_batch_writes_only_the_requests_whose_callers_wait_and_have_time() {
    let now = Instant::now();
    let later = now + Duration::from_millis(100);
    let (on_time, _keep_a) = waiting(Some(later));
    let (left, _keep_b) = waiting(Some(later));
    let (dropped, receiver) = waiting(Some(later));
    let (out_of_time, _keep_d) = waiting(Some(now));
    let (no_deadline, _keep_e) = waiting(None);
    // The caller of `left` leaves after the batch was taken from the
    // queue; that of `dropped` drops its end.
    assert_eq!(left.call.progress.leave(), Stage::Queue);
    drop(receiver);
    let batch = [on_time, left, dropped, out_of_time, no_deadline];
    let written = to_write(&batch, now);
    assert_eq!(written, [true, false, false, false, true]);
    let stages: Vec<Stage> = batch.iter().map(|it| it.call.progress.get()).collect();
    assert_eq!(
        stages,
        [
            Stage::Backend,
            Stage::Queue,
            Stage::Queue,
            Stage::Queue,
            Stage::Backend
        ]
    );
    assert!(matches!(batch[3].terms.unsent, Error::Deadline));
    // Nothing to write: nothing is composed.
    let none = compose(
        Engine::Functions,
        LuaEntry::DecideBatch,
        &batch,
        &[false; 5],
    );
    assert!(matches!(none, Err(Error::Deadline)));
}

fn keys(batch: &[QueuedRequest]) -> Vec<&str> {
    batch.iter().map(|it| it.request.keys[0].as_str()).collect()
}

/// A batch takes the oldest requests that can still be written, and
/// answers those whose moment to be written has passed at once,
/// unsent, instead of carrying them to the write only to leave them
/// out there (under overload, a whole batch of them).
#[tokio::test]
async fn a_batch_takes_the_oldest_requests_with_time_left_and_answers_the_others() {
    let settings = BatchSettings {
        max_requests: 2,
        max_keys: 512,
    };
    // The call whose end forms the batch is in flight.
    let mut queue = BatchQueue {
        in_flight: 1,
        keys_in_flight: 1,
        waiting: VecDeque::new(),
    };
    let mut receivers = Vec::new();
    for (key, age) in [("expired", 900), ("old", 500), ("mid", 100), ("new", 0)] {
        let (it, receiver) = queued(key, Duration::from_millis(age), None);
        queue.waiting.push_back(it);
        receivers.push(receiver);
    }
    let batch = queue.next_batch(1, settings, 64);
    assert_eq!(keys(&batch), ["old", "mid"]);
    assert!(matches!(
        receivers[0].try_recv(),
        Ok(Err(Error::Timeout(1000)))
    ));
    assert_eq!(keys(queue.waiting.make_contiguous()), ["new"]);
    assert_eq!((queue.in_flight, queue.keys_in_flight), (1, 2));
}

/// The keys in the calls in flight together stay within
/// `max_keys_in_flight`: a batch takes only what the others leave (at
/// least one request), so a batched Redis has a bounded amount of work
/// ahead of a new call.
#[tokio::test]
async fn batches_in_flight_carry_at_most_their_bound_of_keys() {
    let settings = BatchSettings {
        max_requests: 64,
        max_keys: 512,
    };
    let max_keys_in_flight = 4;
    let mut queue = BatchQueue {
        in_flight: 4,
        keys_in_flight: 4,
        waiting: VecDeque::new(),
    };
    let mut receivers = Vec::new();
    for key in ["a", "b", "c", "d", "e", "f"] {
        let (it, receiver) = queued(key, Duration::ZERO, None);
        queue.waiting.push_back(it);
        receivers.push(receiver);
    }
    let mut next = |done| queue.next_batch(done, settings, max_keys_in_flight);
    // Three keys still in flight (a request of one each): room for one.
    assert_eq!(keys(&next(1)), ["a"]);
    assert_eq!(keys(&next(1)), ["b"]);
    assert_eq!(queue.keys_in_flight, 4);
    // The others' calls end: room for four, and four wait.
    let mut next = |done| queue.next_batch(done, settings, max_keys_in_flight);
    assert_eq!(keys(&next(4)).len(), 4);
    // One more call ends and none waits: its turn is given back.
    assert!(next(1).is_empty());
    assert_eq!((queue.in_flight, queue.keys_in_flight), (3, 3));
}
