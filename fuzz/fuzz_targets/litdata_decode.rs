//! Fuzzes the LitData reader: an `index.json` and its chunks (leaves, an Arrow footer, tokens;
//! plain or zstd), unpacked into a directory, give records or an error, and never a panic, a
//! hang, or an allocation past what the files and the index's bounds allow. The flags' low bit
//! cuts a token stream into blocks of 8.
#![no_main]

use granary_fuzz::{Count, unpack};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (dir, flags) = unpack(data);
    let block = (flags & 1 == 1).then_some(8);
    let Ok(input) = granary::ingest::LitDataInput::open(&dir, &[], block) else { return };
    let mut count = Count::default();
    if granary::ingest::records_from_litdata(&mut count, &input, &()).is_ok() {
        assert!(count.records > 0, "a LitData ingest of no item succeeded");
    }
});
