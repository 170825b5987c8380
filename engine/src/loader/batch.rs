//! What a trainer gets from a loader: `LoadedBatch` (the host view, the device copy and its
//! event, the indices and the position after it), `DeviceBatch`, and `LoaderStats`.
//!
//! Owns those types and the return of a batch's staging lease and device buffer when it is
//! dropped. Never: reads, plans or waits on the stages.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::time::Duration;

#[cfg(feature = "policy")]
use super::rebalance::WeightsAt;
use crate::error::{Error, Result};

use crate::plan::Position;
use crate::read::{Batch, ReadStats};
use crate::staging::PoolStats;
use crate::staging::cuda::{Cuda, DeviceBuffer, Fence, Stream, Upload};
use crate::tier::TierStats;

/// Batches ready on the device: where, and the event after the copy.
pub struct DeviceBatch<'a> {
    upload: &'a Upload,
}

impl DeviceBatch<'_> {
    /// The device address of the batch's bytes.
    pub fn ptr(&self) -> u64 {
        self.upload.device().device_ptr()
    }

    /// Bytes on the device.
    pub fn len(&self) -> usize {
        self.upload.host().len()
    }

    /// Whether the batch holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the copy has completed.
    pub fn is_ready(&self) -> Result<bool> {
        self.upload.is_ready()
    }

    /// Waits for the copy.
    pub fn wait(&self) -> Result<()> {
        self.upload.wait()
    }

    /// Makes later work on `stream` (a raw `CUstream` of the loader's device; 1 and 2 name the
    /// legacy and the per-thread default streams, as in DLPack) wait for the copy, without
    /// blocking the calling thread.
    pub fn order_before(&self, stream: u64) -> Result<()> {
        self.upload.order_before(stream)
    }

    /// The raw `CUevent` recorded after the copy: make the trainer's stream wait on it.
    #[cfg(feature = "cuda")]
    pub fn event(&self) -> cudarc::driver::sys::CUevent {
        self.upload.event_raw()
    }

    /// Copies the device bytes back (for checks, not the hot path).
    pub fn download(&self, out: &mut [u8]) -> Result<()> {
        self.upload.wait()?;
        self.upload.device().download(out)
    }
}

/// One batch handed to the trainer. Dropping it returns its staging buffer (and device buffer)
/// to the loader: drop it only after the work that reads it has finished.
pub struct LoadedBatch {
    pub(super) batch: Batch,
    pub(super) upload: Option<Upload>,
    /// The rank weights the batch's step was cut with (rebalancing only).
    #[cfg(feature = "policy")]
    pub(super) weights: Option<Arc<WeightsAt>>,
    pub(super) position: Position,
    pub(super) stall: Duration,
    pub(super) returns: Option<Sender<Returned>>,
    /// Points in the trainer's streams after which the device buffer is free again.
    pub(super) fences: Vec<Fence>,
    /// The trainer's streams are unknown: the buffer is free once the whole device has run
    /// the work queued before it is reused.
    pub(super) after_all_work: bool,
    pub(super) held: Arc<AtomicUsize>,
}

/// A device buffer back from the trainer, free once its fences have passed (or, with
/// `after_all_work`, once the device has run everything queued before the reuse). Dropped
/// unused (the loader is gone, or stops), it waits for them before the buffer is freed.
pub(super) struct Returned {
    pub(super) buffer: Option<DeviceBuffer>,
    pub(super) fences: Vec<Fence>,
    pub(super) after_all_work: bool,
}

impl Returned {
    /// The buffer, once `stream`'s later work is ordered after the fences.
    pub(super) fn after_fences_on(mut self, stream: &Stream) -> Result<DeviceBuffer> {
        for fence in &self.fences {
            stream.wait_for(fence)?;
        }
        self.fences.clear();
        if self.after_all_work {
            Cuda::get().ok_or_else(|| Error::invalid_input("a device buffer without CUDA"))?.synchronize()?;
            self.after_all_work = false;
        }
        Ok(self.buffer.take().expect("taken once"))
    }
}

impl Drop for Returned {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            // Freeing memory a consumer's queued kernels may still read is not allowed: wait.
            // If waiting fails the context is broken; leak the buffer rather than free it.
            let idle = || Cuda::get().is_some_and(|cuda| cuda.synchronize().is_ok());
            if self.fences.iter().all(|fence| fence.wait().is_ok()) && (!self.after_all_work || idle()) {
                drop(buffer);
            } else {
                std::mem::forget(buffer);
            }
        }
    }
}

impl LoadedBatch {
    /// The dataset indices of the records, in batch order.
    pub fn indices(&self) -> &[u64] {
        self.batch.indices()
    }

    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.batch.len()
    }

    /// Whether the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.batch.is_empty()
    }

    /// Where each record ends in `data`.
    pub fn ends(&self) -> &[u64] {
        self.batch.ends()
    }

    /// The verified bytes in host (staging) memory: for fixed-size records one dense
    /// `len x shape` array, otherwise records back to back (see `ends`).
    pub fn data(&self) -> &[u8] {
        match &self.upload {
            Some(upload) => upload.host().as_slice(),
            None => self.batch.data(),
        }
    }

    /// The bytes of record `i` of the batch.
    pub fn record(&self, i: usize) -> &[u8] {
        let ends = self.ends();
        debug_assert!(ends.last().is_none_or(|&end| end as usize <= self.data().len()), "ends inside the data");
        let start = if i == 0 { 0 } else { ends[i - 1] as usize };
        &self.data()[start..ends[i] as usize]
    }

    /// The batch on the GPU, when the loader copies to one.
    pub fn device(&self) -> Option<DeviceBatch<'_>> {
        self.upload.as_ref().map(|upload| DeviceBatch { upload })
    }

    /// Where the run is after this batch: resume from here to read the next one.
    pub fn position(&self) -> Position {
        self.position
    }

    /// The rank weights this batch's step was cut with, when the loader rebalances.
    #[cfg(feature = "policy")]
    pub fn weights(&self) -> Option<&WeightsAt> {
        self.weights.as_deref()
    }

    /// How long `next` waited for this batch.
    pub fn stall(&self) -> Duration {
        self.stall
    }

    /// Keeps the device buffer from being reused until the work enqueued so far on `stream` (a
    /// raw `CUstream` of the loader's device, as in `DeviceBatch::order_before`) has run: for a
    /// consumer that drops the batch while kernels reading it are still queued. Nothing to do for
    /// a host batch (host reads are done when they return).
    pub fn release_after(&mut self, stream: u64) -> Result<()> {
        if self.upload.is_some() {
            let cuda = Cuda::get().ok_or_else(|| Error::invalid_input("a device batch without CUDA"))?;
            self.fences.push(Fence::record(cuda, stream)?);
        }
        Ok(())
    }

    /// Keeps the device buffer from being reused until the device has run all the work queued
    /// on it before the reuse, on any stream: for a consumer that cannot name its streams
    /// (DLPack's stream -1), or whose `release_after` failed. It costs a device-wide
    /// synchronisation on the loader's copy thread at each such reuse; name the stream where
    /// you can.
    pub fn release_after_all_device_work(&mut self) {
        self.after_all_work = self.upload.is_some();
    }

    /// Whether the bytes are in page-locked memory.
    pub fn pinned(&self) -> bool {
        match &self.upload {
            Some(upload) => upload.host().pinned(),
            None => self.batch.lease().is_some_and(|lease| lease.pinned()),
        }
    }
}

impl Drop for LoadedBatch {
    fn drop(&mut self) {
        if let Some(upload) = self.upload.take() {
            give_back(upload, std::mem::take(&mut self.fences), self.after_all_work, self.returns.as_ref());
        }
        self.held.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Gives `upload`'s staging lease back to the pool and its device buffer to the device stage,
/// to be reused once the work `fences` mark (or all the device's, `after_all_work`) is done: a
/// batch dropped by the trainer, or one the loader drops before handing it out.
pub(super) fn give_back(upload: Upload, fences: Vec<Fence>, after_all_work: bool, returns: Option<&Sender<Returned>>) {
    if let Ok((lease, buffer)) = upload.into_parts() {
        drop(lease);
        if let Some(returns) = returns {
            // A closed queue hands the buffer back, to be dropped after its fences.
            let _ = returns.send(Returned { buffer: Some(buffer), fences, after_all_work });
        }
    }
}

/// Counters of a loader.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoaderStats {
    /// Batches handed out.
    pub batches: u64,
    /// Records handed out.
    pub records: u64,
    /// Bytes handed out.
    pub bytes: u64,
    /// Batches that were already in the queue when `next` asked for them (no wait at all).
    pub ready: u64,
    /// Time `next` spent waiting for data, in total.
    pub stall: Duration,
    /// The longest wait for one batch.
    pub stall_max: Duration,
    /// Batches read past a rebalance point before its measures came, which then told the
    /// ranks apart: dropped, and their steps read again with the point's weights.
    pub recut: u64,
    /// From the first `next` to the last.
    pub elapsed: Duration,
    /// The reader's counters.
    pub read: ReadStats,
    /// The staging pool's counters.
    pub pool: PoolStats,
    /// The memory tier's counters, when the loader uses one.
    pub tier: Option<TierStats>,
    /// The counters of the cache an attached dataset is read through (this loader's), if any.
    pub cache: Option<crate::read::CacheStats>,
}

/// The counters of the loaders of a run (one per epoch, say), summed: counts and times add, the
/// longest stall is the longest of both, the pool's and the tier's figures are the later ones
/// (they describe a state, not a count).
impl std::ops::AddAssign<&LoaderStats> for LoaderStats {
    fn add_assign(&mut self, more: &LoaderStats) {
        let LoaderStats { batches, records, bytes, ready, stall, stall_max, recut, elapsed, read, pool, tier, cache } =
            more;
        self.batches += batches;
        self.records += records;
        self.bytes += bytes;
        self.ready += ready;
        self.stall += *stall;
        self.stall_max = self.stall_max.max(*stall_max);
        self.recut += recut;
        self.elapsed += *elapsed;
        self.read += read;
        self.pool = *pool;
        if tier.is_some() {
            self.tier = *tier;
        }
        if let Some(more) = cache {
            *self.cache.get_or_insert_default() += more;
        }
    }
}

impl LoaderStats {
    /// Fraction of the time between the first and last `next` spent waiting for data.
    pub fn stall_fraction(&self) -> f64 {
        if self.elapsed.is_zero() { 0.0 } else { self.stall.as_secs_f64() / self.elapsed.as_secs_f64() }
    }
}
