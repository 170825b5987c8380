//! What a Python loader reads: one dataset version, or a mixture of versions with their
//! weights, either as records or as packed windows of tokens; and how packed windows and a
//! mixture's description reach Python.
//!
//! Owns `Source` (the dataset argument as given, checked; opened once into the dataset, the
//! mixture and the packing, which set the loader's plan; a mixture's changes of weights) and the
//! Python forms of a packed batch and of a mixture. Never: reads records or runs a loader
//! (`loader.rs` does), or decides an order (the engine's plans do).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use granary::loader::{PackedBatch, Packer, Packing};
use granary::pack::PackConfig;
use granary::{Dataset, EpochLength, LoaderConfig, Mixture, Order, PlanSource, Position, StorePaths, VersionSpec};

use crate::errors::{invalid, to_py};

/// What a loader reads: one version, or a mixture of versions with their weights.
enum DatasetArg {
    One(VersionSpec),
    /// The parts are pinned to their manifest ids once opened (a name committed to meanwhile
    /// does not change what a restart reads).
    Mixture {
        parts: Vec<(VersionSpec, f64)>,
        epoch: EpochLength,
        changes: Vec<(Position, Vec<f64>)>,
    },
}

/// The loader's source: as given, and once opened.
pub(crate) struct Source {
    root: PathBuf,
    arg: DatasetArg,
    /// Packed windows asked for: how, and the documents' order.
    pack: Option<(PackConfig, Order)>,
    dataset: Option<Arc<Dataset>>,
    mixture: Option<Mixture>,
    packing: Option<Packing>,
}

/// The mixture and packing arguments of a loader, as Python gives them.
pub(crate) struct SourceArgs<'a> {
    pub(crate) mixture_samples: Option<u64>,
    pub(crate) mixture_pass_of: Option<usize>,
    pub(crate) mixture_changes: Option<Vec<(u64, u64, Vec<f64>)>>,
    pub(crate) seq_len: Option<u64>,
    pub(crate) eod: Option<u64>,
    pub(crate) pad: u64,
    pub(crate) within_documents: bool,
    pub(crate) order: Option<&'a str>,
    /// A partitioner, its options or rebalancing asked for.
    pub(crate) partitioner_given: bool,
    pub(crate) rebalance_given: bool,
    pub(crate) device: Option<&'a str>,
}

impl Source {
    /// Checks `dataset` (a name, `name@N`, a manifest id, or a list of `(name, weight)`) and the
    /// mixture and packing arguments.
    pub(crate) fn parse(root: PathBuf, dataset: &Bound<'_, PyAny>, args: SourceArgs<'_>) -> PyResult<Self> {
        let paths = StorePaths::new(&root);
        let arg = match dataset.extract::<String>() {
            Ok(name) => {
                if args.mixture_samples.is_some() || args.mixture_pass_of.is_some() || args.mixture_changes.is_some() {
                    return Err(invalid("mixture_samples, mixture_pass_of and mixture_changes are a mixture's"));
                }
                DatasetArg::One(paths.parse_spec(&name).map_err(to_py)?)
            }
            Err(_) => {
                let given: Vec<(String, f64)> = dataset.extract().map_err(|_| {
                    invalid("dataset is a name, name@version or manifest id, or a list of (name, weight) pairs")
                })?;
                if given.is_empty() {
                    return Err(invalid("a mixture needs at least one (name, weight) pair"));
                }
                let parts = given
                    .iter()
                    .map(|(name, weight)| Ok((paths.parse_spec(name).map_err(to_py)?, *weight)))
                    .collect::<PyResult<Vec<_>>>()?;
                if args.order.is_some() || args.partitioner_given {
                    return Err(invalid(
                        "a mixture is ordered by its weights (each source shuffled): drop order and partitioner",
                    ));
                }
                let epoch = match (args.mixture_samples, args.mixture_pass_of) {
                    (Some(_), Some(_)) => return Err(invalid("give mixture_samples or mixture_pass_of, not both")),
                    (Some(n), None) => EpochLength::Samples(n),
                    (None, Some(i)) => EpochLength::PassOf(i),
                    (None, None) => EpochLength::Records,
                };
                let changes = args
                    .mixture_changes
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(epoch, cursor, weights)| (Position { epoch, cursor }, weights))
                    .collect();
                DatasetArg::Mixture { parts, epoch, changes }
            }
        };
        let pack = match args.seq_len {
            None if args.eod.is_some() || args.pad != 0 || args.within_documents => {
                return Err(invalid("eod, pad and within_documents are packing's: give seq_len too"));
            }
            None => None,
            Some(_) if args.partitioner_given || args.rebalance_given => {
                return Err(invalid(
                    "packed windows are cut by their own plan: drop partitioner, partitioner_options and rebalance_every",
                ));
            }
            Some(0) => return Err(invalid("seq_len must be at least 1")),
            Some(seq_len) => {
                let order = match args.order {
                    None | Some("shuffled") => Order::Shuffled,
                    Some("sequential") => Order::Sequential,
                    Some(other) => {
                        return Err(invalid(format!("order {other:?}: expected \"shuffled\" or \"sequential\"")));
                    }
                };
                Some((
                    PackConfig { seq_len, eod: args.eod, cross_documents: !args.within_documents, pad: args.pad },
                    order,
                ))
            }
        };
        if pack.is_some() && !matches!(args.device, None | Some("cpu")) {
            return Err(invalid("packed windows are built in host memory: the native loader takes device=\"cpu\""));
        }
        Ok(Self { root, arg, pack, dataset: None, mixture: None, packing: None })
    }

    /// Whether it is a mixture.
    pub(crate) fn is_mixture(&self) -> bool {
        matches!(self.arg, DatasetArg::Mixture { .. })
    }

    /// Whether it reads packed windows.
    pub(crate) fn is_packed(&self) -> bool {
        self.pack.is_some()
    }

    /// The dataset read (a mixture's: its sources' records in order), opened once; `config`'s
    /// plan becomes the mixture's or the packing's.
    pub(crate) fn open(&mut self, config: &mut LoaderConfig) -> granary::Result<Arc<Dataset>> {
        if let Some(dataset) = &self.dataset {
            return Ok(Arc::clone(dataset));
        }
        let paths = StorePaths::new(&self.root);
        let dataset = match &mut self.arg {
            DatasetArg::One(spec) => Dataset::open(&paths, spec)?,
            DatasetArg::Mixture { parts, epoch, changes } => {
                let mut mixture = Mixture::open(&paths, parts, *epoch)?;
                for (at, weights) in changes.iter() {
                    mixture = mixture.with_change(*at, weights)?;
                }
                for ((spec, _), source) in parts.iter_mut().zip(mixture.sources()) {
                    *spec = VersionSpec::Manifest(source.manifest);
                }
                config.plan = PlanSource::Mixture(Arc::clone(mixture.blend()));
                let dataset = Arc::clone(mixture.dataset());
                self.mixture = Some(mixture);
                dataset
            }
        };
        if let Some((pack, order)) = self.pack.clone() {
            // A mixture's sources are packed each on its own and blended by window.
            let packing = match &self.mixture {
                Some(mixture) => Packing::Mixture(Arc::new(granary::loader::pack_mixture(mixture, pack)?)),
                None => Packing::One(Arc::new(granary::loader::pack_plan(&dataset, pack)?), order),
            };
            *config = Packer::loader_config(&packing, config.clone())?;
            self.packing = Some(packing);
        }
        self.dataset = Some(Arc::clone(&dataset));
        Ok(dataset)
    }

    /// The packing, once opened.
    pub(crate) fn packing(&self) -> Option<&Packing> {
        self.packing.as_ref()
    }

    /// The mixture's changes of weights so far (none for one dataset).
    pub(crate) fn changes(&self) -> Option<Vec<(Position, Vec<f64>)>> {
        match &self.arg {
            DatasetArg::Mixture { changes, .. } => Some(changes.clone()),
            DatasetArg::One(_) => None,
        }
    }

    /// Replaces the mixture's changes of weights and opens it again (checked now: a change
    /// past the epoch's end, weights of the wrong count); the old changes stay when the new
    /// ones are refused.
    pub(crate) fn set_changes(
        &mut self,
        config: &mut LoaderConfig,
        new: Vec<(Position, Vec<f64>)>,
    ) -> granary::Result<()> {
        let DatasetArg::Mixture { changes, .. } = &mut self.arg else {
            return Err(granary::Error::invalid_input("weights change in a mixture; this loader reads one dataset"));
        };
        let old = std::mem::replace(changes, new);
        self.forget();
        if let Err(e) = self.open(config) {
            if let DatasetArg::Mixture { changes, .. } = &mut self.arg {
                *changes = old;
            }
            self.forget();
            self.open(config)?;
            return Err(e);
        }
        Ok(())
    }

    fn forget(&mut self) {
        self.dataset = None;
        self.mixture = None;
        self.packing = None;
    }

    /// The mixture read, as `Loader.mixture` describes it: `None` for one dataset.
    pub(crate) fn mixture_dict<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(mixture) = &self.mixture else { return Ok(None) };
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
        Ok(Some(out))
    }
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
