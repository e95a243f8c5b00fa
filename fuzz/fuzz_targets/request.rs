//! The `request` target: its body is `throttlegate::fuzzing::request`, which the
//! proptest twins in `src/fuzzing/tests.rs` run too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| throttlegate::fuzzing::request(data));
