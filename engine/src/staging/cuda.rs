//! The CUDA driver API, loaded at run time (cudarc with dynamic loading): nothing links against
//! CUDA, and where no driver or no device exists `Cuda::get` says why and returns `None`.
//!
//! Owns the few driver objects the loader needs: the primary context of one device (0 unless
//! the process selected another with `Cuda::select` before first use), page-locked
//! registrations of staging memory, streams, events, device buffers, and `Upload` (an
//! asynchronous host-to-device copy that owns its source lease and destination buffer until the
//! copy is done, so neither can be reused or freed under the copy engine). Every call makes the
//! context current on the calling thread for its length, then restores what was current there.
//! Invariants: host memory is unregistered before
//! it is unmapped (`HostRegistration` is dropped before the mapping, by field order in the pool);
//! an `Upload` waits for its copy before it gives back or drops its lease. Never: calls the
//! driver without checking first that the library loaded (cudarc's safe layer panics then).
#![allow(unsafe_code, reason = "CUDA driver calls through cudarc's raw API, and handles shared between threads")]

use crate::error::{Error, Result};
use crate::io::AlignedBuf;

use super::Lease;

#[cfg(feature = "cuda")]
use cudarc::driver::{result, sys};

/// What was current on this thread before `Cuda::bind` (another context, or none: null), made
/// current again on drop.
#[cfg(feature = "cuda")]
#[must_use]
struct Bind {
    restore: Option<sys::CUcontext>,
}

#[cfg(feature = "cuda")]
impl Drop for Bind {
    fn drop(&mut self) {
        if let Some(previous) = self.restore {
            // SAFETY: `previous` was current on this thread a moment ago (the driver keeps a
            // context alive while it is current anywhere), or is null, which unbinds.
            let _ = unsafe { result::ctx::set_current(previous) };
        }
    }
}

/// The CUDA device the engine uses and its primary context.
pub struct Cuda {
    #[cfg(feature = "cuda")]
    ctx: sys::CUcontext,
    /// The process that initialised it: CUDA does not survive a fork.
    pid: u32,
    ordinal: u32,
    name: String,
    memory_bytes: usize,
}

// SAFETY: a primary context is a process-wide handle that the driver lets any thread make
// current; `Cuda` only passes it to the driver and never dereferences it.
#[cfg(feature = "cuda")]
unsafe impl Send for Cuda {}
// SAFETY: as for `Send`: shared use only hands the same handle to thread-safe driver calls.
#[cfg(feature = "cuda")]
unsafe impl Sync for Cuda {}

static CUDA: std::sync::OnceLock<std::result::Result<Cuda, String>> = std::sync::OnceLock::new();

/// The process that initialised the driver (`cuInit`), which a forked child must not use.
#[cfg(feature = "cuda")]
static DRIVER_PID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();

/// Loads and initialises the driver (`cuInit`; an error in a child forked after the parent
/// initialised it) and returns how many devices it sees; the reason when it cannot.
fn init_driver() -> std::result::Result<i32, String> {
    #[cfg(feature = "cuda")]
    {
        // SAFETY: only probes whether the driver library can be loaded.
        if !unsafe { sys::is_culib_present() } {
            return Err("no CUDA driver library (libcuda) found".to_owned());
        }
        let pid = *DRIVER_PID.get_or_init(std::process::id);
        if pid != std::process::id() {
            return Err(forked(pid));
        }
        result::init().map_err(|e| format!("cuInit: {e:?}"))?;
        result::device::get_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))
    }
    #[cfg(not(feature = "cuda"))]
    Err("this build has no CUDA support (the `cuda` feature is off)".to_owned())
}

impl Cuda {
    /// The device, initialised on first use (device 0 unless `select` chose another first);
    /// `None` without a driver or a device.
    pub fn get() -> Option<&'static Cuda> {
        CUDA.get_or_init(|| Cuda::init(0)).as_ref().ok().filter(|cuda| cuda.pid == std::process::id())
    }

    /// Why `get` returns `None`.
    pub fn unavailable_reason() -> Option<String> {
        match CUDA.get_or_init(|| Cuda::init(0)) {
            Err(reason) => Some(reason.clone()),
            Ok(cuda) if cuda.pid != std::process::id() => Some(forked(cuda.pid)),
            Ok(_) => None,
        }
    }

    /// The devices the driver sees, without initialising the engine's device (so a later
    /// `select` may still choose any); the reason when there is no usable driver.
    pub fn device_count() -> std::result::Result<u32, String> {
        match CUDA.get() {
            Some(Ok(cuda)) if cuda.pid != std::process::id() => return Err(forked(cuda.pid)),
            Some(Err(reason)) => return Err(reason.clone()),
            _ => {}
        }
        init_driver().map(|count| u32::try_from(count).unwrap_or(0))
    }

    /// Uses device `ordinal` (as the driver numbers the visible devices) for the rest of the
    /// process. One device per process: an error if another one is already in use, or if this
    /// one cannot be used.
    pub fn select(ordinal: u32) -> Result<&'static Cuda> {
        match CUDA.get_or_init(|| Cuda::init(ordinal)) {
            Ok(cuda) if cuda.pid != std::process::id() => Err(Error::invalid_input(forked(cuda.pid))),
            Ok(cuda) if cuda.ordinal == ordinal => Ok(cuda),
            Ok(cuda) => Err(Error::NoGpu {
                detail: format!(
                    "this process already uses CUDA device {} ({}); one process loads to one device",
                    cuda.ordinal, cuda.name
                ),
            }),
            Err(reason) => Err(Error::NoGpu { detail: format!("CUDA device {ordinal} cannot be used: {reason}") }),
        }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's memory in bytes.
    pub fn memory_bytes(&self) -> usize {
        self.memory_bytes
    }

    #[cfg(not(feature = "cuda"))]
    fn init(_ordinal: u32) -> std::result::Result<Cuda, String> {
        Err(init_driver().err().unwrap_or_default())
    }

    #[cfg(feature = "cuda")]
    fn init(ordinal: u32) -> std::result::Result<Cuda, String> {
        let count = init_driver()?;
        if count < 1 {
            return Err("the CUDA driver sees no device".to_owned());
        }
        let index = i32::try_from(ordinal)
            .ok()
            .filter(|&index| index < count)
            .ok_or_else(|| format!("the CUDA driver sees {count} devices, so there is no device {ordinal}"))?;
        let device = result::device::get(index).map_err(|e| format!("cuDeviceGet: {e:?}"))?;
        let name = result::device::get_name(device).unwrap_or_else(|_| format!("CUDA device {ordinal}"));
        // SAFETY: `device` is a valid ordinal handle returned just above.
        let memory_bytes = unsafe { result::device::total_mem(device) }.unwrap_or(0);
        // SAFETY: as above; the primary context is retained for the life of the process.
        let ctx =
            unsafe { result::primary_ctx::retain(device) }.map_err(|e| format!("cuDevicePrimaryCtxRetain: {e:?}"))?;
        Ok(Cuda { ctx, pid: std::process::id(), ordinal, name, memory_bytes })
    }

    /// Makes the context current on this thread until the returned guard is dropped, which
    /// puts back what was current before: another context, or none. A trainer's thread is left
    /// as found, so the engine never changes which device its framework (whose runtime adopts
    /// a thread's current context) takes as current.
    #[cfg(feature = "cuda")]
    fn bind(&self) -> Result<Bind> {
        let previous = result::ctx::get_current().map_err(|e| cuda_error("cuCtxGetCurrent", e))?;
        if previous == Some(self.ctx) {
            return Ok(Bind { restore: None });
        }
        // SAFETY: `ctx` is the retained primary context, valid for the life of the process.
        unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        Ok(Bind { restore: Some(previous.unwrap_or(std::ptr::null_mut())) })
    }

    /// Blocks until all work queued on the device so far, by anyone, has run
    /// (`cuCtxSynchronize`): the fallback for a consumer whose streams are unknown.
    pub fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.bind()?;
            result::ctx::synchronize().map_err(|e| cuda_error("cuCtxSynchronize", e))
        }
        #[cfg(not(feature = "cuda"))]
        Ok(())
    }

    /// Page-locks `memory` (portable, not write-combined) until the registration is dropped.
    pub(crate) fn register_host(&self, memory: &AlignedBuf) -> Result<HostRegistration> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.bind()?;
            let ptr = memory.base_ptr();
            // SAFETY: `ptr..ptr + len` is a live mapping owned by the pool, which drops this
            // registration (unregistering) before it unmaps the memory.
            unsafe { sys::cuMemHostRegister_v2(ptr.cast(), memory.len(), sys::CU_MEMHOSTREGISTER_PORTABLE) }
                .result()
                .map_err(|e| cuda_error("cuMemHostRegister", e))?;
            Ok(HostRegistration { ptr })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = memory;
            Err(Error::invalid_input("this build has no CUDA support"))
        }
    }

    /// A stream of its own (non-blocking with respect to the legacy default stream).
    pub fn stream(&'static self) -> Result<Stream> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.bind()?;
            let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda_error("cuStreamCreate", e))?;
            Ok(Stream { cuda: self, raw })
        }
        #[cfg(not(feature = "cuda"))]
        Err(Error::invalid_input("this build has no CUDA support"))
    }

    /// `bytes` of device memory.
    pub fn alloc(&'static self, bytes: usize) -> Result<DeviceBuffer> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.bind()?;
            // SAFETY: a plain allocation; the pointer is owned by the returned buffer and freed
            // once, in its `Drop`.
            let ptr = unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| cuda_error("cuMemAlloc", e))?;
            Ok(DeviceBuffer { cuda: self, ptr, len: bytes })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = bytes;
            Err(Error::invalid_input("this build has no CUDA support"))
        }
    }
}

/// Why CUDA cannot be used in this process: it was initialised in another, before a fork.
fn forked(parent: u32) -> String {
    format!(
        "CUDA was initialised in process {parent}, which this process ({}) was forked from, and CUDA \
         does not survive a fork: initialise it only in the process that uses it, or start \
         children with the 'spawn' method",
        std::process::id()
    )
}

#[cfg(feature = "cuda")]
fn cuda_error(call: &'static str, e: result::DriverError) -> Error {
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Cuda { call, detail: format!("{:?} {text}", e.0) }
}

/// A page-locked registration of host memory.
pub struct HostRegistration {
    ptr: *mut u8,
}

// SAFETY: the registration is an address the driver knows; unregistering it from another thread
// is allowed (the context is made current first).
unsafe impl Send for HostRegistration {}
// SAFETY: shared references give no access to the pointer.
unsafe impl Sync for HostRegistration {}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(cuda) = Cuda::get()
            && let Ok(_bound) = cuda.bind()
        {
            // SAFETY: `ptr` was registered by `register_host` and is unregistered once, here,
            // before the pool unmaps it.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr.cast()) };
        }
        #[cfg(not(feature = "cuda"))]
        let _ = self.ptr;
    }
}

/// A CUDA stream.
pub struct Stream {
    cuda: &'static Cuda,
    #[cfg(feature = "cuda")]
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread with its context current (every method
// binds it first).
unsafe impl Send for Stream {}

impl Stream {
    /// The raw `CUstream`, for a caller that enqueues its own work after the loader's copies.
    #[cfg(feature = "cuda")]
    pub fn raw(&self) -> sys::CUstream {
        self.raw
    }

    /// Copies `lease`'s bytes to the start of `buffer` on this stream, and records an event after
    /// the copy. The upload owns both until it is done. On failure, work queued on the stream
    /// before (waits for a consumer's fences, which keep the buffer from being written while
    /// the consumer reads it) may still be pending: the stream is synchronised before the lease
    /// and the buffer go, or, if even that fails, both are leaked rather than freed under it.
    pub fn upload(&self, lease: Lease, buffer: DeviceBuffer) -> Result<Upload> {
        match self.enqueue_upload(&lease, &buffer) {
            Ok(event) => Ok(Upload { parts: Some((lease, buffer)), event }),
            Err(e) => {
                if self.synchronize().is_err() {
                    std::mem::forget((lease, buffer));
                }
                Err(e)
            }
        }
    }

    fn enqueue_upload(&self, lease: &Lease, buffer: &DeviceBuffer) -> Result<Event> {
        if lease.len() > buffer.len {
            return Err(Error::invalid_input(format!(
                "a batch of {} bytes does not fit a device buffer of {} bytes",
                lease.len(),
                buffer.len
            )));
        }
        #[cfg(feature = "cuda")]
        {
            let _bound = self.cuda.bind()?;
            let event = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_error("cuEventCreate", e))?;
            let event = Event { cuda: self.cuda, raw: event };
            // SAFETY: the source is the lease's `len` bytes and the destination the start of a
            // device buffer at least that long; the caller's `Upload` owns both and does not
            // release either before the event after the copy has completed (on failure the
            // caller synchronises the stream first).
            unsafe { result::memcpy_htod_async(buffer.ptr, lease.as_slice(), self.raw) }
                .map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))?;
            // SAFETY: both handles are live and belong to the current context.
            unsafe { result::event::record(event.raw, self.raw) }.map_err(|e| cuda_error("cuEventRecord", e))?;
            Ok(event)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = self.cuda;
            Err(Error::invalid_input("this build has no CUDA support"))
        }
    }

    /// Blocks until the work queued on this stream so far has run.
    pub fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.cuda.bind()?;
            // SAFETY: the stream is live (owned by `self`).
            unsafe { result::stream::synchronize(self.raw) }.map_err(|e| cuda_error("cuStreamSynchronize", e))
        }
        #[cfg(not(feature = "cuda"))]
        Ok(())
    }
}

impl Stream {
    /// Makes later work on this stream wait until `fence` has passed (without blocking the
    /// calling thread).
    pub fn wait_for(&self, fence: &Fence) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.cuda.bind()?;
            // SAFETY: both handles are live: the stream is owned by `self`, the event by `fence`.
            unsafe {
                result::stream::wait_event(self.raw, fence.event.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            }
            .map_err(|e| cuda_error("cuStreamWaitEvent", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (self.cuda, &fence.event);
            Ok(())
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Ok(_bound) = self.cuda.bind() {
            // SAFETY: the stream was created by `Cuda::stream` and is destroyed once, here; the
            // driver finishes work already enqueued before it releases the stream.
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
    }
}

/// A CUDA event.
struct Event {
    cuda: &'static Cuda,
    #[cfg(feature = "cuda")]
    raw: sys::CUevent,
}

// SAFETY: an event handle may be queried, synchronised and destroyed from any thread.
unsafe impl Send for Event {}

impl Event {
    /// Blocks until the work before the event has run.
    fn synchronize(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.cuda.bind()?;
            // SAFETY: the event is live (owned by `self`).
            unsafe { result::event::synchronize(self.raw) }.map_err(|e| cuda_error("cuEventSynchronize", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = self.cuda;
            Ok(())
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Ok(_bound) = self.cuda.bind() {
            // SAFETY: created by `upload` or `Fence::record` and destroyed once, here.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}

/// A point in a stream the engine does not own (a consumer's): an event recorded there, so
/// that the engine's own stream can wait for the work enqueued before it.
pub struct Fence {
    event: Event,
}

impl Fence {
    /// Records a fence after the work enqueued so far on `stream`, a raw `CUstream` of `cuda`'s
    /// context (1 and 2 name the legacy and the per-thread default streams, as in DLPack).
    pub fn record(cuda: &'static Cuda, stream: u64) -> Result<Fence> {
        #[cfg(feature = "cuda")]
        {
            let _bound = cuda.bind()?;
            let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| cuda_error("cuEventCreate", e))?;
            let event = Event { cuda, raw };
            // SAFETY: the event is live. The stream handle is the caller's promise (DLPack's
            // contract: the consumer names one of its streams on this device); the driver
            // only enqueues the record on it.
            unsafe { result::event::record(event.raw, stream as sys::CUstream) }
                .map_err(|e| cuda_error("cuEventRecord", e))?;
            Ok(Fence { event })
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (cuda, stream);
            Err(Error::invalid_input("this build has no CUDA support"))
        }
    }

    /// Blocks until the work before the fence has run.
    pub fn wait(&self) -> Result<()> {
        self.event.synchronize()
    }
}

/// Device memory.
pub struct DeviceBuffer {
    cuda: &'static Cuda,
    #[cfg(feature = "cuda")]
    ptr: sys::CUdeviceptr,
    len: usize,
}

// SAFETY: device memory may be used and freed from any thread with its context current.
unsafe impl Send for DeviceBuffer {}

impl DeviceBuffer {
    /// The device address.
    pub fn device_ptr(&self) -> u64 {
        #[cfg(feature = "cuda")]
        return self.ptr;
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies the first `out.len()` bytes back to the host, waiting for the copy (for tests and
    /// checks, not the hot path).
    pub fn download(&self, out: &mut [u8]) -> Result<()> {
        if out.len() > self.len {
            return Err(Error::invalid_input("more bytes asked than the device buffer holds"));
        }
        #[cfg(feature = "cuda")]
        {
            let _bound = self.cuda.bind()?;
            // SAFETY: `out` is at most `len` bytes and the source is this buffer's allocation;
            // the synchronous copy is done when the call returns.
            unsafe { result::memcpy_dtoh_sync(out, self.ptr) }.map_err(|e| cuda_error("cuMemcpyDtoH", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = self.cuda;
            Err(Error::invalid_input("this build has no CUDA support"))
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        if let Ok(_bound) = self.cuda.bind() {
            // SAFETY: allocated by `Cuda::alloc` and freed once, here; uploads into it own it, so
            // none is in flight (an `Upload` waits before it gives the buffer back).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// A host-to-device copy in flight (or done), owning its source and destination.
pub struct Upload {
    parts: Option<(Lease, DeviceBuffer)>,
    event: Event,
}

impl Upload {
    /// Whether the copy has completed.
    pub fn is_ready(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.event.cuda.bind()?;
            // SAFETY: the event is live (owned by `self`).
            match unsafe { result::event::query(self.event.raw) } {
                Ok(()) => Ok(true),
                Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                Err(e) => Err(cuda_error("cuEventQuery", e)),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = &self.event;
            Ok(true)
        }
    }

    /// Makes later work on `stream` (a raw `CUstream` of this context; 1 and 2 name the legacy
    /// and the per-thread default streams, as in DLPack) wait for the copy, without blocking the
    /// calling thread.
    pub fn order_before(&self, stream: u64) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            let _bound = self.event.cuda.bind()?;
            // SAFETY: the event is live (owned by `self`). The stream handle is the caller's
            // promise (DLPack's contract: the consumer names one of its streams on this
            // device); the driver only enqueues the wait on it.
            unsafe {
                result::stream::wait_event(
                    stream as sys::CUstream,
                    self.event.raw,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(|e| cuda_error("cuStreamWaitEvent", e))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = stream;
            Ok(())
        }
    }

    /// Waits for the copy.
    pub fn wait(&self) -> Result<()> {
        self.event.synchronize()
    }

    /// The raw event recorded after the copy, for a stream that should wait on it.
    #[cfg(feature = "cuda")]
    pub fn event_raw(&self) -> sys::CUevent {
        self.event.raw
    }

    /// The source bytes (valid to read: the copy only reads them).
    pub fn host(&self) -> &Lease {
        &self.parts.as_ref().expect("parts are taken only by into_parts").0
    }

    /// The destination.
    pub fn device(&self) -> &DeviceBuffer {
        &self.parts.as_ref().expect("parts are taken only by into_parts").1
    }

    /// Waits for the copy, then gives back the lease and the buffer.
    pub fn into_parts(mut self) -> Result<(Lease, DeviceBuffer)> {
        self.wait()?;
        Ok(self.parts.take().expect("parts are taken once"))
    }
}

impl Drop for Upload {
    fn drop(&mut self) {
        if self.parts.is_some() {
            // The copy may still read the lease: wait before the lease goes back to the pool. If
            // waiting fails the context is broken; leak the lease rather than hand out memory
            // the copy engine may still read.
            if self.wait().is_err() {
                std::mem::forget(self.parts.take());
            }
        }
    }
}
