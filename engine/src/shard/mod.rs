//! The shard format: content-addressed, checksummed files of records.
//!
//! A shard is a header block, a data region of 4 KiB blocks (each with a CRC32C seeded by its
//! index), a record index, a checksum table and a footer, every region 4 KiB aligned; its id is
//! the BLAKE3 hash of the whole file. `docs/format.md` draws the bytes.
//!
//! Owns: encoding (`ShardWriter`), decoding and verifying metadata (`ShardMeta`), the per-block
//! check, and the record encodings (`Layout`, `Sample`). Invariants: a shard is immutable once
//! written; no byte of it escapes a checksum. Never: knows where files live (the store does),
//! reads data blocks (the io module does; `ShardMeta::read` reads only the metadata, with plain
//! positioned reads), or knows anything of plugins.

mod format;
mod layout;
mod meta;
mod sample;
mod writer;

#[cfg(test)]
pub(crate) mod tests;

pub use format::{
    BLOCK_BYTES, BLOCK_BYTES_U64, CHECK_RUN_BLOCKS, DATA_OFFSET, FILE_BYTES_MAX, FOOTER_MAGIC, FORMAT_VERSION, Footer,
    HEADER_MAGIC, block_crc, blocks_match, padded,
};
pub use layout::{Dtype, FIXED_RECORD_BYTES_MAX, FixedLayout, LAYOUT_BYTES, Layout, SHAPE_DIMS_MAX};
pub use meta::{MetaDigest, ShardMeta, check_file_bytes};
pub use sample::{Sample, encode_sample};
pub use writer::{ShardWriter, WRITE_CHUNK_BYTES, WrittenShard};

pub(crate) use layout::{read_u32, read_u64};

/// The CRC32C used by every checksum of the format (Castagnoli, hardware-accelerated).
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// Rewrites every checksum of bytes presented as a shard file (the header's, each data block's
/// as far as the footer's counts reach, the record index's, the checksum table's, the footer's)
/// so that a fuzzer's mutations get past them to the structural checks behind. Does nothing to
/// bytes too short or misaligned to hold a header and a footer; never panics.
pub fn fix_checksums(bytes: &mut [u8]) {
    let len = bytes.len();
    if len < 2 * BLOCK_BYTES || !len.is_multiple_of(BLOCK_BYTES) {
        return;
    }
    let seal = |block: &mut [u8]| {
        let crc = crc32c::crc32c(&block[..BLOCK_BYTES - 4]);
        block[BLOCK_BYTES - 4..BLOCK_BYTES].copy_from_slice(&crc.to_le_bytes());
    };
    seal(&mut bytes[..BLOCK_BYTES]);
    let header_crc = read_u32(bytes, BLOCK_BYTES - 4);
    let footer_at = len - BLOCK_BYTES;
    let field = |bytes: &[u8], at: usize| usize::try_from(read_u64(bytes, footer_at + at)).unwrap_or(usize::MAX);
    let (n_blocks, index_at, table_at) = (field(bytes, 40), field(bytes, 48), field(bytes, 64));
    let regions_fit = BLOCK_BYTES <= index_at && index_at <= table_at && table_at <= footer_at;
    if regions_fit {
        let data_blocks = (index_at - BLOCK_BYTES) / BLOCK_BYTES;
        for block in 0..n_blocks.min(data_blocks).min((footer_at - table_at) / 4) {
            let start = BLOCK_BYTES * (block + 1);
            let crc = block_crc(block as u64, &bytes[start..start + BLOCK_BYTES]);
            bytes[table_at + 4 * block..table_at + 4 * block + 4].copy_from_slice(&crc.to_le_bytes());
        }
        let index_crc = crc32c::crc32c(&bytes[index_at..table_at]);
        let table_crc = crc32c::crc32c(&bytes[table_at..footer_at]);
        bytes[footer_at + 88..footer_at + 92].copy_from_slice(&header_crc.to_le_bytes());
        bytes[footer_at + 92..footer_at + 96].copy_from_slice(&index_crc.to_le_bytes());
        bytes[footer_at + 96..footer_at + 100].copy_from_slice(&table_crc.to_le_bytes());
    }
    seal(&mut bytes[footer_at..]);
}

/// Checks everything a decoder can check about arbitrary bytes presented as a shard file: the
/// metadata, every data block, every record range and, for samples, every sample encoding. It
/// never panics, whatever the input; the fuzz target calls it.
pub fn fuzz_decode(bytes: &[u8]) -> Result<u64, crate::error::FormatError> {
    let meta = check_file_bytes(bytes)?;
    let data = &bytes[BLOCK_BYTES..];
    let mut total = 0u64;
    for local in 0..meta.n_records() {
        let range = meta.record_range(local);
        let record =
            &data[usize::try_from(range.start).expect("in file")..usize::try_from(range.end).expect("in file")];
        if matches!(meta.layout(), Layout::Samples) {
            Sample::decode(record)?;
        }
        total += record.len() as u64;
    }
    Ok(total)
}
