//! Reading blocks from shard files: one `Io` trait, an io_uring backend, a pread backend, a
//! fault-injecting wrapper, and the bare reader that benchmarks measure the engine against.
//!
//! Owns: the `Io` trait and what a backend and its stream exchange (`ReadOp`, `Next`, `Dest`,
//! `FileId`, `FileOpener`, `ReadStream`, `OwnedMemory`), `IoConfig` and `Backend` (`build` makes
//! io_uring where the kernel allows it, pread otherwise), the limits `QUEUE_DEPTH_MAX` and
//! `OP_BYTES_MAX_LIMIT`, and `start_writeback`; beside them `exact.rs` (`read_exact`: one range
//! read whole through any backend, as the memory tier's fills read).
//!
//! The unit of work is a `ReadOp`: a block-aligned range of an opened file. A backend pulls ops
//! from a `ReadStream` whenever it has a free buffer slot, keeps as many in flight as its queue
//! depth allows, and hands each op's bytes back to the stream as soon as that op completes, while
//! the others are still in flight, so planning, checking and copying overlap the disk. The bytes
//! live in the backend's own buffers (for io_uring: page-aligned memory registered with the ring as
//! fixed buffers) and are valid only during the callback, or, for an op the stream issues as
//! `Next::Into`, in the stream's own memory (a batch's staging buffer, or the reader's scratch
//! memory that a verify worker copies from), read there by DMA. A stream that checks bytes on other
//! threads says `Wait` while they work and is asked to block (`ReadStream::idle`) when nothing is
//! in flight. Invariants: every op is block-aligned (O_DIRECT-legal) and no longer than
//! `op_bytes_max`; a backend never returns from `read_stream` with an op still in flight, also when
//! the stream fails, unless the ring itself breaks (then it refuses further reads and leaks its
//! buffers rather than unmap memory the kernel may still write); short reads, EINTR, EAGAIN and
//! ECANCELED are retried, EIO and end-of-file are errors naming the file and offset. Never:
//! allocates per op on the hot path, or interprets the bytes (the `read` module checks them).

mod aligned;
mod checked_copy;
pub mod bare;
mod exact;
mod fault;
// Only the metrics endpoint's sockets need it.
#[cfg(feature = "metrics-http")]
mod fork;
mod lazy;
mod mapped;
mod pread;
#[cfg(target_os = "linux")]
mod uring;
mod watch;

use std::path::{Path, PathBuf};

pub use aligned::AlignedBuf;
pub use checked_copy::copy_crc32c;
pub use exact::read_exact;
pub use fault::{Fault, FaultIo};
#[cfg(feature = "metrics-http")]
pub(crate) use fork::close_in_forked_child;
pub use lazy::{BuildIo, LazyIo};
pub use mapped::{Advice, MappedFile, WritableMap, advise, flock, fs_space, open_files_limit};
pub use pread::PreadIo;
#[cfg(target_os = "linux")]
pub use uring::UringIo;
pub use watch::{Changes, DirWatch};

use crate::error::{Error, Result};
use crate::shard::BLOCK_BYTES;

/// Largest queue depth a backend accepts.
pub const QUEUE_DEPTH_MAX: u32 = 4096;
/// Largest single op: 64 MiB.
pub const OP_BYTES_MAX_LIMIT: usize = 64 << 20;

/// An open file of a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FileId(pub u32);

/// One read: `len` bytes at `offset` of `file`, both multiples of the block size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOp {
    /// The file, as returned by [`Io::open`] or a [`FileOpener`].
    pub file: FileId,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read.
    pub len: u32,
}

/// What a stream has to issue next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// This op, into the backend's own memory: its bytes go to [`ReadStream::complete`].
    Op(ReadOp),
    /// This op, straight into the stream's memory at `Dest` (no copy): the backend tells
    /// [`ReadStream::complete_into`] when the bytes are there.
    Into(ReadOp, Dest),
    /// Nothing until some op in flight completes (its buffer is needed first).
    Wait,
    /// Nothing more, ever.
    Done,
}

/// Where an op of [`Next::Into`] puts its bytes: memory of the stream's own, aligned as
/// O_DIRECT needs it (to the block size), that only the read writes while the op is in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dest(std::ptr::NonNull<u8>);

impl Dest {
    /// The destination at `ptr`.
    ///
    /// # Safety
    ///
    /// `ptr` is aligned to the block size and the op's `len` bytes from it are writable memory
    /// that stays valid, and that nothing else reads or writes, from the moment the op is
    /// handed to a backend until [`ReadStream::complete_into`] for it has returned, or
    /// `read_stream` has returned, whichever is first. (The stream itself may read the bytes
    /// during `complete_into`, through the slice it is given.)
    #[allow(unsafe_code, reason = "the caller promises memory the kernel may write into")]
    pub unsafe fn new(ptr: std::ptr::NonNull<u8>) -> Self {
        Self(ptr)
    }

    /// The destination's start.
    pub fn as_ptr(self) -> *mut u8 {
        self.0.as_ptr()
    }
}

// SAFETY: a `Dest` is an address the stream promised (`Dest::new`); it is only dereferenced by
// the backend the stream handed it to, on the thread that runs `read_stream`.
#[allow(unsafe_code, reason = "a Dest travels with its op")]
unsafe impl Send for Dest {}

/// Opens files for a stream while the backend is reading (the backend owns the descriptors).
pub trait FileOpener {
    /// Opens `path` for reading through the backend.
    fn open(&mut self, path: &Path) -> Result<FileId>;

    /// Closes a file this stream opened that no op in flight reads; its `FileId` is not used
    /// again until the backend's `close_all`.
    fn close(&mut self, file: FileId) -> Result<()>;
}

/// A backend's files between two streams (nothing in flight), as a stream's `FileOpener`.
pub struct BackendFiles<'a>(pub &'a mut dyn Io);

impl FileOpener for BackendFiles<'_> {
    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.0.open(path)
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        self.0.close(file)
    }
}

/// A source of ops and a sink of their bytes, pulled by a backend: ops are asked for only when a
/// buffer slot is free, so a stream can plan its next batch while the disk reads the current one.
pub trait ReadStream {
    /// The next op to issue.
    fn next_op(&mut self, files: &mut dyn FileOpener) -> Result<Next>;

    /// Op number `seq` (in issue order, from 0 in each `read_stream` call) has completed; its
    /// bytes are valid during this call only.
    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()>;

    /// Op number `seq`, issued as [`Next::Into`], has completed: `bytes` is its destination,
    /// now holding what was read (a wrapper may still change them, as a fault injector does).
    fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
        let _ = bytes;
        Err(Error::invalid_input(format!("op {seq} completed into memory this stream never gave")))
    }

    /// Nothing is in flight and the stream said [`Next::Wait`]: blocks until it can go on (work
    /// of its own finishes, such as checks on other threads) and returns true, or returns false
    /// when nothing will change (the backend then reports a stall).
    fn idle(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// Memory a backend may hand to the kernel for its reads (its slots): a page-aligned region that
/// the value owns alone. Implemented by [`AlignedBuf`] and by staging leases.
///
/// # Safety
///
/// `as_ptr()` and `len()` describe the same page-aligned, initialised, writable region on every
/// call, valid until the value is dropped (it does not move when the value moves), and nothing
/// outside the value reads or writes it while the value lives.
#[allow(unsafe_code, reason = "implementors promise memory the kernel may write into")]
pub unsafe trait OwnedMemory: Send {
    /// The region's start.
    fn as_ptr(&self) -> *mut u8;
    /// The region's length.
    fn len(&self) -> usize;
    /// Whether the region is empty (never, for a usable one).
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// SAFETY: an `AlignedBuf` is its own page-aligned mapping, owned alone, unmapped only on drop.
#[allow(unsafe_code, reason = "an AlignedBuf is such memory")]
unsafe impl OwnedMemory for AlignedBuf {
    fn as_ptr(&self) -> *mut u8 {
        self.base_ptr()
    }

    fn len(&self) -> usize {
        AlignedBuf::len(self)
    }
}

/// Called once per op with its index in the slice and its bytes, in completion order.
pub type OnRead<'a> = dyn FnMut(usize, &[u8]) -> Result<()> + 'a;

/// A block reader. A backend reads [`Next::Into`] ops straight into the stream's memory: with
/// io_uring, O_DIRECT DMA into it.
pub trait Io: Send {
    /// The backend's name, for reports.
    fn name(&self) -> &'static str;

    /// Ops kept in flight at once, at the longest op size: the backend keeps
    /// `queue_depth * op_bytes_max` bytes in flight (more, shorter, ops when they are short).
    fn queue_depth(&self) -> usize;

    /// The longest op accepted.
    fn op_bytes_max(&self) -> usize;

    /// Opens a file for reading.
    fn open(&mut self, path: &Path) -> Result<FileId>;

    /// Reads the stream's ops until it is done, keeping up to `queue_depth` in flight. Stops
    /// issuing at the first error (its own or the stream's), waits for the ops in flight, and
    /// returns it. A stream that waits while nothing is in flight is an error, not a hang.
    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()>;

    /// Closes every open file (never called with an op in flight); the next `open` starts
    /// again from the first `FileId`. A reader calls this after a failed read, and after 1024
    /// opens (files otherwise stay open from read to read).
    fn close_all(&mut self) -> Result<()>;

    /// Closes one open file (never called with an op in flight); its `FileId` is not used
    /// again until `close_all`. A reader calls this for a file replaced by a repair and for
    /// files removed or replaced since it opened them (cache entries evicted by another reader,
    /// quarantined shards), keeping the rest open.
    fn close(&mut self, file: FileId) -> Result<()>;

    /// Reads every op of a slice, calling `on_done` with each op's index as it completes.
    fn read(&mut self, ops: &[ReadOp], on_done: &mut OnRead<'_>) -> Result<()> {
        self.read_stream(&mut SliceStream { ops, next: 0, on_done })
    }
}

/// The stream of a slice of ops.
struct SliceStream<'a, 'b> {
    ops: &'a [ReadOp],
    next: usize,
    on_done: &'a mut OnRead<'b>,
}

impl ReadStream for SliceStream<'_, '_> {
    fn next_op(&mut self, _: &mut dyn FileOpener) -> Result<Next> {
        let next = self.ops.get(self.next).map_or(Next::Done, |op| Next::Op(*op));
        self.next += 1;
        Ok(next)
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
        (self.on_done)(usize::try_from(seq).expect("seq counts the slice's ops"), bytes)
    }
}

/// The error of a stream that asks the backend to wait while nothing is in flight.
/// An op on a file closed by `Io::close`: a caller's mistake, reported as such.
fn closed(path: &Path) -> Error {
    Error::io("read", path, std::io::Error::other("the file was closed (Io::close) before this op"))
}

fn stalled() -> Error {
    Error::invalid_input("the read stream waited with no read in flight (a planning bug)")
}

/// Which backend to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backend {
    /// io_uring where the kernel allows it, pread otherwise.
    #[default]
    Auto,
    /// io_uring, or an error.
    Uring,
    /// Positioned reads, one at a time: portable, and the oracle the others are tested against.
    Pread,
}

/// How to build a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IoConfig {
    /// Which backend.
    pub backend: Backend,
    /// Ops in flight at once (io_uring).
    pub queue_depth: u32,
    /// The longest op, a multiple of the block size; larger extents are split.
    pub op_bytes_max: usize,
    /// Open files with O_DIRECT (io_uring), bypassing the page cache.
    pub direct: bool,
}

impl Default for IoConfig {
    fn default() -> Self {
        Self { backend: Backend::Auto, queue_depth: 32, op_bytes_max: 1 << 20, direct: true }
    }
}

impl IoConfig {
    /// Checks the numbers.
    pub fn validate(&self) -> Result<()> {
        if self.queue_depth == 0 || self.queue_depth > QUEUE_DEPTH_MAX {
            return Err(Error::invalid_input(format!(
                "queue depth {} is not in 1..={QUEUE_DEPTH_MAX}",
                self.queue_depth
            )));
        }
        if self.op_bytes_max == 0
            || !self.op_bytes_max.is_multiple_of(BLOCK_BYTES)
            || self.op_bytes_max > OP_BYTES_MAX_LIMIT
        {
            return Err(Error::invalid_input(format!(
                "op size {} is not a multiple of {BLOCK_BYTES} in 1..={OP_BYTES_MAX_LIMIT}",
                self.op_bytes_max
            )));
        }
        Ok(())
    }

    /// Builds the backend.
    pub fn build(&self) -> Result<Box<dyn Io>> {
        self.validate()?;
        match self.backend {
            Backend::Pread => Ok(Box::new(PreadIo::new(self.op_bytes_max)?)),
            #[cfg(target_os = "linux")]
            Backend::Uring => Ok(Box::new(UringIo::new(self)?)),
            #[cfg(target_os = "linux")]
            Backend::Auto => match UringIo::new(self) {
                Ok(uring) => Ok(Box::new(uring)),
                Err(_) => Ok(Box::new(PreadIo::new(self.op_bytes_max)?)),
            },
            #[cfg(not(target_os = "linux"))]
            Backend::Uring => Err(Error::invalid_input("io_uring exists only on Linux")),
            #[cfg(not(target_os = "linux"))]
            Backend::Auto => Ok(Box::new(PreadIo::new(self.op_bytes_max)?)),
        }
    }
}

/// Checks an op against a backend's limits before it is issued.
fn check_op(op: &ReadOp, op_bytes_max: usize, n_files: usize) -> Result<()> {
    let aligned = op.offset.is_multiple_of(BLOCK_BYTES as u64) && (op.len as usize).is_multiple_of(BLOCK_BYTES);
    if !aligned || op.len == 0 || op.len as usize > op_bytes_max || op.file.0 as usize >= n_files {
        return Err(Error::invalid_input(format!(
            "read op {op:?} is not block-aligned, empty, over {op_bytes_max} bytes or of an unknown file"
        )));
    }
    Ok(())
}

/// The error of a failed read, naming the file and offset.
fn read_error(path: &Path, op: &ReadOp, source: std::io::Error) -> Error {
    let mut named = PathBuf::from(path);
    named.as_mut_os_string().push(format!(" at offset {} (+{} bytes)", op.offset, op.len));
    Error::io("read", named, source)
}

/// Asks the kernel to start writing `len` bytes of `file` from `offset` back to the disk, and
/// returns without waiting: a writer that calls this as it goes leaves little for its final
/// fsync, so the flush overlaps the work that produced the bytes. Durability still comes only
/// from fsync. A no-op where the call does not exist.
pub fn start_writeback(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        };
        #[allow(unsafe_code, reason = "sync_file_range has no safe wrapper in std")]
        // SAFETY: the descriptor is open for as long as `file` is borrowed, and the call only
        // reads its integer arguments; it touches no memory of this process.
        let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, SeekFrom, Write};

    use super::start_writeback;

    #[test]
    fn writeback_is_a_hint_that_changes_no_byte_and_refuses_offsets_past_the_range() {
        let mut file = tempfile::tempfile().expect("a temp file");
        let bytes: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
        file.write_all(&bytes).expect("written");
        start_writeback(&file, 0, 1 << 20).expect("writeback of a written range");
        // Past the end, and the rest of the file: both accepted (the kernel writes what is there).
        start_writeback(&file, 1 << 20, 8 << 20).expect("writeback past the end");
        file.sync_all().expect("synced");
        let mut back = Vec::new();
        file.seek(SeekFrom::Start(0)).expect("seek");
        file.read_to_end(&mut back).expect("read back");
        assert!(back == bytes, "writeback changed the file");
        #[cfg(target_os = "linux")]
        {
            let error = start_writeback(&file, u64::MAX, 1).expect_err("an offset past i64");
            assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
        }
    }
}
