//! The `decision` target: its body is `throttlegate::fuzzing::decision`, which the
//! proptest twins in `src/fuzzing/tests.rs` run too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| throttlegate::fuzzing::decision(data));
