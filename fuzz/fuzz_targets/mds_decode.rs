//! Fuzzes the MDS reader: an `index.json` and its shard files (plain or compressed), unpacked
//! into a directory, give records or an error, and never a panic, a hang, or an allocation
//! past what the files and the index's bounds allow.
#![no_main]

use granary_fuzz::{Count, unpack};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (dir, _) = unpack(data);
    let Ok(input) = granary::ingest::MdsInput::open(&dir, &[]) else { return };
    let mut count = Count::default();
    if granary::ingest::records_from_mds(&mut count, &input, &()).is_ok() {
        assert!(count.records > 0, "an MDS ingest of no sample succeeded");
    }
});
