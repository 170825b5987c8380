//! The io_uring backend: O_DIRECT reads into registered (fixed) buffers, batched submission.
//!
//! Owns: `UringIo`, its ring, and `2 * queue_depth` buffer slots of `op_bytes_max` bytes each,
//! carved from one page-aligned mapping (or handed in by the caller, such as page-locked staging
//! buffers that a GPU copy engine reads) and registered with the ring at the first op into one
//! (registering pins and so allocates every page); each opened file is registered in a sparse
//! fixed-file table. An op the stream issues into its own memory (`Next::Into`) needs no
//! buffer slot: the kernel reads straight into that memory. `read_stream` keeps
//! `queue_depth * op_bytes_max` bytes in flight, in at most `4 * queue_depth` ops (so short ops,
//! such as the 256 KiB chunks of a block-shuffled plan, still keep the disk as busy as long ones)
//! and at most `queue_depth` ops into buffer slots.
//! Finished ops queue up; before each one's bytes go to the stream (which checks and copies them)
//! the backend collects new completions and refills the queue from the spare slots, so the disk
//! never waits on the callbacks. Invariant
//! (what the SAFETY comments rest on): a slot is written by the kernel only while its op is in
//! flight, Rust code reads a slot only after its op completed and before the slot is reused, and
//! no op is in flight when `read` returns or the backend is dropped (an op still in flight after
//! a ring failure leaks the mapping rather than free memory the kernel may still write, and
//! aborts the process when it reads into a stream's memory, which cannot be kept from reuse).
//!
//! Never: checks or copies an op's bytes (the stream does), or frees or reuses a slot while the
//! kernel may still write into it.
#![allow(unsafe_code, reason = "io_uring submission hands the kernel raw pointers into the backend's own buffers")]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use io_uring::{IoUring, opcode, squeue, types};

use super::{
    AlignedBuf, Dest, FileId, FileOpener, Io, IoConfig, Next, OwnedMemory, QUEUE_DEPTH_MAX, ReadOp, ReadStream,
    check_op, read_error, stalled,
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
    /// For an op into the stream's memory: where its bytes go (the slot's buffer is unused).
    dest: Option<Dest>,
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

    /// Closes one file no op in flight reads (ops on other files may be: a fixed-file slot is
    /// updated without waiting for them, each op holding its own reference).
    fn close(&mut self, ring: &IoUring, file: FileId) -> Result<()> {
        let Some(open) = self.open.get_mut(file.0 as usize) else { return Ok(()) };
        if let Some(slot) = open.fixed.take() {
            ring.submitter()
                .register_files_update(slot, &[-1])
                .map_err(|e| Error::io("io_uring_register", "io_uring", e))?;
        }
        open.file = None;
        Ok(())
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

    fn close(&mut self, file: FileId) -> Result<()> {
        self.files.close(self.ring, file)
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
    /// Whether the slots are registered (`None`: not tried yet).
    fixed_buffers: Option<bool>,
    /// Registrations interrupted so far (retried at the next op into a slot, a few times).
    register_attempts: u32,
    files: Files,
    /// `2 * queue_depth` slots with a buffer each, then `ops_max` slots for ops into the
    /// stream's memory.
    slots: Vec<Slot>,
    free_slots: Vec<usize>,
    free_direct: Vec<usize>,
    /// Ops in flight at most.
    ops_max: usize,
    in_flight: usize,
    /// Of them, ops into buffer slots.
    in_flight_buffered: usize,
    /// Of them, ops into the stream's memory (a broken ring with one in flight aborts).
    in_flight_direct: usize,
    /// Bytes the ops in flight read.
    in_flight_bytes: usize,
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
        let ops_max = (4 * queue_depth).min(QUEUE_DEPTH_MAX as usize);
        // Every op in flight may hold a submission entry; the completion ring is twice as long.
        let entries = u32::try_from(ops_max).expect("at most QUEUE_DEPTH_MAX");
        let ring = IoUring::new(entries).map_err(|e| Error::io("io_uring_setup", "io_uring", e))?;
        let n_slots = 2 * queue_depth;
        let fixed_files =
            if ring.submitter().register_files_sparse(FIXED_FILES_MAX).is_ok() { FIXED_FILES_MAX } else { 0 };
        Ok(Self {
            ring,
            memory: Some(memory),
            queue_depth,
            op_bytes_max: config.op_bytes_max,
            fixed_buffers: None,
            register_attempts: 0,
            files: Files { open: Vec::new(), fixed_files, direct: config.direct },
            slots: vec![Slot::default(); n_slots + ops_max],
            free_slots: (0..n_slots).rev().collect(),
            free_direct: (n_slots..n_slots + ops_max).rev().collect(),
            ops_max,
            in_flight: 0,
            in_flight_buffered: 0,
            in_flight_direct: 0,
            in_flight_bytes: 0,
            unsubmitted: 0,
            completions: Vec::with_capacity(ops_max),
            ready: std::collections::VecDeque::with_capacity(n_slots + ops_max),
        })
    }

    /// Whether the slots are registered fixed buffers. They are registered at the first op into
    /// one (registering pins, and so allocates, every page of them: a reader whose ops all go
    /// into its caller's memory never pays for it); false before that, or when the kernel
    /// refused (for example over RLIMIT_MEMLOCK: reads then use plain buffers).
    pub fn fixed_buffers(&self) -> bool {
        self.fixed_buffers == Some(true)
    }

    /// Registers the slots as fixed buffers, once.
    fn register_buffers(&mut self) -> bool {
        if let Some(registered) = self.fixed_buffers {
            return registered;
        }
        let memory = self.memory.as_ref().expect("the memory lives until drop");
        let iovecs: Vec<libc::iovec> = (0..2 * self.queue_depth)
            .map(|slot| libc::iovec {
                iov_base: slot_start(memory, slot, self.op_bytes_max).cast(),
                iov_len: self.op_bytes_max,
            })
            .collect();
        // SAFETY: every iovec lies inside `memory` (`slot_start`), which this backend owns and
        // keeps valid until the ring is closed (field order, and `Drop` waits for ops in flight).
        match unsafe { self.ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                self.fixed_buffers = Some(true);
                true
            }
            // Interrupted or busy: plain reads this time, registration again at the next op, a
            // few times at most.
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN))
                    && self.register_attempts < 3 =>
            {
                self.register_attempts += 1;
                false
            }
            Err(_) => {
                self.fixed_buffers = Some(false);
                false
            }
        }
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        slot_start(self.memory.as_ref().expect("the memory lives until drop"), slot, self.op_bytes_max)
    }

    /// Queues the unread rest of `slot`'s op.
    fn push(&mut self, slot: usize) -> Result<()> {
        let s = self.slots[slot];
        let base = s.dest.map_or_else(|| self.slot_ptr(slot), Dest::as_ptr);
        // SAFETY: `done < len`, and `len` bytes from `base` are the slot's (`len <= op_bytes_max`)
        // or the stream's destination (`Dest::new`), so the target stays inside them.
        let target = unsafe { base.add(s.done as usize) };
        let (len, offset) = (s.len - s.done, s.offset + u64::from(s.done));
        // The stream's memory is not a registered buffer: a plain read, pinned per op.
        let fixed_buffer = s.dest.is_none() && self.register_buffers();
        let open = &self.files.open[s.file as usize];
        let Some(file) = open.file.as_ref() else { return Err(super::closed(&open.path)) };
        let entry = match (open.fixed, fixed_buffer) {
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
            // completes (no op outlives `read` or the backend), or into the stream's memory,
            // which the stream keeps for the op until it completes (`Dest::new`).
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
        while let Some((slot, _)) = self.ready.pop_front() {
            self.release(slot);
        }
        while self.in_flight > 0 {
            if self.submit_and_wait().is_err() {
                if self.in_flight_direct > 0 {
                    broken_with_reads_into_stream_memory();
                }
                return false;
            }
            let completed: Vec<usize> = self.ring.completion().map(|cqe| cqe.user_data() as usize).collect();
            for slot in completed {
                self.landed(slot);
                self.release(slot);
            }
        }
        true
    }

    /// Accounts for slot `slot`'s op leaving the kernel.
    fn landed(&mut self, slot: usize) {
        let s = &self.slots[slot];
        debug_assert!(self.in_flight > 0 && self.in_flight_bytes >= s.len as usize, "an op landed that was counted");
        self.in_flight -= 1;
        self.in_flight_bytes -= s.len as usize;
        if s.dest.is_some() {
            self.in_flight_direct -= 1;
        } else {
            self.in_flight_buffered -= 1;
        }
        debug_assert_eq!(self.in_flight, self.in_flight_direct + self.in_flight_buffered);
    }

    /// Puts slot `slot` back on its free list.
    fn release(&mut self, slot: usize) {
        if self.slots[slot].dest.take().is_some() {
            self.free_direct.push(slot);
        } else {
            self.free_slots.push(slot);
        }
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
        self.files.close(&self.ring, file)
    }

    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
        if !self.drain() {
            return Err(Error::io("io_uring_enter", "io_uring", std::io::Error::other("ring failed")));
        }
        // A callback that panics unwinds through here with ops in flight, some perhaps into the
        // stream's memory, which the caller may free while unwinding: every op is waited for
        // first (`drain` aborts the process if that fails with such ops in flight).
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_stream(stream))) {
            Ok(outcome) => outcome,
            Err(panic) => {
                self.drain();
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl UringIo {
    /// `read_stream` after the backend is known idle.
    fn run_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
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
                let s = self.slots[slot];
                self.release(slot);
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
                    && let Err(e) = self.finish(slot, s, verdict, stream)
                {
                    issue.failure = Some(e);
                }
                continue;
            }
            if self.in_flight == 0 {
                if !issue.done && issue.failure.is_none() {
                    // The stream waits with nothing in flight: for work of its own, or forever.
                    match stream.idle() {
                        Ok(true) => continue,
                        Ok(false) => issue.failure = Some(stalled()),
                        Err(e) => issue.failure = Some(e),
                    }
                }
                break;
            }
            // Only a broken ring fails here, with ops possibly in flight: the backend then
            // refuses further reads (its drain fails) and `Drop` leaks the buffers rather than
            // unmap memory the kernel may still write.
            if let Err(e) = self.submit_and_wait() {
                if self.in_flight_direct > 0 {
                    broken_with_reads_into_stream_memory();
                }
                return Err(e);
            }
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
            self.landed(slot);
            self.ready.push_back((slot, verdict));
        }
    }

    /// Hands a finished op's bytes to the stream, or turns its failure into an error.
    /// `s` is the slot as it was when the op finished (released since).
    fn finish(&self, slot: usize, s: Slot, verdict: Completion, stream: &mut dyn ReadStream) -> Result<()> {
        let op = ReadOp { file: FileId(s.file), offset: s.offset, len: s.len };
        let path = &self.files.open[s.file as usize].path;
        match (verdict, s.dest) {
            (Completion::Done, Some(dest)) => {
                // SAFETY: the op into the stream's memory completed, so the kernel no longer
                // writes it, and the stream keeps it for this op until this call returns
                // (`Dest::new`); the slice lives only as long as the call.
                let bytes = unsafe { std::slice::from_raw_parts_mut(dest.as_ptr(), s.len as usize) };
                stream.complete_into(s.seq, bytes)
            }
            (Completion::Done, None) => {
                // SAFETY: the op into this slot completed, and although the slot is on the free
                // list, only `fill` reuses it, after this call returns: no op targets it now,
                // and it holds `len` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(self.slot_ptr(slot), s.len as usize) };
                stream.complete(s.seq, bytes)
            }
            (Completion::Eof, _) => Err(read_error(path, &op, std::io::ErrorKind::UnexpectedEof.into())),
            (Completion::Failed(errno), _) => Err(read_error(path, &op, std::io::Error::from_raw_os_error(errno))),
            (Completion::Partial(_) | Completion::Retry, _) => Ok(()),
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
    /// Issues the stream's ops while fewer than `queue_depth * op_bytes_max` bytes and `ops_max`
    /// ops are in flight, fewer than `queue_depth` of them into buffer slots, and a slot of each
    /// kind is free (there are twice as many buffer slots as the queue depth, so completed slots
    /// can wait for their callbacks while new ops run).
    fn fill(&mut self, stream: &mut dyn ReadStream, issue: &mut Issue) {
        let bytes_max = self.queue_depth * self.op_bytes_max;
        while issue.failure.is_none()
            && !issue.done
            && self.in_flight < self.ops_max
            && self.in_flight_bytes < bytes_max
            && self.in_flight_buffered < self.queue_depth
        {
            let (Some(&buffered), Some(&direct)) = (self.free_slots.last(), self.free_direct.last()) else { break };
            let next = stream.next_op(&mut Opener { files: &mut self.files, ring: &self.ring });
            let (op, dest) = match next {
                Ok(Next::Op(op)) => (op, None),
                Ok(Next::Into(op, dest)) => (op, Some(dest)),
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
            let slot = if dest.is_some() {
                self.free_direct.pop();
                direct
            } else {
                self.free_slots.pop();
                buffered
            };
            self.slots[slot] =
                Slot { dest, seq: issue.seq, file: op.file.0, offset: op.offset, len: op.len, done: 0, retries: 0 };
            if let Err(e) = self.push(slot) {
                self.release(slot);
                issue.failure = Some(e);
                break;
            }
            self.in_flight += 1;
            self.in_flight_bytes += op.len as usize;
            if dest.is_some() {
                self.in_flight_direct += 1;
            } else {
                self.in_flight_buffered += 1;
            }
            // At most `queue_depth` ops into buffer slots: one each, and twice as many slots.
            debug_assert!(self.in_flight_buffered <= 2 * self.queue_depth, "{} buffered ops", self.in_flight_buffered);
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

/// The ring broke while the kernel may still be reading into a stream's memory: that memory
/// belongs to the caller, who will reuse or free it once the read returns, so returning would let
/// the kernel write into memory in other use. Nothing safe is left but to stop the process.
#[cold]
fn broken_with_reads_into_stream_memory() -> ! {
    eprintln!(
        "granary: the io_uring ring failed with reads into the caller's memory still in flight; \
         aborting rather than let the kernel write into memory that is handed back"
    );
    std::process::abort()
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
