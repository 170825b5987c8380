//! Parquet files as an ingest source (arrow-rs's reader): one record per row of the chosen
//! columns, rows in file order, files in the order given (a directory's `.parquet` files and a
//! glob pattern's matches in path order).
//!
//! What a row becomes, by the columns chosen: one column's values as records of their own
//! (lists of numbers as array records of the element's type, `Layout::Arrays`; numbers and
//! bools as fixed records of one element; anything else as byte records), several columns as a
//! sample of parts named `COLUMN.EXT` (`Layout::Samples`, key the row's position in the input as
//! 12 digits), each value as `arrow_rows` writes it. Columns are found by name in every file,
//! whatever their order there.
//!
//! A null (a null value, or a null element inside a list) is refused, naming the file, the row
//! and the column, unless the caller asked to skip such rows (`Nulls::Skip`, counted).
//!
//! Owns: `ParquetInput` (the files, the columns and the layout, every file's schema and the
//! sizes and offsets its footer claims checked before anything is ingested) and
//! `records_from_parquet` (a file's row groups decoded on a thread per core, each two batches
//! ahead, the rows taken in the file's order while they are copied and written). Never: reads a column the caller did not choose, takes a
//! column by its position, lets a panic of the decoder out (it is the file's error), or changes a
//! value (a number is stored in its own type; a string's bytes are its UTF-8).

use std::fs::File;
use std::path::{Path, PathBuf};

use arrow_array::RecordBatch;
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::file::metadata::ParquetMetaData;

use super::RecordSink;
use super::arrow_rows::{Kind, Rows, layout_of};
pub use super::arrow_rows::{Nulls, RowsIngested};
use super::sources::Progress;
use crate::error::{Error, Result, catch_panic};
use crate::shard::Layout;

/// Rows read at once.
const BATCH_ROWS: usize = 4096;
/// Batches of rows each decoding thread keeps ahead of the ingest (each `BATCH_ROWS` rows of the
/// chosen columns).
const DECODED_AHEAD: usize = 2;
/// Decoding threads at most (one per core up to this): what they hold ahead is bounded by
/// `DECODERS_MAX * DECODED_AHEAD` batches.
const DECODERS_MAX: usize = 8;

/// What a decoding thread hands over: a batch of its row group (or the file's error), or the
/// end of that row group.
enum Decoded {
    Batch(Result<RecordBatch>),
    GroupEnd,
}

/// What an ingest of Parquet files did.
pub type ParquetIngested = RowsIngested;

/// A set of Parquet files to ingest, checked: every file readable, every chosen column present
/// in each with one type.
#[derive(Debug)]
pub struct ParquetInput {
    files: Vec<(PathBuf, u64)>,
    columns: Vec<(String, Kind)>,
    nulls: Nulls,
}

impl ParquetInput {
    /// The files of `inputs` (files, directories of `.parquet` files, glob patterns), and the
    /// columns `columns` (none: the files' only column), each file's footer read and checked.
    pub fn open(inputs: &[String], columns: &[String], nulls: Nulls) -> Result<Self> {
        let paths = expand(inputs)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut chosen: Vec<(String, Kind)> = Vec::new();
        for path in paths {
            let (bytes, metadata) = open_file(&path)?;
            let schema = metadata.schema();
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
                let kind = Kind::of(field.data_type())
                    .map_err(|what| Error::invalid_input(format!("{}: column {name:?} is {what}", path.display())))?;
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
        layout_of(&self.columns)
    }

    /// The files, in the order their rows are ingested.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|(path, _)| path.as_path())
    }
}

/// Ingests every row of `input`'s files, in order, as records of `input.layout()`. Returns the
/// rows ingested and skipped; an input of no row is refused.
pub fn records_from_parquet(
    ingest: &mut dyn RecordSink,
    input: &ParquetInput,
    progress: &dyn Progress,
) -> Result<ParquetIngested> {
    progress.start(input.files.iter().map(|(_, bytes)| bytes).sum());
    let mut rows = Rows::new(&input.columns, input.nulls)?;
    let decoders = std::thread::available_parallelism().map_or(1, usize::from).clamp(1, DECODERS_MAX);
    for (path, bytes) in &input.files {
        let (_, metadata) = open_file(path)?;
        // The chosen columns' places in this file, found by name: the reader hands the
        // projected columns over in the file's order, whatever the order they were chosen in.
        let roots = input
            .columns
            .iter()
            .map(|(name, _)| metadata.schema().index_of(name))
            .collect::<std::result::Result<Vec<usize>, _>>()
            .map_err(|e| Error::invalid_input(format!("{}: {e}", path.display())))?;
        let in_batch: Vec<usize> =
            roots.iter().map(|root| roots.iter().filter(|other| *other < root).count()).collect();
        let rows_in_file = u64::try_from(metadata.metadata().file_metadata().num_rows()).unwrap_or(0);
        let mask = ProjectionMask::roots(metadata.parquet_schema(), roots.iter().copied());
        let groups = metadata.metadata().num_row_groups();
        let decoders = decoders.min(groups).max(1);
        let source = path.display().to_string();
        let mut row_in_file = 0u64;
        let mut advanced = 0u64;
        // Row groups are decoded on `decoders` threads of their own (group g on thread g mod
        // decoders), each a few batches ahead, while this one takes the batches in the file's
        // order, copies the rows into records, and the ingest writes and hashes them.
        std::thread::scope(|scope| -> Result<()> {
            let mut channels = Vec::with_capacity(decoders);
            for decoder in 0..decoders {
                let (decoded, batches) = std::sync::mpsc::sync_channel::<Decoded>(DECODED_AHEAD);
                channels.push(batches);
                let (metadata, mask) = (metadata.clone(), mask.clone());
                std::thread::Builder::new()
                    .name("parquet-decode".into())
                    .spawn_scoped(scope, move || {
                        // A panic of the decoder on a hostile file is that file's error.
                        let _ = decoder_guard(path, || {
                            // A file of its own: arrow-rs seeks and reads a `File`, and copies
                            // of one descriptor share its offset between the threads.
                            let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
                            for group in (decoder..groups).step_by(decoders) {
                                let file = file.try_clone().map_err(|e| Error::io("open", path, e))?;
                                let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(file, metadata.clone())
                                    .with_projection(mask.clone())
                                    .with_row_groups(vec![group])
                                    .with_batch_size(BATCH_ROWS)
                                    .build()
                                    .map_err(|e| bad_file(path, &e.to_string()))?;
                                for batch in reader {
                                    let batch = batch.map_err(|e| bad_file(path, &e.to_string()));
                                    let failed = batch.is_err();
                                    if decoded.send(Decoded::Batch(batch)).is_err() || failed {
                                        return Ok(());
                                    }
                                }
                                if decoded.send(Decoded::GroupEnd).is_err() {
                                    return Ok(());
                                }
                            }
                            Ok(())
                        })
                        .map_err(|failed| decoded.send(Decoded::Batch(Err(failed))));
                    })
                    .map_err(|e| Error::io("spawn", "a Parquet decoding thread", e))?;
            }
            for group in 0..groups {
                let channel = &channels[group % decoders];
                loop {
                    let batch = match channel.recv() {
                        Ok(Decoded::Batch(batch)) => batch?,
                        Ok(Decoded::GroupEnd) => break,
                        Err(_) => return Err(bad_file(path, &format!("its decoder stopped in row group {group}"))),
                    };
                    rows.push_batch(ingest, &batch, &in_batch, &source, row_in_file)?;
                    row_in_file += batch.num_rows() as u64;
                    // Progress in file bytes, in proportion to the rows read.
                    let now = (u128::from(*bytes) * u128::from(row_in_file.min(rows_in_file)))
                        .checked_div(u128::from(rows_in_file))
                        .map_or(*bytes, |now| u64::try_from(now).unwrap_or(*bytes));
                    progress.advance(now.saturating_sub(advanced));
                    advanced = now;
                }
            }
            Ok(())
        })?;
        progress.advance(bytes.saturating_sub(advanced));
    }
    let done = rows.done();
    if done.records == 0 {
        return Err(Error::invalid_input(format!(
            "no row to ingest in {} Parquet file(s){}",
            input.files.len(),
            if done.skipped > 0 { format!(" ({} rows skipped for nulls)", done.skipped) } else { String::new() }
        )));
    }
    Ok(done)
}

/// Opens `path` as a Parquet file: its length and its footer read (every size and offset it
/// claims checked against the file).
fn open_file(path: &Path) -> Result<(u64, ArrowReaderMetadata)> {
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(Error::invalid_input(format!("{} is not a regular file", path.display())));
    }
    let metadata = decoder_guard(path, || {
        ArrowReaderMetadata::load(&file, ArrowReaderOptions::default()).map_err(|e| bad_file(path, &e.to_string()))
    })?;
    check_footer(metadata.metadata(), meta.len()).map_err(|detail| bad_file(path, &detail))?;
    Ok((meta.len(), metadata))
}

/// Every count, size and offset of a footer that the reader will size or seek by: no count below
/// zero, every column chunk inside the file, rows that add up.
fn check_footer(metadata: &ParquetMetaData, file_bytes: u64) -> std::result::Result<(), String> {
    let file_rows = metadata.file_metadata().num_rows();
    let mut rows = 0i64;
    for (g, group) in metadata.row_groups().iter().enumerate() {
        if group.num_rows() < 0 {
            return Err(format!("row group {g} claims {} rows", group.num_rows()));
        }
        rows = rows.saturating_add(group.num_rows());
        for (c, chunk) in group.columns().iter().enumerate() {
            let start = chunk.dictionary_page_offset().unwrap_or(chunk.data_page_offset());
            let claims =
                [("data page offset", chunk.data_page_offset()), ("start", start), ("size", chunk.compressed_size())];
            if let Some((what, value)) = claims.iter().find(|(_, value)| *value < 0) {
                return Err(format!("row group {g}, column chunk {c} claims a {what} of {value}"));
            }
            let end = start.unsigned_abs().checked_add(chunk.compressed_size().unsigned_abs());
            if end.is_none_or(|end| end > file_bytes) {
                return Err(format!(
                    "row group {g}, column chunk {c} claims bytes {start}..+{} of a file of {file_bytes}",
                    chunk.compressed_size()
                ));
            }
        }
    }
    if file_rows < 0 {
        return Err(format!("the footer claims {file_rows} rows"));
    }
    if rows != file_rows {
        return Err(format!("the footer claims {file_rows} rows, its row groups {rows}"));
    }
    Ok(())
}

/// Runs `work` of arrow-rs's reader on `path`: a panic inside it (a hostile file it does not
/// check) is the file's error, not the process's.
fn decoder_guard<T>(path: &Path, work: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_panic(|| format!("reading {}", path.display()), work).map_err(|error| match error {
        Error::Panicked { detail, .. } => bad_file(path, &format!("the reader failed on it ({detail})")),
        other => other,
    })
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
