use super::*;

#[test]
fn only_a_thread_that_entered_is_a_serving_thread() {
    assert_eq!(current(), None);
    let on_thread = std::thread::spawn(|| {
        enter(3);
        current()
    })
    .join()
    .expect("thread");
    assert_eq!(on_thread, Some(3));
    assert_eq!(current(), None);
}
