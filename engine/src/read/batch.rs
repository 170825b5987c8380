//! The batch a reader delivers: the records' indices, their bytes (in staging memory when the
//! reader has a pool, else in memory of its own) and their ends, reused from batch to batch.
//! While a batch's ops are in flight its memory is written and read only through raw pointers
//! to the disjoint ranges each op owns (`BatchMemory`): the kernel, verify workers and copies
//! work on it at once. What fills it is `batch_plan.rs`'s.
//!
//! Owns: `Batch` (the records delivered: indices, bytes, ends, the staging lease) and
//! `BatchMemory`. Never: plans a read, submits one, or opens a file.

use crate::error::{Error, Result};
use crate::io::AlignedBuf;
use crate::staging::{Lease, StagingPool};

/// Records read together: their bytes back to back in request order, and where each ends.
///
/// The bytes live in page-aligned memory (huge pages when large), reused from batch to batch:
/// it is what a device copy wants, and it keeps TLB misses off the copy into the batch. A reader
/// with a staging pool puts them in a lease of the pool instead (page-locked when the loader
/// copies to a GPU), which the batch holds until it is dropped or the lease is taken.
#[derive(Debug, Default)]
pub struct Batch {
    pub(super) indices: Vec<u64>,
    pub(super) ends: Vec<u64>,
    pub(super) data: BatchBytes,
}

/// A page-aligned byte buffer whose contents need not survive growth: owned and growable, or a
/// staging lease of fixed capacity.
#[derive(Debug, Default)]
pub(super) struct BatchBytes {
    storage: Storage,
    len: usize,
}

#[derive(Debug, Default)]
enum Storage {
    #[default]
    Empty,
    Owned(AlignedBuf),
    Leased(Lease),
}

impl BatchBytes {
    fn as_slice(&self) -> &[u8] {
        match &self.storage {
            Storage::Empty => &[],
            Storage::Owned(buf) => &buf.as_slice()[..self.len],
            Storage::Leased(lease) => lease.as_slice(),
        }
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Empty => &mut [],
            Storage::Owned(buf) => &mut buf.as_mut_slice()[..self.len],
            Storage::Leased(lease) => lease.as_mut_slice(),
        }
    }

    /// The bytes' memory, as raw parts (no reference to the bytes is made): page-aligned.
    fn memory(&mut self) -> BatchMemory {
        let base = match &mut self.storage {
            Storage::Empty => std::ptr::NonNull::dangling().as_ptr(),
            Storage::Owned(buf) => buf.base_ptr(),
            Storage::Leased(lease) => crate::io::OwnedMemory::as_ptr(lease),
        };
        BatchMemory { base, len: if matches!(self.storage, Storage::Empty) { 0 } else { self.len } }
    }

    /// Sets the length; growing past the capacity allocates afresh (or leases from `staging`,
    /// waiting for a buffer to come back) and does not keep the bytes (every byte of a batch is
    /// written before it is read).
    pub(super) fn set_len(&mut self, len: usize, staging: Option<&StagingPool>) -> Result<()> {
        match (staging, &mut self.storage) {
            (Some(_), Storage::Leased(lease)) if lease.capacity() >= len => lease.set_len(len)?,
            (Some(pool), _) => {
                if len > pool.buffer_bytes() {
                    return Err(Error::invalid_input(format!(
                        "a batch of {len} bytes does not fit a staging buffer of {} bytes",
                        pool.buffer_bytes()
                    )));
                }
                self.storage = Storage::Empty;
                let mut lease = pool.acquire();
                lease.set_len(len)?;
                self.storage = Storage::Leased(lease);
            }
            (None, Storage::Owned(buf)) if buf.len() >= len => {}
            (None, _) => {
                self.storage = Storage::Empty;
                self.storage = Storage::Owned(AlignedBuf::new(len.next_power_of_two())?);
            }
        }
        self.len = len;
        Ok(())
    }
}

impl Batch {
    /// Records in the batch.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    /// Whether the batch has no records.
    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }

    /// The dataset indices of the records, in batch order.
    pub fn indices(&self) -> &[u64] {
        &self.indices
    }

    /// Every record's bytes back to back: for fixed-size records, one dense `len x shape` array.
    pub fn data(&self) -> &[u8] {
        self.data.as_slice()
    }

    /// Where each record ends in `data`.
    pub fn ends(&self) -> &[u64] {
        &self.ends
    }

    /// The bytes of record `i` of the batch.
    pub fn record(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.data.as_slice()[to_usize(start)..to_usize(self.ends[i])]
    }

    /// Every record's bytes, in batch order.
    pub fn records(&self) -> impl Iterator<Item = &[u8]> {
        (0..self.len()).map(|i| self.record(i))
    }

    /// The staging lease holding the bytes, if a staging pool provided them (page-locked when
    /// CUDA is present: what a device copy reads).
    pub fn lease(&self) -> Option<&Lease> {
        match &self.data.storage {
            Storage::Leased(lease) => Some(lease),
            _ => None,
        }
    }

    /// Takes the staging lease out of the batch (its bytes go with it; `data` is then empty).
    pub(crate) fn take_lease(&mut self) -> Option<Lease> {
        match std::mem::take(&mut self.data.storage) {
            Storage::Leased(lease) => {
                self.data.len = 0;
                Some(lease)
            }
            other => {
                self.data.storage = other;
                None
            }
        }
    }

    pub(super) fn clear(&mut self) {
        self.indices.clear();
        self.ends.clear();
        self.data.len = 0;
        if let Storage::Leased(lease) = &mut self.data.storage {
            lease.set_len(0).expect("0 bytes fit");
        }
    }

    /// The batch's memory as raw parts, for ops and checks that work on disjoint ranges of it
    /// at once. Valid until the batch is planned again or dropped.
    pub(super) fn memory(&mut self) -> BatchMemory {
        self.data.memory()
    }
}

/// A batch's bytes as raw parts: `len` bytes at `base`, page-aligned. Ranges of it are handed
/// to the kernel (reads straight into it), to verify workers, and to copies, each range to one
/// of them at a time; no reference to the whole is made while they work.
#[derive(Clone, Copy, Debug)]
pub(super) struct BatchMemory {
    base: *mut u8,
    len: usize,
}

impl BatchMemory {
    /// The address of byte `offset`, which with `len` more bytes lies inside the batch.
    pub(super) fn range(self, offset: u64, len: usize) -> Result<std::ptr::NonNull<u8>> {
        let offset = usize::try_from(offset).unwrap_or(usize::MAX);
        if offset.checked_add(len).is_none_or(|end| end > self.len) || len == 0 {
            return Err(Error::invalid_input(format!(
                "bytes {offset}..+{len} are not inside a batch of {} bytes",
                self.len
            )));
        }
        // Inside the mapping (checked above): plain address arithmetic, no dereference here.
        std::ptr::NonNull::new(self.base.wrapping_add(offset))
            .ok_or_else(|| Error::invalid_input("a batch's memory at address 0"))
    }

    /// Copies `src` to the batch's bytes at `dst`.
    ///
    /// # Safety
    ///
    /// The memory is still the batch's (the batch was not planned again or dropped), and the
    /// range `dst..dst + src.len()` is no op's in flight and no worker's: this copy owns it.
    #[allow(unsafe_code, reason = "a write into one range of a batch others work on")]
    pub(super) unsafe fn write(self, dst: u64, src: &[u8]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let at = self.range(dst, src.len())?;
        // SAFETY: `range` checked the bounds; the caller owns the range; `src` is a backend's
        // buffer or the tier's, never the batch.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), at.as_ptr(), src.len()) };
        Ok(())
    }
}

// SAFETY: a `BatchMemory` is an address range of a batch that the reader owns; it moves with the
// pipeline's slot, and whoever dereferences a range of it owns that range (see `write`).
#[allow(unsafe_code, reason = "raw parts of a batch travel with the reader")]
unsafe impl Send for BatchMemory {}

pub(super) fn to_usize(offset: u64) -> usize {
    usize::try_from(offset).expect("batch offsets fit in memory: the batch was allocated")
}
