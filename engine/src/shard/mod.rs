//! The shard format: content-addressed, checksummed files of records.
//!
//! A shard is a header block, a data region of 4 KiB blocks (each with a CRC32C seeded by its
//! index), a record index, a checksum table and a footer, every region 4 KiB aligned; its id is
//! the BLAKE3 hash of the whole file. `docs/format.md` draws the bytes.
//!
//! Owns: encoding (`ShardWriter`), decoding and verifying metadata (`ShardMeta`), the per-block
//! check, and the record encodings (`Layout`, `Sample`). Invariants: a shard is immutable once
//! written; no byte of it escapes a checksum. Never: knows where files live (the store does),
//! how they are read (the io module does), or anything of plugins.

mod format;
mod layout;
mod meta;
mod sample;
mod writer;

#[cfg(test)]
mod tests;

pub use format::{
    BLOCK_BYTES, BLOCK_BYTES_U64, DATA_OFFSET, FOOTER_MAGIC, FORMAT_VERSION, Footer, HEADER_MAGIC, block_crc, padded,
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
