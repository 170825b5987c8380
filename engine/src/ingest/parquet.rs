//! Parquet files as an ingest source (arrow-rs's reader): one record per row of the chosen
//! columns, rows in file order, files in the order given (a directory's `.parquet` files and a
//! glob pattern's matches in path order).
//!
//! What a row becomes, by the columns chosen:
//! - one column of lists of numbers (`list<int32>` token ids, ...): an array record of the
//!   element's type (`Layout::Arrays`);
//! - one column of binary or string values: a byte record (`Layout::Bytes`, UTF-8 for strings);
//! - one column of numbers: a fixed record of one element (`Layout::Fixed`, shape `[1]`);
//! - several columns: a sample of parts named `COLUMN.EXT` as `parts.rs` names them, as
//!   WebDataset samples are stored (`Layout::Samples`, key the row's position in the input as 12
//!   digits): binary (`.bin`) and strings (`.txt`) as their bytes, lists of numbers as `.npy`
//!   arrays, numbers as decimal text (`.cls` for integers, `.float` for floats).
//!
//! A null (a null value, or a null element inside a list) is refused, naming the file, the row
//! and the column, unless the caller asked to skip such rows (`Nulls::Skip`, counted).
//!
//! Owns: `ParquetInput` (the files, the columns and the layout, every file's schema checked
//! before anything is ingested) and `records_from_parquet` (a file's row batches decoded on a
//! thread of their own, two ahead of the rows being copied and written). Never: reads a column
//! the caller did not choose, or changes a value (a number is stored in its own type; a
//! string's bytes are its UTF-8).

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::cast::AsArray;
use arrow_array::types::{
    Float16Type, Float32Type, Float64Type, Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type,
    UInt32Type, UInt64Type,
};
use arrow_array::{Array, ArrowPrimitiveType, RecordBatch};
use arrow_schema::DataType;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use super::Ingest;
use super::parts::{PartKind, RecordParts, part_name, push_npy};
use super::sources::Progress;
use crate::error::{Error, Result};
use crate::shard::{Dtype, FixedLayout, Layout};

/// Rows read at once.
const BATCH_ROWS: usize = 4096;
/// Batches of rows decoded ahead of the ingest (each `BATCH_ROWS` rows of the chosen columns).
const DECODED_AHEAD: usize = 2;

/// What to do with a row that holds a null in a chosen column.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Nulls {
    /// Refuse the input, naming the file, row and column (nothing is committed).
    #[default]
    Refuse,
    /// Leave the row out (counted in `ParquetIngested::skipped`).
    Skip,
}

/// What a column's values are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Binary values (`binary`, `large_binary`, `binary_view`, `fixed_size_binary`).
    Binary,
    /// Strings (`utf8`, `large_utf8`, `utf8_view`): their UTF-8 bytes.
    Text,
    /// One number of this type.
    Number(Dtype),
    /// A list of numbers of this type (`list`, `large_list`, `fixed_size_list`).
    List(Dtype),
}

impl Kind {
    /// What it becomes as a sample's part.
    fn part_kind(self) -> PartKind {
        match self {
            Kind::Binary => PartKind::Bytes,
            Kind::Text => PartKind::Text,
            Kind::Number(dtype) => PartKind::of_number(dtype),
            Kind::List(_) => PartKind::Array,
        }
    }
}

/// A set of Parquet files to ingest, checked: every file readable, every chosen column present
/// in each with one type.
#[derive(Debug)]
pub struct ParquetInput {
    files: Vec<(PathBuf, u64)>,
    columns: Vec<(String, Kind)>,
    nulls: Nulls,
}

/// What an ingest of Parquet files did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParquetIngested {
    /// Records ingested (rows).
    pub records: u64,
    /// Rows left out for a null (`Nulls::Skip`).
    pub skipped: u64,
}

impl ParquetInput {
    /// The files of `inputs` (files, directories of `.parquet` files, glob patterns), and the
    /// columns `columns` (none: the files' only column), each file's footer read and checked.
    pub fn open(inputs: &[String], columns: &[String], nulls: Nulls) -> Result<Self> {
        let paths = expand(inputs)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut chosen: Vec<(String, Kind)> = Vec::new();
        for path in paths {
            let (bytes, builder) = open_file(&path)?;
            let schema = builder.schema();
            let names: Vec<String> = if columns.is_empty() {
                if schema.fields().len() != 1 {
                    let all: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                    return Err(Error::invalid_input(format!(
                        "{}: {} columns ({}): name the ones to ingest (--column)",
                        path.display(),
                        all.len(),
                        all.join(", ")
                    )));
                }
                vec![schema.field(0).name().clone()]
            } else {
                columns.to_vec()
            };
            for (i, name) in names.iter().enumerate() {
                let field = schema.field_with_name(name).map_err(|_| {
                    let all: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
                    Error::invalid_input(format!(
                        "{}: no column {name:?} (its columns: {})",
                        path.display(),
                        all.join(", ")
                    ))
                })?;
                let kind = kind_of(field.data_type()).ok_or_else(|| {
                    Error::invalid_input(format!(
                        "{}: column {name:?} is {}: only binary, strings, numbers and lists of numbers are ingested",
                        path.display(),
                        field.data_type()
                    ))
                })?;
                match chosen.get(i) {
                    None => chosen.push((name.clone(), kind)),
                    Some((_, first)) if *first == kind => {}
                    Some((_, first)) => {
                        return Err(Error::invalid_input(format!(
                            "{}: column {name:?} is {} here but {first:?} in the files before it",
                            path.display(),
                            field.data_type()
                        )));
                    }
                }
            }
            files.push((path, bytes));
        }
        if chosen.len() > 1 {
            for (i, (name, _)) in chosen.iter().enumerate() {
                if chosen[..i].iter().any(|(other, _)| other == name) {
                    return Err(Error::invalid_input(format!("column {name:?} is named twice")));
                }
            }
        }
        Ok(Self { files, columns: chosen, nulls })
    }

    /// The layout of the records it becomes.
    pub fn layout(&self) -> Layout {
        match self.columns.as_slice() {
            [(_, Kind::Binary | Kind::Text)] => Layout::Bytes,
            [(_, Kind::List(dtype))] => Layout::Arrays(*dtype),
            [(_, Kind::Number(dtype))] => match FixedLayout::new(*dtype, &[1]) {
                Ok(fixed) => Layout::Fixed(fixed),
                Err(_) => Layout::Bytes,
            },
            _ => Layout::Samples,
        }
    }

    /// The files, in the order their rows are ingested.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(path, _)| path.as_path())
    }
}

/// Ingests every row of `input`'s files, in order, as records of `input.layout()`. Returns the
/// rows ingested and skipped; an input of no row is refused.
pub fn records_from_parquet(
    ingest: &mut Ingest<'_>,
    input: &ParquetInput,
    progress: &dyn Progress,
) -> Result<ParquetIngested> {
    progress.start(input.files.iter().map(|(_, bytes)| bytes).sum());
    let samples = input.columns.len() > 1;
    let mut done = ParquetIngested::default();
    let mut row_in_input = 0u64;
    let mut record =
        RecordParts::new(input.columns.iter().map(|(name, kind)| part_name(name, kind.part_kind())).collect());
    for (path, bytes) in &input.files {
        let (_, builder) = open_file(path)?;
        let indices = input
            .columns
            .iter()
            .map(|(name, _)| builder.schema().index_of(name))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|e| Error::invalid_input(format!("{}: {e}", path.display())))?;
        let rows_in_file = u64::try_from(builder.metadata().file_metadata().num_rows()).unwrap_or(0);
        let mask = ProjectionMask::roots(builder.parquet_schema(), indices.iter().copied());
        let reader = builder
            .with_projection(mask)
            .with_batch_size(BATCH_ROWS)
            .build()
            .map_err(|e| bad_file(path, &e.to_string()))?;
        let mut row_in_file = 0u64;
        let mut advanced = 0u64;
        // Decoding (arrow-rs, one thread) runs ahead on a thread of its own while this one copies
        // the rows into records and the ingest writes and hashes them.
        std::thread::scope(|scope| -> Result<()> {
            let (decoded, batches) = std::sync::mpsc::sync_channel(DECODED_AHEAD);
            std::thread::Builder::new()
                .name("parquet-decode".into())
                .spawn_scoped(scope, move || {
                    for batch in reader {
                        let failed = batch.is_err();
                        if decoded.send(batch).is_err() || failed {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::io("spawn", "a Parquet decoding thread", e))?;
            for batch in batches {
                let batch: RecordBatch = batch.map_err(|e| bad_file(path, &e.to_string()))?;
                let arrays: Vec<&dyn Array> = (0..input.columns.len()).map(|c| batch.column(c).as_ref()).collect();
                for row in 0..batch.num_rows() {
                    let mut null = None;
                    for ((c, array), part) in arrays.iter().enumerate().zip(record.clear()) {
                        if !append(*array, input.columns[c].1, row, samples, part) {
                            null = Some(c);
                            break;
                        }
                    }
                    if let Some(c) = null {
                        if input.nulls == Nulls::Refuse {
                            return Err(Error::invalid_input(format!(
                                "{}: row {} has a null in column {:?} (skip such rows with --skip-nulls, \
                                 nulls=\"skip\" in Python)",
                                path.display(),
                                row_in_file,
                                input.columns[c].0
                            )));
                        }
                        done.skipped += 1;
                    } else {
                        // A sample's key is its row's position in the input, skipped rows counted.
                        record.push(ingest, !samples, row_in_input)?;
                        done.records += 1;
                    }
                    row_in_file += 1;
                    row_in_input += 1;
                }
                // Progress in file bytes, in proportion to the rows read.
                let now = (bytes * row_in_file.min(rows_in_file)).checked_div(rows_in_file).unwrap_or(*bytes);
                progress.advance(now.saturating_sub(advanced));
                advanced = now;
            }
            Ok(())
        })?;
        progress.advance(bytes.saturating_sub(advanced));
    }
    if done.records == 0 {
        return Err(Error::invalid_input(format!(
            "no row to ingest in {} Parquet file(s){}",
            input.files.len(),
            if done.skipped > 0 { format!(" ({} rows skipped for nulls)", done.skipped) } else { String::new() }
        )));
    }
    Ok(done)
}

/// Appends row `row` of `array` to `out`: as a sample's part when `text` (numbers as decimal
/// text, lists as `.npy`), else as a record (little-endian); false when the row is null or a
/// list holds a null.
fn append(array: &dyn Array, kind: Kind, row: usize, text: bool, out: &mut Vec<u8>) -> bool {
    if array.is_null(row) {
        return false;
    }
    match kind {
        Kind::Binary => {
            let value: &[u8] = match array.data_type() {
                DataType::Binary => array.as_binary::<i32>().value(row),
                DataType::LargeBinary => array.as_binary::<i64>().value(row),
                DataType::BinaryView => array.as_binary_view().value(row),
                _ => array.as_fixed_size_binary().value(row),
            };
            out.extend_from_slice(value);
        }
        Kind::Text => {
            let value: &str = match array.data_type() {
                DataType::Utf8 => array.as_string::<i32>().value(row),
                DataType::LargeUtf8 => array.as_string::<i64>().value(row),
                _ => array.as_string_view().value(row),
            };
            out.extend_from_slice(value.as_bytes());
        }
        Kind::Number(dtype) => numbers(array, dtype, row..row + 1, text, out),
        Kind::List(dtype) => {
            let (values, range) = match array.data_type() {
                DataType::List(_) => {
                    let list = array.as_list::<i32>();
                    let offsets = list.value_offsets();
                    (list.values(), to_index(offsets[row])..to_index(offsets[row + 1]))
                }
                DataType::LargeList(_) => {
                    let list = array.as_list::<i64>();
                    let offsets = list.value_offsets();
                    (list.values(), to_index(offsets[row])..to_index(offsets[row + 1]))
                }
                _ => {
                    let list = array.as_fixed_size_list();
                    let len = to_index(list.value_length());
                    let start = list.value_offset_at(row);
                    (list.values(), start..start + len)
                }
            };
            if values.null_count() > 0 && range.clone().any(|i| values.is_null(i)) {
                return false;
            }
            if text {
                // A sample's part: an `.npy` of the list's elements.
                let mut elements = Vec::with_capacity(range.len() * 8);
                let len = range.len() as u64;
                numbers(values.as_ref(), dtype, range, false, &mut elements);
                return push_npy(dtype, &[len], &elements, out);
            }
            numbers(values.as_ref(), dtype, range, false, out);
        }
    }
    true
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

/// The kind of a column of `data_type`, if it is one that is ingested.
fn kind_of(data_type: &DataType) -> Option<Kind> {
    match data_type {
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView | DataType::FixedSizeBinary(_) => {
            Some(Kind::Binary)
        }
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => Some(Kind::Text),
        DataType::List(field) | DataType::LargeList(field) | DataType::FixedSizeList(field, _) => {
            number_type(field.data_type()).map(Kind::List)
        }
        other => number_type(other).map(Kind::Number),
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

/// An Arrow offset (never negative in an array that was read) as an index.
fn to_index<T: TryInto<usize>>(offset: T) -> usize {
    offset.try_into().unwrap_or(0)
}

/// Opens `path` as a Parquet file: its length and a reader builder (its footer read).
fn open_file(path: &Path) -> Result<(u64, ParquetRecordBatchReaderBuilder<File>)> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(Error::invalid_input(format!("{} is not a regular file", path.display())));
    }
    let builder = ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| bad_file(path, &e.to_string()))?;
    Ok((meta.len(), builder))
}

fn bad_file(path: &Path, detail: &str) -> Error {
    Error::invalid_input(format!("{}: not a readable Parquet file: {detail}", path.display()))
}

/// The files of `inputs`, in order: a file as it is, a directory's `*.parquet` files (under it,
/// in path order), a glob pattern's matches (in path order; none is an error).
fn expand(inputs: &[String]) -> Result<Vec<PathBuf>> {
    if inputs.is_empty() {
        return Err(Error::invalid_input("no input Parquet files"));
    }
    let mut files = Vec::new();
    for input in inputs {
        let path = Path::new(input);
        if input.contains(['*', '?', '[']) && !path.exists() {
            let pattern = glob::glob(input)
                .map_err(|e| Error::invalid_input(format!("{input:?} is not a valid pattern: {e}")))?;
            let mut matched: Vec<PathBuf> = pattern
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::io("read", e.path(), std::io::Error::other(e.to_string())))?;
            matched.retain(|p| p.is_file());
            if matched.is_empty() {
                return Err(Error::invalid_input(format!("{input:?} matches no file")));
            }
            matched.sort();
            files.extend(matched);
        } else if path.is_dir() {
            let mut found = Vec::new();
            parquet_files_under(path, &mut found)?;
            if found.is_empty() {
                return Err(Error::invalid_input(format!("{} holds no .parquet file", path.display())));
            }
            found.sort();
            files.extend(found);
        } else {
            files.push(path.to_owned());
        }
    }
    Ok(files)
}

fn parquet_files_under(dir: &Path, found: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io("read", dir, e))? {
        let entry = entry.map_err(|e| Error::io("read", dir, e))?;
        let path = entry.path();
        let kind = entry.file_type().map_err(|e| Error::io("stat", &path, e))?;
        if kind.is_dir() {
            parquet_files_under(&path, found)?;
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "parquet") {
            found.push(path);
        }
    }
    Ok(())
}
