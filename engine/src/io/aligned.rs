//! Page-aligned memory from anonymous mmap: what O_DIRECT and registered buffers need.
//!
//! Invariant: an `AlignedBuf` owns its mapping alone; its length is a non-zero multiple of the
//! page size. The mapping is returned to the kernel with munmap, never to the allocator, so pages
//! a kernel still holds (a registered buffer) never come back as someone else's heap memory.
//!
//! Buffers of 2 MiB and more are aligned to 2 MiB and asked to be backed by transparent huge
//! pages. Measured here: with 4 KiB pages a 1 MiB read usually spans more physical segments than
//! the disk queue allows (`max_segments` 254), the block layer splits every op in two, and
//! sequential O_DIRECT reads lose about a quarter of their bandwidth.
//!
//! Owns: `AlignedBuf` (its mapping, pointers and slices) and the count of buffers mapped in the
//! process (`mappings_made`). Never: takes memory from the allocator or gives it back to it (mmap
//! and munmap only), or pins or registers it (a backend registers it with its ring).
#![allow(unsafe_code, reason = "mmap and munmap of the buffer's own mapping, and slices over it")]

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::shard::BLOCK_BYTES;

/// Buffers mapped so far, process-wide (tests check that steady-state reading maps none).
static MAPPINGS_MADE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Transparent huge page size on x86-64 and arm64 with 4 KiB base pages.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A page-aligned, zero-initialised buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its mapping exclusively (no aliasing handles exist), so moving it to
// another thread moves sole ownership, like a `Box<[u8]>`.
unsafe impl Send for AlignedBuf {}

// SAFETY: through a shared reference the buffer can only be read (`as_slice`) or its address
// taken (`base_ptr`, whose writers are unsafe code that must itself exclude other access), so
// sharing it between threads is like sharing a `&[u8]`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// At least `len` bytes (rounded up to whole 4 KiB pages, at least one; buffers of 2 MiB
    /// or more to whole huge pages).
    pub fn new(len: usize) -> Result<Self> {
        let huge = len >= HUGE_PAGE_BYTES;
        let align = if huge { HUGE_PAGE_BYTES } else { BLOCK_BYTES };
        let len = len.max(1).div_ceil(align) * align;
        // Over-allocate by one alignment unit so an aligned start exists inside the mapping.
        let mapped = if huge { len + HUGE_PAGE_BYTES } else { len };
        // SAFETY: an anonymous private mapping with no address hint touches no existing memory;
        // the result is checked against MAP_FAILED before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io("mmap", "anonymous buffer", std::io::Error::last_os_error()));
        }
        let base = base.cast::<u8>();
        let head = base.align_offset(align);
        debug_assert!(head + len <= mapped);
        // SAFETY: head + len <= mapped, so the aligned start and the end stay inside the mapping.
        let start = unsafe { base.add(head) };
        let tail = mapped - head - len;
        // SAFETY: the unmapped head [base, start) and tail [start + len, base + mapped) are parts
        // of the mapping just created that nothing references. madvise only hints the kernel;
        // its failure (THP disabled) leaves ordinary pages, which is correct, only slower.
        unsafe {
            if head > 0 {
                libc::munmap(base.cast(), head);
            }
            if tail > 0 {
                libc::munmap(start.add(len).cast(), tail);
            }
            if huge {
                libc::madvise(start.cast(), len, libc::MADV_HUGEPAGE);
            }
        }
        let ptr = NonNull::new(start).expect("mmap does not return null on success");
        MAPPINGS_MADE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self { ptr, len })
    }

    /// Buffers mapped so far in this process.
    pub fn mappings_made() -> u64 {
        MAPPINGS_MADE.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: a buffer has at least one page.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The start of the buffer, for handing to the kernel.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The start of the buffer, for handing to the kernel without a unique borrow. Writing
    /// through it is only sound where no Rust reference to the same bytes is alive.
    pub fn base_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The whole buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, initialised (anonymous pages are zero),
        // and lives as long as `self`; the shared borrow of `self` excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole buffer, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and the unique borrow of `self` excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: `ptr` and `len` are exactly the mapping created in `new`, unmapped once here.
        let rc = unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
        debug_assert_eq!(rc, 0, "munmap of our own mapping cannot fail");
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_zeroed_and_writable() {
        for len in [0, 1, 4095, 4096, 4097, 1 << 20, 2 << 20, 5 << 20] {
            let mut buf = AlignedBuf::new(len).unwrap();
            assert_eq!(buf.as_mut_ptr() as usize % BLOCK_BYTES, 0);
            assert!(buf.len() >= len.max(1) && buf.len().is_multiple_of(BLOCK_BYTES));
            assert!(buf.as_slice().iter().all(|&b| b == 0));
            buf.as_mut_slice().fill(0xab);
            assert!(buf.as_slice().iter().all(|&b| b == 0xab));
        }
    }
}
