//! Which serving thread (`--grpc-threads`) the running code is on, for what
//! keeps state per thread: the Redis backend gives each serving thread its
//! own connections, made on that thread's runtime, so that a call and its
//! answer never leave the thread that serves the request.
//!
//! A serving thread says which it is once, when it starts; every other
//! thread (the shared runtime's workers, the blocking pool, tests) is none.

use std::cell::Cell;

thread_local! {
    static INDEX: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Marks the calling thread as serving thread `index`, for its lifetime.
pub fn enter(index: usize) {
    INDEX.with(|it| it.set(Some(index)));
}

/// The serving thread the caller runs on; `None` off the serving threads.
pub fn current() -> Option<usize> {
    INDEX.with(Cell::get)
}

#[cfg(test)]
mod tests;
