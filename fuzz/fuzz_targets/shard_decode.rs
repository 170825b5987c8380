//! Fuzzes the shard decoder: arbitrary bytes presented as a shard file must decode to an error
//! or to metadata whose every record range lies in the file, and never panic.
//!
//! Random bytes rarely get past the header and footer checksums, so each input is also tried
//! with those two checksums recomputed: mutations of the fields behind them then reach the
//! structural checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = granary::shard::fuzz_decode(data);
    let block = granary::shard::BLOCK_BYTES;
    if data.len() >= 2 * block && data.len() % block == 0 {
        let mut fixed = data.to_vec();
        let header_crc = crc32c(&fixed[..block - 4]);
        fixed[block - 4..block].copy_from_slice(&header_crc.to_le_bytes());
        let footer = fixed.len() - block;
        let footer_crc = crc32c(&fixed[footer..fixed.len() - 4]);
        let end = fixed.len();
        fixed[end - 4..].copy_from_slice(&footer_crc.to_le_bytes());
        let _ = granary::shard::fuzz_decode(&fixed);
    }
});

fn crc32c(bytes: &[u8]) -> u32 {
    granary::shard::crc32c(bytes)
}
