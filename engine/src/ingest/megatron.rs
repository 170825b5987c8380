//! Megatron-LM's indexed datasets (`PREFIX.bin` + `PREFIX.idx`, the token format of Megatron-LM,
//! Megatron Core, NeMo and Fast-LLM): each sequence becomes one record of the `Arrays` layout of
//! the index's dtype, in index order, so record `i` is what Megatron's `IndexedDataset[i]`
//! returns.
//!
//! The index (version 1), little-endian: the 9 bytes `MMIDIDX\0\0`, version u64 (1), dtype code
//! u8 (1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16), sequence count u64, document count
//! u64, then per sequence its length in elements (i32), per sequence its byte offset in `.bin`
//! (i64), per document the sequence it starts at (i64; the first 0, the last the sequence
//! count); a multimodal index adds a mode per sequence (i8), which has no place in a record and
//! is refused.
//! Owns: reading and checking the index whole (every count and offset against the two files'
//! sizes) before the first record is written. Never: trusts a number of the index unchecked.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use super::{Ingest, Progress};
use crate::error::{Error, Result};
use crate::shard::{Dtype, Layout};

const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// Magic, version, dtype code, sequence count, document count.
const HEADER_BYTES: u64 = 9 + 8 + 1 + 8 + 8;

/// A checked Megatron index.
#[derive(Clone, Debug)]
pub struct MegatronIndex {
    /// The element type of every sequence.
    pub dtype: Dtype,
    /// Each sequence's byte offset in `.bin` and its length in bytes.
    pub sequences: Vec<(u64, u64)>,
    /// The sequence each document starts at, then the sequence count.
    pub documents: Vec<u64>,
    /// The data file.
    pub bin: PathBuf,
}

impl MegatronIndex {
    /// Reads and checks `PREFIX.idx` against `PREFIX.bin` (`prefix` may also name either file).
    pub fn open(prefix: &Path) -> Result<Self> {
        let prefix = match prefix.extension().and_then(|e| e.to_str()) {
            Some("bin" | "idx") => prefix.with_extension(""),
            _ => prefix.to_path_buf(),
        };
        let with = |ext: &str| {
            let mut path = prefix.clone().into_os_string();
            path.push(ext);
            PathBuf::from(path)
        };
        let (idx, bin) = (with(".idx"), with(".bin"));
        let bin_bytes = regular_len(&bin)?;
        let idx_bytes = regular_len(&idx)?;
        let bad = |detail: String| {
            Error::invalid_input(format!("{} is not a Megatron index (version 1): {detail}", idx.display()))
        };
        if idx_bytes < HEADER_BYTES {
            return Err(bad(format!("{idx_bytes} bytes, shorter than its header")));
        }
        let bytes = std::fs::read(&idx).map_err(|e| Error::io("read", &idx, e))?;
        if &bytes[..9] != MAGIC {
            return Err(bad("it does not start with MMIDIDX".to_owned()));
        }
        let u64_at = |at: usize| bytes.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
        let version = u64_at(9).unwrap_or(0);
        if version != 1 {
            return Err(bad(format!("version {version}")));
        }
        let code = bytes[17];
        let dtype = match code {
            1 => Dtype::U8,
            2 => Dtype::I8,
            3 => Dtype::I16,
            4 => Dtype::I32,
            5 => Dtype::I64,
            6 => Dtype::F64,
            7 => Dtype::F32,
            8 => Dtype::U16,
            other => return Err(bad(format!("unknown dtype code {other}"))),
        };
        let (count, n_documents) = (u64_at(18).unwrap_or(0), u64_at(26).unwrap_or(0));
        let body = count
            .checked_mul(4 + 8)
            .and_then(|b| b.checked_add(n_documents.checked_mul(8)?))
            .and_then(|b| b.checked_add(HEADER_BYTES))
            .ok_or_else(|| bad(format!("{count} sequences and {n_documents} documents")))?;
        if idx_bytes == body.saturating_add(count) && count > 0 {
            return Err(Error::invalid_input(format!(
                "{} is a multimodal Megatron index (a mode per sequence): only token sequences are ingested",
                idx.display()
            )));
        }
        if idx_bytes != body {
            return Err(bad(format!(
                "{count} sequences and {n_documents} documents need {body} bytes, the file has {idx_bytes}"
            )));
        }
        let count = usize::try_from(count).map_err(|_| bad("too many sequences".to_owned()))?;
        let lengths_at = HEADER_BYTES as usize;
        let pointers_at = lengths_at + 4 * count;
        let documents_at = pointers_at + 8 * count;
        let element = dtype.size_bytes();
        let mut sequences = Vec::with_capacity(count);
        for i in 0..count {
            let at = lengths_at + 4 * i;
            let length = i32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
            let pointer = u64_at(pointers_at + 8 * i).unwrap_or(u64::MAX).cast_signed();
            let (Ok(length), Ok(pointer)) = (u64::try_from(length), u64::try_from(pointer)) else {
                return Err(bad(format!("sequence {i} has length {length} at offset {pointer}")));
            };
            let len = length * element;
            if pointer.checked_add(len).is_none_or(|end| end > bin_bytes) {
                return Err(Error::invalid_input(format!(
                    "{}: sequence {i} ({length} elements at byte {pointer}) runs past the end of {} ({bin_bytes} bytes)",
                    idx.display(),
                    bin.display()
                )));
            }
            sequences.push((pointer, len));
        }
        let documents: Vec<u64> =
            (0..n_documents as usize).map(|d| u64_at(documents_at + 8 * d).unwrap_or(0)).collect();
        let ordered = documents.windows(2).all(|w| w[0] <= w[1]);
        if documents.first() != Some(&0) || documents.last() != Some(&(count as u64)) || !ordered {
            return Err(bad(format!(
                "its document index does not run from sequence 0 to {count} in order ({} entries)",
                documents.len()
            )));
        }
        Ok(Self { dtype, sequences, documents, bin })
    }

    /// The layout of the records it becomes.
    pub fn layout(&self) -> Layout {
        Layout::Arrays(self.dtype)
    }
}

fn regular_len(path: &Path) -> Result<u64> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io("open", path, e))?;
    if !meta.is_file() {
        return Err(Error::invalid_input(format!("{} is not a regular file", path.display())));
    }
    Ok(meta.len())
}

/// Ingests the sequences of `index`, one record each, in order; `ingest`'s layout must be the
/// index's (`MegatronIndex::layout`). An index of no sequences is refused.
pub fn records_from_megatron(ingest: &mut Ingest<'_>, index: &MegatronIndex, progress: &dyn Progress) -> Result<()> {
    if *ingest.layout() != index.layout() {
        return Err(Error::invalid_input(format!(
            "{} holds {} sequences; the dataset's records are {}",
            index.bin.display(),
            index.dtype.name(),
            ingest.layout()
        )));
    }
    if index.sequences.is_empty() {
        return Err(Error::invalid_input(format!("{} holds no sequences: nothing to ingest", index.bin.display())));
    }
    progress.start(index.sequences.iter().map(|&(_, len)| len).sum());
    let file = File::open(&index.bin).map_err(|e| Error::io("open", &index.bin, e))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut at = 0u64;
    for &(pointer, len) in &index.sequences {
        if pointer != at {
            reader.seek(SeekFrom::Start(pointer)).map_err(|e| Error::io("seek", &index.bin, e))?;
        }
        // The file may shrink under us: a short read is an error, not a short record.
        let mut exact = (&mut reader).take(len);
        ingest.push_from(&mut exact, len).map_err(|e| match e {
            Error::InvalidInput { detail } => Error::invalid_input(format!("{}: {detail}", index.bin.display())),
            Error::Io { op: "read", source, .. } => Error::io("read", &index.bin, source),
            other => other,
        })?;
        at = pointer + len;
        progress.advance(len);
    }
    Ok(())
}
