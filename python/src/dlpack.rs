//! DLPack export: a batch's bytes handed to PyTorch or NumPy without a copy.
//!
//! `Exported` is what `torch.from_dlpack` and `numpy.from_dlpack` take: `__dlpack_device__`
//! says where the bytes are, `__dlpack__` returns a capsule named `dltensor` holding a
//! `DLManagedTensor` (DLPack's stable C ABI, the unversioned form every consumer reads). The
//! managed tensor owns a reference to what keeps the bytes alive (the batch, with its staging
//! lease and device buffer); the consumer calls its deleter when its tensor is freed, on
//! whatever thread frees it, with or without the GIL, so the deleter touches no Python object.
//! A capsule nobody consumed is deleted by its own destructor instead (its name is still
//! `dltensor`; a consumer renames it `used_dltensor`).
//!
//! Device batches: `__dlpack__(stream=s)` makes the consumer's stream `s` wait for the batch's
//! copy (without blocking the host), and remembers `s` so that, once the consumer frees its
//! tensor, the loader's next copy into that buffer waits for the work `s` had queued by then.
//! A consumer that names no stream (-1), or whose stream can no longer take that fence, gets
//! the safe fallback: the reuse waits for all the work queued on the device.
//!
//! Owns the DLPack C structs, `Exported` and the deleters. Never: copies a batch's bytes, or
//! touches a Python object from a deleter (it may run without the GIL, on any thread).
#![allow(unsafe_code, reason = "DLPack is a C ABI: raw structs, a capsule, and a deleter called by the consumer")]

use std::ffi::{CStr, c_void};
use std::sync::Arc;

use parking_lot::Mutex;
use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

use granary::LoadedBatch;

/// DLPack's device types (`DLDeviceType`).
pub(crate) const DEVICE_CPU: i32 = 1;
pub(crate) const DEVICE_CUDA: i32 = 2;

/// DLPack's type codes (`DLDataTypeCode`).
const CODE_INT: u8 = 0;
const CODE_UINT: u8 = 1;
const CODE_FLOAT: u8 = 2;
const CODE_BFLOAT: u8 = 4;

#[repr(C)]
struct DlDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DlDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

impl DlDataType {
    pub(crate) const U8: DlDataType = DlDataType { code: CODE_UINT, bits: 8, lanes: 1 };
    pub(crate) const I64: DlDataType = DlDataType { code: CODE_INT, bits: 64, lanes: 1 };
    pub(crate) const I32: DlDataType = DlDataType { code: CODE_INT, bits: 32, lanes: 1 };

    /// The DLPack type of an engine dtype (`None` for one added after these bindings).
    pub(crate) fn of(dtype: granary::Dtype) -> Option<DlDataType> {
        use granary::Dtype as D;
        let (code, bits) = match dtype {
            D::U8 => (CODE_UINT, 8),
            D::I8 => (CODE_INT, 8),
            D::U16 => (CODE_UINT, 16),
            D::I16 => (CODE_INT, 16),
            D::U32 => (CODE_UINT, 32),
            D::I32 => (CODE_INT, 32),
            D::U64 => (CODE_UINT, 64),
            D::I64 => (CODE_INT, 64),
            D::F16 => (CODE_FLOAT, 16),
            D::Bf16 => (CODE_BFLOAT, 16),
            D::F32 => (CODE_FLOAT, 32),
            D::F64 => (CODE_FLOAT, 64),
            _ => return None,
        };
        Some(DlDataType { code, bits, lanes: 1 })
    }
}

#[repr(C)]
struct DlTensor {
    data: *mut c_void,
    device: DlDevice,
    ndim: i32,
    dtype: DlDataType,
    shape: *mut i64,
    /// Null: compact row-major.
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DlManagedTensor {
    dl_tensor: DlTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DlManagedTensor)>,
}

/// What keeps exported bytes alive.
#[derive(Clone)]
pub(crate) enum Owner {
    /// A loaded batch (its staging lease, and its device buffer when it has one).
    Batch(Arc<HeldBatch>),
    /// Host memory of the bindings' own (offsets, indices, widened batches).
    Host(#[allow(dead_code, reason = "held for its lifetime: the exported values live in it")] Arc<Vec<i64>>),
    /// Host memory of the bindings' own, 32-bit (batches widened to int32).
    Host32(#[allow(dead_code, reason = "held for its lifetime: the exported values live in it")] Arc<Vec<i32>>),
}

/// A batch that exports hold; dropped when the last export and the Python batch are gone.
pub(crate) struct HeldBatch {
    /// Behind a lock only because CUDA handles are not `Sync`; nothing contends for it.
    batch: Mutex<Option<LoadedBatch>>,
    /// The process whose loader threads the batch goes back to.
    pid: u32,
    /// Consumer streams the device bytes were handed to.
    streams: Mutex<Vec<u64>>,
    /// The device bytes were handed to a consumer that named no stream (DLPack's -1).
    unordered: std::sync::atomic::AtomicBool,
}

impl HeldBatch {
    pub(crate) fn new(batch: LoadedBatch) -> Self {
        Self {
            batch: Mutex::new(Some(batch)),
            pid: std::process::id(),
            streams: Mutex::new(Vec::new()),
            unordered: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Calls `f` with the batch.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&LoadedBatch) -> R) -> R {
        let batch = self.batch.lock();
        f(batch.as_ref().expect("taken only in drop"))
    }
}

impl Drop for HeldBatch {
    fn drop(&mut self) {
        let Some(mut batch) = self.batch.get_mut().take() else {
            return;
        };
        if std::process::id() != self.pid {
            // A copy made by fork: the loader and its CUDA context are the parent's. Giving the
            // buffers back here would talk to threads that do not exist in this process.
            std::mem::forget(batch);
            return;
        }
        let streams = std::mem::take(&mut *self.streams.lock());
        // A consumer that named no stream, or whose stream cannot take a fence (a handle
        // destroyed while its tensor lived, against DLPack's contract), leaves the buffer's
        // reuse ordered after all the device's work instead.
        let mut after_all_work = *self.unordered.get_mut();
        for stream in streams {
            after_all_work |= batch.release_after(stream).is_err();
        }
        if after_all_work {
            batch.release_after_all_device_work();
        }
        drop(batch);
    }
}

/// A tensor ready for `torch.from_dlpack` or `numpy.from_dlpack`.
#[pyclass(module = "granary._native", frozen)]
pub(crate) struct Exported {
    owner: Owner,
    data: u64,
    device_type: i32,
    device_id: i32,
    dtype: DlDataType,
    shape: Vec<i64>,
}

impl Exported {
    /// Bytes at `data` (host or device address), `shape` elements of `dtype`, kept alive by
    /// `owner`. The caller guarantees `owner` keeps `data .. data + len` valid.
    pub(crate) fn new(owner: Owner, data: u64, device: (i32, i32), dtype: DlDataType, shape: Vec<i64>) -> Self {
        Self { owner, data, device_type: device.0, device_id: device.1, dtype, shape }
    }

    /// Host memory of the bindings' own.
    pub(crate) fn host(values: Vec<i64>) -> Self {
        let shape = vec![values.len() as i64];
        Self::host_shaped(values, shape)
    }

    /// Host memory of the bindings' own, of `shape` (whose product is `values.len()`).
    pub(crate) fn host_shaped(values: Vec<i64>, shape: Vec<i64>) -> Self {
        let values = Arc::new(values);
        let data = values.as_ptr() as u64;
        Self::new(Owner::Host(values), data, (DEVICE_CPU, 0), DlDataType::I64, shape)
    }

    /// 32-bit host memory of the bindings' own, of `shape` (whose product is `values.len()`).
    pub(crate) fn host_shaped_i32(values: Vec<i32>, shape: Vec<i64>) -> Self {
        let values = Arc::new(values);
        let data = values.as_ptr() as u64;
        Self::new(Owner::Host32(values), data, (DEVICE_CPU, 0), DlDataType::I32, shape)
    }
}

#[pymethods]
impl Exported {
    /// `(device_type, device_id)` as DLPack numbers them.
    fn __dlpack_device__(&self) -> (i32, i32) {
        (self.device_type, self.device_id)
    }

    /// A `dltensor` capsule. `stream` is the consumer's (CUDA: 1 the legacy default stream,
    /// otherwise a `cudaStream_t`, which must outlive the tensor; `None`: the legacy default
    /// stream; -1: no ordering wanted, the consumer synchronises itself, and the buffer's reuse
    /// then waits for all the device's work, which is slow).
    /// The per-thread default stream (2) is refused: the batch's release is ordered after the
    /// consumer's stream from whatever thread frees the tensor, where 2 would name another
    /// stream. `copy=True` is refused: this exporter never copies.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<i64>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Consumers that ask for version 1 read the unversioned capsule too (the name tells).
        let _ = max_version;
        if copy == Some(true) {
            return Err(PyBufferError::new_err("granary exports batches without copying; copy=True is not supported"));
        }
        if let Some(device) = dl_device
            && device != (self.device_type, self.device_id)
        {
            return Err(PyBufferError::new_err(format!(
                "the batch is on DLPack device {:?}, not {device:?}; load it with the device you want",
                (self.device_type, self.device_id)
            )));
        }
        if self.device_type == DEVICE_CUDA {
            let stream = match stream {
                None => Some(1),
                Some(-1) => None,
                Some(0) => return Err(PyValueError::new_err("stream 0 is ambiguous in DLPack; pass 1 or a stream")),
                Some(2) => {
                    return Err(PyBufferError::new_err(
                        "granary cannot order a batch's release after the per-thread default stream (2): \
                         export on the legacy default stream (1) or on an explicit stream",
                    ));
                }
                Some(s) if s < 0 => return Err(PyValueError::new_err(format!("stream {s} is not a CUDA stream"))),
                Some(s) => Some(s as u64),
            };
            if let Owner::Batch(held) = &self.owner {
                match stream {
                    Some(stream) => {
                        held.with(|batch| match batch.device() {
                            Some(device) => device.order_before(stream).map_err(crate::errors::to_py),
                            None => Err(PyValueError::new_err("not a device batch")),
                        })?;
                        held.streams.lock().push(stream);
                    }
                    None => held.unordered.store(true, std::sync::atomic::Ordering::Relaxed),
                }
            }
        }
        self.capsule(py)
    }

    /// Elements along each dimension.
    #[getter]
    fn shape(&self) -> Vec<i64> {
        self.shape.clone()
    }

    /// The address of the first element (host or device), for checks that nothing was copied.
    #[getter]
    fn address(&self) -> u64 {
        self.data
    }
}

/// The managed tensor and what it points into, freed together by `delete`.
#[repr(C)]
struct Export {
    /// First, so that a pointer to the export is a pointer to the managed tensor.
    managed: DlManagedTensor,
    shape: Vec<i64>,
    _owner: Owner,
}

const CAPSULE_NAME: &CStr = c"dltensor";

impl Exported {
    fn capsule<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let ndim = i32::try_from(self.shape.len()).map_err(|_| PyValueError::new_err("too many dimensions"))?;
        let export = Box::new(Export {
            managed: DlManagedTensor {
                dl_tensor: DlTensor {
                    data: self.data as *mut c_void,
                    device: DlDevice { device_type: self.device_type, device_id: self.device_id },
                    ndim,
                    dtype: self.dtype,
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: 0,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete),
            },
            shape: self.shape.clone(),
            _owner: self.owner.clone(),
        });
        let raw = Box::into_raw(export);
        // SAFETY: `raw` is the live allocation just made; the shape vector is owned by it and
        // never resized, so the pointer stays valid until `delete` frees the export.
        unsafe {
            (*raw).managed.dl_tensor.shape = (*raw).shape.as_mut_ptr();
            (*raw).managed.manager_ctx = raw.cast();
        }
        // SAFETY: `raw` points to the managed tensor (first field of a `repr(C)` struct); the
        // name is a static C string, as the capsule API requires for the capsule's lifetime.
        let capsule = unsafe { ffi::PyCapsule_New(raw.cast(), CAPSULE_NAME.as_ptr(), Some(capsule_destructor)) };
        if capsule.is_null() {
            // SAFETY: the capsule was not made, so nobody else owns the export.
            unsafe { delete(raw.cast()) };
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `PyCapsule_New` returned a new reference.
        Ok(unsafe { Bound::from_owned_ptr(py, capsule) })
    }
}

/// DLPack's deleter: frees the export (and drops its reference to the batch).
///
/// # Safety
/// `managed` is null or a pointer made by `Exported::capsule` not yet deleted.
unsafe extern "C" fn delete(managed: *mut DlManagedTensor) {
    if managed.is_null() {
        return;
    }
    // SAFETY: per the contract, `managed` is the first field of a boxed `Export`, deleted once.
    drop(unsafe { Box::from_raw(managed.cast::<Export>()) });
}

/// The capsule's destructor: deletes the tensor if no consumer took it.
///
/// # Safety
/// Called by Python with the GIL held, on a capsule made by `Exported::capsule`.
unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // SAFETY: `capsule` is a live capsule object; checking its name sets no error.
    if unsafe { ffi::PyCapsule_IsValid(capsule, CAPSULE_NAME.as_ptr()) } != 1 {
        // Renamed `used_dltensor`: a consumer owns the tensor and calls the deleter itself.
        return;
    }
    // SAFETY: the name matched, so the pointer is the managed tensor this module stored.
    let managed = unsafe { ffi::PyCapsule_GetPointer(capsule, CAPSULE_NAME.as_ptr()) }.cast::<DlManagedTensor>();
    // SAFETY: unconsumed, so not deleted yet.
    unsafe { delete(managed) };
}
