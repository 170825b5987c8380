//! A loader's saved state as a Python dict (`Loader.state_dict`, `Loader.load_state_dict`): the
//! engine's `SavedState` written out and read back, in the dict a state of format 1 has always
//! been (`epoch`, `cursor`, `seed`, `plan`, `manifest`, `mixture`, `rebalance`), with `digest`.
//!
//! Owns the conversions, the `plan` dict's shapes among them. Never: compares a state with a
//! loader or checks its digest (the engine's `Session::resume` does).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use granary::loader::{SavedMixture, SavedState};
use granary::plan::Position;

use crate::errors::invalid;

/// The state `saved` as a dict; `mixture` is the mixture's own dict (`mixture_dict`: its
/// labels and sizes too), written for a mixture's state.
pub(crate) fn state_dict<'py>(
    py: Python<'py>,
    saved: &SavedState,
    mixture: Option<Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("format", 1)?;
    out.set_item("epoch", saved.position.epoch)?;
    out.set_item("cursor", saved.position.cursor)?;
    out.set_item("seed", saved.seed)?;
    out.set_item("plan", plan_dict(py, &saved.order)?)?;
    out.set_item("manifest", &saved.manifest)?;
    if let Some(mixture) = mixture {
        out.set_item("mixture", mixture)?;
    }
    if let Some(rebalance) = &saved.rebalance {
        out.set_item("rebalance", crate::exchange::rebalance_dict(py, rebalance)?)?;
    }
    if let Some(digest) = &saved.digest {
        out.set_item("digest", digest)?;
    }
    Ok(out)
}

/// The state a dict of `state_dict`'s (or of a release before digests) says; a key missing or
/// of the wrong kind is a `ValueError` naming it.
pub(crate) fn state_from_dict(state: &Bound<'_, PyDict>) -> PyResult<SavedState> {
    let format = state.get_item("format")?;
    if format.as_ref().and_then(|f| f.extract::<u64>().ok()) != Some(1) {
        let shown =
            format.map_or_else(|| "None".to_owned(), |f| f.repr().map_or_else(|_| "?".to_owned(), |r| r.to_string()));
        return Err(invalid(format!("not a granary loader state (format {shown})")));
    }
    let get = |key: &str| state.get_item(key)?.ok_or_else(|| invalid(format!("the state has no {key:?}")));
    let mixture = match state.get_item("mixture")? {
        Some(mixture) if !mixture.is_none() => Some(mixture_from_dict(mixture.cast::<PyDict>()?)?),
        _ => None,
    };
    let rebalance = match state.get_item("rebalance")? {
        Some(rebalance) if !rebalance.is_none() => {
            Some(crate::exchange::rebalance_from_dict(rebalance.cast::<PyDict>()?)?)
        }
        _ => None,
    };
    Ok(SavedState {
        position: Position { epoch: get("epoch")?.extract()?, cursor: get("cursor")?.extract()? },
        seed: get("seed")?.extract()?,
        order: plan_pairs(get("plan")?.cast::<PyDict>()?)?,
        manifest: get("manifest")?.extract()?,
        mixture,
        rebalance,
        // `None` as absent: a state without a digest, checked field by field.
        digest: state.get_item("digest")?.filter(|d| !d.is_none()).map(|d| d.extract()).transpose()?,
    })
}

fn mixture_from_dict(mixture: &Bound<'_, PyDict>) -> PyResult<SavedMixture> {
    let get = |key: &str| mixture.get_item(key)?.ok_or_else(|| invalid(format!("the state's mixture has no {key:?}")));
    let mut sources = Vec::new();
    for source in get("sources")?.try_iter()? {
        let source = source?;
        let source = source.cast::<PyDict>()?;
        let field =
            |key: &str| source.get_item(key)?.ok_or_else(|| invalid(format!("a mixture source has no {key:?}")));
        sources.push((field("manifest")?.extract()?, field("weight")?.extract()?));
    }
    let changes: Vec<(u64, u64, Vec<f64>)> = as_tuples(&get("changes")?)?.extract()?;
    Ok(SavedMixture {
        id: get("id")?.str()?.to_string(),
        sources,
        epoch_samples: get("epoch_samples")?.extract()?,
        changes: changes.into_iter().map(|(epoch, cursor, weights)| (Position { epoch, cursor }, weights)).collect(),
    })
}

/// `value` with every list in it a tuple: a state written to JSON and read back has lists where
/// `state_dict` put tuples.
pub(crate) fn as_tuples<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let items = value.try_iter()?.map(|item| as_tuples(&item?)).collect::<PyResult<Vec<_>>>()?;
        return Ok(PyTuple::new(value.py(), items)?.into_any());
    }
    Ok(value.clone())
}

/// The order's pairs as the `plan` dict has always shown them: `{"order": ...}`,
/// `{"partitioner": ..., "options": {...}}`, `{"mixture": "weights"}` or `{"pack": {...}}`.
fn plan_dict<'py>(py: Python<'py>, pairs: &[(String, String)]) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    let value = |key: &str| pairs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
    if let Some(seq_len) = value("pack.seq_len") {
        let pack = PyDict::new(py);
        let number = |text: &str| text.parse::<u64>().map_err(|_| invalid(format!("a packing number {text:?}")));
        pack.set_item("seq_len", number(seq_len)?)?;
        match value("pack.eod") {
            Some("none") | None => pack.set_item("eod", py.None())?,
            Some(eod) => pack.set_item("eod", number(eod)?)?,
        }
        pack.set_item("pad", number(value("pack.pad").unwrap_or("0"))?)?;
        pack.set_item("within_documents", value("pack.within_documents") == Some("true"))?;
        pack.set_item("order", value("pack.order").unwrap_or("shuffled"))?;
        out.set_item("pack", pack)?;
    } else if let Some(partitioner) = value("partitioner") {
        out.set_item("partitioner", partitioner)?;
        let options = PyDict::new(py);
        for (key, value) in pairs {
            if let Some(name) = key.strip_prefix("option:") {
                options.set_item(name, value)?;
            }
        }
        out.set_item("options", options)?;
    } else {
        for (key, value) in pairs {
            out.set_item(key, value)?;
        }
    }
    Ok(out)
}

/// `plan_dict`'s dict as pairs again.
fn plan_pairs(plan: &Bound<'_, PyDict>) -> PyResult<Vec<(String, String)>> {
    let text = |value: Bound<'_, PyAny>| -> PyResult<String> {
        if value.is_none() {
            return Ok("none".to_owned());
        }
        Ok(value.str()?.to_string().to_lowercase())
    };
    let mut pairs = Vec::new();
    if let Some(pack) = plan.get_item("pack")? {
        for (key, value) in pack.cast::<PyDict>()?.iter() {
            pairs.push((format!("pack.{}", key.str()?), text(value)?));
        }
    } else if let Some(partitioner) = plan.get_item("partitioner")? {
        pairs.push(("partitioner".to_owned(), partitioner.str()?.to_string()));
        if let Some(options) = plan.get_item("options")? {
            for (key, value) in options.cast::<PyDict>()?.iter() {
                pairs.push((format!("option:{}", key.str()?), value.str()?.to_string()));
            }
        }
    } else {
        for (key, value) in plan.iter() {
            pairs.push((key.str()?.to_string(), value.str()?.to_string()));
        }
    }
    Ok(pairs)
}
