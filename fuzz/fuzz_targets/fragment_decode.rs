//! Fuzzes the fragment decoder: whatever bytes a peer sends as a fragment of a shard, checking
//! them returns a fragment or an error, never panics, never allocates by a length it has not
//! checked against the bytes, and a header that checks out encodes back to the same block.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    granary::erasure::fuzz_decode(data);
});
