//! The io_uring backend: O_DIRECT reads into registered (fixed) buffers, batched submission.
//!
//! The backend owns `2 * queue_depth` buffer slots of `op_bytes_max` bytes each, carved from one
//! page-aligned mapping (or handed in by the caller, such as page-locked staging buffers that a GPU
//! copy engine reads) and registered with the ring once, and registers each opened file in a
//! sparse fixed-file table. `read_stream` keeps up to `queue_depth` ops in flight, one per slot.
//! Finished ops queue up; before each one's bytes go to the stream (which checks and copies them)
//! the backend collects new completions and refills the queue from the spare slots, so the disk
//! never waits on the callbacks. Invariant
//! (what the SAFETY comments rest on): a slot is written by the kernel only while its op is in
//! flight, Rust code reads a slot only after its op completed and before the slot is reused, and
//! no op is in flight when `read` returns or the backend is dropped (an op still in flight after
//! a ring failure leaks the mapping rather than free memory the kernel may still write).
#![allow(unsafe_code, reason = "io_uring submission hands the kernel raw pointers into the backend's own buffers")]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use io_uring::{IoUring, opcode, squeue, types};

use super::{
    AlignedBuf, FileId, FileOpener, Io, IoConfig, Next, OwnedMemory, ReadOp, ReadStream, check_op, read_error, stalled,
};
use crate::error::{Error, Result};

/// Fixed-file table size; files past it are read through their plain descriptor.
const FIXED_FILES_MAX: u32 = 4096;
/// Retries of EAGAIN, EINTR or ECANCELED on one op before it fails.
const RETRIES_MAX: u32 = 16;

/// What to do with a completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Completion {
    /// The op has all its bytes.
    Done,
    /// `n` more bytes arrived; read the rest.
    Partial(u32),
    /// A transient failure: issue the same read again.
    Retry,
    /// End of file before the op's end.
    Eof,
    /// A failure to report, with its errno.
    Failed(i32),
}

/// Classifies a completion's result for an op with `remaining` bytes still wanted and `retries`
/// retries so far. Pure, so every branch is unit-tested without a misbehaving disk.
pub(crate) fn classify(result: i32, remaining: u32, retries: u32) -> Completion {
    if result < 0 {
        let errno = -result;
        let transient = matches!(errno, libc::EAGAIN | libc::EINTR | libc::ECANCELED);
        return if transient && retries < RETRIES_MAX { Completion::Retry } else { Completion::Failed(errno) };
    }
    match result.unsigned_abs() {
        0 => Completion::Eof,
        n if n >= remaining => Completion::Done,
        n => Completion::Partial(n),
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    seq: u64,
    file: u32,
    offset: u64,
    len: u32,
    done: u32,
    retries: u32,
}

struct OpenFile {
    /// `None` once closed by `Io::close`.
    file: Option<File>,
    path: PathBuf,
    fixed: Option<u32>,
}

/// The open files and how they are opened; a `FileOpener` together with the ring.
struct Files {
    open: Vec<OpenFile>,
    fixed_files: u32,
    direct: bool,
}

impl Files {
    fn open(&mut self, ring: &IoUring, path: &Path) -> Result<FileId> {
        let id = FileId(u32::try_from(self.open.len()).map_err(|_| Error::invalid_input("too many open files"))?);
        let mut options = OpenOptions::new();
        options.read(true);
        if self.direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = match options.open(path) {
            // Some filesystems (tmpfs) refuse O_DIRECT: read through the page cache instead.
            Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => File::open(path),
            other => other,
        }
        .map_err(|e| Error::io("open", path, e))?;
        let fixed = (id.0 < self.fixed_files)
            .then(|| ring.submitter().register_files_update(id.0, &[file.as_raw_fd()]).ok())
            .flatten()
            .map(|_| id.0);
        self.open.push(OpenFile { file: Some(file), path: path.to_owned(), fixed });
        Ok(id)
    }
}

struct Opener<'a> {
    files: &'a mut Files,
    ring: &'a IoUring,
}

impl FileOpener for Opener<'_> {
    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.files.open(self.ring, path)
    }
}

/// Reads through io_uring.
pub struct UringIo {
    // What keeps the buffers valid for the kernel is `drain` (no op outlives `read_stream` or
    // `Drop` unless the ring broke, and then the buffers are leaked); the ring is declared first
    // only so that its registrations go before the memory they name.
    ring: IoUring,
    /// The slots' memory: one region per slot, or one region carved into all of them.
    memory: Option<Vec<Box<dyn OwnedMemory>>>,
    queue_depth: usize,
    op_bytes_max: usize,
    fixed_buffers: bool,
    files: Files,
    slots: Vec<Slot>,
    free_slots: Vec<usize>,
    in_flight: usize,
    /// Ops queued in the submission ring but not yet handed to the kernel.
    unsubmitted: usize,
    completions: Vec<(u64, i32)>,
    /// Finished ops whose callbacks are due, oldest first: (slot, verdict).
    ready: std::collections::VecDeque<(usize, Completion)>,
}

impl UringIo {
    /// A ring of `config.queue_depth` entries with its buffers registered.
    pub fn new(config: &IoConfig) -> Result<Self> {
        config.validate()?;
        let n_slots = 2 * config.queue_depth as usize;
        let arena = AlignedBuf::new(n_slots * config.op_bytes_max)?;
        Self::build(config, vec![Box::new(arena)])
    }

    /// A ring whose slots are `slots` (at least `2 * queue_depth` regions of at least
    /// `op_bytes_max` bytes each), registered as its fixed buffers: the disk's DMA lands in them.
    pub fn with_slots(config: &IoConfig, slots: Vec<Box<dyn OwnedMemory>>) -> Result<Self> {
        config.validate()?;
        let n_slots = 2 * config.queue_depth as usize;
        if slots.len() < n_slots || slots.iter().any(|slot| slot.len() < config.op_bytes_max) {
            return Err(Error::invalid_input(format!(
                "io_uring needs {n_slots} slot buffers of {} bytes, was given {}",
                config.op_bytes_max,
                slots.len()
            )));
        }
        Self::build(config, slots)
    }

    fn build(config: &IoConfig, memory: Vec<Box<dyn OwnedMemory>>) -> Result<Self> {
        let queue_depth = config.queue_depth as usize;
        let ring = IoUring::new(config.queue_depth).map_err(|e| Error::io("io_uring_setup", "io_uring", e))?;
        let n_slots = 2 * queue_depth;
        let iovecs: Vec<libc::iovec> = (0..n_slots)
            .map(|slot| libc::iovec {
                iov_base: slot_start(&memory, slot, config.op_bytes_max).cast(),
                iov_len: config.op_bytes_max,
            })
            .collect();
        // SAFETY: every iovec lies inside `memory` (`slot_start`), which this backend owns and
        // keeps valid until the ring is closed (field order, and `Drop` waits for ops in flight).
        let fixed_buffers = unsafe { ring.submitter().register_buffers(&iovecs) }.is_ok();
        let fixed_files =
            if ring.submitter().register_files_sparse(FIXED_FILES_MAX).is_ok() { FIXED_FILES_MAX } else { 0 };
        Ok(Self {
            ring,
            memory: Some(memory),
            queue_depth,
            op_bytes_max: config.op_bytes_max,
            fixed_buffers,
            files: Files { open: Vec::new(), fixed_files, direct: config.direct },
            slots: vec![Slot::default(); n_slots],
            free_slots: (0..n_slots).rev().collect(),
            in_flight: 0,
            unsubmitted: 0,
            completions: Vec::with_capacity(queue_depth),
            ready: std::collections::VecDeque::with_capacity(2 * queue_depth),
        })
    }

    /// Whether the slots are registered fixed buffers (false when the kernel refused, for
    /// example over RLIMIT_MEMLOCK; reads then use plain buffers).
    pub fn fixed_buffers(&self) -> bool {
        self.fixed_buffers
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        slot_start(self.memory.as_ref().expect("the memory lives until drop"), slot, self.op_bytes_max)
    }

    /// Queues the unread rest of `slot`'s op.
    fn push(&mut self, slot: usize) -> Result<()> {
        let s = self.slots[slot];
        // SAFETY: `done < len <= op_bytes_max`, so the target stays inside the slot.
        let target = unsafe { self.slot_ptr(slot).add(s.done as usize) };
        let (len, offset) = (s.len - s.done, s.offset + u64::from(s.done));
        let open = &self.files.open[s.file as usize];
        let Some(file) = open.file.as_ref() else { return Err(super::closed(&open.path)) };
        let entry = match (open.fixed, self.fixed_buffers) {
            (Some(fixed), true) => {
                opcode::ReadFixed::new(types::Fixed(fixed), target, len, slot as u16).offset(offset).build()
            }
            (None, true) => {
                opcode::ReadFixed::new(types::Fd(file.as_raw_fd()), target, len, slot as u16).offset(offset).build()
            }
            (Some(fixed), false) => opcode::Read::new(types::Fixed(fixed), target, len).offset(offset).build(),
            (None, false) => opcode::Read::new(types::Fd(file.as_raw_fd()), target, len).offset(offset).build(),
        };
        let entry: squeue::Entry = entry.user_data(slot as u64);
        // The submission queue has `queue_depth` entries and each op in flight holds at most one,
        // so it has room; a full queue is submitted first all the same.
        loop {
            // SAFETY: the entry points into slot `slot`, which no other op targets (a slot is on
            // the free list or owned by exactly one op) and which stays mapped until the op
            // completes (no op outlives `read` or the backend).
            let pushed = unsafe { self.ring.submission().push(&entry) };
            if pushed.is_ok() {
                self.unsubmitted += 1;
                return Ok(());
            }
            self.ring.submit().map_err(|e| Error::io("io_uring_enter", "io_uring", e))?;
            self.unsubmitted = 0;
        }
    }

    /// Submits what is queued and waits for at least one completion, retrying EINTR and EBUSY.
    fn submit_and_wait(&mut self) -> Result<()> {
        self.unsubmitted = 0;
        match self.ring.submit_and_wait(1) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)) => Ok(()),
            Err(e) => Err(Error::io("io_uring_enter", "io_uring", e)),
        }
    }

    /// Waits for every op in flight, discarding results. Returns false if the ring failed.
    fn drain(&mut self) -> bool {
        // Ops whose callbacks never ran (an earlier callback panicked) are discarded.
        for (slot, _) in self.ready.drain(..) {
            self.free_slots.push(slot);
        }
        while self.in_flight > 0 {
            if self.submit_and_wait().is_err() {
                return false;
            }
            for cqe in self.ring.completion() {
                self.free_slots.push(cqe.user_data() as usize);
                self.in_flight -= 1;
            }
        }
        true
    }
}

impl Io for UringIo {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn queue_depth(&self) -> usize {
        self.queue_depth
    }

    fn op_bytes_max(&self) -> usize {
        self.op_bytes_max
    }

    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.files.open(&self.ring, path)
    }

    fn close_all(&mut self) -> Result<()> {
        if !self.drain() {
            return Err(Error::io("io_uring_enter", "io_uring", std::io::Error::other("ring failed")));
        }
        // File `i` may hold fixed-file slot `i` (slots below the table's size, in open order):
        // empty every slot an open file could have taken, registered or not.
        let n_slots = self.files.open.len().min(self.files.fixed_files as usize);
        if n_slots > 0 {
            let empty = vec![-1; n_slots];
            self.ring
                .submitter()
                .register_files_update(0, &empty)
                .map_err(|e| Error::io("io_uring_register", "io_uring", e))?;
        }
        self.files.open.clear();
        Ok(())
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        if !self.drain() {
            return Err(Error::io("io_uring_enter", "io_uring", std::io::Error::other("ring failed")));
        }
        let Some(open) = self.files.open.get_mut(file.0 as usize) else { return Ok(()) };
        if let Some(slot) = open.fixed.take() {
            self.ring
                .submitter()
                .register_files_update(slot, &[-1])
                .map_err(|e| Error::io("io_uring_register", "io_uring", e))?;
        }
        open.file = None;
        Ok(())
    }

    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
        if !self.drain() {
            return Err(Error::io("io_uring_enter", "io_uring", std::io::Error::other("ring failed")));
        }
        let mut issue = Issue { seq: 0, done: false, failure: None };
        loop {
            // Between two callbacks: collect what completed and refill from the spare slots, so
            // the disk stays busy however long the callbacks (checks, copies) take.
            self.reap(&mut issue);
            self.fill(stream, &mut issue);
            if let Some((slot, verdict)) = self.ready.pop_front() {
                // The slot goes back on the free list before its bytes are handed out: only
                // `fill` reuses free slots, and it runs after the callback returns. A callback
                // that panics (or a failed submit) therefore loses no slot.
                self.free_slots.push(slot);
                // Submitting costs a system call: batch new ops until the kernel holds less than
                // half the queue (the wait below submits whatever is left, so a transient refusal
                // here only delays them).
                if self.unsubmitted > 0 && self.in_flight - self.unsubmitted < self.queue_depth.div_ceil(2) {
                    match self.ring.submit() {
                        Ok(_) => self.unsubmitted = 0,
                        Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)) => {}
                        Err(e) => {
                            issue.failure.get_or_insert(Error::io("io_uring_enter", "io_uring", e));
                        }
                    }
                }
                if issue.failure.is_none()
                    && let Err(e) = self.finish(slot, verdict, stream)
                {
                    issue.failure = Some(e);
                }
                continue;
            }
            if self.in_flight == 0 {
                if !issue.done && issue.failure.is_none() {
                    issue.failure = Some(stalled());
                }
                break;
            }
            // Only a broken ring fails here, with ops possibly in flight: the backend then
            // refuses further reads (its drain fails) and `Drop` leaks the buffers rather than
            // unmap memory the kernel may still write.
            self.submit_and_wait()?;
        }
        issue.failure.map_or(Ok(()), Err)
    }
}

impl UringIo {
    /// Moves every available completion to `ready`, re-issuing the rest of a short read and
    /// retrying transient errors. Never blocks.
    fn reap(&mut self, issue: &mut Issue) {
        self.completions.clear();
        self.completions.extend(self.ring.completion().map(|cqe| (cqe.user_data(), cqe.result())));
        for i in 0..self.completions.len() {
            let (slot, result) = self.completions[i];
            let slot = slot as usize;
            let s = self.slots[slot];
            let verdict = classify(result, s.len - s.done, s.retries);
            if issue.failure.is_none() && matches!(verdict, Completion::Partial(_) | Completion::Retry) {
                match verdict {
                    Completion::Partial(n) => self.slots[slot].done += n,
                    _ => self.slots[slot].retries += 1,
                }
                match self.push(slot) {
                    Ok(()) => continue,
                    Err(e) => {
                        issue.failure.get_or_insert(e);
                    }
                }
            }
            self.in_flight -= 1;
            self.ready.push_back((slot, verdict));
        }
    }

    /// Hands a finished op's bytes to the stream, or turns its failure into an error.
    fn finish(&self, slot: usize, verdict: Completion, stream: &mut dyn ReadStream) -> Result<()> {
        let s = self.slots[slot];
        let op = ReadOp { file: FileId(s.file), offset: s.offset, len: s.len };
        let path = &self.files.open[s.file as usize].path;
        match verdict {
            Completion::Done => {
                // SAFETY: the op into this slot completed, and although the slot is on the free
                // list, only `fill` reuses it, after this call returns: no op targets it now,
                // and it holds `len` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), s.len as usize) };
                stream.complete(s.seq, bytes)
            }
            Completion::Eof => Err(read_error(path, &op, std::io::ErrorKind::UnexpectedEof.into())),
            Completion::Failed(errno) => Err(read_error(path, &op, std::io::Error::from_raw_os_error(errno))),
            Completion::Partial(_) | Completion::Retry => Ok(()),
        }
    }
}

/// The issuing side of one `read_stream` call.
struct Issue {
    /// Sequence number of the next op.
    seq: u64,
    /// The stream said `Done`.
    done: bool,
    /// The first error; nothing more is issued after it.
    failure: Option<Error>,
}

impl UringIo {
    /// Issues the stream's ops while fewer than `queue_depth` are in flight and a slot is free
    /// (there are twice as many slots as the queue depth, so completed slots can wait for their
    /// callbacks while new ops run).
    fn fill(&mut self, stream: &mut dyn ReadStream, issue: &mut Issue) {
        while issue.failure.is_none() && !issue.done && self.in_flight < self.queue_depth {
            let Some(&slot) = self.free_slots.last() else { break };
            let next = stream.next_op(&mut Opener { files: &mut self.files, ring: &self.ring });
            let op = match next {
                Ok(Next::Op(op)) => op,
                Ok(Next::Wait) => break,
                Ok(Next::Done) => {
                    issue.done = true;
                    break;
                }
                Err(e) => {
                    issue.failure = Some(e);
                    break;
                }
            };
            if let Err(e) = check_op(&op, self.op_bytes_max, self.files.open.len()) {
                issue.failure = Some(e);
                break;
            }
            self.free_slots.pop();
            self.slots[slot] =
                Slot { seq: issue.seq, file: op.file.0, offset: op.offset, len: op.len, done: 0, retries: 0 };
            if let Err(e) = self.push(slot) {
                self.free_slots.push(slot);
                issue.failure = Some(e);
                break;
            }
            self.in_flight += 1;
            issue.seq += 1;
        }
    }
}

/// Where slot `slot` starts: in region `slot` when there is one per slot, else carved from the
/// single region. Callers keep `slot < 2 * queue_depth`, and the constructors checked that the
/// regions are that many and that large.
fn slot_start(memory: &[Box<dyn OwnedMemory>], slot: usize, op_bytes_max: usize) -> *mut u8 {
    if memory.len() > 1 {
        memory[slot].as_ptr()
    } else {
        debug_assert!((slot + 1) * op_bytes_max <= memory[0].len());
        // SAFETY: the single region holds `2 * queue_depth * op_bytes_max` bytes (`new`) and
        // `slot < 2 * queue_depth`, so the offset stays inside it.
        unsafe { memory[0].as_ptr().add(slot * op_bytes_max) }
    }
}

impl Drop for UringIo {
    fn drop(&mut self) {
        if !self.drain() {
            // The kernel may still write into the buffers: leak them rather than unmap them.
            std::mem::forget(self.memory.take());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completions_are_classified() {
        assert_eq!(classify(4096, 4096, 0), Completion::Done);
        assert_eq!(classify(8192, 4096, 0), Completion::Done);
        assert_eq!(classify(512, 4096, 0), Completion::Partial(512));
        assert_eq!(classify(0, 4096, 0), Completion::Eof);
        for errno in [libc::EAGAIN, libc::EINTR, libc::ECANCELED] {
            assert_eq!(classify(-errno, 4096, 0), Completion::Retry);
            assert_eq!(classify(-errno, 4096, RETRIES_MAX), Completion::Failed(errno));
        }
        assert_eq!(classify(-libc::EIO, 4096, 0), Completion::Failed(libc::EIO));
        assert_eq!(classify(-libc::EINVAL, 4096, 0), Completion::Failed(libc::EINVAL));
    }
}
