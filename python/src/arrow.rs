//! The Arrow PyCapsule stream interface: an object's `__arrow_c_stream__()` capsule taken over
//! as an Arrow stream reader the engine ingests from (`Store.ingest_arrow`).
//!
//! Owns: `stream_of` (the capsule checked by name, its stream moved out of it). Never: reads a
//! batch (the engine does, with the GIL released), or trusts the producer's buffers (the engine
//! checks each batch's chosen columns as Arrow data before reading a row).
#![allow(unsafe_code, reason = "the Arrow C stream interface is a C ABI: a raw struct behind a capsule")]

use arrow_array::ffi_stream::{FFI_ArrowArrayStream, RecordBatchStreamReader};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::errors::invalid;

/// The name the Arrow PyCapsule interface gives a stream's capsule.
const STREAM_CAPSULE: &std::ffi::CStr = c"arrow_array_stream";

/// The Arrow stream `source` offers through `__arrow_c_stream__`, as a reader of its batches.
pub(crate) fn stream_of(source: &Bound<'_, PyAny>) -> PyResult<RecordBatchStreamReader> {
    if !source.hasattr("__arrow_c_stream__")? {
        let kind = source.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into());
        return Err(PyTypeError::new_err(format!(
            "a {kind} offers no Arrow stream (__arrow_c_stream__): pass a pyarrow Table or RecordBatchReader, a \
             Polars DataFrame, a DuckDB relation, a Lance scanner's to_reader(), or a Hugging Face Dataset's \
             .data.table"
        )));
    }
    let capsule = source.call_method0("__arrow_c_stream__")?;
    let capsule = capsule.cast::<PyCapsule>().map_err(|_| {
        PyTypeError::new_err("__arrow_c_stream__() did not return a capsule, as the Arrow PyCapsule interface says")
    })?;
    // Checks the capsule's name: a capsule of another kind is refused, not read.
    let pointer = capsule.pointer_checked(Some(STREAM_CAPSULE))?;
    let stream = pointer.as_ptr().cast::<FFI_ArrowArrayStream>();
    // SAFETY: a capsule named "arrow_array_stream" holds a valid, live `ArrowArrayStream` struct
    // (the Arrow PyCapsule interface), which the capsule keeps alive while we hold `capsule`.
    // `from_raw` moves the stream out and leaves the struct marked released, so the capsule's
    // destructor, which releases a stream not yet released, does nothing more.
    let reader = unsafe { RecordBatchStreamReader::from_raw(stream) }
        .map_err(|e| invalid(format!("the Arrow stream's schema cannot be read: {e}")))?;
    Ok(reader)
}
