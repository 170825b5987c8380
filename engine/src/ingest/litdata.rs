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
//! (those serializers are refused, naming them), or takes an item whose offsets or sizes run
//! outside its chunk.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::Ingest;
use super::arrow_rows::{Kind, Nulls, Rows, choose_columns, layout_of};
use super::parts::{PartKind, RecordParts, json_strings, offset_table, push_npy, push_number_text, read_index};
use super::sources::Progress;
use crate::error::{Error, Result, catch_panic};
use crate::shard::{Dtype, FixedLayout, Layout};

/// How one leaf was serialized (`data_format`).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Serializer {
    /// `str`: UTF-8.
    Str,
    /// `bytes`.
    Bytes,
    /// `int`: an int64.
    Int,
    /// `float`: a float64.
    Float,
    /// `bool`: one byte.
    Bool,
    /// `no_header_numpy:I` / `no_header_tensor:I`: a 1-D array of one dtype.
    Flat(Dtype),
    /// `numpy`: dtype index, rank and dims as `u32`, then the elements.
    Numpy,
    /// `tensor`: dtype index and rank as big-endian `u32`, the dims likewise, then the elements.
    Tensor,
}

impl Serializer {
    fn parse(text: &str) -> std::result::Result<Self, String> {
        let (name, arg) = match text.split_once(':') {
            Some((name, arg)) => (name, Some(arg)),
            None => (text, None),
        };
        let index = || arg.and_then(|a| a.parse::<u32>().ok()).ok_or_else(|| text.to_owned());
        Ok(match name {
            "str" => Serializer::Str,
            "bytes" => Serializer::Bytes,
            "int" => Serializer::Int,
            "float" => Serializer::Float,
            "bool" => Serializer::Bool,
            "no_header_numpy" => Serializer::Flat(numpy_dtype(index()?).ok_or_else(|| text.to_owned())?),
            "no_header_tensor" => Serializer::Flat(torch_dtype(index()?).ok_or_else(|| text.to_owned())?),
            "numpy" => Serializer::Numpy,
            "tensor" => Serializer::Tensor,
            "pickle" => return Err("pickle (it runs code when it is read)".into()),
            _ => return Err(text.to_owned()),
        })
    }

    fn part_kind(&self) -> PartKind {
        match self {
            Serializer::Str => PartKind::Text,
            Serializer::Bytes => PartKind::Bytes,
            Serializer::Int => PartKind::Integer,
            Serializer::Bool => PartKind::Json,
            Serializer::Float => PartKind::Float,
            Serializer::Flat(_) | Serializer::Numpy | Serializer::Tensor => PartKind::Array,
        }
    }
}

/// NumPy's types in LitData's order of them (`_NUMPY_SCTYPES`).
fn numpy_dtype(index: u32) -> Option<Dtype> {
    Some(match index {
        0 => Dtype::I8,
        1 => Dtype::I16,
        2 => Dtype::I32,
        3 => Dtype::I64,
        4 => Dtype::U8,
        5 => Dtype::U16,
        6 => Dtype::U32,
        7 => Dtype::U64,
        8 => Dtype::F16,
        9 => Dtype::F32,
        10 => Dtype::F64,
        _ => return None,
    })
}

/// torch's types by LitData's index of them (`_TORCH_DTYPES_MAPPING`).
fn torch_dtype(index: u32) -> Option<Dtype> {
    Some(match index {
        0 | 1 => Dtype::F32,
        2 | 3 => Dtype::F64,
        8 | 9 => Dtype::F16,
        10 => Dtype::Bf16,
        11 => Dtype::U8,
        12 => Dtype::I8,
        13 | 14 => Dtype::I16,
        15 | 16 => Dtype::I32,
        17 | 18 => Dtype::I64,
        20 => Dtype::U16,
        _ => return None,
    })
}

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

/// The magic that ends a chunk carrying its items as an Arrow IPC file.
const ARROW_FOOTER_MAGIC: &[u8; 8] = b"LDARW01\0";

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
        let chunks = chunks_of(dir, &index, packing, tokens).map_err(|e| match e {
            ChunkError::Index(detail) => bad(detail),
            ChunkError::Input(error) => error,
        })?;
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
            leaves_reading(dir, config, &formats, wanted).map_err(|e| match e {
                ChunkError::Index(detail) => bad(detail),
                ChunkError::Input(error) => error,
            })?
        };
        input.layout = match &input.reading {
            Reading::Leaves { leaves, chosen } => match chosen.as_slice() {
                &[only] => match &leaves[only].1 {
                    Serializer::Str | Serializer::Bytes => Layout::Bytes,
                    Serializer::Int => Layout::Fixed(fixed_of(Dtype::I64, 1)?),
                    Serializer::Float => Layout::Fixed(fixed_of(Dtype::F64, 1)?),
                    Serializer::Bool => Layout::Fixed(fixed_of(Dtype::U8, 1)?),
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
            Reading::Tokens { dtype, block: Some(block) } => Layout::Fixed(fixed_of(*dtype, *block)?),
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
        zstd::stream::decode_all(data.as_slice()).map_err(|e| self.bad_chunk(chunk, &format!("not zstd: {e}")))
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
            Packing::Sample => offset_table(&data, chunk.items, "item")
                .map_err(&bad)?
                .into_iter()
                .map(|item| zstd::stream::decode_all(item).map_err(|e| bad(format!("an item is not zstd: {e}"))))
                .collect::<Result<Vec<_>>>()?,
            Packing::Batch => framed(&data, chunk.items).map_err(bad)?,
        };
        Ok(items)
    }
}

/// Each leaf's bytes in one item of `leaves`.
fn leaves_of<'a>(leaves: &[(String, Serializer)], item: &'a [u8]) -> std::result::Result<Vec<&'a [u8]>, String> {
    let n = leaves.len();
    let mut at = 4 * n;
    if item.len() < at {
        return Err(format!("{} bytes, too few for its {n} sizes", item.len()));
    }
    let mut values = Vec::with_capacity(n);
    for (i, size) in item[..4 * n].chunks_exact(4).enumerate() {
        let size = u32::from_le_bytes([size[0], size[1], size[2], size[3]]) as usize;
        let end = at
            .checked_add(size)
            .filter(|&end| end <= item.len())
            .ok_or_else(|| format!("leaf {:?} runs past the item's {} bytes", leaves[i].0, item.len()))?;
        values.push(&item[at..end]);
        at = end;
    }
    Ok(values)
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
    let mut chosen = Vec::new();
    for name in wanted {
        let at = leaves.iter().position(|(leaf, _)| leaf == name).ok_or_else(|| {
            let all: Vec<&str> = leaves.iter().map(|(leaf, _)| leaf.as_str()).collect();
            ChunkError::Input(Error::invalid_input(format!(
                "{}: no leaf {name:?} (its leaves: {})",
                dir.display(),
                all.join(", ")
            )))
        })?;
        if chosen.contains(&at) {
            return Err(ChunkError::Input(Error::invalid_input(format!("leaf {name:?} is named twice"))));
        }
        chosen.push(at);
    }
    if chosen.is_empty() {
        chosen = (0..leaves.len()).collect();
    }
    Ok(Reading::Leaves { leaves, chosen })
}

/// The Arrow IPC file at the end of a chunk's `data`, when it ends with LitData's footer magic.
fn arrow_footer(data: &[u8]) -> std::result::Result<Option<&[u8]>, String> {
    let Some(body) = data.strip_suffix(ARROW_FOOTER_MAGIC) else { return Ok(None) };
    let Some(length_at) = body.len().checked_sub(4) else { return Err("an Arrow footer without its length".into()) };
    let length = u32::from_le_bytes([body[length_at], body[length_at + 1], body[length_at + 2], body[length_at + 3]]);
    let start = length_at
        .checked_sub(length as usize)
        .filter(|_| length > 0)
        .ok_or_else(|| format!("an Arrow footer of {length} bytes in a chunk of {}", data.len()))?;
    Ok(Some(&body[start..length_at]))
}

/// `n` numbers of `dtype`, as a record's layout.
fn fixed_of(dtype: Dtype, n: u64) -> Result<FixedLayout> {
    FixedLayout::new(dtype, &[n]).map_err(|e| Error::invalid_input(e.to_string()))
}

/// The names of the leaves of a torch pytree spec as LitData stores it (`treespec_dumps`): a
/// single leaf (""), or one dict, tuple or list of leaves (the dict's keys, the positions).
fn leaf_names(spec: &str) -> std::result::Result<Vec<String>, String> {
    let value: Value = serde_json::from_str(spec).map_err(|e| format!("not JSON: {e}"))?;
    let tree = value.get(1).ok_or("not a [version, tree] pair")?;
    let children = tree.get("children_spec").and_then(Value::as_array).ok_or("a node without children_spec")?;
    let kind = tree.get("type").and_then(Value::as_str);
    if kind.is_none() {
        return Ok(vec![String::new()]);
    }
    if children.iter().any(|c| !c.get("type").is_none_or(Value::is_null)) {
        return Err("items nested more than one level deep are not ingested".into());
    }
    match kind {
        Some("builtins.dict" | "collections.OrderedDict") => {
            let context = tree.get("context").and_then(Value::as_str).ok_or("a dict without its keys")?;
            let keys: Vec<Value> = serde_json::from_str(context).map_err(|e| format!("the dict's keys: {e}"))?;
            let keys: Vec<String> = keys
                .iter()
                .map(|k| match k {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                })
                .collect();
            if keys.len() != children.len() {
                return Err(format!("{} keys for {} leaves", keys.len(), children.len()));
            }
            Ok(keys)
        }
        Some("builtins.tuple" | "builtins.list") => Ok((0..children.len()).map(|i| i.to_string()).collect()),
        Some(other) => Err(format!("items of type {other} are not ingested (a dict, tuple, list or one value are)")),
        None => Ok(vec![String::new()]),
    }
}

/// The items of an `LDFZ01` chunk: each frame decompressed and checked against its lengths, the
/// items cut at the directory's offsets.
fn framed(data: &[u8], expected: u64) -> std::result::Result<Vec<Vec<u8>>, String> {
    const PREFIX: usize = 24;
    const FRAME: usize = 24;
    if data.len() < PREFIX || &data[..8] != b"LDFZ01\0\0" {
        return Err("no LDFZ01 directory".into());
    }
    let u16_at = |at: usize| u16::from_le_bytes([data[at], data[at + 1]]);
    let u32_at = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let version = u16_at(8);
    if version != 1 {
        return Err(format!("LDFZ01 version {version}"));
    }
    let (count, frames) = (u32_at(12).unwrap_or(0), u32_at(20).unwrap_or(0) as usize);
    if u64::from(count) != expected || count == 0 {
        return Err(format!("{count} items where the index says {expected}"));
    }
    let count = count as usize;
    let offsets: Vec<usize> = (0..=count)
        .map(|i| u32_at(PREFIX + 4 * i).map(|o| o as usize))
        .collect::<Option<_>>()
        .ok_or("its offsets run past its end")?;
    let table = PREFIX + 4 * (count + 1);
    let mut joined = Vec::with_capacity(offsets[count]);
    for f in 0..frames {
        let at = table + FRAME * f;
        let entry = data.get(at..at + FRAME).ok_or("its frame table runs past its end")?;
        let word = |i: usize| u32::from_le_bytes([entry[i], entry[i + 1], entry[i + 2], entry[i + 3]]) as usize;
        let offset =
            u64::from_le_bytes([entry[8], entry[9], entry[10], entry[11], entry[12], entry[13], entry[14], entry[15]]);
        let (packed_len, raw_len) = (word(16), word(20));
        let start = usize::try_from(offset).map_err(|_| "a frame past the end".to_owned())?;
        let packed = start
            .checked_add(packed_len)
            .and_then(|end| data.get(start..end))
            .ok_or_else(|| format!("frame {f} runs past the chunk"))?;
        let raw = zstd::stream::decode_all(packed).map_err(|e| format!("frame {f} is not zstd: {e}"))?;
        if raw.len() != raw_len {
            return Err(format!("frame {f} holds {} bytes where its entry says {raw_len}", raw.len()));
        }
        joined.extend_from_slice(&raw);
    }
    let mut items = Vec::with_capacity(count);
    for (i, pair) in offsets.windows(2).enumerate() {
        let (start, end) = (pair[0], pair[1]);
        if start > end || end > joined.len() {
            return Err(format!("item {i} at bytes {start}..{end} of {}", joined.len()));
        }
        items.push(joined[start..end].to_vec());
    }
    Ok(items)
}

/// An array leaf: its dtype, shape and elements.
fn array<'a>(serializer: &Serializer, value: &'a [u8]) -> std::result::Result<(Dtype, Vec<u64>, &'a [u8]), String> {
    let word = |at: usize, big: bool| {
        value.get(at..at + 4).map(|b| {
            let b = [b[0], b[1], b[2], b[3]];
            if big { big_endian_u32(b) } else { u32::from_le_bytes(b) }
        })
    };
    let (dtype, shape, at) = match serializer {
        Serializer::Flat(dtype) => {
            let n = value.len() as u64 / dtype.size_bytes();
            (*dtype, vec![n], 0)
        }
        Serializer::Numpy | Serializer::Tensor => {
            let big = *serializer == Serializer::Tensor;
            let (index, rank) = (word(0, big).ok_or("a truncated header")?, word(4, big).ok_or("a truncated header")?);
            let dtype = if big { torch_dtype(index) } else { numpy_dtype(index) }
                .ok_or_else(|| format!("an array of dtype index {index}"))?;
            let rank = rank as usize;
            if rank > 32 {
                return Err(format!("an array of {rank} dimensions"));
            }
            let shape = (0..rank)
                .map(|d| word(8 + 4 * d, big).map(u64::from))
                .collect::<Option<Vec<u64>>>()
                .ok_or("a truncated shape")?;
            (dtype, shape, 8 + 4 * rank)
        }
        _ => return Err("not an array".into()),
    };
    let elements = &value[at..];
    let expected = shape.iter().try_fold(dtype.size_bytes(), |n, &d| n.checked_mul(d));
    if expected != Some(elements.len() as u64) {
        return Err(format!("an array of shape {shape:?} and {} bytes of elements", elements.len()));
    }
    Ok((dtype, shape, elements))
}

/// A big-endian `u32`: LitData's tensor header is written with struct's `>II`.
#[allow(clippy::big_endian_bytes, reason = "a foreign format's header, read as its writer wrote it")]
fn big_endian_u32(bytes: [u8; 4]) -> u32 {
    u32::from_be_bytes(bytes)
}

/// Ingests every item of `input`, chunk by chunk in the index's order, as records of
/// `input.layout()`. Returns the records ingested; an index of no item is refused.
pub fn records_from_litdata(ingest: &mut Ingest<'_>, input: &LitDataInput, progress: &dyn Progress) -> Result<u64> {
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
    ingest: &mut Ingest<'_>,
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
    ingest: &mut Ingest<'_>,
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
    ingest: &mut Ingest<'_>,
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

/// Appends what one leaf becomes: a record of its own (`single`, of `layout`), or a part.
fn leaf_into(
    serializer: &Serializer,
    value: &[u8],
    single: bool,
    layout: &Layout,
    out: &mut Vec<u8>,
) -> std::result::Result<(), String> {
    let number = |dtype: Dtype, out: &mut Vec<u8>| {
        if value.len() as u64 != dtype.size_bytes() {
            return Err(format!("{} bytes for one {dtype:?}", value.len()));
        }
        if single {
            out.extend_from_slice(value);
        } else {
            push_number_text(dtype, value, out);
        }
        Ok(())
    };
    match serializer {
        Serializer::Str | Serializer::Bytes => out.extend_from_slice(value),
        Serializer::Int => number(Dtype::I64, out)?,
        Serializer::Float => number(Dtype::F64, out)?,
        // A bool's part is JSON (`true`/`false`): it reads back as a Python `bool`.
        Serializer::Bool if !single => match value {
            [0] => out.extend_from_slice(b"false"),
            [1] => out.extend_from_slice(b"true"),
            _ => return Err(format!("{} bytes for one bool", value.len())),
        },
        Serializer::Bool => number(Dtype::U8, out)?,
        Serializer::Flat(_) | Serializer::Numpy | Serializer::Tensor => {
            let (dtype, shape, elements) = array(serializer, value)?;
            if single {
                if *layout != Layout::Arrays(dtype) {
                    return Err(format!("an array of {dtype:?} among arrays of another dtype"));
                }
                out.extend_from_slice(elements);
            } else if !push_npy(dtype, &shape, elements, out) {
                return Err(format!("an array of {dtype:?}, which NumPy has no type for"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_spec_names_the_leaves() {
        let dict = r#"[1, {"type": "builtins.dict", "context": "[\"tokens\", \"text\"]", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(leaf_names(dict).unwrap(), ["tokens", "text"]);
        let leaf = r#"[1, {"type": null, "context": null, "children_spec": []}]"#;
        assert_eq!(leaf_names(leaf).unwrap(), [""]);
        let tuple = r#"[1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}, {"type": null, "context": null, "children_spec": []}]}]"#;
        assert_eq!(leaf_names(tuple).unwrap(), ["0", "1"]);
        let nested = r#"[1, {"type": "builtins.dict", "context": "[\"a\"]", "children_spec": [{"type": "builtins.list", "context": "null", "children_spec": []}]}]"#;
        assert!(leaf_names(nested).unwrap_err().contains("nested"));
        assert!(leaf_names("not json").is_err());
    }

    #[test]
    fn framed_chunks_are_read_and_bad_ones_refused() {
        // Two items, "ab" and "cde", in one frame.
        let raw = b"abcde";
        let packed = zstd::stream::encode_all(&raw[..], 3).unwrap();
        let mut data = b"LDFZ01\0\0".to_vec();
        data.extend_from_slice(&1u16.to_le_bytes());
        data.extend_from_slice(&0u16.to_le_bytes());
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&256u32.to_le_bytes());
        data.extend_from_slice(&1u32.to_le_bytes());
        for offset in [0u32, 2, 5] {
            data.extend_from_slice(&offset.to_le_bytes());
        }
        let payload_at = (data.len() + 24) as u64;
        data.extend_from_slice(&0u32.to_le_bytes());
        data.extend_from_slice(&2u32.to_le_bytes());
        data.extend_from_slice(&payload_at.to_le_bytes());
        data.extend_from_slice(&(packed.len() as u32).to_le_bytes());
        data.extend_from_slice(&5u32.to_le_bytes());
        data.extend_from_slice(&packed);
        assert_eq!(framed(&data, 2).unwrap(), [b"ab".to_vec(), b"cde".to_vec()]);
        assert!(framed(&data, 3).unwrap_err().contains("index says 3"));
        for cut in 0..data.len() {
            assert!(framed(&data[..cut], 2).is_err(), "a chunk cut at {cut}");
        }
        let mut wrong = data.clone();
        let at = wrong.len() - packed.len() - 4;
        wrong[at..at + 4].copy_from_slice(&6u32.to_le_bytes());
        assert!(framed(&wrong, 2).unwrap_err().contains("where its entry says 6"));
    }

    #[test]
    fn serializers_are_known_or_refused_by_name() {
        assert_eq!(Serializer::parse("no_header_numpy:2").unwrap(), Serializer::Flat(Dtype::I32));
        assert_eq!(Serializer::parse("no_header_tensor:18").unwrap(), Serializer::Flat(Dtype::I64));
        for bad in ["pickle", "jpeg", "no_header_numpy:13", "no_header_tensor", "video"] {
            assert!(Serializer::parse(bad).is_err(), "{bad}");
        }
        // numpy: int16 (index 1), 2 x 1.
        let value = [1, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 7, 0, 8, 0];
        let (dtype, shape, elements) = array(&Serializer::Numpy, &value).unwrap();
        assert_eq!((dtype, shape, elements), (Dtype::I16, vec![2, 1], &value[16..]));
        assert!(array(&Serializer::Numpy, &value[..19]).is_err());
        // tensor: big-endian header, int32 (16), 1-D of 1.
        let value = [0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 1, 5, 0, 0, 0];
        assert_eq!(array(&Serializer::Tensor, &value).unwrap().1, [1]);
    }
}
