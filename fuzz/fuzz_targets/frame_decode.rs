//! Fuzzes the replication frame decoder: whatever the bytes (an authenticated peer can send any
//! plaintext), decoding returns a frame or an error, never panics, never allocates by a length
//! it has not checked, and a frame that decodes re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    granary::replication::frame::fuzz_decode(data);
});
