//! Any Arrow stream as an ingest source: the record batches a caller's reader yields (in Python,
//! whatever offers `__arrow_c_stream__`: a pyarrow Table or RecordBatchReader, a Polars
//! DataFrame, a DuckDB relation, a Lance scanner's reader), one record per row, by the rules
//! Parquet's rows follow (`arrow_rows`), streamed batch by batch so a source larger than memory
//! goes through.
//!
//! Owns: `ArrowInput` (the stream's schema, the columns chosen by name and the layout) and
//! `records_from_arrow` (each batch's chosen columns checked as Arrow data before a row of it is
//! read: a producer's buffers are not trusted to be well formed). Never: holds more than one
//! batch, or reads a column the caller did not choose.

use arrow_array::{Array, RecordBatch};
use arrow_schema::{ArrowError, Schema};

use super::RecordSink;
use super::arrow_rows::{Kind, Nulls, Rows, RowsIngested, choose_columns, layout_of};
use super::sources::Progress;
use crate::error::{Error, Result};
use crate::shard::Layout;

/// An Arrow stream's columns to ingest, chosen and checked against its schema.
#[derive(Debug)]
pub struct ArrowInput {
    schema: Schema,
    columns: Vec<(String, Kind)>,
    nulls: Nulls,
}

impl ArrowInput {
    /// The columns `columns` of a stream of `schema` (none: every column, in its order).
    pub fn new(schema: &Schema, columns: &[String], nulls: Nulls) -> Result<Self> {
        let columns = choose_columns(schema, columns, "the Arrow stream")?;
        Ok(Self { schema: schema.clone(), columns, nulls })
    }

    /// The layout of the records it becomes.
    pub fn layout(&self) -> Layout {
        layout_of(&self.columns)
    }
}

/// Ingests every row of `batches` (a stream of `input`'s schema), in order, as records of
/// `input.layout()`; progress counts the batches' Arrow bytes (the total is not known before).
/// An error of the stream is the ingest's; a stream of no row is refused.
pub fn records_from_arrow(
    ingest: &mut dyn RecordSink,
    input: &ArrowInput,
    batches: impl Iterator<Item = std::result::Result<RecordBatch, ArrowError>>,
    progress: &dyn Progress,
) -> Result<RowsIngested> {
    progress.start(0);
    let mut rows = Rows::new(&input.columns, input.nulls)?;
    let mut first_row = 0u64;
    for (b, batch) in batches.enumerate() {
        let source = format!("the Arrow stream's batch {b}");
        let batch = batch.map_err(|e| Error::invalid_input(format!("{source}: {e}")))?;
        let schema = batch.schema();
        let mut in_batch = Vec::with_capacity(input.columns.len());
        for (name, _) in &input.columns {
            let at = schema.index_of(name).map_err(|_| {
                Error::invalid_input(format!(
                    "{source} has no column {name:?}, which the stream's schema has (a producer whose batches \
                     disagree with its schema)"
                ))
            })?;
            // Imported buffers are checked before any row is read from them: offsets inside
            // their values, UTF-8 that is UTF-8, children of the lengths they claim.
            batch.column(at).to_data().validate_full().map_err(|e| {
                Error::invalid_input(format!("{source}: column {name:?} is not well-formed Arrow data: {e}"))
            })?;
            in_batch.push(at);
        }
        rows.push_batch(ingest, &batch, &in_batch, &source, first_row)?;
        first_row += batch.num_rows() as u64;
        progress.advance(batch.get_array_memory_size() as u64);
    }
    let done = rows.done();
    if done.records == 0 {
        return Err(Error::invalid_input(format!(
            "no row to ingest in the Arrow stream of {} column(s){}",
            input.schema.fields().len(),
            if done.skipped > 0 { format!(" ({} rows skipped for nulls)", done.skipped) } else { String::new() }
        )));
    }
    Ok(done)
}
