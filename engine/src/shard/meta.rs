//! A shard's decoded and verified metadata: layout, counts, record index and block checksums.
//!
//! Owns: decoding the header, footer, record-index and checksum-table regions, and the per-block
//! check that the read path runs on every block before its bytes are used. Invariant: a
//! `ShardMeta` exists only after every metadata region passed its CRC32C and every offset was
//! checked against the file length, so `record_range` and `expected_crc` cannot go out of bounds
//! for an in-range argument. Never: reads data blocks itself (the `io` module does that).

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, FormatError, Result};

use super::format::{
    BLOCK_BYTES, BLOCK_BYTES_U64, CRC_ENTRY_BYTES, DATA_OFFSET, Footer, INDEX_ENTRY_BYTES, TAIL_BYTES_MAX, block_crc,
    blocks_match, decode_header, padded,
};
use super::layout::{Layout, read_u32, read_u64};

/// Verified metadata of one shard file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardMeta {
    layout: Layout,
    footer: Footer,
    /// CRC32C of each data block, seeded with the block index.
    block_crcs: Vec<u32>,
    /// End offset of each record in the data region (variable layouts; empty for fixed ones).
    record_ends: Vec<u64>,
    /// BLAKE3 of the header block, the tail (index and checksum table) and the footer block.
    digest: MetaDigest,
}

/// The BLAKE3 hash of a shard's metadata: its header block, record index, checksum table and
/// footer block. It binds every block checksum, so a manifest that records it can tell a shard
/// from any other shard of the same shape without hashing the data.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MetaDigest(pub [u8; 32]);

impl MetaDigest {
    /// The digest of the three metadata pieces.
    pub fn of(header: &[u8], tail: &[u8], footer: &[u8]) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(header);
        hasher.update(tail);
        hasher.update(footer);
        Self(*hasher.finalize().as_bytes())
    }
}

impl std::fmt::Debug for MetaDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MetaDigest({})", crate::id::ObjectId::from_bytes(self.0).short(16))
    }
}

impl std::fmt::Display for MetaDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&crate::id::ObjectId::from_bytes(self.0), f)
    }
}

impl ShardMeta {
    /// Decodes the metadata from its three pieces: the header block, the footer block, and the
    /// bytes from `footer.index_offset` to the footer (see [`ShardMeta::tail_range`]).
    pub fn decode(header: &[u8], footer_block: &[u8], tail: &[u8], file_bytes: u64) -> Result<Self, FormatError> {
        let (layout, header_crc) = decode_header(header)?;
        let footer = Footer::decode(footer_block, &layout, file_bytes)?;
        if footer.header_crc != header_crc {
            return Err(FormatError::ChecksumMismatch {
                region: "header copy in footer",
                expected: footer.header_crc,
                actual: header_crc,
            });
        }
        let tail_range = Self::tail_range(&footer);
        let tail_bytes = tail_range.end - tail_range.start;
        if tail.len() as u64 != tail_bytes {
            return Err(FormatError::Truncated {
                region: "shard index and checksum table",
                detail: format!("{} bytes, expected {tail_bytes}", tail.len()),
            });
        }
        let index_padded = usize::try_from(padded(footer.index_bytes)).expect("bounded by the tail length");
        let (index_region, crc_region) = tail.split_at(index_padded);
        check_region_crc("record index", index_region, footer.index_crc)?;
        check_region_crc("checksum table", crc_region, footer.crc_table_crc)?;

        let n_blocks = usize::try_from(footer.n_data_blocks).expect("bounded by the tail length");
        let block_crcs: Vec<u32> =
            crc_region.chunks_exact(CRC_ENTRY_BYTES as usize).take(n_blocks).map(|c| read_u32(c, 0)).collect();
        let record_ends: Vec<u64> = if layout.is_variable() {
            let n_records = usize::try_from(footer.n_records).expect("bounded by the tail length");
            let ends = index_region.chunks_exact(INDEX_ENTRY_BYTES as usize).take(n_records).map(|c| read_u64(c, 0));
            let ends: Vec<u64> = ends.collect();
            check_record_ends(&ends, footer.data_bytes, layout.element_bytes())?;
            ends
        } else {
            Vec::new()
        };
        let digest = MetaDigest::of(header, tail, footer_block);
        Ok(Self { layout, footer, block_crcs, record_ends, digest })
    }

    /// Decodes the metadata of a whole shard file held in memory (tests, fuzzing, verification).
    pub fn from_file_bytes(file: &[u8]) -> Result<Self, FormatError> {
        Self::load(
            file.len() as u64,
            |offset, len| {
                let start = usize::try_from(offset).expect("load reads within the file length");
                let end = usize::try_from(offset + len).expect("load reads within the file length");
                Ok(file[start..end].to_vec())
            },
            |source| source,
        )
    }

    /// Reads and decodes the metadata of a shard file with three positioned reads.
    pub fn read(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let file_bytes = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
        Self::load(
            file_bytes,
            |offset, len| {
                let len = usize::try_from(len).map_err(|_| Error::invalid_input("shard too large"))?;
                let mut buf = vec![0u8; len];
                file.read_exact_at(&mut buf, offset).map_err(|e| Error::io("read", path, e))?;
                Ok(buf)
            },
            |source| Error::Format { path: path.to_owned(), source },
        )
    }

    /// Decodes through `read_at(offset, len)`, which is only asked for ranges inside
    /// `file_bytes`: the header, the footer, then the tail the footer points at.
    pub(crate) fn load<E>(
        file_bytes: u64,
        mut read_at: impl FnMut(u64, u64) -> Result<Vec<u8>, E>,
        format: impl Fn(FormatError) -> E,
    ) -> Result<Self, E> {
        check_file_length(file_bytes).map_err(&format)?;
        let header = read_at(0, BLOCK_BYTES_U64)?;
        let footer_block = read_at(file_bytes - BLOCK_BYTES_U64, BLOCK_BYTES_U64)?;
        let (layout, _) = decode_header(&header).map_err(&format)?;
        let footer = Footer::decode(&footer_block, &layout, file_bytes).map_err(&format)?;
        let tail = Self::tail_range(&footer);
        if tail.end - tail.start > TAIL_BYTES_MAX {
            return Err(format(FormatError::Inconsistent {
                field: "index and checksum table",
                detail: format!("{} bytes, at most {TAIL_BYTES_MAX}", tail.end - tail.start),
            }));
        }
        let tail = read_at(tail.start, tail.end - tail.start)?;
        Self::decode(&header, &footer_block, &tail, file_bytes).map_err(format)
    }

    /// The byte range holding the record index and the checksum table, up to the footer.
    pub fn tail_range(footer: &Footer) -> Range<u64> {
        footer.index_offset..footer.footer_offset()
    }

    /// What the records are.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Records in the shard.
    pub fn n_records(&self) -> u64 {
        self.footer.n_records
    }

    /// Bytes of record data.
    pub fn data_bytes(&self) -> u64 {
        self.footer.data_bytes
    }

    /// Blocks in the data region.
    pub fn n_data_blocks(&self) -> u64 {
        self.footer.n_data_blocks
    }

    /// Length of the whole file.
    pub fn file_bytes(&self) -> u64 {
        self.footer.file_bytes
    }

    /// The digest of the metadata, which manifests record.
    pub fn digest(&self) -> MetaDigest {
        self.digest
    }

    /// The decoded footer.
    pub fn footer(&self) -> &Footer {
        &self.footer
    }

    /// The byte range of record `local` within the data region.
    ///
    /// # Panics
    /// If `local >= n_records()`: callers map dataset indices to shards and check them first.
    pub fn record_range(&self, local: u64) -> Range<u64> {
        assert!(local < self.footer.n_records, "record {local} of a shard with {}", self.footer.n_records);
        match self.layout.record_bytes() {
            Some(record_bytes) => local * record_bytes..(local + 1) * record_bytes,
            None => {
                let local = usize::try_from(local).expect("index length fits in memory");
                let start = if local == 0 { 0 } else { self.record_ends[local - 1] };
                start..self.record_ends[local]
            }
        }
    }

    /// The file offset of data block `block`.
    pub fn block_offset(block: u64) -> u64 {
        DATA_OFFSET + block * BLOCK_BYTES_U64
    }

    /// The stored CRC32C of data block `block` (which must be `< n_data_blocks()`).
    pub fn expected_crc(&self, block: u64) -> u32 {
        self.block_crcs[usize::try_from(block).expect("block index fits in memory")]
    }

    /// The CRC32C (`crc32c::crc32c`) that data block `block`'s bytes alone must have, from its
    /// stored checksum (which is seeded with the block's index); `None` past the data blocks.
    pub fn expected_bytes_crc(&self, block: u64) -> Option<u32> {
        let stored = *self.block_crcs.get(usize::try_from(block).ok()?)?;
        Some(super::format::bytes_crc(block, stored))
    }

    /// Checks data block `block` against its stored checksum; on a mismatch returns
    /// `(expected, actual)`.
    pub fn check_block(&self, block: u64, bytes: &[u8]) -> Result<(), (u32, u32)> {
        debug_assert_eq!(bytes.len(), BLOCK_BYTES);
        let expected = self.expected_crc(block);
        let actual = block_crc(block, bytes);
        if expected == actual { Ok(()) } else { Err((expected, actual)) }
    }

    /// Checks data block `block` given as three consecutive parts that make it up (`head`, `body`,
    /// `tail`): a record copied out of a block is checked where it now lies, with the rest of the
    /// block from where it came. On a mismatch returns `(expected, actual)`.
    pub fn check_block_parts(&self, block: u64, [head, body, tail]: [&[u8]; 3]) -> Result<(), (u32, u32)> {
        debug_assert_eq!(head.len() + body.len() + tail.len(), BLOCK_BYTES);
        let expected = self.expected_crc(block);
        let actual = crc32c::crc32c_append(crc32c::crc32c_append(block_crc(block, head), body), tail);
        if expected == actual { Ok(()) } else { Err((expected, actual)) }
    }

    /// Checks consecutive data blocks starting at `first_block`; returns the first bad one as
    /// `(block, expected, actual)`. Runs of blocks are checked in one pass each (`blocks_match`);
    /// when one fails, the blocks are checked again one by one from `first_block`, to name the
    /// first bad one (the error path only).
    pub fn check_blocks(&self, first_block: u64, bytes: &[u8]) -> Result<(), (u64, u32, u32)> {
        debug_assert_eq!(bytes.len() % BLOCK_BYTES, 0);
        let first = usize::try_from(first_block).unwrap_or(usize::MAX);
        let stored = first.checked_add(bytes.len() / BLOCK_BYTES).and_then(|end| self.block_crcs.get(first..end));
        if let Some(expected) = stored
            && blocks_match(first_block, bytes, expected)
        {
            return Ok(());
        }
        for (block, chunk) in (first_block..).zip(bytes.chunks_exact(BLOCK_BYTES)) {
            self.check_block(block, chunk).map_err(|(expected, actual)| (block, expected, actual))?;
        }
        Ok(())
    }
}

/// Decodes a whole shard file in memory and checks every data block: the complete structural
/// check short of the BLAKE3 id. Never panics, whatever the bytes (fuzzed).
pub fn check_file_bytes(file: &[u8]) -> Result<ShardMeta, FormatError> {
    let meta = ShardMeta::from_file_bytes(file)?;
    let data_start = usize::try_from(DATA_OFFSET).expect("4096 fits");
    let data_end = usize::try_from(meta.footer.index_offset).expect("within the file");
    meta.check_blocks(0, &file[data_start..data_end])
        .map_err(|(block, expected, actual)| FormatError::BlockChecksum { block, expected, actual })?;
    Ok(meta)
}

fn check_file_length(file_bytes: u64) -> Result<(), FormatError> {
    if file_bytes < 2 * BLOCK_BYTES_U64 || !file_bytes.is_multiple_of(BLOCK_BYTES_U64) {
        return Err(FormatError::Truncated {
            region: "shard file",
            detail: format!("{file_bytes} bytes is not a whole number of {BLOCK_BYTES}-byte blocks, at least 2"),
        });
    }
    Ok(())
}

fn check_region_crc(region: &'static str, bytes: &[u8], expected: u32) -> Result<(), FormatError> {
    let actual = crc32c::crc32c(bytes);
    if actual != expected {
        return Err(FormatError::ChecksumMismatch { region, expected, actual });
    }
    Ok(())
}

fn check_record_ends(record_ends: &[u64], data_bytes: u64, element_bytes: u64) -> Result<(), FormatError> {
    let mut previous = 0;
    for (i, &end) in record_ends.iter().enumerate() {
        if end < previous {
            return Err(FormatError::Inconsistent {
                field: "record index",
                detail: format!("record {i} ends at {end}, before record {} ends at {previous}", i.saturating_sub(1)),
            });
        }
        // A record of arrays is whole elements: a reader never gets part of one.
        if !(end - previous).is_multiple_of(element_bytes) {
            return Err(FormatError::Inconsistent {
                field: "record index",
                detail: format!("record {i} is {} bytes, not whole {element_bytes}-byte elements", end - previous),
            });
        }
        previous = end;
    }
    if previous != data_bytes {
        return Err(FormatError::Inconsistent {
            field: "record index",
            detail: format!("the last record ends at {previous}, the data region has {data_bytes} bytes"),
        });
    }
    Ok(())
}
