//! Fuzzes the WebDataset tar reader (plain and gzip): any bytes give samples or an error, and
//! never a panic, a hang, or an allocation by an unchecked length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut parts = 0usize;
    let _ = granary::ingest::tar_samples(
        data,
        &mut |key, sample| {
            assert!(!sample.is_empty(), "sample {key} has no part");
            parts += sample.len();
            Ok(())
        },
        &mut |_, _| {},
        &mut |_| {},
    );
});
