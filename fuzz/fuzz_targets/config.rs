//! The `config` target: its body is `throttlegate::fuzzing::config`, which the
//! proptest twins in `src/fuzzing/tests.rs` run too.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| throttlegate::fuzzing::config(data));
