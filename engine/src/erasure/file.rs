//! Fragment files on disk: opened with their header, id and checksum table checked, then checked
//! (`check_all`) or sent in pieces whose blocks are checked as they come, so a large fragment is
//! not held whole to be checked; `read_whole` reads one whole, for a rebuild.
//!
//! Owns `FragmentFile`. Never: writes, or hands out a block it has not checked (the caller
//! checks each piece with `check_blocks` before using it; `read_whole` checks everything).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{Fragment, FragmentHeader, fragment_id};
use crate::error::{Error, FormatError, Result};
use crate::id::ObjectId;
use crate::shard::{BLOCK_BYTES, BLOCK_BYTES_U64, block_crc, crc32c};

/// A fragment file whose header names the fragment asked for, whose length is the one the header
/// gives, and whose checksum table checked out.
#[derive(Debug)]
pub struct FragmentFile {
    path: PathBuf,
    file: File,
    header: FragmentHeader,
    /// The checksum table: one CRC32C per data block (then zero padding).
    table: Vec<u8>,
}

impl FragmentFile {
    /// Opens fragment `id` at `path`: `NotFound` when there is no file, a `Format` error when
    /// its header, length or checksum table does not check out or it is another fragment.
    pub fn open(path: &Path, id: ObjectId) -> Result<Self> {
        let format = |source: FormatError| Error::Format { path: path.to_owned(), source };
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound { what: format!("fragment {id} ({})", path.display()) },
            _ => Error::io("open", path, e),
        })?;
        let len = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
        let mut head = vec![0u8; BLOCK_BYTES];
        if len < BLOCK_BYTES_U64 {
            return Err(format(FormatError::Truncated {
                region: "fragment",
                detail: format!("{len} bytes, shorter than its header block"),
            }));
        }
        file.read_exact_at(&mut head, 0).map_err(|e| Error::io("read", path, e))?;
        let (header, table_crc) = FragmentHeader::decode(&head).map_err(format)?;
        let named = fragment_id(header.shard, header.coding, header.index);
        if named != id {
            return Err(format(FormatError::Inconsistent {
                field: "fragment header",
                detail: format!(
                    "it names fragment {} of shard {} ({}), not fragment {}",
                    header.index,
                    header.shard.0.short(12),
                    header.coding,
                    id.short(12)
                ),
            }));
        }
        if len != header.file_bytes() {
            return Err(format(FormatError::Truncated {
                region: "fragment",
                detail: format!("{len} bytes, not the {} its header gives", header.file_bytes()),
            }));
        }
        let table_at = header.crc_table_offset();
        let mut table = vec![0u8; usize::try_from(len - table_at).map_err(|_| Error::invalid_input("a huge table"))?];
        file.read_exact_at(&mut table, table_at).map_err(|e| Error::io("read", path, e))?;
        let actual = crc32c(&table);
        if actual != table_crc {
            return Err(format(FormatError::ChecksumMismatch {
                region: "fragment checksum table",
                expected: table_crc,
                actual,
            }));
        }
        let n_blocks = usize::try_from(header.n_blocks()).map_err(|_| Error::invalid_input("a huge fragment"))?;
        if table[4 * n_blocks..].iter().any(|&b| b != 0) {
            return Err(format(FormatError::Inconsistent {
                field: "fragment",
                detail: "checksum table padding is not zero".to_owned(),
            }));
        }
        Ok(Self { path: path.to_owned(), file, header, table })
    }

    /// What the header says.
    pub fn header(&self) -> &FragmentHeader {
        &self.header
    }

    /// The file's length.
    pub fn file_bytes(&self) -> u64 {
        self.header.file_bytes()
    }

    /// Reads `buf.len()` bytes at `offset`, unchecked: pass the data blocks among them to
    /// [`FragmentFile::check_piece`] before using them.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file.read_exact_at(buf, offset).map_err(|e| Error::io("read", &self.path, e))
    }

    /// Checks the data blocks within `piece`, the file's bytes from `offset` (a block boundary):
    /// the header block and the checksum table were checked by `open`.
    pub fn check_piece(&self, offset: u64, piece: &[u8]) -> Result<()> {
        let data = BLOCK_BYTES_U64..self.header.crc_table_offset();
        let (start, end) = (offset.max(data.start), (offset + piece.len() as u64).min(data.end));
        if start >= end {
            return Ok(());
        }
        let bytes = &piece[(start - offset) as usize..(end - offset) as usize];
        let first = (start - BLOCK_BYTES_U64) / BLOCK_BYTES_U64;
        for (i, block) in bytes.chunks(BLOCK_BYTES).enumerate() {
            let b = first + i as u64;
            let at = 4 * b as usize;
            let expected = u32::from_le_bytes(self.table[at..at + 4].try_into().expect("4 bytes"));
            let actual = block_crc(b, block);
            if block.len() != BLOCK_BYTES || actual != expected {
                return Err(Error::Format {
                    path: self.path.clone(),
                    source: FormatError::BlockChecksum { block: b, expected, actual },
                });
            }
        }
        Ok(())
    }

    /// Checks every data block and the payload's zero padding, a piece of at most 1 MiB at a
    /// time: the file checks out whole without being held whole.
    pub fn check_all(&self) -> Result<FragmentHeader> {
        const PIECE: usize = 1 << 20;
        let end = self.header.crc_table_offset();
        let payload_end = BLOCK_BYTES_U64 + self.header.fragment_bytes();
        let mut piece = vec![0u8; PIECE.min(usize::try_from(end).unwrap_or(PIECE))];
        let mut at = BLOCK_BYTES_U64;
        while at < end {
            let len = usize::try_from((end - at).min(PIECE as u64)).expect("at most a piece");
            let bytes = &mut piece[..len];
            self.read_at(bytes, at)?;
            self.check_piece(at, bytes)?;
            // The payload's padding, in the last block(s).
            if at + len as u64 > payload_end {
                let from = payload_end.saturating_sub(at) as usize;
                if bytes[from..].iter().any(|&b| b != 0) {
                    return Err(Error::Format {
                        path: self.path.clone(),
                        source: FormatError::Inconsistent {
                            field: "fragment",
                            detail: "payload padding is not zero".to_owned(),
                        },
                    });
                }
            }
            at += len as u64;
        }
        Ok(self.header)
    }

    /// The whole fragment, every block checked (`Fragment::decode`).
    pub fn read_whole(self) -> Result<Fragment> {
        let len = usize::try_from(self.file_bytes()).map_err(|_| Error::invalid_input("a huge fragment"))?;
        let mut bytes = vec![0u8; len];
        self.read_at(&mut bytes, 0)?;
        Fragment::decode(bytes).map_err(|source| Error::Format { path: self.path.clone(), source })
    }
}
