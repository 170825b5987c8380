//! Fuzzes the small decoders: manifests, ref files and WebDataset sample records. Each must
//! return an error or a value, and never panic or allocate by an unchecked length.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = granary::manifest::Manifest::decode(data);
    let _ = granary::store::RefLog::decode(data);
    let _ = granary::shard::Sample::decode(data);
});
