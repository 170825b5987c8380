//! The byte layout of a shard file's header and footer blocks (docs/format.md has the diagrams).
//!
//! Invariant: every region starts on a `BLOCK_BYTES` boundary and the file length is a multiple of
//! it, so any region can be read with O_DIRECT. A decoded `Footer` has passed `Footer::check`: its
//! offsets are the unique ones its counts imply, and they fit in the file.
//!
//! Owns: the format's constants (`BLOCK_BYTES`, `FORMAT_VERSION`, the magics, `DATA_OFFSET`,
//! `FILE_BYTES_MAX`), the data blocks' checksums (`block_crc`, `blocks_match`), the header block's
//! encoding and `Footer`'s. Never: reads or writes a file (its callers hand it blocks), or looks
//! inside a record.

use crate::error::FormatError;

use super::layout::{LAYOUT_BYTES, Layout, read_u32, read_u64};

/// Bytes of a data block, of the header and of the footer; the alignment of every region.
pub const BLOCK_BYTES: usize = 4096;
/// `BLOCK_BYTES` as a file offset.
pub const BLOCK_BYTES_U64: u64 = BLOCK_BYTES as u64;
/// The shard format this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Opens the header block.
pub const HEADER_MAGIC: [u8; 8] = *b"GRNSHARD";
/// Opens the footer block.
pub const FOOTER_MAGIC: [u8; 8] = *b"GRNFOOTR";
/// Where the data region starts: right after the header block.
pub const DATA_OFFSET: u64 = BLOCK_BYTES_U64;
/// Bytes of a record-index entry (the little-endian u64 end offset of a record).
pub(crate) const INDEX_ENTRY_BYTES: u64 = 8;
/// Bytes of a block checksum in the checksum table.
pub(crate) const CRC_ENTRY_BYTES: u64 = 4;

/// The largest shard file accepted: 1 TiB. Far beyond any real shard, and small enough that no
/// offset computed from a checked footer can overflow.
pub const FILE_BYTES_MAX: u64 = 1 << 40;

/// The largest metadata tail (record index and checksum table) accepted: 1 GiB, so that a
/// hostile footer cannot make a reader allocate by an unchecked length.
pub(crate) const TAIL_BYTES_MAX: u64 = 1 << 30;

/// Where a block's own CRC32C sits: its last four bytes.
const CRC_AT: usize = BLOCK_BYTES - 4;

/// Rounds `bytes` up to a whole number of blocks.
pub const fn padded(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_BYTES_U64) * BLOCK_BYTES_U64
}

/// The CRC32C of a data block, seeded with the block's index so a block read from the wrong place
/// fails its check even when its bytes are intact.
pub fn block_crc(block: u64, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&block.to_le_bytes()), bytes)
}

/// Blocks checked together by `blocks_match` at most: 48 blocks, 192 KiB, eight times the 24 KiB
/// the crate's fastest loop (three interleaved streams) takes at once; a pass per 4 KiB block
/// runs its slower loop and pays a call per block (BENCHMARKS.md). A check over a run keeps
/// CRC32C's guarantees at these lengths: every burst of up to 32 bits and every error of up to 3
/// bits is caught (Hamming distance 4 up to 2^31 bits, as for one block); what a run gives up is
/// only the independent 2^-32 per block when several blocks are damaged at once.
pub const CHECK_RUN_BLOCKS: usize = 48;

/// Whether data blocks `first_block..` (`bytes`, whole blocks) have the checksums `expected`
/// (one per block, as `block_crc` makes them), checked with one CRC32C pass per run of up to
/// `CHECK_RUN_BLOCKS` blocks.
///
/// CRC32C is linear: `crc32c_combine(a, b, n)` is `Z(a) ^ b`, where `Z` runs the CRC over `n`
/// zero bytes. A block's stored checksum is `Z(crc32c(index)) ^ crc32c(bytes)`, so the CRC of the
/// bytes alone follows from it, and the CRC a run's bytes must have follows from those of its
/// blocks (`Z` applied once per block, Horner's way). When a run's CRC differs, the run has a
/// bad block; `false` sends the caller to `block_crc` to name it.
pub fn blocks_match(first_block: u64, bytes: &[u8], expected: &[u32]) -> bool {
    if bytes.len() != expected.len() * BLOCK_BYTES {
        return false;
    }
    let mut block = first_block;
    for (run, want) in bytes.chunks(CHECK_RUN_BLOCKS * BLOCK_BYTES).zip(expected.chunks(CHECK_RUN_BLOCKS)) {
        let mut run_crc = 0u32;
        for &stored in want {
            let seed = crc32c::crc32c(&block.to_le_bytes());
            // Z(run) ^ Z(seed) ^ stored, with Z applied once (it is linear).
            run_crc = zeros_block(run_crc ^ seed) ^ stored;
            block += 1;
        }
        if crc32c::crc32c(run) != run_crc {
            return false;
        }
    }
    true
}

/// The CRC32C of a data block's bytes alone, from its checksum `stored` (`block_crc`, seeded with
/// the block's index): `stored` is `Z(crc32c(index)) ^ crc32c(bytes)`, as `blocks_match` says.
pub(crate) fn bytes_crc(block: u64, stored: u32) -> u32 {
    stored ^ zeros_block(crc32c::crc32c(&block.to_le_bytes()))
}

/// `Z` of `blocks_match` for one block of zeros: linear over GF(2), so four byte tables built
/// from its value on the 32 unit vectors (`crc32c_combine(1 << bit, 0, BLOCK_BYTES)`).
fn zeros_block(crc: u32) -> u32 {
    static TABLES: std::sync::OnceLock<[[u32; 256]; 4]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        let unit: Vec<u32> = (0..32).map(|bit| crc32c::crc32c_combine(1 << bit, 0, BLOCK_BYTES)).collect();
        let mut tables = [[0u32; 256]; 4];
        for (byte, table) in tables.iter_mut().enumerate() {
            for (value, entry) in table.iter_mut().enumerate() {
                *entry = (0..8).filter(|bit| value >> bit & 1 == 1).fold(0, |acc, bit| acc ^ unit[8 * byte + bit]);
            }
        }
        tables
    });
    let [b0, b1, b2, b3] = crc.to_le_bytes();
    tables[0][usize::from(b0)] ^ tables[1][usize::from(b1)] ^ tables[2][usize::from(b2)] ^ tables[3][usize::from(b3)]
}

/// Encodes the header block: magic, version, block size, layout, and a CRC32C of the rest.
pub(crate) fn encode_header(layout: &Layout) -> [u8; BLOCK_BYTES] {
    let mut block = [0u8; BLOCK_BYTES];
    block[0..8].copy_from_slice(&HEADER_MAGIC);
    block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    block[12..16].copy_from_slice(&u32::try_from(BLOCK_BYTES).expect("4096 fits").to_le_bytes());
    block[16..16 + LAYOUT_BYTES].copy_from_slice(&layout.encode());
    seal(&mut block);
    block
}

/// Decodes the header block; returns the layout and the header's CRC (which the footer repeats).
pub(crate) fn decode_header(block: &[u8]) -> Result<(Layout, u32), FormatError> {
    let region = "shard header";
    let crc = unseal(block, region, &HEADER_MAGIC)?;
    let block_bytes = read_u32(block, 12);
    if block_bytes as usize != BLOCK_BYTES {
        return Err(FormatError::Inconsistent {
            field: "block_bytes",
            detail: format!("{block_bytes}, this build reads {BLOCK_BYTES}"),
        });
    }
    let mut layout = [0u8; LAYOUT_BYTES];
    layout.copy_from_slice(&block[16..16 + LAYOUT_BYTES]);
    let layout = Layout::decode(&layout)?;
    if block[16 + LAYOUT_BYTES..CRC_AT].iter().any(|&b| b != 0) {
        return Err(FormatError::Inconsistent { field: "header", detail: "reserved bytes are not zero".to_owned() });
    }
    Ok((layout, crc))
}

/// The footer: counts, region offsets and region checksums.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Footer {
    /// Records in the shard.
    pub n_records: u64,
    /// Bytes of record data, before the last block's zero padding.
    pub data_bytes: u64,
    /// Blocks in the data region: `data_bytes` rounded up.
    pub n_data_blocks: u64,
    /// Offset of the record index (end offsets, variable layouts only).
    pub index_offset: u64,
    /// Bytes of the record index before padding.
    pub index_bytes: u64,
    /// Offset of the per-block checksum table.
    pub crc_table_offset: u64,
    /// Bytes of the checksum table before padding.
    pub crc_table_bytes: u64,
    /// Length of the whole file.
    pub file_bytes: u64,
    /// The header block's CRC, binding the footer to its header.
    pub header_crc: u32,
    /// CRC32C of the padded record-index region.
    pub index_crc: u32,
    /// CRC32C of the padded checksum-table region.
    pub crc_table_crc: u32,
}

impl Footer {
    /// The footer a writer emits for these counts; offsets follow from them.
    pub fn for_counts(layout: &Layout, n_records: u64, data_bytes: u64, header_crc: u32) -> Footer {
        let n_data_blocks = data_bytes.div_ceil(BLOCK_BYTES_U64);
        let index_offset = DATA_OFFSET + n_data_blocks * BLOCK_BYTES_U64;
        let index_bytes = if layout.is_variable() { n_records * INDEX_ENTRY_BYTES } else { 0 };
        let crc_table_offset = index_offset + padded(index_bytes);
        let crc_table_bytes = n_data_blocks * CRC_ENTRY_BYTES;
        let file_bytes = crc_table_offset + padded(crc_table_bytes) + BLOCK_BYTES_U64;
        // The format's invariant: every region starts on a block, the file is whole blocks.
        debug_assert!(
            [index_offset, crc_table_offset, file_bytes].iter().all(|at| at.is_multiple_of(BLOCK_BYTES_U64)),
            "regions on blocks"
        );
        Footer {
            n_records,
            data_bytes,
            n_data_blocks,
            index_offset,
            index_bytes,
            crc_table_offset,
            crc_table_bytes,
            file_bytes,
            header_crc,
            index_crc: 0,
            crc_table_crc: 0,
        }
    }

    /// Offset of the footer block.
    pub fn footer_offset(&self) -> u64 {
        self.file_bytes - BLOCK_BYTES_U64
    }

    /// Encodes the footer block with its CRC32C.
    pub fn encode(&self) -> [u8; BLOCK_BYTES] {
        let mut block = [0u8; BLOCK_BYTES];
        block[0..8].copy_from_slice(&FOOTER_MAGIC);
        block[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        let words = [
            self.n_records,
            DATA_OFFSET,
            self.data_bytes,
            self.n_data_blocks,
            self.index_offset,
            self.index_bytes,
            self.crc_table_offset,
            self.crc_table_bytes,
            self.file_bytes,
        ];
        for (slot, word) in block[16..88].chunks_exact_mut(8).zip(words) {
            slot.copy_from_slice(&word.to_le_bytes());
        }
        block[88..92].copy_from_slice(&self.header_crc.to_le_bytes());
        block[92..96].copy_from_slice(&self.index_crc.to_le_bytes());
        block[96..100].copy_from_slice(&self.crc_table_crc.to_le_bytes());
        seal(&mut block);
        block
    }

    /// Decodes the footer block of a file of `file_bytes` bytes with the given header, and checks
    /// that every offset is the one its counts imply.
    pub fn decode(block: &[u8], layout: &Layout, file_bytes: u64) -> Result<Footer, FormatError> {
        unseal(block, "shard footer", &FOOTER_MAGIC)?;
        if read_u32(block, 12) != 0 || read_u32(block, 100) != 0 || block[104..CRC_AT].iter().any(|&b| b != 0) {
            return Err(FormatError::Inconsistent {
                field: "footer",
                detail: "reserved bytes are not zero".to_owned(),
            });
        }
        let data_offset = read_u64(block, 24);
        if data_offset != DATA_OFFSET {
            return Err(FormatError::Inconsistent {
                field: "data_offset",
                detail: format!("{data_offset}, expected {DATA_OFFSET}"),
            });
        }
        let footer = Footer {
            n_records: read_u64(block, 16),
            data_bytes: read_u64(block, 32),
            n_data_blocks: read_u64(block, 40),
            index_offset: read_u64(block, 48),
            index_bytes: read_u64(block, 56),
            crc_table_offset: read_u64(block, 64),
            crc_table_bytes: read_u64(block, 72),
            file_bytes: read_u64(block, 80),
            header_crc: read_u32(block, 88),
            index_crc: read_u32(block, 92),
            crc_table_crc: read_u32(block, 96),
        };
        footer.check(layout, file_bytes)?;
        Ok(footer)
    }

    /// Checks that the footer describes exactly a file of `file_bytes` bytes with this layout.
    fn check(&self, layout: &Layout, file_bytes: u64) -> Result<(), FormatError> {
        let inconsistent = |field: &'static str, found: u64, expected: u64| FormatError::Inconsistent {
            field,
            detail: format!("{found}, expected {expected}"),
        };
        if self.file_bytes != file_bytes {
            return Err(FormatError::Truncated {
                region: "shard file",
                detail: format!("{file_bytes} bytes, the footer says {}", self.file_bytes),
            });
        }
        // Every count is bounded by the file length (itself bounded) before any arithmetic, so
        // nothing below can overflow, whatever the footer claims.
        if file_bytes > FILE_BYTES_MAX {
            return Err(inconsistent("file_bytes", file_bytes, FILE_BYTES_MAX));
        }
        if self.data_bytes > file_bytes {
            return Err(inconsistent("data_bytes", self.data_bytes, file_bytes));
        }
        let n_records_max = if layout.is_variable() { file_bytes / INDEX_ENTRY_BYTES } else { file_bytes };
        if self.n_records > n_records_max {
            return Err(inconsistent("n_records", self.n_records, n_records_max));
        }
        let expected = Footer::for_counts(layout, self.n_records, self.data_bytes, self.header_crc);
        if self.n_data_blocks != expected.n_data_blocks {
            return Err(inconsistent("n_data_blocks", self.n_data_blocks, expected.n_data_blocks));
        }
        if self.index_offset != expected.index_offset {
            return Err(inconsistent("index_offset", self.index_offset, expected.index_offset));
        }
        if self.index_bytes != expected.index_bytes {
            return Err(inconsistent("index_bytes", self.index_bytes, expected.index_bytes));
        }
        if self.crc_table_offset != expected.crc_table_offset {
            return Err(inconsistent("crc_table_offset", self.crc_table_offset, expected.crc_table_offset));
        }
        if self.crc_table_bytes != expected.crc_table_bytes {
            return Err(inconsistent("crc_table_bytes", self.crc_table_bytes, expected.crc_table_bytes));
        }
        if self.file_bytes != expected.file_bytes {
            return Err(inconsistent("file_bytes", self.file_bytes, expected.file_bytes));
        }
        if let Some(record_bytes) = layout.record_bytes() {
            let implied = self.n_records.checked_mul(record_bytes);
            if implied != Some(self.data_bytes) {
                return Err(FormatError::Inconsistent {
                    field: "n_records",
                    detail: format!(
                        "{} records of {record_bytes} bytes in {} data bytes",
                        self.n_records, self.data_bytes
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Writes the CRC32C of a block's first 4092 bytes into its last four.
fn seal(block: &mut [u8; BLOCK_BYTES]) {
    let crc = crc32c::crc32c(&block[..CRC_AT]);
    block[CRC_AT..].copy_from_slice(&crc.to_le_bytes());
}

/// Checks a sealed block's length, magic, version and CRC, in that order; returns its CRC.
/// The version comes before the CRC so that a block from a newer format, which may seal itself
/// differently, reads as "unsupported version" rather than as corruption.
fn unseal(block: &[u8], region: &'static str, magic: &[u8; 8]) -> Result<u32, FormatError> {
    if block.len() != BLOCK_BYTES {
        return Err(FormatError::Truncated {
            region,
            detail: format!("{} bytes, expected {BLOCK_BYTES}", block.len()),
        });
    }
    if block[0..8] != magic[..] {
        return Err(FormatError::BadMagic { region });
    }
    let version = read_u32(block, 8);
    if version != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion { region, found: version, supported: FORMAT_VERSION });
    }
    let expected = read_u32(block, CRC_AT);
    let actual = crc32c::crc32c(&block[..CRC_AT]);
    if expected != actual {
        return Err(FormatError::ChecksumMismatch { region, expected, actual });
    }
    Ok(actual)
}
