//! Arrow columns as records and parts: what kind of value a column holds (`Kind`), and a row's
//! value written as a record of its own or as a sample's part, exactly as pyarrow's
//! `to_pylist` gives it (a string's UTF-8, a number in its own type, a nested value as the JSON
//! of the same Python value). Parquet files, Arrow streams and LitData's Arrow footers are read
//! through it, so one set of rules serves all three.
//!
//! What a value becomes, by its column's Arrow type:
//! - binary (`binary`, `large_binary`, `binary_view`, `fixed_size_binary`): its bytes (`.bin`);
//! - strings (`utf8`, `large_utf8`, `utf8_view`): their UTF-8 (`.txt`);
//! - a number: its little-endian bytes in a record, its decimal text in a part (`.cls`, `.float`);
//! - `bool`: one byte 0 or 1 in a record, `true`/`false` in a part (`.json`: a Python `bool`);
//! - a list of numbers: its elements, little-endian, in a record; an `.npy` array in a part;
//! - dates and times, as the number Arrow holds in a record, as the Python value `to_pylist`
//!   gives in a part (`arrow_temporal`);
//! - `dictionary<_, V>` (pandas categoricals): the value its key points at, as V's;
//! - `struct<bytes, path>` (Hugging Face's `Image()` and `Audio()`): the struct's `bytes`, in a
//!   part named by what the bytes are (`.jpg`, `.png`, `.webp`, `.gif`, `.bmp`, `.tiff`, `.wav`,
//!   `.flac`, `.mp3`, `.ogg`, else `.bin`); one whose bytes are null (a path only) is refused;
//! - other structs, and lists of strings, bools, lists or structs: the JSON text of the value
//!   (`.json`: the same dicts and lists, `NaN` and `Infinity` as Python's `json` writes them).
//!
//! A null (a null value, or a null element inside a list of numbers) is refused, naming the
//! source, the row and the column, unless the caller asked to skip such rows (`Nulls::Skip`,
//! counted).
//!
//! Owns: `Kind`, `ColumnRows` (one batch's column, a dictionary's keys resolved once), `append`,
//! and `Rows` (a source's batches into records, keyed by their row's position). Never: decides
//! which columns a record has, takes a column by its position without checking its name, or
//! stores a value other than as Arrow held it (no rounding, no cast between types; a column of a
//! type not listed is refused by name).

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrowPrimitiveType, RecordBatch};
use arrow_schema::{DataType, Fields, Schema};

use super::arrow_temporal::{Temporal, append_temporal};

use super::RecordSink;
use super::parts::{PartKind, RecordParts, push_npy};
use crate::error::{Error, Result};
use crate::shard::{Dtype, FixedLayout, Layout};

/// What to do with a row that holds a null in a chosen column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Nulls {
    /// Refuse the input, naming the source, row and column (nothing is committed).
    #[default]
    Refuse,
    /// Leave the row out (counted in `RowsIngested::skipped`).
    Skip,
}

/// What an ingest of rows (Parquet files, an Arrow stream) did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowsIngested {
    /// Records ingested (rows).
    pub records: u64,
    /// Rows left out for a null (`Nulls::Skip`).
    pub skipped: u64,
}

/// The layout of records made of `columns`: one column's values as records of their own,
/// several as samples.
pub(super) fn layout_of(columns: &[(String, Kind)]) -> Layout {
    match columns {
        [(_, kind)] => kind.single_layout(),
        _ => Layout::Samples,
    }
}

/// The chosen `columns` of a batch of `schema`, each with its kind: by name, in the order
/// asked (none asked: every column, in the schema's order), each once. `source` names the
/// input in errors.
pub(super) fn choose_columns(schema: &Schema, columns: &[String], source: &str) -> Result<Vec<(String, Kind)>> {
    let names: Vec<&str> = if columns.is_empty() {
        schema.fields().iter().map(|f| f.name().as_str()).collect()
    } else {
        columns.iter().map(String::as_str).collect()
    };
    if names.is_empty() {
        return Err(Error::invalid_input(format!("{source}: no column to ingest")));
    }
    let mut chosen: Vec<(String, Kind)> = Vec::with_capacity(names.len());
    for name in names {
        if chosen.iter().any(|(other, _)| other == name) {
            return Err(Error::invalid_input(format!("column {name:?} is named twice")));
        }
        let field = schema.field_with_name(name).map_err(|_| {
            let all: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            Error::invalid_input(format!("{source}: no column {name:?} (its columns: {})", all.join(", ")))
        })?;
        let kind = Kind::of(field.data_type())
            .map_err(|what| Error::invalid_input(format!("{source}: column {name:?} is {what}")))?;
        chosen.push((name.to_owned(), kind));
    }
    Ok(chosen)
}

/// What a column's values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// Binary values.
    Binary,
    /// Strings: their UTF-8 bytes.
    Text,
    /// One number of this type.
    Number(Dtype),
    /// One bool.
    Bool,
    /// A list of numbers of this type.
    List(Dtype),
    /// A media file in a `struct<bytes, path>`: its bytes.
    Media,
    /// Any other nested value (structs, lists of strings, bools, lists): its JSON text.
    Nested,
    /// A date, a time, an instant or a duration.
    Temporal(Temporal),
}

impl Kind {
    /// What it becomes as a sample's part (a media part's extension is the bytes' own).
    pub(super) fn part_kind(self) -> PartKind {
        match self {
            Kind::Binary | Kind::Media => PartKind::Bytes,
            Kind::Text => PartKind::Text,
            Kind::Number(dtype) => PartKind::of_number(dtype),
            Kind::List(_) => PartKind::Array,
            Kind::Bool | Kind::Nested => PartKind::Json,
            Kind::Temporal(temporal) => temporal.part_kind(),
        }
    }

    /// The layout of records made of this one column's values.
    pub(super) fn single_layout(self) -> Layout {
        let fixed = |dtype| FixedLayout::new(dtype, &[1]).map_or(Layout::Bytes, Layout::Fixed);
        match self {
            Kind::Binary | Kind::Text | Kind::Media | Kind::Nested => Layout::Bytes,
            Kind::List(dtype) => Layout::Arrays(dtype),
            Kind::Number(dtype) => fixed(dtype),
            Kind::Bool => fixed(Dtype::U8),
            Kind::Temporal(temporal) => fixed(temporal.dtype()),
        }
    }

    /// The kind of a column of `data_type`, or why it is not ingested.
    pub(super) fn of(data_type: &DataType) -> std::result::Result<Kind, String> {
        let refused = || {
            format!(
                "{data_type}, which is not ingested (binary, strings, numbers, bools, dates and times, lists, \
                 structs and dictionaries of those are)"
            )
        };
        Ok(match data_type {
            DataType::Binary | DataType::LargeBinary | DataType::BinaryView | DataType::FixedSizeBinary(_) => {
                Kind::Binary
            }
            DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Kind::Text,
            DataType::Boolean => Kind::Bool,
            DataType::Dictionary(_, values) => match Kind::of(values)? {
                kind @ (Kind::Binary | Kind::Text | Kind::Number(_) | Kind::Bool) => kind,
                _ => return Err(refused()),
            },
            DataType::List(field) | DataType::LargeList(field) | DataType::FixedSizeList(field, _) => {
                match number_type(field.data_type()) {
                    Some(dtype) => Kind::List(dtype),
                    None if json_able(field.data_type()) => Kind::Nested,
                    None => return Err(refused()),
                }
            }
            DataType::Struct(fields) if is_media(fields) => Kind::Media,
            DataType::Struct(_) if json_able(data_type) => Kind::Nested,
            other => match Temporal::of(other) {
                Some(temporal) => Kind::Temporal(temporal),
                None => number_type(other).map(Kind::Number).ok_or_else(refused)?,
            },
        })
    }
}

/// The element type of a number column.
fn number_type(data_type: &DataType) -> Option<Dtype> {
    Some(match data_type {
        DataType::Int8 => Dtype::I8,
        DataType::UInt8 => Dtype::U8,
        DataType::Int16 => Dtype::I16,
        DataType::UInt16 => Dtype::U16,
        DataType::Int32 => Dtype::I32,
        DataType::UInt32 => Dtype::U32,
        DataType::Int64 => Dtype::I64,
        DataType::UInt64 => Dtype::U64,
        DataType::Float16 => Dtype::F16,
        DataType::Float32 => Dtype::F32,
        DataType::Float64 => Dtype::F64,
        _ => return None,
    })
}

/// True for a type whose values `push_json` writes: bools, numbers, strings, and lists and
/// structs of them.
fn json_able(data_type: &DataType) -> bool {
    match data_type {
        DataType::Null | DataType::Boolean | DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => true,
        DataType::List(field) | DataType::LargeList(field) | DataType::FixedSizeList(field, _) => {
            json_able(field.data_type())
        }
        DataType::Struct(fields) => fields.iter().all(|f| json_able(f.data_type())),
        other => number_type(other).is_some(),
    }
}

/// A struct of a media file's `bytes` and its `path`, as Hugging Face `datasets` stores an
/// `Image()` or `Audio()` feature.
fn is_media(fields: &Fields) -> bool {
    let has = |name: &str, ok: fn(&DataType) -> bool| fields.iter().any(|f| f.name() == name && ok(f.data_type()));
    fields.len() == 2
        && has("bytes", |t| matches!(t, DataType::Binary | DataType::LargeBinary | DataType::BinaryView))
        && has("path", |t| matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View))
}

/// One batch's column of `kind`, ready to be read row by row.
pub(super) struct ColumnRows<'a> {
    kind: Kind,
    /// The column as it came (its nulls are the rows' nulls).
    array: &'a dyn Array,
    /// A dictionary's values and each row's index into them.
    dictionary: Option<(&'a dyn Array, Vec<usize>)>,
}

impl<'a> ColumnRows<'a> {
    /// `array`, whose values are of `kind` (the kind its type was found to be); refused when its
    /// type is another kind's (a later file's column of another type).
    pub(super) fn new(array: &'a dyn Array, kind: Kind) -> std::result::Result<Self, String> {
        let found = Kind::of(array.data_type())?;
        if found != kind {
            return Err(format!("is {} here, {kind:?} before", array.data_type()));
        }
        let dictionary = array.as_any_dictionary_opt().map(|dictionary| {
            let values = dictionary.values().as_ref();
            // `normalized_keys` needs a value; a dictionary of none has only null rows.
            let keys = if values.is_empty() { vec![0; array.len()] } else { dictionary.normalized_keys() };
            (values, keys)
        });
        Ok(Self { kind, array, dictionary })
    }
}

/// What `append` did with a row's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Appended {
    /// The value was written.
    Value,
    /// A media file was written; its bytes say it is of this extension.
    Media(&'static str),
    /// The row is null, or a list of numbers holds a null: nothing was written.
    Null,
}

/// Appends row `row` of `column` to `out`: as a sample's part when `part` (numbers as decimal
/// text, lists of numbers as `.npy`), else as a record of its own (numbers little-endian). An
/// error is a value that cannot be stored as it is (a media struct without its bytes).
pub(super) fn append(
    column: &ColumnRows<'_>,
    row: usize,
    part: bool,
    out: &mut Vec<u8>,
) -> std::result::Result<Appended, String> {
    if column.array.is_null(row) {
        return Ok(Appended::Null);
    }
    let (array, row) = match &column.dictionary {
        Some((values, keys)) => (*values, keys[row]),
        None => (column.array, row),
    };
    if array.is_null(row) {
        return Ok(Appended::Null);
    }
    match column.kind {
        Kind::Binary => out.extend_from_slice(binary_at(array, row)),
        Kind::Text => out.extend_from_slice(text_at(array, row).as_bytes()),
        Kind::Number(dtype) => numbers(array, dtype, row..row + 1, part, out),
        Kind::Bool => {
            let value = array.as_boolean().value(row);
            match part {
                true => out.extend_from_slice(if value { b"true" } else { b"false" }),
                false => out.push(u8::from(value)),
            }
        }
        Kind::List(dtype) => {
            let (values, range) = list_at(array, row);
            if values.null_count() > 0 && range.clone().any(|i| values.is_null(i)) {
                return Ok(Appended::Null);
            }
            if !part {
                numbers(values, dtype, range, false, out);
                return Ok(Appended::Value);
            }
            let len = range.len() as u64;
            let mut elements = Vec::with_capacity(range.len() * dtype.size_bytes() as usize);
            numbers(values, dtype, range, false, &mut elements);
            if !push_npy(dtype, &[len], &elements, out) {
                return Err(format!("a list of {dtype:?}, which NumPy has no type for"));
            }
        }
        Kind::Media => {
            let media = array.as_struct();
            let (Some(bytes), Some(path)) = (media.column_by_name("bytes"), media.column_by_name("path")) else {
                return Err("a media struct without its bytes and path".into());
            };
            if bytes.is_null(row) {
                let path = if path.is_null(row) { "none".to_owned() } else { format!("{:?}", text_at(path, row)) };
                return Err(format!(
                    "a media file stored by its path only ({path}): only files whose bytes the table holds are \
                     ingested"
                ));
            }
            let data = binary_at(bytes.as_ref(), row);
            out.extend_from_slice(data);
            let path = (!path.is_null(row)).then(|| text_at(path.as_ref(), row));
            return Ok(Appended::Media(media_extension(data, path)));
        }
        Kind::Nested => push_json(array, row, out),
        Kind::Temporal(temporal) => append_temporal(temporal, array, row, part, out)?,
    }
    Ok(Appended::Value)
}

/// The bytes of row `row` of a binary array.
fn binary_at(array: &dyn Array, row: usize) -> &[u8] {
    match array.data_type() {
        DataType::Binary => array.as_binary::<i32>().value(row),
        DataType::LargeBinary => array.as_binary::<i64>().value(row),
        DataType::BinaryView => array.as_binary_view().value(row),
        _ => array.as_fixed_size_binary().value(row),
    }
}

/// The string of row `row` of a string array.
fn text_at(array: &dyn Array, row: usize) -> &str {
    match array.data_type() {
        DataType::Utf8 => array.as_string::<i32>().value(row),
        DataType::LargeUtf8 => array.as_string::<i64>().value(row),
        _ => array.as_string_view().value(row),
    }
}

/// The elements of row `row` of a list array: the values array and the row's range in it.
fn list_at(array: &dyn Array, row: usize) -> (&dyn Array, std::ops::Range<usize>) {
    // Offsets of an array arrow-rs read or imported are validated: never negative.
    let index = |offset: i64| usize::try_from(offset).unwrap_or(0);
    match array.data_type() {
        DataType::List(_) => {
            let list = array.as_list::<i32>();
            let offsets = list.value_offsets();
            (list.values().as_ref(), index(offsets[row].into())..index(offsets[row + 1].into()))
        }
        DataType::LargeList(_) => {
            let list = array.as_list::<i64>();
            let offsets = list.value_offsets();
            (list.values().as_ref(), index(offsets[row])..index(offsets[row + 1]))
        }
        _ => {
            let list = array.as_fixed_size_list();
            let len = index(list.value_length().into());
            let start = list.value_offset_at(row);
            (list.values().as_ref(), start..start + len)
        }
    }
}

/// The extension of a media file, by its bytes' magic, else its path's extension, else `bin`.
fn media_extension(data: &[u8], path: Option<&str>) -> &'static str {
    let by_magic = match data {
        [0xff, 0xd8, 0xff, ..] => Some("jpg"),
        [0x89, b'P', b'N', b'G', ..] => Some("png"),
        [b'G', b'I', b'F', b'8', ..] => Some("gif"),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'E', b'B', b'P', ..] => Some("webp"),
        [b'R', b'I', b'F', b'F', _, _, _, _, b'W', b'A', b'V', b'E', ..] => Some("wav"),
        [b'B', b'M', ..] => Some("bmp"),
        [b'I', b'I', 42, 0, ..] | [b'M', b'M', 0, 42, ..] => Some("tiff"),
        [b'f', b'L', b'a', b'C', ..] => Some("flac"),
        [b'O', b'g', b'g', b'S', ..] => Some("ogg"),
        [b'I', b'D', b'3', ..] | [0xff, 0xfb | 0xf3 | 0xf2, ..] => Some("mp3"),
        _ => None,
    };
    by_magic
        .or_else(|| {
            let extension = path?.rsplit_once('.')?.1.to_ascii_lowercase();
            ["jpg", "jpeg", "png", "gif", "webp", "bmp", "tiff", "wav", "flac", "mp3", "ogg"]
                .into_iter()
                .find(|known| *known == extension)
                .map(|known| if known == "jpeg" { "jpg" } else { known })
        })
        .unwrap_or("bin")
}

/// Appends the numbers at `range` of `array` (of `dtype`): as decimal text (one, for a sample's
/// part) or little-endian.
fn numbers(array: &dyn Array, dtype: Dtype, range: std::ops::Range<usize>, text: bool, out: &mut Vec<u8>) {
    macro_rules! put {
        ($arrow:ty) => {{
            let buffer = array.as_primitive::<$arrow>().values();
            let values = &buffer[range.clone()];
            if text {
                for value in values {
                    out.extend_from_slice(value.to_string().as_bytes());
                }
            } else if cfg!(target_endian = "little") {
                // Arrow's buffers are in the machine's order, which here is the records'
                // little-endian: the elements' bytes are copied as one run.
                let width = std::mem::size_of::<<$arrow as ArrowPrimitiveType>::Native>();
                out.extend_from_slice(&buffer.inner().as_slice()[range.start * width..range.end * width]);
            } else {
                for value in values {
                    out.extend_from_slice(&value.to_le_bytes());
                }
            }
        }};
    }
    match dtype {
        Dtype::I8 => put!(Int8Type),
        Dtype::U8 => put!(UInt8Type),
        Dtype::I16 => put!(Int16Type),
        Dtype::U16 => put!(UInt16Type),
        Dtype::I32 => put!(Int32Type),
        Dtype::U32 => put!(UInt32Type),
        Dtype::I64 => put!(Int64Type),
        Dtype::U64 => put!(UInt64Type),
        Dtype::F16 => put!(Float16Type),
        Dtype::F32 => put!(Float32Type),
        Dtype::F64 => put!(Float64Type),
        // No Arrow type maps to it (`number_type` never answers it).
        Dtype::Bf16 => {}
    }
}

/// Appends the JSON text of row `row` of `array` (of a type `json_able` accepts): what Python's
/// `json.loads` turns into the value pyarrow's `to_pylist` gives.
fn push_json(array: &dyn Array, row: usize, out: &mut Vec<u8>) {
    use std::io::Write;
    if array.is_null(row) {
        out.extend_from_slice(b"null");
        return;
    }
    macro_rules! int {
        ($arrow:ty) => {{
            let _ = write!(out, "{}", array.as_primitive::<$arrow>().value(row));
        }};
    }
    match array.data_type() {
        DataType::Boolean => out.extend_from_slice(if array.as_boolean().value(row) { b"true" } else { b"false" }),
        DataType::Int8 => int!(Int8Type),
        DataType::UInt8 => int!(UInt8Type),
        DataType::Int16 => int!(Int16Type),
        DataType::UInt16 => int!(UInt16Type),
        DataType::Int32 => int!(Int32Type),
        DataType::UInt32 => int!(UInt32Type),
        DataType::Int64 => int!(Int64Type),
        DataType::UInt64 => int!(UInt64Type),
        DataType::Float16 => push_json_float(f64::from(array.as_primitive::<Float16Type>().value(row).to_f32()), out),
        DataType::Float32 => push_json_float(f64::from(array.as_primitive::<Float32Type>().value(row)), out),
        DataType::Float64 => push_json_float(array.as_primitive::<Float64Type>().value(row), out),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            // serde_json escapes as JSON requires; `json.loads` gives back the same string.
            let _ = serde_json::to_writer(&mut *out, text_at(array, row));
        }
        DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(..) => {
            let (values, range) = list_at(array, row);
            out.push(b'[');
            for (k, i) in range.enumerate() {
                if k > 0 {
                    out.extend_from_slice(b", ");
                }
                push_json(values, i, out);
            }
            out.push(b']');
        }
        DataType::Struct(fields) => {
            let record = array.as_struct();
            out.push(b'{');
            for (k, (field, values)) in fields.iter().zip(record.columns()).enumerate() {
                if k > 0 {
                    out.extend_from_slice(b", ");
                }
                let _ = serde_json::to_writer(&mut *out, field.name());
                out.extend_from_slice(b": ");
                push_json(values.as_ref(), row, out);
            }
            out.push(b'}');
        }
        // `json_able` admits no other type.
        _ => out.extend_from_slice(b"null"),
    }
}

/// A float as Python's `json` writes it: the shortest text that reads back as the same double,
/// always with a point or an exponent (so it reads back as a float), `NaN` and `Infinity` for
/// the values JSON has no number for.
fn push_json_float(value: f64, out: &mut Vec<u8>) {
    use std::io::Write;
    if value.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if value.is_infinite() {
        out.extend_from_slice(if value > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else {
        // Rust's `Debug` of an f64 is its shortest round-trip text with a `.0` or an exponent.
        let _ = write!(out, "{value:?}");
    }
}

/// Rows of a source's batches on their way to the ingest: one record a row, a sample's key its
/// row's position in the input (skipped rows counted).
pub(super) struct Rows<'c> {
    columns: &'c [(String, Kind)],
    nulls: Nulls,
    record: RecordParts,
    samples: bool,
    row_in_input: u64,
    done: RowsIngested,
    /// This row's media parts and the extension their bytes say (reused from row to row).
    media: Vec<(usize, &'static str)>,
}

impl<'c> Rows<'c> {
    /// Rows of `columns` (as `choose_columns` chose them).
    pub(super) fn new(columns: &'c [(String, Kind)], nulls: Nulls) -> Result<Self> {
        assert!(!columns.is_empty(), "a record has at least one column");
        let samples = columns.len() > 1;
        let parts: Vec<(&str, PartKind)> =
            columns.iter().map(|(name, kind)| (name.as_str(), kind.part_kind())).collect();
        let record = RecordParts::new(&parts, !samples)?;
        Ok(Self { columns, nulls, record, samples, row_in_input: 0, done: RowsIngested::default(), media: Vec::new() })
    }

    /// What has been ingested so far.
    pub(super) fn done(&self) -> RowsIngested {
        self.done
    }

    /// Ingests every row of `batch`, whose chosen columns stand at `in_batch` (one place per
    /// column, checked against its name). `source` names the batch in errors (a file's path);
    /// `first_row` is its first row's number there.
    pub(super) fn push_batch(
        &mut self,
        ingest: &mut dyn RecordSink,
        batch: &RecordBatch,
        in_batch: &[usize],
        source: &str,
        first_row: u64,
    ) -> Result<()> {
        assert_eq!(in_batch.len(), self.columns.len(), "one place per chosen column");
        let schema = batch.schema();
        let arrays = self
            .columns
            .iter()
            .zip(in_batch)
            .map(|((name, kind), &at)| {
                let field = schema.fields().get(at).filter(|field| field.name() == name);
                let Some(array) = field.and(batch.columns().get(at)) else {
                    return Err(Error::invalid_input(format!("{source}: the reader returned no column {name:?}")));
                };
                ColumnRows::new(array.as_ref(), *kind)
                    .map_err(|what| Error::invalid_input(format!("{source}: column {name:?} {what}")))
            })
            .collect::<Result<Vec<_>>>()?;
        for row in 0..batch.num_rows() {
            let at_row = first_row + row as u64;
            let mut null = None;
            self.media.clear();
            for (c, (column, part)) in arrays.iter().zip(self.record.clear()).enumerate() {
                let appended = append(column, row, self.samples, part).map_err(|what| {
                    Error::invalid_input(format!("{source}: row {at_row}, column {:?}: {what}", self.columns[c].0))
                })?;
                match appended {
                    Appended::Value => {}
                    Appended::Media(extension) => self.media.push((c, extension)),
                    Appended::Null => {
                        null = Some(c);
                        break;
                    }
                }
            }
            for &(c, extension) in &self.media {
                self.record.set_extension(c, extension);
            }
            if let Some(c) = null {
                if self.nulls == Nulls::Refuse {
                    return Err(Error::invalid_input(format!(
                        "{source}: row {at_row} has a null in column {:?} (skip such rows with --skip-nulls, \
                         nulls=\"skip\" in Python)",
                        self.columns[c].0
                    )));
                }
                self.done.skipped += 1;
            } else {
                self.record.push(ingest, !self.samples, self.row_in_input)?;
                self.done.records += 1;
            }
            self.row_in_input += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow_array::builder::{ListBuilder, StringBuilder};
    use arrow_array::{
        ArrayRef, BinaryArray, BooleanArray, DictionaryArray, Float32Array, Int32Array, StringArray, StructArray,
    };
    use arrow_schema::Field;

    use super::*;

    fn appended(array: &dyn Array, row: usize, part: bool) -> (Appended, Vec<u8>) {
        let kind = Kind::of(array.data_type()).unwrap();
        let column = ColumnRows::new(array, kind).unwrap();
        let mut out = Vec::new();
        let what = append(&column, row, part, &mut out).unwrap();
        (what, out)
    }

    #[test]
    fn floats_are_written_as_python_reads_them_back() {
        let text = |v: f64| {
            let mut out = Vec::new();
            push_json_float(v, &mut out);
            String::from_utf8(out).unwrap()
        };
        assert_eq!(text(1.0), "1.0");
        assert_eq!(text(0.1), "0.1");
        assert_eq!(text(f64::from(0.1f32)), "0.10000000149011612");
        assert_eq!(text(1e300), "1e300");
        assert_eq!(text(f64::NAN), "NaN");
        assert_eq!(text(f64::NEG_INFINITY), "-Infinity");
    }

    #[test]
    fn bools_dictionaries_and_nested_values_are_written_as_their_values() {
        let bools = BooleanArray::from(vec![Some(true), None, Some(false)]);
        assert_eq!(appended(&bools, 0, true), (Appended::Value, b"true".to_vec()));
        assert_eq!(appended(&bools, 1, true).0, Appended::Null);
        assert_eq!(appended(&bools, 2, false), (Appended::Value, vec![0]));

        let dictionary: DictionaryArray<arrow_array::types::Int32Type> =
            vec![Some("b"), Some("a"), None, Some("b")].into_iter().collect();
        assert_eq!(Kind::of(dictionary.data_type()), Ok(Kind::Text));
        assert_eq!(appended(&dictionary, 0, true).1, b"b");
        assert_eq!(appended(&dictionary, 1, true).1, b"a");
        assert_eq!(appended(&dictionary, 2, true).0, Appended::Null);

        let mut lists = ListBuilder::new(StringBuilder::new());
        lists.values().append_value("x\"y");
        lists.values().append_null();
        lists.append(true);
        let lists = lists.finish();
        assert_eq!(Kind::of(lists.data_type()), Ok(Kind::Nested));
        assert_eq!(appended(&lists, 0, true).1, br#"["x\"y", null]"#);

        let record = StructArray::from(vec![
            (Arc::new(Field::new("n", DataType::Int32, true)), Arc::new(Int32Array::from(vec![7])) as ArrayRef),
            (Arc::new(Field::new("f", DataType::Float32, true)), Arc::new(Float32Array::from(vec![2.5])) as ArrayRef),
        ]);
        assert_eq!(appended(&record, 0, true).1, br#"{"n": 7, "f": 2.5}"#);
    }

    #[test]
    fn a_media_struct_is_its_bytes_named_by_what_they_are() {
        let media = |bytes: Vec<Option<&[u8]>>, paths: Vec<Option<&str>>| {
            StructArray::from(vec![
                (Arc::new(Field::new("bytes", DataType::Binary, true)), Arc::new(BinaryArray::from(bytes)) as ArrayRef),
                (Arc::new(Field::new("path", DataType::Utf8, true)), Arc::new(StringArray::from(paths)) as ArrayRef),
            ])
        };
        let png: &[u8] = b"\x89PNG\r\n\x1a\nrest";
        let array = media(vec![Some(png), Some(b"??"), None], vec![None, Some("a/b.JPEG"), Some("c.png")]);
        assert_eq!(Kind::of(array.data_type()), Ok(Kind::Media));
        assert_eq!(appended(&array, 0, true), (Appended::Media("png"), png.to_vec()));
        assert_eq!(appended(&array, 1, true).0, Appended::Media("jpg"));
        let column = ColumnRows::new(&array, Kind::Media).unwrap();
        let error = append(&column, 2, true, &mut Vec::new()).unwrap_err();
        assert!(error.contains("\"c.png\""), "{error}");
    }

    #[test]
    fn a_column_of_another_kind_than_before_is_refused() {
        let texts = StringArray::from(vec!["a"]);
        let error = ColumnRows::new(&texts, Kind::Number(Dtype::I64)).err().unwrap();
        assert!(error.contains("Utf8"), "{error}");
        let interval = DataType::Interval(arrow_schema::IntervalUnit::MonthDayNano);
        assert!(Kind::of(&interval).unwrap_err().contains("Interval"));
    }
}
