//! Read-only shared mappings of whole files: how the memory tier's extents (files in a tmpfs
//! that every process of the node maps) are read without a system call per record.
//!
//! Invariant: a `MappedFile` maps its file read-only and shared, whole, once; the file is never
//! truncated or written while mapped (the memory tier publishes an extent file complete, by
//! rename, and removes it only by unlink, which keeps the pages of existing mappings valid).
//! Never: maps for writing, or maps a file it was handed the length of (the length is the
//! file's own, read with fstat on the descriptor that is mapped).
#![allow(unsafe_code, reason = "mmap and munmap of the file's own mapping, and a slice over it")]

use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A whole file mapped read-only and shared.
pub struct MappedFile {
    ptr: NonNull<u8>,
    len: usize,
    /// Kept open so that `is_unlinked` can ask the kernel about this very file.
    file: std::fs::File,
}

// SAFETY: the mapping is read-only and owned by this value alone; moving it to another thread
// moves that ownership, like a `Box<[u8]>`.
unsafe impl Send for MappedFile {}

// SAFETY: through a shared reference the mapping can only be read, like a `&[u8]`.
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// Maps `file` (opened for reading), whole, every page entered now. An empty file is
    /// refused: there is nothing to map.
    pub fn new(file: std::fs::File, path: &Path) -> Result<Self> {
        Self::map(file, path, libc::MAP_POPULATE)
    }

    /// Opens and maps the file at `path`, pages entered as they are first touched (what
    /// `np.memmap` does: for a file on disk, populating would read all of it first).
    pub fn open_lazy(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
        Self::map(file, path, 0)
    }

    fn map(file: std::fs::File, path: &Path, populate: libc::c_int) -> Result<Self> {
        let len = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
        let len = usize::try_from(len).map_err(|_| Error::invalid_input("a file larger than memory"))?;
        if len == 0 {
            return Err(Error::invalid_input(format!("{} is empty: nothing to map", path.display())));
        }
        // MAP_POPULATE maps every page now, in one pass: a reader then takes no page fault per
        // 64 KiB of the extent (measured: faults were 40% of a warm reader's time without it).
        // SAFETY: a fresh read-only shared mapping of an open descriptor with no address hint
        // touches no existing memory; the result is checked against MAP_FAILED before use.
        let base = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED | populate, file.as_raw_fd(), 0)
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io("mmap", path, std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(base.cast::<u8>()).ok_or_else(|| Error::invalid_input("mmap returned null"))?;
        Ok(Self { ptr, len, file })
    }

    /// Opens and maps the file at `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
        Self::new(file, path)
    }

    /// The file's bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives (munmap runs only
        // in drop), and the module's invariant keeps the file from shrinking under the mapping.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never: empty files are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the file has been removed from its directory since it was mapped (its pages stay
    /// valid for this mapping, but no other process will find it any more).
    pub fn is_unlinked(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map(|m| m.nlink() == 0).unwrap_or(true)
    }
}

/// A new file's bytes mapped shared and writable: the memory tier reads an extent from disk
/// straight into it (O_DIRECT into the file's own pages, no copy), checks it, then publishes the
/// file. Writes through it are the file's contents.
pub struct WritableMap {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone; moving it moves that ownership.
unsafe impl Send for WritableMap {}

impl WritableMap {
    /// Sizes `file` (opened read-write, empty, this process's own) to `len` bytes, its pages
    /// allocated in one call, and maps them all.
    pub fn new(file: &std::fs::File, len: usize, path: &Path) -> Result<Self> {
        if len == 0 {
            return Err(Error::invalid_input("nothing to map: 0 bytes"));
        }
        let len_off = libc::off_t::try_from(len).map_err(|_| Error::invalid_input("a mapping larger than a file"))?;
        // Measured on tmpfs: allocating the pages in one fallocate and entering them with
        // MAP_POPULATE costs a third of what a read into a bare mapping does, where the kernel
        // faults every page in on its own.
        // SAFETY: fallocate takes a descriptor that `file` keeps open and plain integers.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len_off) };
        if rc != 0 {
            let error = std::io::Error::last_os_error();
            // A file system without fallocate gets a sparse file instead.
            if error.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(Error::io("fallocate", path, error));
            }
            file.set_len(len as u64).map_err(|e| Error::io("truncate", path, e))?;
        }
        // SAFETY: a fresh shared mapping of an open descriptor with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED before use. The file was
        // just sized to `len`, so every mapped page is backed.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(Error::io("mmap", path, std::io::Error::last_os_error()));
        }
        let ptr = NonNull::new(base.cast::<u8>()).ok_or_else(|| Error::invalid_input("mmap returned null"))?;
        Ok(Self { ptr, len })
    }

    /// The bytes, page-aligned (what O_DIRECT reads into).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` maps `len` writable bytes until drop; `&mut self` makes this the only
        // slice over them for its lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for WritableMap {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` with this address and length and is unmapped
        // only here; slices from `as_mut_slice` borrow `self` and cannot outlive it.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// `flock(2)` on `file`: `operation` is `LOCK_SH`, `LOCK_EX` or `LOCK_UN`, with `LOCK_NB` for
/// "fail instead of waiting". Retried on EINTR. The lock belongs to the open file description
/// and goes away when the last descriptor of it closes, also when the process dies.
pub fn flock(file: &std::fs::File, operation: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock takes a descriptor that `file` keeps open for the call and an integer;
        // no memory is shared with the kernel.
        let rc = unsafe { libc::flock(file.as_raw_fd(), operation) };
        if rc == 0 {
            return Ok(());
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `new` with this address and length and is unmapped
        // only here; the slices `as_slice` handed out borrow `self`, so none outlives it.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

impl std::fmt::Debug for MappedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedFile").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_the_file_and_sees_an_unlink() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("x");
        std::fs::write(&path, b"hello tier").expect("write");
        let mapped = MappedFile::open(&path).expect("map");
        assert_eq!(mapped.as_slice(), b"hello tier");
        assert!(!mapped.is_unlinked());
        std::fs::remove_file(&path).expect("unlink");
        assert!(mapped.is_unlinked());
        // The pages stay readable after the unlink.
        assert_eq!(mapped.as_slice(), b"hello tier");
    }

    #[test]
    fn refuses_an_empty_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty");
        std::fs::write(&path, b"").expect("write");
        assert!(MappedFile::open(&path).is_err());
    }
}
