//! LitData's optimized directories (what `litdata.optimize` writes: `index.json` and
//! `chunk-*.bin`) as an ingest source: one record per item, chunk by chunk in the index's order.
//!
//! A chunk is `u32` item count, `count + 1` `u32` offsets from the file's start, then the items;
//! zstd-compressed, it is the whole file (`compression_level` "chunk", `*.zstd.bin`), every
//! item its own frame ("sample"), or frames of `K` items behind an `LDFZ01` directory ("batch",
//! the default for zstd). The default item loader (`PyTreeLoader`) writes items three ways:
//! - an item is one `u32` size per leaf of the item's tree (`data_spec`), then each leaf's bytes,
//!   as its serializer (`data_format`) wrote them;
//! - with pyarrow installed, dict items go into an Arrow IPC file at the chunk's end
//!   (`LDARW01` footer: the IPC file, its `u32` length, the magic), the items before it empty
//!   (or, where LitData kept them, unread: its reader reads the footer's rows): a row per item,
//!   read by `arrow_rows`' rules, columns by the dict's keys;
//! - `TokensLoader` writes one token stream (each item a 1-D array, back to back), which LitData
//!   reads as blocks of `block_size` tokens within each chunk: ingested as those blocks (a
//!   block size given), or as the items the writer wrote (the documents).
//!
//! What an item becomes: with one leaf chosen, a 1-D array makes array records of its dtype,
//! `str`/`bytes` byte records, `int`/`float`/`bool` records of one number; otherwise a sample of
//! parts named `LEAF.EXT` as `parts.rs` names them (a dict's keys, a tuple's or list's
//! positions; a bool as `.json`, which reads back as a Python `bool`).
//!
//! Owns: `LitDataInput` (the index read and checked: its item loader, the tree's leaves or the
//! footer's columns, known serializers and compressions, every chunk present) and
//! `records_from_litdata`. Never: unpickles (`pickle` is refused), decodes an image or a video
//! (those serializers are refused, naming them), takes an item whose offsets or sizes run
//! outside its chunk, or decompresses past what is claimed (a whole chunk past the index's
//! `chunk_bytes`, an item past its frame's size, a batch frame past its entry's).

mod chunk;
mod leaves;

use std::path::{Path, PathBuf};

use serde_json::Value;

use self::chunk::{arrow_footer, framed};
use self::leaves::{Serializer, leaf_into, leaf_names, leaves_of};
use super::RecordSink;
use super::arrow_rows::{Kind, Nulls, Rows, choose_columns, layout_of};
use super::parts::{PartKind, RecordParts, chosen_by_name, json_strings, numbers, offset_table, read_index};
use super::sources::Progress;
use crate::error::{Error, Result, catch_panic};
use crate::shard::{Dtype, Layout};

/// How the chunks are compressed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Packing {
    None,
    /// The whole file is one zstd stream.
    Chunk,
    /// Each item's bytes are a zstd frame.
    Sample,
    /// `LDFZ01`: frames of items behind a directory.
    Batch,
}

/// A chunk of the index.
#[derive(Debug)]
struct Chunk {
    path: PathBuf,
    items: u64,
    bytes: u64,
    /// A whole-file zstd chunk found already decompressed.
    unpacked: bool,
    /// Tokens in it (a `TokensLoader` chunk's `dim`).
    dim: u64,
}

/// How a directory's items are read.
#[derive(Debug)]
enum Reading {
    /// Each item's leaves, as their serializers wrote them: `leaves` each leaf's name (a dict's
    /// key, a sequence's position; empty for an item that is one leaf) and serializer, in
    /// `data_format`'s order; `chosen` the ones ingested.
    Leaves { leaves: Vec<(String, Serializer)>, chosen: Vec<usize> },
    /// The rows of each chunk's Arrow footer, these columns chosen by name.
    Footer { columns: Vec<(String, Kind)> },
    /// A `TokensLoader` stream of `dtype`: in blocks of `block` tokens, or the writer's items.
    Tokens { dtype: Dtype, block: Option<u64> },
}

/// A LitData directory to ingest, its index read and checked.
#[derive(Debug)]
pub struct LitDataInput {
    dir: PathBuf,
    reading: Reading,
    packing: Packing,
    chunks: Vec<Chunk>,
    layout: Layout,
}

impl LitDataInput {
    /// The LitData directory `dir` (`dir/index.json`), its leaves `wanted` (none: every leaf);
    /// for a `TokensLoader` directory, `block_size` cuts its token stream as LitData's reader
    /// does (none: the items the writer wrote, one record each).
    pub fn open(dir: &Path, wanted: &[String], block_size: Option<u64>) -> Result<Self> {
        let (index_path, index) = read_index(dir)?;
        let bad = |detail: String| Error::invalid_input(format!("{}: {detail}", index_path.display()));
        let config = index.get("config").ok_or_else(|| bad("no config".into()))?;
        let tokens = match config.get("item_loader").and_then(Value::as_str) {
            None | Some("PyTreeLoader") => false,
            Some("TokensLoader") => true,
            Some(other) => {
                return Err(bad(format!(
                    "items written for LitData's {other}: its default item loader (PyTreeLoader) and \
                     TokensLoader are ingested"
                )));
            }
        };
        if config.get("encryption").is_some_and(|e| !e.is_null()) {
            return Err(bad("the chunks are encrypted".into()));
        }
        let formats: Vec<String> = config
            .get("data_format")
            .and_then(json_strings)
            .ok_or_else(|| bad("data_format is not a list of names".into()))?;
        let packing = match config.get("compression").and_then(Value::as_str) {
            None => Packing::None,
            Some(codec) if codec == "zstd" || codec.starts_with("zstd:") => {
                match config.get("compression_level").and_then(Value::as_str) {
                    None | Some("chunk") => Packing::Chunk,
                    Some("sample") => Packing::Sample,
                    Some("batch") => Packing::Batch,
                    Some(other) => return Err(bad(format!("compression_level {other:?}"))),
                }
            }
            Some(other) => return Err(bad(format!("chunks compressed with {other:?}: zstd is read"))),
        };
        let lift = |e: ChunkError| match e {
            ChunkError::Index(detail) => bad(detail),
            ChunkError::Input(error) => error,
        };
        let chunks = chunks_of(dir, &index, packing, tokens).map_err(lift)?;
        if block_size.is_some() && !tokens {
            return Err(bad("a block size cuts a TokensLoader directory's tokens; this one's items are not".into()));
        }
        let mut input = Self {
            dir: dir.to_owned(),
            reading: Reading::Footer { columns: Vec::new() },
            packing,
            chunks,
            layout: Layout::Bytes,
        };
        input.reading = if tokens {
            if !wanted.is_empty() {
                return Err(bad("a TokensLoader directory holds one token stream: it has no leaves to choose".into()));
            }
            let dtype = match formats.as_slice() {
                [only] => match Serializer::parse(only) {
                    Ok(Serializer::Flat(dtype)) => dtype,
                    _ => return Err(bad(format!("TokensLoader items of {only:?}, not a 1-D array of numbers"))),
                },
                _ => return Err(bad(format!("TokensLoader items of {} leaves, not one token array", formats.len()))),
            };
            if block_size == Some(0) {
                return Err(Error::invalid_input("a block size of 0 tokens"));
            }
            Reading::Tokens { dtype, block: block_size }
        } else if let Some(schema) = input.footer_schema()? {
            Reading::Footer { columns: choose_columns(&schema, wanted, &dir.display().to_string())? }
        } else {
            leaves_reading(dir, config, &formats, wanted).map_err(lift)?
        };
        input.layout = match &input.reading {
            Reading::Leaves { leaves, chosen } => match chosen.as_slice() {
                &[only] => match &leaves[only].1 {
                    Serializer::Str | Serializer::Bytes => Layout::Bytes,
                    Serializer::Int => Layout::Fixed(numbers(Dtype::I64, 1)?),
                    Serializer::Float => Layout::Fixed(numbers(Dtype::F64, 1)?),
                    Serializer::Bool => Layout::Fixed(numbers(Dtype::U8, 1)?),
                    Serializer::Flat(dtype) => Layout::Arrays(*dtype),
                    Serializer::Numpy | Serializer::Tensor => {
                        return Err(Error::invalid_input(format!(
                            "{}: leaf {:?} holds arrays of several dimensions, which keep their shape only in \
                             samples (ingest without --column)",
                            dir.display(),
                            leaves[only].0
                        )));
                    }
                },
                _ => Layout::Samples,
            },
            Reading::Footer { columns } => layout_of(columns),
            Reading::Tokens { dtype, block: None } => Layout::Arrays(*dtype),
            Reading::Tokens { dtype, block: Some(block) } => Layout::Fixed(numbers(*dtype, *block)?),
        };
        Ok(input)
    }

    /// The schema of the first chunk's Arrow footer, when it has one (then every chunk must).
    fn footer_schema(&self) -> Result<Option<arrow_schema::SchemaRef>> {
        if !matches!(self.packing, Packing::None | Packing::Chunk) {
            // LitData frames or compresses items one by one only where it wrote no footer.
            return Ok(None);
        }
        let Some(first) = self.chunks.first() else { return Ok(None) };
        let data = self.chunk_bytes(first)?;
        let Some(ipc) = arrow_footer(&data).map_err(|e| self.bad_chunk(first, &e))? else { return Ok(None) };
        let reader = self.footer_reader(first, ipc)?;
        Ok(Some(reader.schema()))
    }

    /// An Arrow IPC file reader of a chunk's footer bytes; a panic of the reader on a hostile
    /// file is the chunk's error.
    fn footer_reader<'a>(
        &self,
        chunk: &Chunk,
        ipc: &'a [u8],
    ) -> Result<arrow_ipc::reader::FileReader<std::io::Cursor<&'a [u8]>>> {
        catch_panic(
            || chunk.path.display().to_string(),
            || {
                chunk::check_arrow_file(ipc).map_err(|e| self.bad_chunk(chunk, &format!("its Arrow footer: {e}")))?;
                arrow_ipc::reader::FileReader::try_new(std::io::Cursor::new(ipc), None)
                    .map_err(|e| self.bad_chunk(chunk, &format!("its Arrow footer cannot be read: {e}")))
            },
        )
    }

    /// The layout of the records it becomes.
    pub fn layout(&self) -> Layout {
        self.layout.clone()
    }

    /// Items in the index.
    pub fn items(&self) -> u64 {
        self.chunks.iter().map(|c| c.items).sum()
    }

    /// `chunk` named in errors: the directory and the chunk's file.
    fn chunk_name(&self, chunk: &Chunk) -> String {
        let name = chunk.path.strip_prefix(&self.dir).unwrap_or(&chunk.path);
        format!("{}: {}", self.dir.display(), name.display())
    }

    fn bad_chunk(&self, chunk: &Chunk, detail: &str) -> Error {
        Error::invalid_input(format!("{}: {detail}", self.chunk_name(chunk)))
    }

    /// The bytes of `chunk`: the file, or its whole-file zstd stream decompressed.
    fn chunk_bytes(&self, chunk: &Chunk) -> Result<Vec<u8>> {
        let data = std::fs::read(&chunk.path).map_err(|e| Error::io("read", &chunk.path, e))?;
        if chunk.unpacked || self.packing != Packing::Chunk {
            return Ok(data);
        }
        // The index's `chunk_bytes` is the chunk's length before it was compressed.
        let limit = if chunk.bytes > 0 { chunk.bytes } else { chunk::CLASSIC_BYTES_MAX };
        chunk::unzstd(&data, limit).map_err(|e| self.bad_chunk(chunk, &e))
    }

    /// Each item of `chunk`, uncompressed.
    fn read_items(&self, chunk: &Chunk) -> Result<Vec<Vec<u8>>> {
        let bad = |detail: String| self.bad_chunk(chunk, &detail);
        let packing = if chunk.unpacked { Packing::None } else { self.packing };
        let data = self.chunk_bytes(chunk)?;
        let items = match packing {
            Packing::None | Packing::Chunk => {
                offset_table(&data, chunk.items, "item").map_err(bad)?.into_iter().map(<[u8]>::to_vec).collect()
            }
            Packing::Sample => {
                // Together, the items are a classic chunk (addressed by u32 offsets): each
                // decompresses to no more than its frame says, nor past what is left of that.
                let mut left = chunk::CLASSIC_BYTES_MAX;
                let mut items = Vec::with_capacity(usize::try_from(chunk.items).unwrap_or(0).min(1 << 16));
                for (i, packed) in offset_table(&data, chunk.items, "item").map_err(&bad)?.into_iter().enumerate() {
                    let item = chunk::unzstd(packed, chunk::frame_content_size(packed, left))
                        .map_err(|e| bad(format!("item {i}: {e}")))?;
                    left -= item.len() as u64;
                    items.push(item);
                }
                items
            }
            Packing::Batch => framed(&data, chunk.items).map_err(bad)?,
        };
        Ok(items)
    }
}

/// Why the index's chunks or leaves cannot be taken: a fault of the index, or of the input.
enum ChunkError {
    Index(String),
    Input(Error),
}

/// The index's chunks, each file present (`tokens`: each with its count of tokens, `dim`).
fn chunks_of(dir: &Path, index: &Value, packing: Packing, tokens: bool) -> std::result::Result<Vec<Chunk>, ChunkError> {
    let bad = ChunkError::Index;
    let chunks_json = index.get("chunks").and_then(Value::as_array).ok_or_else(|| bad("no chunks".into()))?;
    let mut chunks = Vec::with_capacity(chunks_json.len());
    for (c, chunk) in chunks_json.iter().enumerate() {
        let filename =
            chunk.get("filename").and_then(Value::as_str).ok_or_else(|| bad(format!("chunk {c} has no filename")))?;
        if filename.contains('/') || filename.starts_with('.') {
            return Err(bad(format!("chunk {c} names {filename:?}, not a file of the directory")));
        }
        let mut path = dir.join(filename);
        let mut unpacked = false;
        if !path.is_file()
            && packing == Packing::Chunk
            && let Some(stem) = filename.strip_suffix(".zstd.bin")
            && dir.join(format!("{stem}.bin")).is_file()
        {
            // LitData's own reader, given a local directory, leaves a chunk decompressed
            // beside where the compressed one was: the same items.
            path = dir.join(format!("{stem}.bin"));
            unpacked = true;
        }
        if !path.is_file() {
            return Err(ChunkError::Input(Error::invalid_input(format!(
                "{}: chunk {c}'s file {filename} is missing",
                dir.display()
            ))));
        }
        let items = chunk
            .get("chunk_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad(format!("chunk {c} has no chunk_size")))?;
        let bytes = chunk.get("chunk_bytes").and_then(Value::as_u64).unwrap_or(0);
        let dim = chunk.get("dim").and_then(Value::as_u64);
        if tokens && dim.is_none() {
            return Err(bad(format!("chunk {c} of a TokensLoader directory gives no count of tokens (dim)")));
        }
        chunks.push(Chunk { path, items, bytes, unpacked, dim: dim.unwrap_or(0) });
    }
    Ok(chunks)
}

/// How a directory of leaf-serialized items is read: its leaves, named by `data_spec`, each
/// with its serializer, and the ones `wanted` (none: every one).
fn leaves_reading(
    dir: &Path,
    config: &Value,
    formats: &[String],
    wanted: &[String],
) -> std::result::Result<Reading, ChunkError> {
    let names = leaf_names(config.get("data_spec").and_then(Value::as_str).unwrap_or(""))
        .map_err(|e| ChunkError::Index(format!("data_spec: {e}")))?;
    if names.len() != formats.len() {
        return Err(ChunkError::Index(format!(
            "{} leaves in data_spec, {} in data_format",
            names.len(),
            formats.len()
        )));
    }
    let mut leaves = Vec::with_capacity(names.len());
    for (name, format) in names.into_iter().zip(formats) {
        let serializer = Serializer::parse(format).map_err(|what| {
            ChunkError::Input(Error::invalid_input(format!(
                "{}: leaf {name:?} was serialized as {what}, which is not ingested (str, bytes, int, float, \
                 bool, numpy, no_header_numpy, tensor, no_header_tensor are)",
                dir.display()
            )))
        })?;
        leaves.push((name, serializer));
    }
    let names: Vec<&str> = leaves.iter().map(|(leaf, _)| leaf.as_str()).collect();
    let chosen =
        chosen_by_name(&names, wanted, ("leaf", "leaves"), &dir.display().to_string()).map_err(ChunkError::Input)?;
    Ok(Reading::Leaves { leaves, chosen })
}

/// Ingests every item of `input`, chunk by chunk in the index's order, as records of
/// `input.layout()`. Returns the records ingested; an index of no item is refused.
pub fn records_from_litdata(ingest: &mut dyn RecordSink, input: &LitDataInput, progress: &dyn Progress) -> Result<u64> {
    progress.start(input.chunks.iter().map(|c| c.bytes).sum());
    let n = match &input.reading {
        Reading::Leaves { leaves, chosen } => leaf_records(ingest, input, leaves, chosen, progress)?,
        Reading::Footer { columns } => footer_records(ingest, input, columns, progress)?,
        Reading::Tokens { dtype, block } => token_records(ingest, input, *dtype, *block, progress)?,
    };
    if n == 0 {
        return Err(Error::invalid_input(format!("{}: no item in the index: nothing to ingest", input.dir.display())));
    }
    Ok(n)
}

/// Each item's `chosen` leaves, as records of `input.layout`.
fn leaf_records(
    ingest: &mut dyn RecordSink,
    input: &LitDataInput,
    leaves: &[(String, Serializer)],
    chosen: &[usize],
    progress: &dyn Progress,
) -> Result<u64> {
    let single = input.layout != Layout::Samples;
    let columns: Vec<(&str, PartKind)> = chosen
        .iter()
        .map(|&l| {
            let (name, serializer) = &leaves[l];
            (if name.is_empty() { "item" } else { name.as_str() }, serializer.part_kind())
        })
        .collect();
    let mut record = RecordParts::new(&columns, single)?;
    let mut n = 0u64;
    for chunk in &input.chunks {
        for (i, item) in input.read_items(chunk)?.iter().enumerate() {
            let bad = |detail: String| input.bad_chunk(chunk, &format!("item {i}: {detail}"));
            let values = leaves_of(leaves, item).map_err(bad)?;
            for (part, &l) in record.clear().iter_mut().zip(chosen) {
                let (name, serializer) = &leaves[l];
                leaf_into(serializer, values[l], single, &input.layout, part)
                    .map_err(|e| bad(format!("leaf {name:?}: {e}")))?;
            }
            record.push(ingest, single, n)?;
            n += 1;
        }
        progress.advance(chunk.bytes);
    }
    Ok(n)
}

/// Each chunk's Arrow footer rows, `columns` of them, as records of `input.layout`: every
/// chunk must carry one, of as many rows as the index gives it items.
fn footer_records(
    ingest: &mut dyn RecordSink,
    input: &LitDataInput,
    columns: &[(String, Kind)],
    progress: &dyn Progress,
) -> Result<u64> {
    let mut rows = Rows::new(columns, Nulls::Refuse)?;
    for chunk in &input.chunks {
        let data = input.chunk_bytes(chunk)?;
        let ipc = arrow_footer(&data)
            .map_err(|e| input.bad_chunk(chunk, &e))?
            .ok_or_else(|| input.bad_chunk(chunk, "no Arrow footer, where the directory's first chunk has one"))?;
        let mut reader = input.footer_reader(chunk, ipc)?;
        let source = input.chunk_name(chunk);
        let mut row_in_chunk = 0u64;
        // Decoding happens in `next`: a panic there on a hostile footer is the chunk's error.
        while let Some(batch) = catch_panic(|| source.clone(), || Ok(reader.next()))? {
            let batch = batch.map_err(|e| input.bad_chunk(chunk, &format!("its Arrow footer cannot be read: {e}")))?;
            let schema = batch.schema();
            let in_batch = columns
                .iter()
                .map(|(name, _)| schema.index_of(name))
                .collect::<std::result::Result<Vec<usize>, _>>()
                .map_err(|e| input.bad_chunk(chunk, &format!("its Arrow footer: {e}")))?;
            rows.push_batch(ingest, &batch, &in_batch, &source, row_in_chunk)?;
            row_in_chunk += batch.num_rows() as u64;
        }
        if row_in_chunk != chunk.items {
            return Err(input.bad_chunk(chunk, &format!("{row_in_chunk} rows where the index says {}", chunk.items)));
        }
        progress.advance(chunk.bytes);
    }
    Ok(rows.done().records)
}

/// A `TokensLoader` directory's tokens of `dtype`: each chunk's blocks of `block` tokens (the
/// tail shorter than a block left out, as LitData's reader leaves it), or each item it wrote.
fn token_records(
    ingest: &mut dyn RecordSink,
    input: &LitDataInput,
    dtype: Dtype,
    block: Option<u64>,
    progress: &dyn Progress,
) -> Result<u64> {
    let width = dtype.size_bytes() as usize;
    let mut n = 0u64;
    for chunk in &input.chunks {
        let items = input.read_items(chunk)?;
        let bytes: usize = items.iter().map(Vec::len).sum();
        if let Some((i, item)) = items.iter().enumerate().find(|(_, item)| item.len() % width != 0) {
            return Err(input.bad_chunk(chunk, &format!("item {i}: {} bytes, not whole {dtype:?} tokens", item.len())));
        }
        if (bytes / width) as u64 != chunk.dim {
            let detail = format!("{} tokens where the index says {}", bytes / width, chunk.dim);
            return Err(input.bad_chunk(chunk, &detail));
        }
        match block {
            None => {
                for item in &items {
                    ingest.push(item)?;
                    n += 1;
                }
            }
            Some(block) => {
                let stream: Vec<u8> = items.concat();
                let block_bytes = usize::try_from(block).ok().and_then(|b| b.checked_mul(width)).unwrap_or(usize::MAX);
                for tokens in stream.chunks_exact(block_bytes) {
                    ingest.push(tokens)?;
                    n += 1;
                }
            }
        }
        progress.advance(chunk.bytes);
    }
    Ok(n)
}
