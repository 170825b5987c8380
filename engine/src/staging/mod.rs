//! Staging: the bounded pool of page-aligned host buffers that reads land in and batches are
//! assembled in, page-locked through CUDA when a GPU driver is present.
//!
//! Owns: `StagingPool` (a fixed number of equal buffers, allocated once, handed out as `Lease`s
//! that go back to the pool when dropped) and `cuda` (the CUDA driver API, loaded at run time:
//! nothing links against CUDA, and without it the same code runs on ordinary aligned memory).
//! With CUDA, the pool's memory is page-locked (`cuMemHostRegister`, portable, not write-combined,
//! so the CPU reads it at full speed to verify checksums), and a lease can be an io_uring fixed
//! buffer: the disk's DMA lands where the GPU copy engine reads. Invariants: the pool never holds
//! more than `buffers` buffers and never allocates after `new`; a buffer is leased to one holder
//! at a time; memory is unpinned before it is unmapped. Never: grows, or blocks without an end
//! when a `try_` or timed variant is used.

pub mod cuda;

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::io::{AlignedBuf, OwnedMemory};
use crate::shard::BLOCK_BYTES;

/// Whether to page-lock the pool's memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pinning {
    /// Through CUDA when a driver and a device are present; plain memory otherwise.
    #[default]
    Auto,
    /// Never (plain page-aligned memory).
    Off,
    /// Through CUDA, or an error.
    Required,
}

/// The shape of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    /// Buffers in the pool: the most that can be leased at once.
    pub buffers: usize,
    /// Bytes per buffer, rounded up to whole 4 KiB pages.
    pub buffer_bytes: usize,
    /// Page-locking.
    pub pinning: Pinning,
}

/// Counters of a pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers in the pool (fixed).
    pub buffers: usize,
    /// Bytes per buffer.
    pub buffer_bytes: usize,
    /// Leased now.
    pub leased: usize,
    /// The most ever leased at once.
    pub leased_max: usize,
    /// Leases handed out so far.
    pub leases: u64,
    /// Times a caller had to wait for a buffer to come back.
    pub waits: u64,
    /// Whether the memory is page-locked.
    pub pinned: bool,
}

/// A bounded pool of equal page-aligned buffers. Cloning shares the pool.
#[derive(Clone)]
pub struct StagingPool {
    inner: Arc<Inner>,
}

struct Inner {
    /// Declared before `memory`: unpinned before the mapping goes.
    pin: Option<cuda::HostRegistration>,
    memory: AlignedBuf,
    buffer_bytes: usize,
    buffers: usize,
    state: Mutex<State>,
    returned: Condvar,
}

struct State {
    free: Vec<usize>,
    stats: PoolStats,
}

impl StagingPool {
    /// A pool of `config.buffers` buffers, all allocated (and pinned) now.
    pub fn new(config: StagingConfig) -> Result<Self> {
        if config.buffers == 0 || config.buffer_bytes == 0 {
            return Err(Error::invalid_input("a staging pool needs at least one buffer of at least one byte"));
        }
        let buffer_bytes = config.buffer_bytes.div_ceil(BLOCK_BYTES) * BLOCK_BYTES;
        // Whole blocks, so that reads straight into a buffer stay aligned.
        debug_assert!(buffer_bytes >= config.buffer_bytes && buffer_bytes.is_multiple_of(BLOCK_BYTES));
        let total = buffer_bytes
            .checked_mul(config.buffers)
            .ok_or_else(|| Error::invalid_input("staging pool size overflows"))?;
        let memory = AlignedBuf::new(total)?;
        let pin = match config.pinning {
            Pinning::Off => None,
            Pinning::Auto => cuda::Cuda::get().and_then(|cuda| cuda.register_host(&memory).ok()),
            Pinning::Required => {
                let cuda = cuda::Cuda::get().ok_or_else(|| {
                    Error::invalid_input(format!(
                        "page-locked staging needs CUDA: {}",
                        cuda::Cuda::unavailable_reason().unwrap_or_else(|| "not available".to_owned())
                    ))
                })?;
                Some(cuda.register_host(&memory)?)
            }
        };
        let stats = PoolStats { buffers: config.buffers, buffer_bytes, pinned: pin.is_some(), ..PoolStats::default() };
        let state = State { free: (0..config.buffers).rev().collect(), stats };
        let inner = Inner {
            pin,
            memory,
            buffer_bytes,
            buffers: config.buffers,
            state: Mutex::new(state),
            returned: Condvar::new(),
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Bytes per buffer.
    pub fn buffer_bytes(&self) -> usize {
        self.inner.buffer_bytes
    }

    /// Buffers in the pool.
    pub fn buffers(&self) -> usize {
        self.inner.buffers
    }

    /// Whether the memory is page-locked.
    pub fn pinned(&self) -> bool {
        self.inner.pin.is_some()
    }

    /// Counters so far.
    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats
    }

    /// A buffer, waiting for one to come back when all are leased.
    pub fn acquire(&self) -> Lease {
        let mut state = self.inner.lock();
        if state.free.is_empty() {
            state.stats.waits += 1;
            while state.free.is_empty() {
                self.inner.returned.wait(&mut state);
            }
        }
        self.lease(&mut state)
    }

    /// A buffer, waiting at most `timeout` for one.
    pub fn acquire_timeout(&self, timeout: Duration) -> Option<Lease> {
        let deadline = Instant::now() + timeout;
        let mut state = self.inner.lock();
        if state.free.is_empty() {
            state.stats.waits += 1;
        }
        while state.free.is_empty() {
            let left = deadline.checked_duration_since(Instant::now())?;
            self.inner.returned.wait_for(&mut state, left);
        }
        Some(self.lease(&mut state))
    }

    /// A buffer if one is free now.
    pub fn try_acquire(&self) -> Option<Lease> {
        let mut state = self.inner.lock();
        (!state.free.is_empty()).then(|| self.lease(&mut state))
    }

    fn lease(&self, state: &mut State) -> Lease {
        let index = state.free.pop().expect("the caller checked that a buffer is free");
        // The bound: every buffer is either free or leased to one holder, never both.
        debug_assert!(index < self.inner.buffers, "buffer {index} of {}", self.inner.buffers);
        debug_assert_eq!(state.free.len() + state.stats.leased + 1, self.inner.buffers, "a buffer lost or made");
        state.stats.leased += 1;
        state.stats.leased_max = state.stats.leased_max.max(state.stats.leased);
        state.stats.leases += 1;
        Lease { pool: Arc::clone(&self.inner), index, len: 0 }
    }
}

impl std::fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool").field("stats", &self.stats()).finish()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is a free list and counters, consistent between statements: a panic while
        // holding the lock (which releases it: parking_lot does not poison) leaves nothing
        // half-done.
        self.state.lock()
    }

    fn buffer_ptr(&self, index: usize) -> *mut u8 {
        debug_assert!(index < self.buffers);
        // `index < buffers`, so the buffer lies inside the mapping of `buffers * buffer_bytes`.
        self.memory.base_ptr().wrapping_add(index * self.buffer_bytes)
    }
}

/// One buffer of a pool, held alone until dropped; then it goes back to the pool.
///
/// A lease has a capacity (the pool's buffer size) and a length (the bytes in use, 0 when
/// leased); `as_slice` covers the length.
pub struct Lease {
    pool: Arc<Inner>,
    index: usize,
    len: usize,
}

impl Lease {
    /// The buffer's number in its pool.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Bytes the buffer holds at most.
    pub fn capacity(&self) -> usize {
        self.pool.buffer_bytes
    }

    /// Bytes in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the buffer is page-locked.
    pub fn pinned(&self) -> bool {
        self.pool.pin.is_some()
    }

    /// Sets the bytes in use; more than the capacity is an error. New bytes hold whatever the
    /// buffer held before (callers write every byte they then read).
    pub fn set_len(&mut self, len: usize) -> Result<()> {
        if len > self.capacity() {
            return Err(Error::invalid_input(format!(
                "{len} bytes do not fit a staging buffer of {} bytes",
                self.capacity()
            )));
        }
        self.len = len;
        Ok(())
    }

    /// The bytes in use.
    #[allow(unsafe_code, reason = "a slice over the leased buffer, which the lease owns alone")]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` lies inside the lease's buffer (`len <= capacity`, checked by
        // `set_len`), which is mapped, initialised (anonymous pages start zeroed) and lives as
        // long as the pool the lease keeps alive; the pool hands each buffer to one lease at a
        // time, and the shared borrow of the lease excludes writers while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The bytes in use, mutably.
    #[allow(unsafe_code, reason = "a slice over the leased buffer, which the lease owns alone")]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the unique borrow of the lease excludes every other
        // access while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }

    /// The start of the buffer, for the device copy.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.pool.buffer_ptr(self.index)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut state = self.pool.lock();
        debug_assert!(!state.free.contains(&self.index), "buffer {} returned twice", self.index);
        debug_assert!(state.stats.leased > 0 && state.free.len() < self.pool.buffers, "more returned than leased");
        state.free.push(self.index);
        state.stats.leased -= 1;
        drop(state);
        self.pool.returned.notify_one();
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease(buffer {}, {} of {} bytes)", self.index, self.len, self.capacity())
    }
}

// SAFETY: the lease's buffer is page-aligned (the pool's mapping is, and buffers are whole pages),
// initialised, the same region on every call, valid while the lease keeps the pool alive, and
// leased to this value alone.
#[allow(unsafe_code, reason = "a lease is memory the io_uring backend may give the kernel")]
unsafe impl OwnedMemory for Lease {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr()
    }

    fn len(&self) -> usize {
        self.capacity()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(buffers: usize) -> StagingPool {
        StagingPool::new(StagingConfig { buffers, buffer_bytes: 5000, pinning: Pinning::Off }).unwrap()
    }

    #[test]
    fn leases_are_bounded_disjoint_aligned_and_come_back() {
        let pool = pool(3);
        assert_eq!(pool.buffer_bytes(), 8192);
        let mut leases: Vec<Lease> = (0..3).map(|_| pool.try_acquire().unwrap()).collect();
        assert!(pool.try_acquire().is_none(), "never more than the bound");
        assert!(pool.acquire_timeout(Duration::from_millis(5)).is_none());
        for (i, lease) in leases.iter_mut().enumerate() {
            assert_eq!(lease.ptr() as usize % BLOCK_BYTES, 0);
            lease.set_len(8192).unwrap();
            lease.as_mut_slice().fill(i as u8);
        }
        for (i, lease) in leases.iter().enumerate() {
            assert!(lease.as_slice().iter().all(|&b| b == i as u8), "buffers do not overlap");
        }
        assert!(leases[0].set_len(8193).is_err());
        leases.pop();
        assert!(pool.try_acquire().is_some());
        let stats = pool.stats();
        assert_eq!((stats.buffers, stats.leased, stats.leased_max, stats.leases), (3, 2, 3, 4));
    }

    #[test]
    fn a_waiting_acquire_gets_the_buffer_another_thread_returns() {
        let pool = pool(1);
        let held = pool.acquire();
        let waiter = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.acquire().index())
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(held);
        assert_eq!(waiter.join().unwrap(), 0);
        assert_eq!(pool.stats().waits, 1);
    }

    #[test]
    fn empty_pools_are_refused() {
        let config = StagingConfig { buffers: 0, buffer_bytes: 1, pinning: Pinning::Off };
        assert!(StagingPool::new(config).is_err());
    }
}
