use super::*;

/// The address of the core the calling thread sends through.
fn core_address(backend: &RedisBackend) -> usize {
    Arc::as_ptr(backend.core()) as usize
}

/// Each serving thread gets a core of its own, made once, on its first
/// call; other threads, and serving threads beyond those the backend
/// was told of, use the shared one.
#[test]
fn each_serving_thread_sends_through_a_core_of_its_own() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let settings = RedisSettings {
        // Nothing listens there; connecting is not needed to route.
        url: "redis://127.0.0.1:1".to_owned(),
        sentinel: None,
        pool_size: 1,
        timeout_ms: 100,
        key_prefix: "t".to_owned(),
        clock: ClockSource::Redis,
        expiry_grace_ms: 0,
        batch: None,
        tls: RedisTls::default(),
    };
    let backend = runtime
        .block_on(RedisBackend::connect(settings))
        .expect("backend")
        .with_serving_threads(2);
    let backend = Arc::new(backend);
    let shared = runtime.block_on(async { core_address(&backend) });
    let on_thread = |index: usize| {
        let backend = backend.clone();
        std::thread::spawn(move || {
            crate::serving_thread::enter(index);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async { [core_address(&backend), core_address(&backend)] })
        })
        .join()
        .expect("thread")
    };
    let [first, again] = on_thread(0);
    let [second, _] = on_thread(1);
    let [beyond, _] = on_thread(2);
    assert_eq!(first, again, "a thread keeps its core");
    assert_ne!(first, shared);
    assert_ne!(second, shared);
    assert_ne!(first, second);
    assert_eq!(beyond, shared);
    assert_eq!(on_thread(0)[0], first, "made once per serving thread");
}
