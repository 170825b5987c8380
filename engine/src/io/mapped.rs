//! Read-only shared mappings of whole files: how the tier's memory is read without a system
//! call per record (a memory tier's extent files in a tmpfs, or shard files whose pages the page
//! cache holds, either one mapped by every process of the node); which of their pages are in
//! memory (`mincore`), reading pages in ahead (`MADV_POPULATE_READ`, `posix_fadvise`) and
//! letting them go; and the other file system calls the tier makes that std lacks (`flock`,
//! `fs_space`), and the process's limit on open files (`open_files_limit`), from which a reader
//! sizes how many files it keeps open across reads.
//!
//! Owns: `MappedFile`, `WritableMap` (a new private file's pages mapped shared and writable, which
//! the memory tier reads an extent into before it publishes the file), `advise` with `Advice`,
//! `flock`, `fs_space` and `open_files_limit`.
//!
//! Invariant: a `MappedFile` maps its file read-only and shared, whole, once; the engine never
//! truncates or writes a file while a `MappedFile` maps it (the memory tier publishes an extent
//! file complete, by link, and removes it only by unlink; a shard file is complete under its name
//! and only ever unlinked; either way the pages of existing mappings stay valid). A file another
//! program truncates under a mapping raises SIGBUS at the next touch past its new end: the page
//! cache tier touches only ranges `mincore` has just found in memory, which a truncation empties.
//! Never: maps a published file for writing (a `WritableMap` is a new file's, before it is
//! published), maps a file it was handed the length of (a `MappedFile`'s length is the file's own,
//! read with fstat on the descriptor that is mapped), or keeps the descriptor open (the mapping
//! holds the file; a tier of thousands of extents would otherwise run out of them).
#![allow(unsafe_code, reason = "mmap and munmap of the file's own mapping, and a slice over it")]

use std::os::fd::AsRawFd;
use std::path::Path;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A whole file mapped read-only and shared.
pub struct MappedFile {
    ptr: NonNull<u8>,
    len: usize,
    /// The file's inode number: tells this file from a later one under the same name.
    ino: u64,
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
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        let (len, ino) = (meta.len(), meta.ino());
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
        // The descriptor closes here; the mapping keeps the file (and its pages) alive.
        drop(file);
        Ok(Self { ptr, len, ino })
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

    /// The mapped file's inode number (a file under the same name with another one is another
    /// file).
    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// The pages of bytes `offset..offset + len` of the mapping (cut to it, widened to whole
    /// pages), as an address and a length `madvise` and `mincore` take; `None` for an empty range.
    fn pages(&self, offset: usize, len: usize) -> Option<(*mut libc::c_void, usize)> {
        let end = offset.saturating_add(len).min(self.len);
        if offset >= end {
            return None;
        }
        let start = offset - offset % PAGE_BYTES;
        let end = end.div_ceil(PAGE_BYTES) * PAGE_BYTES;
        // The mapping's base is page-aligned and its last page whole (mmap maps whole pages).
        Some((self.ptr.as_ptr().wrapping_add(start).cast(), end - start))
    }

    /// Bytes of `offset..offset + len` whose pages are in memory now (`mincore(2)`): a page the
    /// kernel holds for the file, whether or not this process touched it. A page the kernel
    /// drops later is read again from the file when touched (a fault, not an error).
    pub fn resident_bytes(&self, offset: usize, len: usize) -> u64 {
        self.count_resident(offset, len, false)
    }

    /// Whether every page of `offset..offset + len` is in memory now (see `resident_bytes`);
    /// stops at the first page that is not (its first and last pages are looked at first: a
    /// range not read in is told in two small calls).
    pub fn is_resident(&self, offset: usize, len: usize) -> bool {
        let Some((_, bytes)) = self.pages(offset, len) else { return false };
        self.ends_resident(offset, len) && self.count_resident(offset, len, true) == bytes as u64
    }

    /// Whether the first and the last page of `offset..offset + len` are in memory now (two
    /// one-page looks).
    pub fn ends_resident(&self, offset: usize, len: usize) -> bool {
        if self.pages(offset, len).is_none() {
            return false;
        }
        let last = offset.saturating_add(len).min(self.len) - 1;
        self.count_resident(offset, 1, true) > 0 && self.count_resident(last, 1, true) > 0
    }

    /// Bytes of the pages of `offset..offset + len` in memory; with `whole`, 0 as soon as one is
    /// not.
    fn count_resident(&self, offset: usize, len: usize, whole: bool) -> u64 {
        let Some((base, len)) = self.pages(offset, len) else { return 0 };
        let mut vec = [0u8; 512];
        let mut resident = 0;
        let mut done = 0;
        while done < len {
            let chunk = (len - done).min(vec.len() * PAGE_BYTES);
            // SAFETY: `base + done .. + chunk` lies within this mapping (`pages` cut it to it),
            // and `vec` has one byte for each of the chunk's pages.
            let rc = unsafe { libc::mincore(base.cast::<u8>().add(done).cast(), chunk, vec.as_mut_ptr()) };
            if rc != 0 {
                return if whole { 0 } else { resident };
            }
            let pages = chunk / PAGE_BYTES;
            let here = vec[..pages].iter().filter(|&&v| v & 1 == 1).count();
            if whole && here < pages {
                return 0;
            }
            resident += here as u64 * PAGE_BYTES as u64;
            done += chunk;
        }
        resident
    }

    /// Reads the pages of `offset..offset + len` into memory and enters them in this mapping
    /// (`MADV_POPULATE_READ`, Linux 5.14): returns once they are in, or with the read's error.
    pub fn populate(&self, offset: usize, len: usize) -> std::io::Result<()> {
        let Some((base, len)) = self.pages(offset, len) else { return Ok(()) };
        loop {
            // SAFETY: the range lies within this mapping; MADV_POPULATE_READ only faults its
            // pages in (read-only, as mapped) and changes no byte of it.
            let rc = unsafe { libc::madvise(base, len, libc::MADV_POPULATE_READ) };
            if rc == 0 {
                return Ok(());
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }

    /// Takes this mapping's page-table entries for `offset..offset + len` away
    /// (`MADV_DONTNEED` on a shared file mapping: the file's pages stay in the page cache; a
    /// later touch maps them again). What lets `advise(.., DONTNEED)` drop them.
    pub fn unmap_pages(&self, offset: usize, len: usize) {
        let Some((base, len)) = self.pages(offset, len) else { return };
        // SAFETY: the range lies within this mapping, which is read-only and shared: dropping
        // its entries loses no data (the file's pages stay), and slices over it stay valid (a
        // touch faults the page in again).
        unsafe {
            libc::madvise(base, len, libc::MADV_DONTNEED);
        }
    }
}

/// The bytes of a page (the tier's ranges are widened to whole pages).
const PAGE_BYTES: usize = 4096;

/// Advice to the kernel on how bytes of an open file will be read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Start reading them into the page cache now (`POSIX_FADV_WILLNEED`: asynchronous, in
    /// large reads).
    WillNeed,
    /// Drop their clean pages from the page cache (`POSIX_FADV_DONTNEED`; pages a process maps
    /// stay).
    DontNeed,
}

/// `posix_fadvise(2)` on bytes `offset..offset + len` of `file`.
pub fn advise(file: &std::fs::File, offset: u64, len: u64, advice: Advice) -> std::io::Result<()> {
    let to_off = |v: u64| {
        libc::off_t::try_from(v).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "offset too large"))
    };
    let advice = match advice {
        Advice::WillNeed => libc::POSIX_FADV_WILLNEED,
        Advice::DontNeed => libc::POSIX_FADV_DONTNEED,
    };
    // SAFETY: posix_fadvise takes a descriptor `file` keeps open for the call and integers; no
    // memory is shared with the kernel.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), to_off(offset)?, to_off(len)?, advice) };
    if rc == 0 { Ok(()) } else { Err(std::io::Error::from_raw_os_error(rc)) }
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
            // No sparse fallback: a write through the mapping to a page the file system then
            // cannot allocate would raise SIGBUS in the trainer instead of returning an error.
            return Err(Error::io("fallocate", path, std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh shared mapping of an open descriptor with no address hint touches no
        // existing memory; the result is checked against MAP_FAILED before use. fallocate just
        // allocated all `len` bytes of the file, so every mapped page is backed.
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
        // What makes a fill's reads go straight into it (`read_exact`'s O_DIRECT ops).
        debug_assert!((ptr.as_ptr() as usize).is_multiple_of(crate::shard::BLOCK_BYTES), "a mapping starts on a page");
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

/// The size of the file system holding `path` and the bytes still free on it for this user
/// (`statvfs(3)`): a tmpfs is bounded by its own size as well as by memory.
pub fn fs_space(path: &Path) -> std::io::Result<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a path with a NUL byte"))?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: statvfs reads the NUL-terminated path `c_path` keeps alive for the call and
    // writes one `statvfs` into `stat`, which is large enough for it.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it filled `stat` in.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::useless_conversion, reason = "the fields are narrower than u64 on 32-bit targets")]
    let unit = u64::from(stat.f_frsize);
    #[allow(clippy::useless_conversion, reason = "the fields are narrower than u64 on 32-bit targets")]
    let (blocks, free) = (u64::from(stat.f_blocks), u64::from(stat.f_bavail));
    Ok((blocks.saturating_mul(unit), free.saturating_mul(unit)))
}

/// The process's soft limit on open descriptors (`getrlimit(RLIMIT_NOFILE)`); `None` when it
/// cannot be read or is unlimited.
pub fn open_files_limit() -> Option<u64> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one `rlimit` into `limit`, which lives for the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    #[allow(clippy::useless_conversion, reason = "rlim_t is narrower than u64 on 32-bit targets")]
    let soft = u64::from(limit.rlim_cur);
    (rc == 0 && limit.rlim_cur != libc::RLIM_INFINITY).then_some(soft)
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
    fn the_open_files_limit_is_read() {
        let limit = open_files_limit().expect("a finite limit here");
        let open = std::fs::read_dir("/proc/self/fd").expect("fds").count() as u64;
        assert!(limit >= open, "{limit} descriptors allowed, {open} open");
    }

    #[test]
    fn maps_the_file_without_holding_a_descriptor_and_outlives_an_unlink() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let open_fds = || std::fs::read_dir("/proc/self/fd").expect("fds").count();
        let before = open_fds();
        let maps: Vec<(std::path::PathBuf, MappedFile)> = (0..64)
            .map(|i| {
                let path = dir.path().join(format!("x{i}"));
                std::fs::write(&path, format!("hello tier {i}")).expect("write");
                let mapped = MappedFile::open(&path).expect("map");
                (path, mapped)
            })
            .collect();
        // Other tests open files concurrently: a held descriptor per mapping would still show
        // as 64 more.
        assert!(open_fds() < before + 32, "no descriptor is held per mapping");
        for (i, (path, mapped)) in maps.iter().enumerate() {
            assert_eq!(mapped.as_slice(), format!("hello tier {i}").as_bytes());
            assert_eq!(mapped.ino(), std::fs::metadata(path).expect("stat").ino());
            std::fs::remove_file(path).expect("unlink");
            // The pages stay readable after the unlink.
            assert_eq!(mapped.as_slice(), format!("hello tier {i}").as_bytes());
        }
    }

    #[test]
    fn the_space_of_a_file_system_is_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (size, free) = fs_space(dir.path()).expect("statvfs");
        assert!(size > 0 && free <= size, "{free} of {size}");
        assert!(fs_space(&dir.path().join("nosuch")).is_err());
    }

    #[test]
    fn residency_is_seen_populated_and_given_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 64 << 10]).expect("write");
        let file = std::fs::File::open(&path).expect("open");
        let mapped = MappedFile::open_lazy(&path).expect("map");
        mapped.populate(0, 64 << 10).expect("populate");
        assert!(mapped.is_resident(4096, 8192), "populated pages are in memory");
        assert!(mapped.ends_resident(0, 64 << 10));
        assert_eq!(mapped.resident_bytes(0, 64 << 10), 64 << 10);
        // Ranges are cut to the mapping and widened to whole pages.
        assert_eq!(mapped.resident_bytes(100, 10), 4096);
        assert_eq!(mapped.resident_bytes(1 << 20, 10), 0);
        assert!(!mapped.is_resident(1 << 20, 10), "nothing past the end");
        mapped.unmap_pages(0, 64 << 10);
        // A written file's pages may be dirty (not droppable yet): write them back first.
        file.sync_all().expect("fsync");
        advise(&file, 0, 64 << 10, Advice::DontNeed).expect("fadvise");
        assert!(mapped.resident_bytes(0, 64 << 10) < 64 << 10, "dropped pages leave the page cache");
        assert_eq!(mapped.as_slice()[5000], 7, "a dropped page is read again when touched");
        advise(&file, 0, 64 << 10, Advice::WillNeed).expect("fadvise");
    }

    #[test]
    fn refuses_an_empty_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("empty");
        std::fs::write(&path, b"").expect("write");
        assert!(MappedFile::open(&path).is_err());
    }
}
