//! Fuzzes the shard decoder: arbitrary bytes presented as a shard file must decode to an error
//! or to metadata whose every record range lies in the file, and never panic.
//!
//! Random bytes rarely get past the checksums, so each input is also tried with every checksum
//! recomputed (`fix_checksums`): mutations of the fields behind them then reach the structural
//! checks, the record index and the record ranges.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = granary::shard::fuzz_decode(data);
    let mut fixed = data.to_vec();
    granary::shard::fix_checksums(&mut fixed);
    let _ = granary::shard::fuzz_decode(&fixed);
});
