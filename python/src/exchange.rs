//! The ranks' exchange of their measures for rebalancing, through a Python callable.
//!
//! Owns `PyExchange` (a `MeasureExchange` over a callable: by default, in the Python layer,
//! `torch.distributed.all_gather_object`). Never: decides weights (the partitioner does) or
//! holds the GIL longer than the call.

use pyo3::prelude::*;

use granary::loader::MeasureExchange;
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
