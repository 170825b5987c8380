//! What a Python loader reads, as the engine's session takes it (a version or a mixture of
//! versions with their weights, records or packed windows), and how a packed batch and a
//! mixture's description reach Python.
//!
//! Owns `SourceArgs` and `reads_of` (the `dataset` argument and the mixture and packing ones
//! turned into the session's `Reads` and `PackConfig`), `mixture_dict` and `packed_dict`.
//! Never: checks what the session checks (what goes with a mixture or packing), opens a
//! version, or decides an order (the engine's session and plans do).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use granary::loader::{PackedBatch, Packing, Reads};
use granary::pack::PackConfig;
use granary::{EpochLength, Mixture, Position, StorePaths};

use crate::errors::{invalid, to_py};

/// The mixture and packing arguments of a loader, as Python gives them.
pub(crate) struct SourceArgs {
    pub(crate) mixture_samples: Option<u64>,
    pub(crate) mixture_pass_of: Option<usize>,
    pub(crate) mixture_changes: Option<Vec<(u64, u64, Vec<f64>)>>,
    pub(crate) seq_len: Option<u64>,
    pub(crate) eod: Option<u64>,
    pub(crate) pad: u64,
    pub(crate) within_documents: bool,
}

/// `dataset` (a name, `name@N`, a manifest id, or a list of `(name, weight)`) and the mixture
/// and packing arguments, as the session reads them.
pub(crate) fn reads_of(
    paths: &StorePaths,
    dataset: &Bound<'_, PyAny>,
    args: SourceArgs,
) -> PyResult<(Reads, Option<PackConfig>)> {
    let reads = match dataset.extract::<String>() {
        Ok(name) => {
            if args.mixture_samples.is_some() || args.mixture_pass_of.is_some() || args.mixture_changes.is_some() {
                return Err(invalid(
                    "mixture_samples, mixture_pass_of and mixture_changes are a mixture's: pass a list of (dataset, weight)",
                ));
            }
            Reads::One(paths.parse_spec(&name).map_err(to_py)?)
        }
        Err(_) => {
            let given: Vec<(String, f64)> = dataset.extract().map_err(|_| {
                invalid("dataset is a name, name@version or manifest id, or a list of (name, weight) pairs")
            })?;
            let parts = given
                .iter()
                .map(|(name, weight)| Ok((paths.parse_spec(name).map_err(to_py)?, *weight)))
                .collect::<PyResult<Vec<_>>>()?;
            let epoch = match (args.mixture_samples, args.mixture_pass_of) {
                (Some(_), Some(_)) => return Err(invalid("give mixture_samples or mixture_pass_of, not both")),
                (Some(n), None) => EpochLength::Samples(n),
                (None, Some(i)) => EpochLength::PassOf(i),
                (None, None) => EpochLength::Records,
            };
            let changes = args.mixture_changes.unwrap_or_default().into_iter().map(change).collect();
            Reads::Mixture { parts, epoch, changes }
        }
    };
    let pack = match args.seq_len {
        None if args.eod.is_some() || args.pad != 0 || args.within_documents => {
            return Err(invalid("eod, pad and within_documents are packing's: give seq_len too"));
        }
        None => None,
        Some(seq_len) => {
            Some(PackConfig { seq_len, eod: args.eod, cross_documents: !args.within_documents, pad: args.pad })
        }
    };
    Ok((reads, pack))
}

/// A change of weights as Python gives it: `(epoch, cursor, weights)`.
pub(crate) fn change((epoch, cursor, weights): (u64, u64, Vec<f64>)) -> (Position, Vec<f64>) {
    (Position { epoch, cursor }, weights)
}

/// The mixture read, as `Loader.mixture` describes it.
pub(crate) fn mixture_dict<'py>(py: Python<'py>, mixture: &Mixture) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("id", mixture.id())?;
    let sources = PyList::empty(py);
    for source in mixture.sources() {
        let entry = PyDict::new(py);
        entry.set_item("label", &source.label)?;
        entry.set_item("manifest", source.manifest.to_string())?;
        entry.set_item("records", source.n_records)?;
        entry.set_item("weight", source.weight)?;
        sources.append(entry)?;
    }
    out.set_item("sources", sources)?;
    out.set_item("epoch_samples", mixture.blend().epoch_samples())?;
    let changes: Vec<(u64, u64, Vec<f64>)> =
        mixture.blend().changes().into_iter().map(|(at, weights)| (at.epoch, at.cursor, weights)).collect();
    out.set_item("changes", changes)?;
    Ok(out)
}

/// A packed batch as `Loader.next_packed` hands it to Python (`tokens` already the bytes the
/// windows were cut into).
pub(crate) fn packed_dict<'py>(
    py: Python<'py>,
    packed: &PackedBatch,
    tokens: Bound<'py, PyBytes>,
    packing: &Packing,
    layout: &granary::Layout,
) -> PyResult<Bound<'py, PyDict>> {
    let config = packing.config().ok_or_else(|| invalid("no packing"))?;
    let out = PyDict::new(py);
    let p = &packed.packed;
    out.set_item("tokens", tokens)?;
    out.set_item("cu_seqlens", int32_bytes(py, &p.cu_seqlens)?)?;
    out.set_item("position_ids", int32_bytes(py, &p.position_ids)?)?;
    out.set_item("real_tokens", p.real_tokens.clone())?;
    out.set_item("windows", p.windows)?;
    out.set_item("width", config.seq_len + 1)?;
    out.set_item("dtype", token_typestr(layout))?;
    out.set_item("first_window", packed.windows.start)?;
    Ok(out)
}

/// `values` as the bytes of little-endian int32s, written once.
fn int32_bytes<'py>(py: Python<'py>, values: &[i32]) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 4, |buf| {
        for (out, value) in buf.chunks_exact_mut(4).zip(values) {
            out.copy_from_slice(&value.to_le_bytes());
        }
        Ok(())
    })
}

/// NumPy's type string of a packed dataset's tokens (`"<u2"`).
fn token_typestr(layout: &granary::Layout) -> String {
    let dtype = match layout {
        granary::Layout::Arrays(dtype) => *dtype,
        granary::Layout::Fixed(fixed) => fixed.dtype(),
        _ => granary::Dtype::U8,
    };
    let kind = match dtype.name().as_bytes().first() {
        Some(b'i') => 'i',
        Some(b'f') | Some(b'b') => 'f',
        _ => 'u',
    };
    format!("<{kind}{}", dtype.size_bytes())
}
