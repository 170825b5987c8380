//! Streaming shard writer: records in, one complete shard file out, in bounded memory.
//!
//! Owns the write side of the format. Bytes leave in whole blocks of at most
//! `WRITE_CHUNK_BYTES` at a time; each block's checksum and the BLAKE3 id are computed from the
//! exact bytes written, so the id names the file as it is on disk. Memory is bounded by the write
//! chunk plus 4 bytes per data block and 8 per variable-length record, about twice that while
//! `finish` encodes the index and checksum table; the ingest driver rolls over to a new shard
//! long before either grows large (64 MiB of data: 64 KiB of checksums). Never: fsyncs or renames (the store
//! publishes), never writes a partial block except through `finish`.

use std::io::{Read, Write};
use std::path::PathBuf;

use crate::error::{Error, Result};
use crate::id::{ObjectId, ShardId};

use super::format::{BLOCK_BYTES, Footer, block_crc, encode_header, padded};
use super::layout::Layout;
use super::meta::MetaDigest;

/// Bytes buffered before a write: whole blocks, large enough for sequential disk bandwidth.
pub const WRITE_CHUNK_BYTES: usize = 1 << 20;

const _: () = assert!(WRITE_CHUNK_BYTES.is_multiple_of(BLOCK_BYTES));

/// A shard file that has been written completely (but not yet synced or published).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrittenShard {
    /// The BLAKE3 hash of the file.
    pub id: ShardId,
    /// Records in it.
    pub n_records: u64,
    /// Bytes of record data.
    pub data_bytes: u64,
    /// Length of the file.
    pub file_bytes: u64,
    /// The digest of its metadata.
    pub meta_digest: MetaDigest,
}

/// Writes one shard to `out`, streaming.
pub struct ShardWriter<W: Write> {
    out: W,
    /// Named in errors.
    path: PathBuf,
    layout: Layout,
    hasher: blake3::Hasher,
    header: [u8; BLOCK_BYTES],
    header_crc: u32,
    /// Data bytes not yet written; always starts on a block boundary of the data region.
    pending: Vec<u8>,
    block_crcs: Vec<u32>,
    record_ends: Vec<u64>,
    data_bytes: u64,
    n_records: u64,
    file_bytes: u64,
}

impl<W: Write> ShardWriter<W> {
    /// Starts a shard: writes the header block. `path` only names the output in errors.
    pub fn new(out: W, path: PathBuf, layout: Layout) -> Result<Self> {
        let header = encode_header(&layout);
        let header_crc = super::layout::read_u32(&header, BLOCK_BYTES - 4);
        let mut writer = Self {
            out,
            path,
            layout,
            hasher: blake3::Hasher::new(),
            header,
            header_crc,
            pending: Vec::with_capacity(WRITE_CHUNK_BYTES),
            block_crcs: Vec::new(),
            record_ends: Vec::new(),
            data_bytes: 0,
            n_records: 0,
            file_bytes: 0,
        };
        writer.emit(&header)?;
        Ok(writer)
    }

    /// Records written so far.
    pub fn n_records(&self) -> u64 {
        self.n_records
    }

    /// Bytes of record data written so far.
    pub fn data_bytes(&self) -> u64 {
        self.data_bytes
    }

    /// Appends one record.
    pub fn push(&mut self, record: &[u8]) -> Result<()> {
        self.check_record_len(record.len() as u64)?;
        self.append_data(record)?;
        self.end_record();
        Ok(())
    }

    /// Appends one record of exactly `len` bytes streamed from `source`, without holding it in
    /// memory. `scratch` is a reusable buffer (any non-zero length).
    pub fn push_from(&mut self, source: &mut impl Read, len: u64, scratch: &mut [u8]) -> Result<()> {
        assert!(!scratch.is_empty());
        self.check_record_len(len)?;
        let mut remaining = len;
        while remaining > 0 {
            let n = usize::try_from(remaining).map_or(scratch.len(), |r| r.min(scratch.len()));
            source.read_exact(&mut scratch[..n]).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    Error::invalid_input(format!("input ended {remaining} bytes before the end of a record"))
                } else {
                    Error::io("read", "record source", e)
                }
            })?;
            self.append_data(&scratch[..n])?;
            debug_assert!(n as u64 <= remaining, "a record's bytes are read up to its length");
            remaining -= n as u64;
        }
        self.end_record();
        Ok(())
    }

    /// Pads the last block, writes the record index, the checksum table and the footer, and
    /// returns the output and what was written. The caller syncs and publishes the file.
    pub fn finish(mut self) -> Result<(W, WrittenShard)> {
        if !self.pending.is_empty() {
            let padded_len = self.pending.len().div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
            self.pending.resize(padded_len, 0);
            self.write_pending_blocks()?;
        }
        let mut footer = Footer::for_counts(&self.layout, self.n_records, self.data_bytes, self.header_crc);
        assert_eq!(footer.n_data_blocks, self.block_crcs.len() as u64);

        let mut index = Vec::with_capacity(region_len(footer.index_bytes));
        if self.layout.is_variable() {
            index.extend(self.record_ends.iter().flat_map(|end| end.to_le_bytes()));
        }
        index.resize(region_len(footer.index_bytes), 0);
        footer.index_crc = crc32c::crc32c(&index);

        let mut crc_table = Vec::with_capacity(region_len(footer.crc_table_bytes));
        crc_table.extend(self.block_crcs.iter().flat_map(|crc| crc.to_le_bytes()));
        crc_table.resize(region_len(footer.crc_table_bytes), 0);
        footer.crc_table_crc = crc32c::crc32c(&crc_table);

        assert_eq!(self.file_bytes, footer.index_offset);
        let footer_block = footer.encode();
        let mut tail = index;
        tail.extend_from_slice(&crc_table);
        let meta_digest = MetaDigest::of(&self.header, &tail, &footer_block);
        self.emit(&tail)?;
        self.emit(&footer_block)?;
        assert_eq!(self.file_bytes, footer.file_bytes);
        self.out.flush().map_err(|e| Error::io("write", &self.path, e))?;
        let written = WrittenShard {
            id: ShardId(ObjectId::from_hash(self.hasher.finalize())),
            n_records: self.n_records,
            data_bytes: self.data_bytes,
            file_bytes: self.file_bytes,
            meta_digest,
        };
        Ok((self.out, written))
    }

    fn check_record_len(&self, len: u64) -> Result<()> {
        match self.layout.record_bytes() {
            Some(record_bytes) if record_bytes != len => {
                Err(Error::invalid_input(format!("a record of {len} bytes in a layout of {record_bytes}-byte records")))
            }
            None if !len.is_multiple_of(self.layout.element_bytes()) => Err(Error::invalid_input(format!(
                "a record of {len} bytes in a layout of {}: not whole elements",
                self.layout
            ))),
            _ => Ok(()),
        }
    }

    fn append_data(&mut self, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let n = bytes.len().min(WRITE_CHUNK_BYTES - self.pending.len());
            self.pending.extend_from_slice(&bytes[..n]);
            bytes = &bytes[n..];
            self.data_bytes += n as u64;
            if self.pending.len() == WRITE_CHUNK_BYTES {
                self.write_pending_blocks()?;
            }
        }
        Ok(())
    }

    fn end_record(&mut self) {
        self.n_records += 1;
        if self.layout.is_variable() {
            self.record_ends.push(self.data_bytes);
        }
    }

    /// Checksums and writes `pending`, which holds whole blocks.
    fn write_pending_blocks(&mut self) -> Result<()> {
        assert_eq!(self.pending.len() % BLOCK_BYTES, 0);
        let first_block = self.block_crcs.len() as u64;
        for (block, bytes) in (first_block..).zip(self.pending.chunks_exact(BLOCK_BYTES)) {
            self.block_crcs.push(block_crc(block, bytes));
        }
        let pending = std::mem::take(&mut self.pending);
        self.emit(&pending)?;
        self.pending = pending;
        self.pending.clear();
        Ok(())
    }

    fn emit(&mut self, bytes: &[u8]) -> Result<()> {
        self.hasher.update(bytes);
        self.out.write_all(bytes).map_err(|e| Error::io("write", &self.path, e))?;
        self.file_bytes += bytes.len() as u64;
        Ok(())
    }
}

fn region_len(bytes: u64) -> usize {
    usize::try_from(padded(bytes)).expect("a shard's metadata fits in memory")
}
