//! The engine's errors as Python exceptions. Each carries `kind` (a stable snake_case name of
//! what went wrong) besides its message, so callers can branch without parsing text. Their
//! module is `granary` (the package re-exports them), so tracebacks name `granary.<Error>` and
//! pickle finds the class: an error raised in a multiprocessing pool arrives in the parent as
//! itself, message and `kind` included; one raised in a torch DataLoader worker arrives as its
//! class made anew from its traceback's text, which carries `kind` in a note (Python 3.11+).
//!
//! Owns the exception classes, `to_py` (an engine error to its exception) and `engine` (an engine
//! call with the GIL released, its error converted). Never: lets a panic cross into Python (one
//! inside an engine call becomes an error).

use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    granary,
    Error,
    PyException,
    "An error of the granary engine; `kind` names it (see `granary.Error`)."
);
pyo3::create_exception!(
    granary,
    CorruptionError,
    Error,
    "Stored bytes failed verification (a block's CRC32C, a file's BLAKE3, or its format); none were returned."
);
pyo3::create_exception!(granary, NotFoundError, Error, "A dataset, version, record or shard that does not exist.");
pyo3::create_exception!(
    granary,
    PluginError,
    Error,
    "A policy plugin failed to load, trapped, or returned an invalid answer."
);
pyo3::create_exception!(
    granary,
    DeviceError,
    Error,
    "A GPU this process cannot use: no CUDA driver, no such device, another device already in use, or a failing driver call."
);
pyo3::create_exception!(
    granary,
    IngestIntentError,
    Error,
    "An ingest into a dataset that exists, of other records than its current version's, without mode='append' or mode='replace'."
);
pyo3::create_exception!(
    granary,
    ForkError,
    Error,
    "Something set up in another process was used in a child forked from it: a loader whose \
     engine threads live there, or the store's catalog, whose I/O threads do."
);

/// Opens the note that carries an error's `kind` in its traceback text.
const KIND_NOTE: &str = "granary error kind: ";

/// The Python exception for an engine error.
pub(crate) fn to_py(error: granary::Error) -> PyErr {
    use granary::Error as E;
    let kind = match &error {
        E::Io { .. } => "io",
        E::Format { .. } => "format",
        E::ChecksumMismatch { .. } => "checksum_mismatch",
        E::HashMismatch { .. } => "hash_mismatch",
        E::InvalidName { .. } => "invalid_name",
        E::NotFound { .. } => "not_found",
        E::MissingShard { .. } => "missing_shard",
        E::InvalidInput { .. } => "invalid_input",
        E::RecordOutOfRange { .. } => "record_out_of_range",
        E::StoreLocked { .. } => "store_locked",
        E::NotAStore { .. } => "not_a_store",
        E::Plugin(_) => "plugin",
        E::Cuda { .. } => "cuda",
        E::NoGpu { .. } => "no_gpu",
        E::HoldLimit { .. } => "hold_limit",
        E::IngestIntent { .. } => "ingest_intent",
        E::Catalog { .. } => "catalog",
        E::CatalogForked { .. } => "forked",
        E::Transport { .. } => "transport",
        E::PeerRefused { .. } => "peer_refused",
        E::Unavailable { .. } => "unavailable",
        E::Origin { .. } => "origin",
        E::Panicked { .. } => "internal",
        _ => "other",
    };
    let message = match &error {
        // In Python terms: the engine's message names the Rust setting.
        E::HoldLimit { held } => format!(
            "the trainer holds {held} batches, the most this loader allows (hold={held}): a batch is held \
             while any array or tensor made from it lives; drop one, or make the loader with a larger \
             hold= (list(loader) keeps every batch: iterate instead)"
        ),
        E::IngestIntent { name, version, records, incoming, same_count_shard_bytes } => format!(
            "dataset {name} exists ({name}@{version}{}) and this input differs ({incoming} records): pass \
             mode='append' to add them to the current version's records, or mode='replace' to make them \
             the new version{}",
            records.map(|n| format!(": {n} records")).unwrap_or_default(),
            granary::error::same_count_hint(*same_count_shard_bytes)
        ),
        _ => error.to_string(),
    };
    let err = match &error {
        _ if error.is_corruption() => CorruptionError::new_err(message),
        E::NotFound { .. } | E::MissingShard { .. } | E::RecordOutOfRange { .. } | E::NotAStore { .. } => {
            NotFoundError::new_err(message)
        }
        E::Plugin(_) => PluginError::new_err(message),
        E::CatalogForked { .. } => ForkError::new_err(message),
        E::NoGpu { .. } | E::Cuda { .. } => DeviceError::new_err(message),
        E::IngestIntent { .. } => IngestIntentError::new_err(message),
        _ => Error::new_err(message),
    };
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("kind", kind);
        // Also in the text a traceback shows (Python 3.11's notes): a DataLoader worker's error
        // reaches the parent as its class made anew from that text, attributes lost, and
        // `kind` is read back from it there (`granary/__init__.py`). Older Pythons have no notes.
        let _ = value.call_method1("add_note", (format!("{KIND_NOTE}{kind}"),));
    });
    err
}

/// Runs `work` of the engine with the GIL released (`py.detach`); a panic inside it becomes a
/// `granary.Error` of kind `internal`, never a `PanicException` (a `BaseException` that neither
/// `except granary.Error` nor `except Exception` catches).
pub(crate) fn engine<T: Send>(py: Python<'_>, work: impl FnOnce() -> granary::Result<T> + Send) -> PyResult<T> {
    py.detach(|| granary::catch_panic(|| "a call of the engine".to_owned(), work)).map_err(to_py)
}

/// A `ValueError` for an argument the bindings refuse before the engine sees it.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    PyValueError::new_err(message.into())
}

/// An `OSError` for a failure outside the engine (a path that is not UTF-8, for example).
pub(crate) fn os(message: impl Into<String>) -> PyErr {
    PyOSError::new_err(message.into())
}

/// The error for an object used in a process other than the one that started its threads.
pub(crate) fn forked(what: &str, started_in: u32) -> PyErr {
    ForkError::new_err(format!(
        "this {what} was started in process {started_in} and copied into process {} by fork: its I/O \
         threads (io_uring, and CUDA's) do not exist here. Create the {what} in the process that \
         iterates it (for DataLoader workers: inside the dataset's __iter__, which granary's \
         IterableDataset does), or use the 'spawn' start method",
        std::process::id()
    ))
}
