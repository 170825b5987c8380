//! Mosaic Streaming's MDS directories (what `streaming.MDSWriter` writes: `index.json` and
//! `shard.NNNNN.mds`, optionally compressed to `shard.NNNNN.mds.zstd` and the like) as an ingest
//! source: one record per sample, in the index's order.
//!
//! A shard file is `u32` sample count, `count + 1` `u32` offsets from the file's start, then the
//! samples; a sample is one `u32` size per column of no fixed size, then each column's bytes in
//! column order (all little-endian). What a sample becomes: with one column chosen, an `ndarray`
//! column of one dtype makes array records of it, `bytes`/`str`/`json`/`jpeg`/`png` byte records,
//! a number (`int`, `uint8` ... `float64`) records of one number; otherwise (or for `pil`, or
//! arrays of more than one dimension) a sample of parts named `COLUMN.EXT` as `parts.rs` names
//! them (arrays as `.npy` with their dtype and shape, numbers as decimal text, images and bytes
//! as they are, a `pil` image's raw pixels as a `.npy` array of shape `[height, width]` or
//! `[height, width, channels]`, as `np.asarray` gives them; `jpeg_array` and `list[jpeg]`,
//! `list[png]`, `list[pil]` as one list part, `COLUMN.jpg.list` and the like, its elements the
//! files, or the `.npy` arrays, Streaming's list holds).
//!
//! Owns: `MdsInput` (the index read and checked: one set of columns, known encodings and
//! compressions, every shard file present) and `records_from_mds`; what one value becomes is
//! `values.rs`'s. Never: unpickles (`pkl` is
//! refused, as Streaming refuses it by default), decodes an image (JPEG and PNG stay the files
//! they are), takes a sample whose offsets or sizes run outside its shard, an index shard entry
//! of other fields than Streaming's reader takes, or text (`str`, `str_*`, `json`) not UTF-8.

mod values;

use std::path::{Path, PathBuf};

use serde_json::Value;

use self::values::{Encoding, ndarray, value_into};
use super::RecordSink;
use super::parts::{PartKind, RecordParts, chosen_by_name, json_strings, numbers, offset_table, read_index};
use super::sources::Progress;
use crate::error::{Error, Result};
use crate::shard::{Dtype, Layout};

/// A column of the dataset.
#[derive(Clone, Debug)]
struct Column {
    name: String,
    encoding: Encoding,
    /// Its bytes in every sample, when fixed (`column_sizes`).
    size: Option<u32>,
}

/// How a shard file is compressed (`compression`: `zstd`, `gz`, `snappy`, `br`, with a level or
/// not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Codec {
    Zstd,
    Gzip,
    Snappy,
    Brotli,
}

/// A shard of the index.
#[derive(Debug)]
struct ShardFile {
    /// The uncompressed file, read when present.
    raw: PathBuf,
    /// Its bytes, as the index gives them.
    raw_bytes: u64,
    /// The hashes the writer recorded of the uncompressed bytes (`raw_data.hashes`).
    raw_hashes: Vec<(String, String)>,
    /// The compressed file and its codec, read when the raw file is not there.
    zip: Option<ZipFile>,
    samples: u64,
}

/// A shard's compressed file.
#[derive(Debug)]
struct ZipFile {
    path: PathBuf,
    codec: Codec,
    /// Its bytes, as the index gives them (0: not given).
    bytes: u64,
    /// The hashes the writer recorded of it (`zip_data.hashes`).
    hashes: Vec<(String, String)>,
}

/// The fields of a shard in `index.json`: Streaming's reader takes each as an argument (its
/// `from_json`), so that one missing or one more (a damaged name) makes it refuse the index.
const SHARD_FIELDS: &[&str] = &[
    "version",
    "format",
    "column_encodings",
    "column_names",
    "column_sizes",
    "compression",
    "hashes",
    "raw_data",
    "samples",
    "size_limit",
    "zip_data",
];

/// The fields of a shard's file (`raw_data`, `zip_data`), as Streaming's `FileInfo` takes them.
const FILE_FIELDS: &[&str] = &["basename", "bytes", "hashes"];

/// What Python makes of `value` as a condition (Streaming's `FileInfo(**arg) if arg else None`):
/// `null`, `false`, `0`, `""`, `[]` and `{}` are absent.
fn truthy(value: &Value) -> bool {
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// `value` is an object of exactly the fields `names`, or what is wrong with it (a phrase that
/// follows what it is about).
fn fields_as_streaming_takes_them(value: &Value, names: &[&str]) -> std::result::Result<(), String> {
    let object = value.as_object().ok_or(" is not an object")?;
    if let Some(unknown) = object.keys().find(|k| !names.contains(&k.as_str())) {
        return Err(format!(" has a field {unknown:?} it does not know"));
    }
    if let Some(missing) = names.iter().find(|name| !object.contains_key(**name)) {
        return Err(format!(" has no {missing}"));
    }
    Ok(())
}

/// The longest shard read whose index does not give its length (`raw_data.bytes`): Streaming's
/// writer always gives it, and caps shards at 64 MiB by default.
const SHARD_BYTES_UNDECLARED_MAX: u64 = 1 << 30;

/// An MDS directory to ingest, its index read and checked.
#[derive(Debug)]
pub struct MdsInput {
    dir: PathBuf,
    /// Every column of the shards, in order.
    columns: Vec<Column>,
    /// The ones ingested (indices into `columns`).
    chosen: Vec<usize>,
    shards: Vec<ShardFile>,
    layout: Layout,
}

impl MdsInput {
    /// The MDS dataset in `dir` (`dir/index.json`), its columns `wanted` (none: every column,
    /// as samples). A column whose encoding is not supported is refused, naming it; so is an
    /// index whose shards disagree on the columns, or a shard file that is missing.
    pub fn open(dir: &Path, wanted: &[String]) -> Result<Self> {
        let (index_path, index) = read_index(dir)?;
        let bad = |detail: String| Error::invalid_input(format!("{}: {detail}", index_path.display()));
        if index.get("version").and_then(Value::as_f64) != Some(2.0) {
            return Err(bad("not an MDS index of version 2".into()));
        }
        let shards_json = index.get("shards").and_then(Value::as_array).ok_or_else(|| bad("no shards".into()))?;
        let mut all: Option<Vec<Column>> = None;
        let mut shards = Vec::with_capacity(shards_json.len());
        for (s, shard) in shards_json.iter().enumerate() {
            fields_as_streaming_takes_them(shard, SHARD_FIELDS)
                .map_err(|why| bad(format!("shard {s}{why}: Streaming's reader refuses it too")))?;
            for info in ["raw_data", "zip_data"] {
                if let Some(file) = shard.get(info).filter(|f| truthy(f)) {
                    fields_as_streaming_takes_them(file, FILE_FIELDS)
                        .map_err(|why| bad(format!("shard {s}: {info}{why}: Streaming's reader refuses it too")))?;
                }
            }
            if shard.get("version").and_then(Value::as_f64) != Some(2.0) {
                return Err(bad(format!("shard {s} is not of version 2")));
            }
            let field = |name: &str| shard.get(name).ok_or_else(|| bad(format!("shard {s} has no {name}")));
            let format = field("format")?.as_str().unwrap_or("");
            if format != "mds" {
                return Err(bad(format!("shard {s} is of format {format:?}: only mds shards are ingested")));
            }
            let strings = |name: &str| -> Result<Vec<String>> {
                json_strings(field(name)?).ok_or_else(|| bad(format!("shard {s}: {name} is not a list of strings")))
            };
            let names = strings("column_names")?;
            let encodings = strings("column_encodings")?;
            let sizes: Vec<Option<u32>> = field("column_sizes")?
                .as_array()
                .map(|a| a.iter().map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok())).collect())
                .ok_or_else(|| bad(format!("shard {s}: column_sizes is not a list")))?;
            if names.len() != encodings.len() || names.len() != sizes.len() || names.is_empty() {
                return Err(bad(format!("shard {s}: its column names, encodings and sizes do not match")));
            }
            let mut these = Vec::with_capacity(names.len());
            for ((name, encoding), size) in names.into_iter().zip(&encodings).zip(sizes) {
                let encoding = Encoding::parse(encoding).map_err(|what| {
                    Error::invalid_input(format!(
                        "{}: column {name:?} is encoded as {what}, which is not ingested (bytes, str, int, \
                         uint8..float64, str_int, str_float, str_decimal, ndarray, json, jpeg, png, pil are)",
                        dir.display()
                    ))
                })?;
                these.push(Column { name, encoding, size });
            }
            match &all {
                None => all = Some(these),
                Some(first) => {
                    let same = first.len() == these.len()
                        && first.iter().zip(&these).all(|(a, b)| a.name == b.name && a.encoding == b.encoding);
                    if !same {
                        return Err(bad(format!("shard {s} has other columns than shard 0")));
                    }
                }
            }
            let codec = match shard.get("compression").and_then(Value::as_str) {
                None => None,
                Some(text) => Some(match text.split(':').next().unwrap_or("") {
                    "zstd" => Codec::Zstd,
                    "gz" => Codec::Gzip,
                    "snappy" => Codec::Snappy,
                    "br" => Codec::Brotli,
                    other => {
                        return Err(bad(format!(
                            "shard {s} is compressed with {other:?}: zstd, gz, snappy and br are read"
                        )));
                    }
                }),
            };
            shards.push(shard_file(dir, s, shard, codec, &bad)?);
        }
        let columns = all.ok_or_else(|| bad("no shards".into()))?;
        let names: Vec<&str> = columns.iter().map(|c| c.name.as_str()).collect();
        let chosen = chosen_by_name(&names, wanted, ("column", "columns"), &dir.display().to_string())?;
        let mut input = Self { dir: dir.to_owned(), columns, chosen, shards, layout: Layout::Samples };
        input.layout = input.decide_layout()?;
        Ok(input)
    }

    /// The layout of the records it becomes.
    pub fn layout(&self) -> Layout {
        self.layout.clone()
    }

    /// Samples in the index.
    pub fn samples(&self) -> u64 {
        self.shards.iter().map(|s| s.samples).sum()
    }

    /// Samples for several columns, or for one of `pil` images or of arrays of more than one
    /// dimension (the index's shape, else the first sample's: an array keeps its shape only as a
    /// sample's part); for another one, records of its values (an array's dtype read from the
    /// first sample when the encoding does not fix it).
    fn decide_layout(&self) -> Result<Layout> {
        let &[only] = self.chosen.as_slice() else { return Ok(Layout::Samples) };
        let column = &self.columns[only];
        Ok(match &column.encoding {
            Encoding::Bytes
            | Encoding::Str
            | Encoding::NumberText(_)
            | Encoding::Json
            | Encoding::Jpeg
            | Encoding::Png => Layout::Bytes,
            Encoding::Int => Layout::Fixed(numbers(Dtype::I64, 1)?),
            Encoding::Scalar(dtype) => Layout::Fixed(numbers(*dtype, 1)?),
            Encoding::Pil | Encoding::List { .. } => Layout::Samples,
            Encoding::NdArray { dtype: Some(dtype), shape: Some(shape) } => {
                if shape.len() > 1 {
                    Layout::Samples
                } else {
                    Layout::Arrays(*dtype)
                }
            }
            Encoding::NdArray { .. } => {
                let first = self.shards.iter().find(|s| s.samples > 0).ok_or_else(|| {
                    Error::invalid_input(format!("{}: no sample in the index: nothing to ingest", self.dir.display()))
                })?;
                let data = self.read_shard(first)?;
                let samples = offset_table(&data, first.samples, "sample").map_err(|e| self.bad_shard(first, &e))?;
                let values =
                    self.values_of(samples[0]).map_err(|e| self.bad_shard(first, &format!("sample 0: {e}")))?;
                let (dtype, shape, _) =
                    ndarray(&column.encoding, values[only]).map_err(|e| self.bad_shard(first, &e))?;
                if shape.len() > 1 { Layout::Samples } else { Layout::Arrays(dtype) }
            }
        })
    }

    /// The decompressed bytes of `shard`: the raw file when it is there, else the compressed
    /// one, decompressed, never past the index's length; each checked against the length and
    /// the hashes the writer recorded of it.
    fn read_shard(&self, shard: &ShardFile) -> Result<Vec<u8>> {
        let Some(zip) = shard.zip.as_ref().filter(|_| !shard.raw.is_file()) else {
            let limit = if shard.raw_bytes == 0 { SHARD_BYTES_UNDECLARED_MAX } else { shard.raw_bytes };
            let data = read_at_most(&shard.raw, limit).map_err(|e| self.bad_shard(shard, &e))?;
            if shard.raw_bytes != 0 && data.len() as u64 != shard.raw_bytes {
                let detail = format!("{} bytes where the index says {}", data.len(), shard.raw_bytes);
                return Err(self.bad_shard(shard, &detail));
            }
            self.check_hashes(shard, &shard.raw, &data, &shard.raw_hashes)?;
            return Ok(data);
        };
        let limit = if zip.bytes == 0 { SHARD_BYTES_UNDECLARED_MAX } else { zip.bytes };
        let packed = read_at_most(&zip.path, limit).map_err(|e| self.bad_shard(shard, &e))?;
        self.check_hashes(shard, &zip.path, &packed, &zip.hashes)?;
        let data = decompress(zip.codec, &packed, shard.raw_bytes)
            .map_err(|e| Error::invalid_input(format!("{}: cannot be decompressed: {e}", zip.path.display())))?;
        if data.len() as u64 != shard.raw_bytes {
            return Err(
                self.bad_shard(shard, &format!("{} bytes where the index says {}", data.len(), shard.raw_bytes))
            );
        }
        self.check_hashes(shard, &shard.raw, &data, &shard.raw_hashes)?;
        Ok(data)
    }

    /// Refuses `data` (of `path`, a file of `shard`) when a hash the writer recorded of it is
    /// not its hash. Hashes of an algorithm granary does not compute are passed over.
    fn check_hashes(&self, shard: &ShardFile, path: &Path, data: &[u8], recorded: &[(String, String)]) -> Result<()> {
        for (algorithm, expected) in recorded {
            let Some(actual) = super::digests::hex_digest(algorithm, data) else { continue };
            if !actual.eq_ignore_ascii_case(expected) {
                let name = path.file_name().unwrap_or_default().to_string_lossy();
                return Err(self.bad_shard(
                    shard,
                    &format!("{name}'s {algorithm} is {actual} where the index records {expected}: damaged, refused"),
                ));
            }
        }
        Ok(())
    }

    fn bad_shard(&self, shard: &ShardFile, detail: &str) -> Error {
        let name = shard.raw.strip_prefix(&self.dir).unwrap_or(&shard.raw);
        Error::invalid_input(format!("{}: {}: {detail}", self.dir.display(), name.display()))
    }

    /// Each column's bytes in one sample.
    fn values_of<'a>(&self, sample: &'a [u8]) -> std::result::Result<Vec<&'a [u8]>, String> {
        let variable = self.columns.iter().filter(|c| c.size.is_none()).count();
        let mut at = 4 * variable;
        if sample.len() < at {
            return Err(format!("{} bytes, too few for its {variable} sizes", sample.len()));
        }
        let mut sizes = sample[..at].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
        let mut values = Vec::with_capacity(self.columns.len());
        for column in &self.columns {
            let size = match column.size {
                Some(size) => size,
                None => sizes.next().unwrap_or(0),
            };
            let end = at
                .checked_add(size as usize)
                .filter(|&end| end <= sample.len())
                .ok_or_else(|| format!("column {:?} runs past the sample's {} bytes", column.name, sample.len()))?;
            values.push(&sample[at..end]);
            at = end;
        }
        Ok(values)
    }
}

/// Shard `s` of the index (`shard`, compressed with `codec`): its files, each a path inside
/// `dir` (`inside`), with the lengths and hashes the writer recorded; the uncompressed file or
/// the compressed one present, and the compressed one's decompressed length given. `bad` makes
/// an error about the index.
fn shard_file(
    dir: &Path,
    s: usize,
    shard: &Value,
    codec: Option<Codec>,
    bad: &dyn Fn(String) -> Error,
) -> Result<ShardFile> {
    let raw_data = shard.get("raw_data").ok_or_else(|| bad(format!("shard {s} has no raw_data")))?;
    let basename = |info: &Value, what: &str| -> Result<PathBuf> {
        let name = info
            .get("basename")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("shard {s}: {what} has no basename")))?;
        inside(dir, name).map_err(|why| bad(format!("shard {s}: {what}'s basename {name:?} {why}")))
    };
    let hashes = |info: &Value| -> Vec<(String, String)> {
        let recorded = info.get("hashes").and_then(Value::as_object);
        recorded
            .map(|map| map.iter().filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned()))).collect())
            .unwrap_or_default()
    };
    let raw = basename(raw_data, "raw_data")?;
    let raw_bytes = raw_data.get("bytes").and_then(Value::as_u64).unwrap_or(0);
    let zip = match (shard.get("zip_data").filter(|z| truthy(z)), codec) {
        (Some(info), Some(codec)) => Some(ZipFile {
            path: basename(info, "zip_data")?,
            codec,
            bytes: info.get("bytes").and_then(Value::as_u64).unwrap_or(0),
            hashes: hashes(info),
        }),
        _ => None,
    };
    if !raw.is_file() && !zip.as_ref().is_some_and(|z| z.path.is_file()) {
        return Err(Error::invalid_input(format!(
            "{}: shard {s}'s file {} is missing",
            dir.display(),
            raw.file_name().unwrap_or_default().to_string_lossy()
        )));
    }
    if zip.is_some() && !raw.is_file() && raw_bytes == 0 {
        return Err(bad(format!("shard {s}: raw_data gives no length, which bounds its decompression: refused")));
    }
    let samples = shard
        .get("samples")
        .ok_or_else(|| bad(format!("shard {s} has no samples")))?
        .as_u64()
        .ok_or_else(|| bad(format!("shard {s}: samples is not a count")))?;
    Ok(ShardFile { raw, raw_bytes, raw_hashes: hashes(raw_data), zip, samples })
}

/// `name` (an index's basename) as a path inside `dir`, or why not: relative, no component that
/// climbs, and (where it exists) inside `dir` once links are resolved.
fn inside(dir: &Path, name: &str) -> std::result::Result<PathBuf, &'static str> {
    use std::path::Component;
    let relative = Path::new(name);
    if name.is_empty() || !relative.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err("is not a path inside the dataset's directory: refused");
    }
    let path = dir.join(relative);
    if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize())
        && !real.starts_with(&root)
    {
        return Err("leads out of the dataset's directory through a link: refused");
    }
    Ok(path)
}

/// The bytes of `path`, refused when it holds more than `limit`: a file's length is checked
/// before it is read.
fn read_at_most(path: &Path, limit: u64) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut data = Vec::new();
    file.take(limit.saturating_add(1)).read_to_end(&mut data).map_err(|e| format!("{}: {e}", path.display()))?;
    if data.len() as u64 > limit {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        return Err(format!("{name} holds more than the {limit} bytes the index gives it: refused"));
    }
    Ok(data)
}

/// `packed` decompressed with `codec`, refused at the first byte past `raw_bytes` (the index's
/// length of the shard), so a decompression bomb costs no more memory than the shard it claims
/// to be.
fn decompress(codec: Codec, packed: &[u8], raw_bytes: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let too_long = || std::io::Error::other(format!("it decompresses to more than the index's {raw_bytes} bytes"));
    let mut out = Vec::with_capacity(usize::try_from(raw_bytes).unwrap_or(0).min(64 << 20));
    let limit = raw_bytes.saturating_add(1);
    match codec {
        Codec::Zstd => {
            zstd::stream::read::Decoder::new(packed)?.take(limit).read_to_end(&mut out)?;
        }
        Codec::Gzip => {
            flate2::read::MultiGzDecoder::new(packed).take(limit).read_to_end(&mut out)?;
        }
        Codec::Snappy => {
            // A raw snappy block says its length first: checked before anything is allocated.
            let claimed = snap::raw::decompress_len(packed).map_err(std::io::Error::other)?;
            if claimed as u64 > raw_bytes {
                return Err(too_long());
            }
            out = snap::raw::Decoder::new().decompress_vec(packed).map_err(std::io::Error::other)?;
        }
        Codec::Brotli => {
            brotli::Decompressor::new(packed, 1 << 16).take(limit).read_to_end(&mut out)?;
        }
    }
    if out.len() as u64 > raw_bytes {
        return Err(too_long());
    }
    Ok(out)
}

/// Ingests every sample of `input`, shard by shard in the index's order, as records of
/// `input.layout()`. Returns the records ingested; an index of no sample is refused.
pub fn records_from_mds(ingest: &mut dyn RecordSink, input: &MdsInput, progress: &dyn Progress) -> Result<u64> {
    progress.start(input.shards.iter().map(|s| s.raw_bytes).sum());
    let single = input.layout != Layout::Samples;
    let mut n = 0u64;
    let columns: Vec<(&str, PartKind)> =
        input.chosen.iter().map(|&c| (input.columns[c].name.as_str(), input.columns[c].encoding.part_kind())).collect();
    let mut record = RecordParts::new(&columns, single)?;
    for shard in &input.shards {
        let data = input.read_shard(shard)?;
        let samples = offset_table(&data, shard.samples, "sample").map_err(|e| input.bad_shard(shard, &e))?;
        for (i, sample) in samples.into_iter().enumerate() {
            let bad = |detail: String| input.bad_shard(shard, &format!("sample {i}: {detail}"));
            let values = input.values_of(sample).map_err(bad)?;
            for (part, &c) in record.clear().iter_mut().zip(&input.chosen) {
                let column = &input.columns[c];
                value_into(&column.encoding, values[c], single, &input.layout, part)
                    .map_err(|e| bad(format!("column {:?}: {e}", column.name)))?;
            }
            record.push(ingest, single, n)?;
            n += 1;
        }
        progress.advance(shard.raw_bytes);
    }
    if n == 0 {
        return Err(Error::invalid_input(format!(
            "{}: no sample in the index: nothing to ingest",
            input.dir.display()
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard file of `samples`, as MDSWriter lays it out (no config bytes between).
    fn shard(samples: &[&[u8]]) -> Vec<u8> {
        let mut out = (samples.len() as u32).to_le_bytes().to_vec();
        let mut at = 4 + 4 * (samples.len() as u32 + 1);
        out.extend_from_slice(&at.to_le_bytes());
        for s in samples {
            at += s.len() as u32;
            out.extend_from_slice(&at.to_le_bytes());
        }
        for s in samples {
            out.extend_from_slice(s);
        }
        out
    }

    #[test]
    fn samples_split_at_their_offsets_and_bad_offsets_are_refused() {
        let data = shard(&[b"ab", b"", b"cde"]);
        assert_eq!(offset_table(&data, 3, "sample").unwrap(), [&b"ab"[..], b"", b"cde"]);
        assert!(offset_table(&data, 4, "sample").unwrap_err().contains("3 samples where the index says 4"));
        let mut past = data.clone();
        past[8..12].copy_from_slice(&100u32.to_le_bytes());
        assert!(offset_table(&past, 3, "sample").unwrap_err().contains("sample 0 at bytes"));
        assert!(offset_table(&data[..10], 3, "sample").is_err());
        assert!(offset_table(&[], 0, "sample").is_err());
        // Every prefix and every single-byte change of a shard is a sample list or an error.
        for cut in 0..data.len() {
            let _ = offset_table(&data[..cut], 3, "sample");
            for bit in 0..8 {
                let mut flipped = data.clone();
                flipped[cut] ^= 1 << bit;
                let _ = offset_table(&flipped, 3, "sample");
            }
        }
    }
}
