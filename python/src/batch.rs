//! A batch as Python receives it: `NativeBatch` (its records, indices, position and device
//! copy, exported through DLPack without a copy), and the widening of integer records that
//! `dtype=` asks for.
//!
//! Owns `NativeBatch` and the widening helpers. Never: reads, plans or holds the loader's lock
//! (the loader hands it a batch already verified).

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use granary::shard::Sample;
use granary::staging::cuda::Cuda;
use granary::{Dataset, Dtype, Layout};

use crate::dlpack::{DEVICE_CPU, DEVICE_CUDA, DlDataType, Exported, HeldBatch, Owner};
use crate::errors::{invalid, to_py};

/// What `dtype=` widens fixed-size integer records of `layout` to: `(from, to)`; an error for
/// records that are not integers, or that the target cannot hold all values of.
pub(crate) fn widening(layout: &Layout, dtype: &str) -> PyResult<(Dtype, Dtype)> {
    use granary::Dtype as D;
    let from = match layout {
        Layout::Fixed(fixed) => fixed.dtype(),
        Layout::Arrays(dtype) => *dtype,
        _ => {
            return Err(invalid(
                "dtype= widens fixed-size records and arrays; this dataset's records are byte strings or samples",
            ));
        }
    };
    let to = match Dtype::from_name(dtype) {
        Some(to @ (D::I64 | D::I32)) => to,
        _ => return Err(invalid(format!("dtype={dtype:?}: expected \"int64\" or \"int32\" (or None)"))),
    };
    let fits = match to {
        D::I64 => matches!(from, D::U8 | D::I8 | D::U16 | D::I16 | D::U32 | D::I32 | D::I64),
        _ => matches!(from, D::U8 | D::I8 | D::U16 | D::I16 | D::I32),
    };
    if !fits {
        return Err(invalid(format!(
            "dtype={dtype:?}: the records are {}, which {} cannot hold every value of",
            numpy_name(from),
            numpy_name(to)
        )));
    }
    Ok((from, to))
}

/// NumPy's name of `dtype`.
fn numpy_name(dtype: Dtype) -> &'static str {
    use granary::Dtype as D;
    match dtype {
        D::U8 => "uint8",
        D::I8 => "int8",
        D::U16 => "uint16",
        D::I16 => "int16",
        D::U32 => "uint32",
        D::I32 => "int32",
        D::U64 => "uint64",
        D::I64 => "int64",
        D::F16 => "float16",
        D::Bf16 => "bfloat16",
        D::F32 => "float32",
        D::F64 => "float64",
        _ => "an unknown dtype",
    }
}

/// The little-endian integers of `from` in `bytes`, each as `cast` makes it: one pass.
fn widen<T>(bytes: &[u8], from: Dtype, cast: impl Fn(i64) -> T) -> Vec<T> {
    use granary::Dtype as D;
    let mut out = Vec::with_capacity(bytes.len() / from.size_bytes() as usize);
    match from {
        D::U8 => out.extend(bytes.iter().map(|&b| cast(i64::from(b)))),
        D::I8 => out.extend(bytes.iter().map(|&b| cast(i64::from(b.cast_signed())))),
        D::U16 => out.extend(bytes.chunks_exact(2).map(|c| cast(i64::from(u16::from_le_bytes([c[0], c[1]]))))),
        D::I16 => out.extend(bytes.chunks_exact(2).map(|c| cast(i64::from(i16::from_le_bytes([c[0], c[1]]))))),
        D::U32 => {
            out.extend(bytes.chunks_exact(4).map(|c| cast(i64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))))
        }
        D::I32 => {
            out.extend(bytes.chunks_exact(4).map(|c| cast(i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))))
        }
        D::I64 => out.extend(bytes.chunks_exact(8).map(|c| cast(i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))))),
        // `widening` admits no other.
        _ => {}
    }
    out
}

pub(crate) fn layout_name(layout: &Layout) -> &'static str {
    match layout {
        Layout::Fixed(_) => "fixed",
        Layout::Samples => "samples",
        Layout::Arrays(_) => "arrays",
        _ => "bytes",
    }
}

/// One batch as the engine handed it over, before conversion to tensors.
#[pyclass(module = "granary._native", frozen)]
pub(crate) struct NativeBatch {
    held: Arc<HeldBatch>,
    /// Dimensions of one record, and its dtype, for fixed-size records.
    fixed: Option<(Vec<i64>, DlDataType)>,
    /// The dataset's layout (what `data_as` widens from).
    layout: Layout,
    /// The dataset, when its records are WebDataset samples (to name a record that fails to
    /// decode).
    samples: Option<Arc<Dataset>>,
    device: (i32, i32),
    len: usize,
    position: (u64, u64),
    stall: f64,
    pinned: bool,
}

impl NativeBatch {
    pub(crate) fn new(batch: granary::LoadedBatch, dataset: &Arc<Dataset>, device: Option<u32>) -> PyResult<Self> {
        let fixed = match dataset.layout() {
            Layout::Fixed(fixed) => {
                let dtype = DlDataType::of(fixed.dtype()).ok_or_else(|| {
                    invalid(format!("dtype {} has no DLPack type in these bindings", fixed.dtype().name()))
                })?;
                Some((fixed.dims().iter().map(|&d| d as i64).collect(), dtype))
            }
            _ => None,
        };
        // Only a device batch asks CUDA which device: a host batch must not start CUDA (a
        // context on device 0, and this process tied to it).
        let device = match batch.device() {
            Some(_) => (DEVICE_CUDA, device.or_else(|| Cuda::get().map(Cuda::ordinal)).unwrap_or(0) as i32),
            None => (DEVICE_CPU, 0),
        };
        let position = batch.position();
        Ok(Self {
            len: batch.len(),
            position: (position.epoch, position.cursor),
            stall: batch.stall().as_secs_f64(),
            pinned: batch.pinned(),
            held: Arc::new(HeldBatch::new(batch)),
            fixed,
            layout: dataset.layout().clone(),
            samples: matches!(dataset.layout(), Layout::Samples).then(|| Arc::clone(dataset)),
            device,
        })
    }
}

#[pymethods]
impl NativeBatch {
    /// Records in the batch.
    fn __len__(&self) -> usize {
        self.len
    }

    /// The batch's bytes: `(records, *record_shape)` of the dataset's dtype for fixed-size
    /// records, every record's elements back to back for arrays (of their dtype), otherwise every
    /// record's bytes back to back (uint8); see `offsets`.
    fn data(&self) -> PyResult<Exported> {
        let (address, bytes) = self.held.with(|batch| match batch.device() {
            Some(device) => (device.ptr(), batch.data().len()),
            None => (batch.data().as_ptr() as u64, batch.data().len()),
        });
        let (shape, dtype) = match &self.fixed {
            Some((dims, dtype)) => {
                let mut shape = vec![self.len as i64];
                shape.extend_from_slice(dims);
                (shape, *dtype)
            }
            None => match &self.layout {
                Layout::Arrays(element) => {
                    let dtype = DlDataType::of(*element).ok_or_else(|| {
                        invalid(format!("dtype {} has no DLPack type in these bindings", element.name()))
                    })?;
                    (vec![(bytes as u64 / element.size_bytes()) as i64], dtype)
                }
                _ => (vec![bytes as i64], DlDataType::U8),
            },
        };
        Ok(Exported::new(Owner::Batch(Arc::clone(&self.held)), address, self.device, dtype, shape))
    }

    /// The batch's fixed-size integer records widened to `dtype` (`"int64"` or `"int32"`), in
    /// one pass over the batch into memory of the bindings' own (host batches only; the GIL is
    /// released meanwhile).
    fn data_as(&self, py: Python<'_>, dtype: &str) -> PyResult<Exported> {
        let (from, to) = widening(&self.layout, dtype)?;
        if self.device.0 == DEVICE_CUDA {
            return Err(invalid("dtype= widens host batches: on a GPU, widen the tensor there (batch.long())"));
        }
        let held = Arc::clone(&self.held);
        let shape = match &self.fixed {
            Some((dims, _)) => {
                let mut shape = vec![self.len as i64];
                shape.extend_from_slice(dims);
                shape
            }
            // Arrays: the batch's elements back to back (see `offsets`).
            None => vec![(held.with(|batch| batch.data().len()) as u64 / from.size_bytes()) as i64],
        };
        Ok(if to == Dtype::I64 {
            Exported::host_shaped(py.detach(|| held.with(|batch| widen(batch.data(), from, |v| v))), shape)
        } else {
            // `widening` admits only dtypes whose every value fits.
            let values = py.detach(|| held.with(|batch| widen(batch.data(), from, |v| v as i32)));
            Exported::host_shaped_i32(values, shape)
        })
    }

    /// The records decoded as WebDataset samples, in batch order: one dict per record, its
    /// key under `"__key__"` and each part's bytes under the part's name as the tar spelled it
    /// (`"jpg"`, `"seg.png"`; `""` for a file name without a dot). Samples datasets only, in host memory. A record that does not decode (it passed
    /// its checksum, so it was written wrong) is a `CorruptionError` naming it.
    fn samples<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let Some(dataset) = &self.samples else {
            return Err(invalid("the dataset's records are not WebDataset samples"));
        };
        if self.device.0 == DEVICE_CUDA {
            return Err(invalid("samples are decoded in host memory: load them with device='cpu'"));
        }
        // Decoded into owned memory first: no Python object is made (no code that could run a
        // finalizer touching this batch) while the batch's lock is held.
        let decoded = self.held.with(|batch| decode_samples(dataset, batch.indices(), &|i| batch.record(i)))?;
        samples_to_py(py, decoded)
    }

    /// Where each record starts and ends in `data`, in its elements (bytes, but for arrays):
    /// `len + 1` int64 offsets, from 0 (host memory, whatever the device).
    fn offsets(&self) -> Exported {
        let element = if let Layout::Arrays(dtype) = &self.layout { dtype.size_bytes() } else { 1 };
        let mut offsets = Vec::with_capacity(self.len + 1);
        offsets.push(0);
        self.held.with(|batch| offsets.extend(batch.ends().iter().map(|&end| (end / element) as i64)));
        Exported::host(offsets)
    }

    /// The dataset indices of the records, in batch order (int64, host memory).
    fn indices(&self) -> Exported {
        Exported::host(self.held.with(|batch| batch.indices().iter().map(|&i| i as i64).collect()))
    }

    /// `(epoch, cursor)` after this batch.
    #[getter]
    fn position(&self) -> (u64, u64) {
        self.position
    }

    /// Seconds the loader waited for this batch.
    #[getter]
    fn stall_seconds(&self) -> f64 {
        self.stall
    }

    /// Whether the host bytes are page-locked.
    #[getter]
    fn pinned(&self) -> bool {
        self.pinned
    }

    /// `"fixed"`, `"bytes"`, `"arrays"` or `"samples"` (see `Loader.layout`).
    #[getter]
    fn layout(&self) -> &'static str {
        layout_name(&self.layout)
    }

    /// Whether the records are fixed-size arrays (`data` is then one dense array).
    #[getter]
    fn fixed(&self) -> bool {
        self.fixed.is_some()
    }

    /// `"cpu"` or `"cuda:N"`.
    #[getter]
    fn device(&self) -> String {
        if self.device.0 == DEVICE_CUDA { format!("cuda:{}", self.device.1) } else { "cpu".to_owned() }
    }
}

/// A sample decoded into owned memory: its key and its parts (name, bytes).
pub(crate) type OwnedSample = (String, Vec<(String, Vec<u8>)>);

/// The records `record(0..)` of `dataset` (its records `indices`) decoded as WebDataset samples.
/// A record that does not decode (it passed its checksum, so it was written wrong) is a
/// `CorruptionError` naming its shard and place; a part named twice or `__key__` is refused.
pub(crate) fn decode_samples<'a>(
    dataset: &Dataset,
    indices: &[u64],
    record: &dyn Fn(usize) -> &'a [u8],
) -> PyResult<Vec<OwnedSample>> {
    let mut decoded = Vec::with_capacity(indices.len());
    for (i, &index) in indices.iter().enumerate() {
        let record_path = || match dataset.locate(index) {
            Ok((shard, local)) => {
                let mut path = dataset.shard_path(shard).into_os_string();
                path.push(format!(" (record {local})"));
                PathBuf::from(path)
            }
            Err(_) => PathBuf::from(format!("record {index}")),
        };
        let sample = Sample::decode(record(i))
            .map_err(|source| to_py(granary::Error::Format { path: record_path(), source }))?;
        // Ingest refuses these; a store written before it did may hold them.
        for (k, (name, _)) in sample.parts.iter().enumerate() {
            if *name == "__key__" || sample.parts[..k].iter().any(|(other, _)| other == name) {
                return Err(invalid(format!(
                    "{}: sample {} has a part named {name:?} twice or one named \"__key__\"",
                    record_path().display(),
                    sample.key
                )));
            }
        }
        let parts = sample.parts.iter().map(|(name, bytes)| ((*name).to_owned(), bytes.to_vec())).collect();
        decoded.push((sample.key.to_owned(), parts));
    }
    Ok(decoded)
}

/// Decoded samples as Python dicts: the key under `"__key__"`, each part's bytes under its name.
pub(crate) fn samples_to_py(py: Python<'_>, decoded: Vec<OwnedSample>) -> PyResult<Bound<'_, PyList>> {
    let out = PyList::empty(py);
    for (key, parts) in decoded {
        let dict = PyDict::new(py);
        dict.set_item("__key__", key)?;
        for (name, bytes) in parts {
            dict.set_item(name, PyBytes::new(py, &bytes))?;
        }
        out.append(dict)?;
    }
    Ok(out)
}
