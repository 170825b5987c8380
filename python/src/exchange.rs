//! The ranks' exchange of their measures for rebalancing, through a Python callable.
//!
//! Owns `PyExchange` (a `MeasureExchange` over a callable: by default, in the Python layer,
//! `torch.distributed.all_gather_object`) and the rebalancing state's dict (what
//! `Loader.state_dict` saves of it, and reads back). Never: decides weights (the partitioner does) or
//! holds the GIL longer than the call.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use granary::loader::{MeasureExchange, RebalanceState, WeightsAt};

use crate::errors::invalid;
use granary::policy::RankMeasure;

/// A rank's measure as Python sees it: `(rank, records, busy_nanos)`.
pub(crate) type MeasureTuple = (u32, u64, u64);

/// The ranks' exchange of their measures through a Python callable (by default, in the Python
/// layer, `torch.distributed.all_gather_object`): called with `(epoch, step, (rank, records,
/// busy_nanos))`, it returns every rank's triple.
pub(crate) struct PyExchange {
    pub(crate) callable: Py<PyAny>,
}

impl MeasureExchange for PyExchange {
    fn all_gather(&self, epoch: u64, step: u64, mine: RankMeasure) -> granary::Result<Vec<RankMeasure>> {
        Python::attach(|py| {
            let out = self.callable.call1(py, (epoch, step, (mine.rank, mine.records, mine.busy_nanos)))?;
            out.extract::<Vec<MeasureTuple>>(py)
        })
        .map(|all| {
            all.into_iter().map(|(rank, records, busy_nanos)| RankMeasure { rank, records, busy_nanos }).collect()
        })
        .map_err(|error| {
            granary::Error::invalid_input(format!(
                "the ranks' exchange of their measures at rebalance point {step} of epoch {epoch} failed: {error}"
            ))
        })
    }
}

/// `saved` as `Loader.rebalance_state` gives it: `epoch`, `step`, `weights`, and `pending`
/// (`None`, or the step and every rank's `(rank, records, busy_nanos)` already exchanged).
pub(crate) fn rebalance_dict<'py>(py: Python<'py>, saved: &RebalanceState) -> PyResult<Bound<'py, PyDict>> {
    let out = PyDict::new(py);
    out.set_item("epoch", saved.weights.epoch)?;
    out.set_item("step", saved.weights.step)?;
    out.set_item("weights", saved.weights.weights.clone())?;
    match &saved.pending {
        None => out.set_item("pending", py.None())?,
        Some((step, measured)) => {
            let measured: Vec<MeasureTuple> = measured.iter().map(|m| (m.rank, m.records, m.busy_nanos)).collect();
            out.set_item("pending", (step, measured))?;
        }
    }
    Ok(out)
}

/// The rebalancing state `rebalance_dict` wrote; a key missing is named.
pub(crate) fn rebalance_from_dict(saved: &Bound<'_, PyDict>) -> PyResult<RebalanceState> {
    let get = |key: &str| saved.get_item(key)?.ok_or_else(|| invalid(format!("the rebalance state has no {key:?}")));
    let weights = WeightsAt {
        epoch: get("epoch")?.extract()?,
        step: get("step")?.extract()?,
        weights: get("weights")?.extract()?,
    };
    let pending: Option<(u64, Vec<MeasureTuple>)> = crate::state::as_tuples(&get("pending")?)?.extract()?;
    let pending = pending.map(|(step, measured)| {
        let measured =
            measured.into_iter().map(|(rank, records, busy_nanos)| RankMeasure { rank, records, busy_nanos }).collect();
        (step, measured)
    });
    Ok(RebalanceState { weights, pending })
}
