//! How a value of another format becomes a part of a WebDataset-style sample: named
//! `COLUMN.EXT`, the extension saying how to decode it, as webdataset's decoders do (`npy` an
//! array with its dtype and shape, `cls` an integer's decimal text, `txt` text, `json`, `jpg`,
//! `png`, `bin` raw bytes), and `float` a float's decimal text (webdataset has no name for it;
//! `granary.formats.decode` reads every one of them). Parquet's, MDS's and LitData's samples are written through it, so one decoder
//! reads both.
//!
//! Owns: `PartKind` (the extension of each kind of value), the encodings of numbers and
//! arrays (`push_number_text`, `push_npy`), and the offset table MDS shards and LitData chunks
//! share (`offset_table`) with their JSON indexes (`read_index`, `json_strings`), and a record's
//! parts on their way to the ingest (`RecordParts`), the UTF-8 check of text values (`utf8_text`),
//! the user's column names found among an input's (`chosen_by_name`) and a record of numbers'
//! layout (`numbers`). Never: decides which columns a sample has (the user and the
//! sources do), or stores a value other than as the format held it (an array's elements keep
//! their type; a number's text parses back to the same value).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::RecordSink;
use crate::error::{Error, Result};
use crate::shard::{Dtype, encode_sample};

/// What a part holds, which names its extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PartKind {
    /// Raw bytes.
    Bytes,
    /// UTF-8 text.
    Text,
    /// An integer's decimal text.
    Integer,
    /// A float's decimal text (the shortest that parses back to the same value).
    Float,
    /// A decimal number's exact text (Python's `decimal.Decimal`).
    Decimal,
    /// A NumPy `.npy` file: dtype, shape and the elements.
    Array,
    /// JSON text.
    Json,
    /// A JPEG file.
    Jpeg,
    /// A PNG file.
    Png,
    /// A date and time, ISO 8601 (`YYYY-MM-DDTHH:MM:SS.ffffff`, nine digits for nanoseconds),
    /// then `+00:00[ZONE]` for an instant of a zone.
    Datetime,
    /// A date, `YYYY-MM-DD`.
    Date,
    /// A time of day, `HH:MM:SS.ffffff`.
    Time,
    /// A duration: `COUNT UNIT` (`s`, `ms`, `us`, `ns`).
    Timedelta,
    /// A list of JPEG files, of PNG files, of `.npy` arrays: a `u32` count, each element's `u32`
    /// length, then the elements back to back (all little-endian).
    JpegList,
    PngList,
    ArrayList,
}

impl PartKind {
    /// The extension a part of this kind is named with.
    pub(super) fn extension(self) -> &'static str {
        match self {
            PartKind::Bytes => "bin",
            PartKind::Text => "txt",
            PartKind::Integer => "cls",
            PartKind::Float => "float",
            PartKind::Decimal => "decimal",
            PartKind::Array => "npy",
            PartKind::Json => "json",
            PartKind::Jpeg => "jpg",
            PartKind::Png => "png",
            PartKind::Datetime => "datetime",
            PartKind::Date => "date",
            PartKind::Time => "time",
            PartKind::Timedelta => "timedelta",
            PartKind::JpegList => "jpg.list",
            PartKind::PngList => "png.list",
            PartKind::ArrayList => "npy.list",
        }
    }

    /// The kind of a number of `dtype`.
    pub(super) fn of_number(dtype: Dtype) -> Self {
        match dtype {
            Dtype::F16 | Dtype::Bf16 | Dtype::F32 | Dtype::F64 => PartKind::Float,
            _ => PartKind::Integer,
        }
    }
}

/// The part name of column `column` holding values of `kind`.
fn part_name(column: &str, kind: PartKind) -> String {
    format!("{column}.{}", kind.extension())
}

/// Names a sample's reader gives meanings of its own (webdataset's, and `granary.formats.decode`,
/// which keeps them as they are): a column of one of these names would be lost to the sample's
/// key or source, so it is refused in a sample, naming it.
const RESERVED_PART_NAMES: [&str; 3] = ["__key__", "__url__", "__local_path__"];

/// Appends the decimal text of the one number of `dtype` in `le` (its little-endian bytes).
/// Returns false when `le` is not one number of `dtype`.
pub(super) fn push_number_text(dtype: Dtype, le: &[u8], out: &mut Vec<u8>) -> bool {
    macro_rules! text {
        ($t:ty) => {{
            let Ok(bytes) = <[u8; std::mem::size_of::<$t>()]>::try_from(le) else { return false };
            out.extend_from_slice(<$t>::from_le_bytes(bytes).to_string().as_bytes());
        }};
    }
    match dtype {
        Dtype::U8 => text!(u8),
        Dtype::I8 => text!(i8),
        Dtype::U16 => text!(u16),
        Dtype::I16 => text!(i16),
        Dtype::U32 => text!(u32),
        Dtype::I32 => text!(i32),
        Dtype::U64 => text!(u64),
        Dtype::I64 => text!(i64),
        Dtype::F32 => text!(f32),
        Dtype::F64 => text!(f64),
        // Half floats widen exactly to f32, whose shortest text parses back to the same half.
        Dtype::F16 => {
            let Ok(bytes) = <[u8; 2]>::try_from(le) else { return false };
            out.extend_from_slice(f16_to_f32(u16::from_le_bytes(bytes)).to_string().as_bytes());
        }
        Dtype::Bf16 => {
            let Ok(bytes) = <[u8; 2]>::try_from(le) else { return false };
            out.extend_from_slice(f32::from_bits(u32::from(u16::from_le_bytes(bytes)) << 16).to_string().as_bytes());
        }
    }
    true
}

/// An IEEE 754 half as the f32 of the same value.
fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits >> 15) << 31;
    let exponent = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match (exponent, mantissa) {
        (0, 0) => 0,
        // Subnormal: mantissa x 2^-24, exact in f32.
        (0, m) => (m as f32 * 2f32.powi(-24)).to_bits(),
        (0x1f, 0) => 0x7f80_0000,
        (0x1f, m) => 0x7f80_0000 | (m << 13),
        (e, m) => ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(sign | magnitude)
}

/// NumPy's name of `dtype` in an `.npy` header (`<i4`, ...); bfloat16 has none.
fn npy_descr(dtype: Dtype) -> Option<&'static str> {
    Some(match dtype {
        Dtype::U8 => "|u1",
        Dtype::I8 => "|i1",
        Dtype::U16 => "<u2",
        Dtype::I16 => "<i2",
        Dtype::U32 => "<u4",
        Dtype::I32 => "<i4",
        Dtype::U64 => "<u8",
        Dtype::I64 => "<i8",
        Dtype::F16 => "<f2",
        Dtype::F32 => "<f4",
        Dtype::F64 => "<f8",
        Dtype::Bf16 => return None,
    })
}

/// Appends an `.npy` file (format 1.0) of an array of `dtype` and `shape` whose elements are
/// `le` (little-endian, C order). Returns false for a dtype NumPy has no name for.
pub(super) fn push_npy(dtype: Dtype, shape: &[u64], le: &[u8], out: &mut Vec<u8>) -> bool {
    let Some(descr) = npy_descr(dtype) else { return false };
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    let shape = match dims.len() {
        // A 0-d array: one element, which NumPy gives back as a scalar of its dtype.
        0 => "()".to_owned(),
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Magic (6) + version (2) + length (2) + header + '\n', padded with spaces to 64 bytes.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&u16::try_from(header.len()).unwrap_or(u16::MAX).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(le);
    true
}

/// `value`, a text value of a reader's format, is UTF-8, or why not: a text the format's own
/// reader cannot decode is refused at ingest rather than handed to a trainer to fail on.
pub(super) fn utf8_text(value: &[u8]) -> std::result::Result<(), String> {
    std::str::from_utf8(value).map(drop).map_err(|e| format!("text that is not UTF-8 (at byte {})", e.valid_up_to()))
}

/// The parts of one record being made, and how it goes to the ingest: as a record of its own
/// (one part, `single`) or as a sample of named parts keyed by a position (12 digits). The
/// parts' memory is reused from record to record.
pub(super) struct RecordParts {
    names: Vec<String>,
    parts: Vec<Vec<u8>>,
}

impl RecordParts {
    /// The parts of columns `columns` (each with the kind of its values, which names its
    /// extension), in that order; for a record of its own (`single`) the one column's values.
    /// A sample column whose name a sample's reader reserves (`__key__`, `__url__`) is refused.
    pub(super) fn new(columns: &[(&str, PartKind)], single: bool) -> Result<Self> {
        assert!(!columns.is_empty(), "a record has at least one part");
        assert!(!single || columns.len() == 1, "a record of its own is one column's values");
        if !single && let Some((column, _)) = columns.iter().find(|(column, _)| RESERVED_PART_NAMES.contains(column)) {
            return Err(Error::invalid_input(format!(
                "column {column:?}: that name stands for the sample's own {} when read (granary.formats.decode, \
                 webdataset): rename the column, or ingest it alone",
                column.trim_matches('_').replace('_', " ")
            )));
        }
        let names: Vec<String> = columns.iter().map(|(column, kind)| part_name(column, *kind)).collect();
        let parts = vec![Vec::new(); names.len()];
        Ok(Self { names, parts })
    }

    /// Names part `part` `COLUMN.EXTENSION` for this and later records (a column whose values
    /// say their own kind, as an image's bytes do).
    pub(super) fn set_extension(&mut self, part: usize, extension: &str) {
        let name = &mut self.names[part];
        // `part_name` always puts the dot.
        let dot = name.rfind('.').unwrap_or(name.len());
        if name.get(dot + 1..) != Some(extension) {
            name.truncate(dot + 1);
            name.push_str(extension);
        }
    }

    /// The parts, emptied, for the next record.
    pub(super) fn clear(&mut self) -> &mut [Vec<u8>] {
        self.parts.iter_mut().for_each(Vec::clear);
        &mut self.parts
    }

    /// Pushes the record: the first part alone when `single`, else the sample keyed `key`.
    pub(super) fn push(&self, ingest: &mut dyn RecordSink, single: bool, key: u64) -> Result<()> {
        if single {
            return ingest.push(&self.parts[0]);
        }
        let named: Vec<(&str, &[u8])> =
            self.names.iter().zip(&self.parts).map(|(name, data)| (name.as_str(), data.as_slice())).collect();
        ingest.push(&encode_sample(&format!("{key:012}"), &named))
    }
}

/// The records of a file in the offset-table layout MDS shards and LitData chunks share: a
/// `u32` count (checked against `expected`, the index's), `count + 1` `u32` offsets from the
/// file's start (checked against the file), then the records. `noun` names a record in errors.
pub(super) fn offset_table<'a>(
    data: &'a [u8],
    expected: u64,
    noun: &str,
) -> std::result::Result<Vec<&'a [u8]>, String> {
    let u32_at = |at: usize| data.get(at..at + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let count = u32_at(0).ok_or("shorter than its header")?;
    if u64::from(count) != expected {
        return Err(format!("{count} {noun}s where the index says {expected}"));
    }
    let count = count as usize;
    let offsets: Vec<usize> = (0..=count)
        .map(|i| u32_at(4 + 4 * i).map(|o| o as usize))
        .collect::<Option<_>>()
        .ok_or("its offsets run past its end")?;
    let header_end = 4 + 4 * (count + 1);
    let mut records = Vec::with_capacity(count);
    for (i, pair) in offsets.windows(2).enumerate() {
        let (start, end) = (pair[0], pair[1]);
        if start < header_end || start > end || end > data.len() {
            return Err(format!("{noun} {i} at bytes {start}..{end} of {}", data.len()));
        }
        records.push(&data[start..end]);
    }
    Ok(records)
}

/// The JSON index of an MDS or LitData directory, `dir/index.json`, and its path (errors about
/// it name the path).
pub(super) fn read_index(dir: &Path) -> Result<(PathBuf, Value)> {
    let path = dir.join("index.json");
    let text = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
    let index = serde_json::from_slice(&text)
        .map_err(|e| Error::invalid_input(format!("{}: not JSON: {e}", path.display())))?;
    Ok((path, index))
}

/// A JSON list of strings, owned; `None` when `value` is not one.
pub(super) fn json_strings(value: &Value) -> Option<Vec<String>> {
    value.as_array()?.iter().map(|v| v.as_str().map(str::to_owned)).collect()
}

/// Where each name of `wanted` sits among `names` (every one, in order, when none is wanted);
/// a name not there, or named twice, is an error naming `input` and calling them `what`
/// (`("column", "columns")`, `("leaf", "leaves")`).
pub(super) fn chosen_by_name(names: &[&str], wanted: &[String], what: (&str, &str), input: &str) -> Result<Vec<usize>> {
    let (one, many) = what;
    let mut chosen = Vec::with_capacity(wanted.len());
    for name in wanted {
        let at = names.iter().position(|n| n == name).ok_or_else(|| {
            Error::invalid_input(format!("{input}: no {one} {name:?} (its {many}: {})", names.join(", ")))
        })?;
        if chosen.contains(&at) {
            return Err(Error::invalid_input(format!("{one} {name:?} is named twice")));
        }
        chosen.push(at);
    }
    if chosen.is_empty() {
        chosen = (0..names.len()).collect();
    }
    Ok(chosen)
}

/// `n` numbers of `dtype`, as a record's layout.
pub(super) fn numbers(dtype: crate::shard::Dtype, n: u64) -> Result<crate::shard::FixedLayout> {
    crate::shard::FixedLayout::new(dtype, &[n]).map_err(|e| Error::invalid_input(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_npy_header_is_aligned_and_names_dtype_and_shape() {
        let mut out = Vec::new();
        assert!(push_npy(Dtype::I32, &[3], &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], &mut out));
        assert_eq!(&out[..8], b"\x93NUMPY\x01\x00");
        let len = usize::from(u16::from_le_bytes([out[8], out[9]]));
        assert_eq!((10 + len) % 64, 0);
        let header = std::str::from_utf8(&out[10..10 + len]).unwrap();
        assert!(header.starts_with("{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }"), "{header}");
        assert!(header.ends_with('\n'));
        assert_eq!(out.len(), 10 + len + 12);
        out.clear();
        assert!(push_npy(Dtype::U8, &[2, 2], &[1, 2, 3, 4], &mut out));
        let len = usize::from(u16::from_le_bytes([out[8], out[9]]));
        assert!(
            std::str::from_utf8(&out[10..10 + len])
                .unwrap()
                .contains("'descr': '|u1', 'fortran_order': False, 'shape': (2, 2), }")
        );
        assert_eq!(&out[10 + len..], [1, 2, 3, 4]);
        assert!(!push_npy(Dtype::Bf16, &[1], &[0, 0], &mut out));
    }

    #[test]
    fn numbers_become_text_that_parses_back() {
        let mut out = Vec::new();
        assert!(push_number_text(Dtype::I64, &(-42i64).to_le_bytes(), &mut out));
        assert_eq!(out, b"-42");
        out.clear();
        assert!(push_number_text(Dtype::F32, &0.1f32.to_le_bytes(), &mut out));
        assert_eq!(out, b"0.1");
        out.clear();
        // 1.5 as a half: sign 0, exponent 15, mantissa 0x200.
        assert!(push_number_text(Dtype::F16, &0x3e00u16.to_le_bytes(), &mut out));
        assert_eq!(out, b"1.5");
        assert!(!push_number_text(Dtype::I32, &[0, 0], &mut out));
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0xfc00), f32::NEG_INFINITY);
    }
}
