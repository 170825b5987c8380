//! Verify workers: threads that check the CRC32C of long ops' blocks, and copy the records of
//! those not read straight into the batch from the reader's scratch memory into it, so that the
//! thread reaping the disk's completions only reaps and resubmits.
//!
//! Owns: the worker threads of one reader and the two queues between them and it (jobs out,
//! verdicts back, each job answered exactly once, a panicking check answered as a failure).
//! Never: reads files, writes the memory it checks, copies a byte of an op whose check failed,
//! or decides anything about a batch: the reader counts the verdicts and delivers a batch only
//! when every one of its ops has checked out.

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::thread::JoinHandle;

use parking_lot::Mutex;

use super::batch::BatchMemory;
use super::batch_plan::Piece;
use crate::error::{Error, Result};
use crate::shard::ShardMeta;

/// Ops of at least this many bytes are checked by a worker; shorter ones (a random 4 KiB record)
/// cost less to check than to hand over, and are checked on the reaping thread.
pub(super) const OFFLOAD_BYTES_MIN: usize = 64 << 10;

/// The most verify workers one reader starts.
pub const VERIFY_THREADS_MAX: usize = 64;

/// Verify workers for a reader on this machine: `GRANARY_VERIFY_THREADS` when set (0: check on
/// the reaping thread), else one per 8 cores, at most 8, and none below 8 cores. Reading straight
/// into the batch leaves the reaping thread a checksum per op (0.13 core-seconds per GB here): on
/// the 2-core VM a worker costs more in hand-offs and shared cores than it saves (BENCHMARKS.md,
/// issue 16); it pays where one thread cannot check what the disks deliver.
pub fn default_verify_threads() -> usize {
    if let Some(threads) = std::env::var("GRANARY_VERIFY_THREADS").ok().and_then(|v| v.trim().parse::<usize>().ok()) {
        return threads.min(VERIFY_THREADS_MAX);
    }
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    (cores / 8).min(8)
}

/// One check: `len` bytes at `ptr`, blocks of `meta` from `first_block`; then, for an op read
/// into scratch memory, its copies into the batch.
struct Job {
    meta: Arc<ShardMeta>,
    first_block: u64,
    ptr: *const u8,
    len: usize,
    gather: Option<Gather>,
    /// The reader's name for the op (its batch slot and extent).
    tag: u64,
}

/// An op's copies into its batch, made once its blocks checked out: `n` pieces at `pieces` (the
/// plan's), into `memory`.
pub(super) struct Gather {
    pub(super) pieces: *const Piece,
    pub(super) n: usize,
    pub(super) memory: BatchMemory,
}

// SAFETY: the bytes at `ptr`, the pieces and the batch ranges they name are kept by the reader
// (unwritten, unread, not let go: the pieces' ranges are this job's alone) until the job's
// verdict is back (`VerifyPool::submit`); the worker reads the bytes and pieces and writes only
// the pieces' ranges of the batch.
#[allow(unsafe_code, reason = "a job names memory the reader keeps for it")]
unsafe impl Send for Job {}

/// A job's answer: the first bad block as `(block, expected, actual)`, or a check that panicked.
pub(super) struct Verdict {
    pub(super) tag: u64,
    pub(super) outcome: std::result::Result<(), Failure>,
}

/// How a check failed.
pub(super) enum Failure {
    /// Block `0` holds CRC32C `2`; its metadata says `1`.
    Mismatch(u64, u32, u32),
    /// The check or the copy panicked (a bug): the op counts as unverified.
    Panicked,
    /// The copy found a piece that does not fit the op (a bug in the plan): nothing past it
    /// was copied.
    Copy(String),
}

/// The workers of one reader.
pub(super) struct VerifyPool {
    jobs: Option<Sender<Job>>,
    verdicts: Receiver<Verdict>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs submitted whose verdict has not been taken.
    pending: usize,
    /// Verdicts given on this thread (no worker was left to take the job).
    stash: Vec<Verdict>,
}

impl VerifyPool {
    /// Starts `threads` workers (at least one).
    pub(super) fn new(threads: usize) -> Result<Self> {
        let (jobs, job_queue) = channel::<Job>();
        let (verdict_out, verdicts) = channel();
        let job_queue = Arc::new(Mutex::new(job_queue));
        let mut handles = Vec::new();
        for i in 0..threads.clamp(1, VERIFY_THREADS_MAX) {
            let (queue, out) = (Arc::clone(&job_queue), verdict_out.clone());
            let name = format!("granary-verify-{i}");
            let handle = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || work(&queue, &out))
                .map_err(|e| Error::io("spawn", name, e))?;
            handles.push(handle);
        }
        Ok(Self { jobs: Some(jobs), verdicts, threads: handles, pending: 0, stash: Vec::new() })
    }

    /// Verdicts still to be taken.
    pub(super) fn pending(&self) -> usize {
        self.pending
    }

    /// Hands `len` bytes at `ptr` to a worker to check against `meta`'s blocks from
    /// `first_block`, and with `gather`, to copy into the batch once they checked out.
    ///
    /// # Safety
    ///
    /// The `len` bytes at `ptr` stay valid and unwritten until this job's verdict has been taken
    /// (`try_take` or `take`); so do `gather`'s pieces, and its pieces' ranges of the batch stay
    /// valid and are read or written by nothing else until then. A caller that owns them waits
    /// for every pending verdict before it lets them go, on every path (`take` until `pending`
    /// is 0).
    #[allow(unsafe_code, reason = "the caller keeps the memory for the worker")]
    pub(super) unsafe fn submit(
        &mut self,
        meta: Arc<ShardMeta>,
        first_block: u64,
        (ptr, len): (*const u8, usize),
        gather: Option<Gather>,
        tag: u64,
    ) {
        let job = Job { meta, first_block, ptr, len, gather, tag };
        let unsent = match &self.jobs {
            Some(jobs) => jobs.send(job).err().map(|std::sync::mpsc::SendError(job)| job),
            None => Some(job),
        };
        // No worker left to take it (workers stop only when the pool is dropped): checked here,
        // so the verdict is still given.
        if let Some(job) = unsent {
            self.stash.push(check(&job));
        }
        self.pending += 1;
    }

    /// A verdict, if one is in; never blocks.
    pub(super) fn try_take(&mut self) -> Option<Verdict> {
        if self.pending == 0 {
            return None;
        }
        let verdict = match self.stash.pop() {
            Some(verdict) => verdict,
            None => match self.verdicts.try_recv() {
                Ok(verdict) => verdict,
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => return None,
            },
        };
        debug_assert!(self.pending > 0, "a verdict for a job sent");
        self.pending -= 1;
        Some(verdict)
    }

    /// The next verdict, waiting for it; `None` when none is pending. Fails only if the workers
    /// are gone with jobs unanswered (they exit only at drop, so never in practice); nothing
    /// reads the jobs' memory then, and none is pending any more.
    pub(super) fn take(&mut self) -> Result<Option<Verdict>> {
        if self.pending == 0 {
            return Ok(None);
        }
        let verdict = match self.stash.pop() {
            Some(verdict) => verdict,
            None => match self.verdicts.recv() {
                Ok(verdict) => verdict,
                Err(_) => {
                    self.pending = 0;
                    return Err(Error::invalid_input("the verify workers stopped with checks unanswered"));
                }
            },
        };
        debug_assert!(self.pending > 0, "a verdict for a job sent");
        self.pending -= 1;
        Ok(Some(verdict))
    }

    /// Waits for every pending verdict and drops them: what a reader does before it lets go of
    /// the memory the jobs read, when it has stopped caring about their outcome (a failed read).
    pub(super) fn wait_all(&mut self) {
        while let Ok(Some(_)) = self.take() {}
    }
}

impl Drop for VerifyPool {
    fn drop(&mut self) {
        self.wait_all();
        // Closing the job queue stops the workers.
        self.jobs = None;
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// A worker: takes jobs until the queue closes, answers each.
fn work(queue: &Mutex<Receiver<Job>>, out: &Sender<Verdict>) {
    loop {
        let job = queue.lock().recv();
        let Ok(job) = job else { return };
        if out.send(check(&job)).is_err() {
            return;
        }
    }
}

/// Checks a job's bytes; a panic in the check is a failed verdict, not a lost one.
fn check(job: &Job) -> Verdict {
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        #[allow(unsafe_code, reason = "reads memory the reader keeps for this job")]
        // SAFETY: `submit`'s caller keeps the `len` bytes at `ptr` valid and unwritten until this
        // verdict is taken; the slice does not outlive this check.
        let bytes = unsafe { std::slice::from_raw_parts(job.ptr, job.len) };
        if let Err((block, expected, actual)) = job.meta.check_blocks(job.first_block, bytes) {
            return Err(Failure::Mismatch(block, expected, actual));
        }
        let Some(gather) = &job.gather else { return Ok(()) };
        #[allow(unsafe_code, reason = "the plan's pieces, kept for this job")]
        // SAFETY: `submit`'s caller keeps the `n` pieces at `pieces` as they are until this
        // verdict is taken.
        let pieces = unsafe { std::slice::from_raw_parts(gather.pieces, gather.n) };
        #[allow(unsafe_code, reason = "copies into ranges of a batch this job owns")]
        // SAFETY: the pieces' ranges of the batch are this job's alone until its verdict is
        // taken (`submit`'s caller); the bytes checked out above.
        unsafe { super::batch_plan::gather(pieces, bytes, gather.memory) }.map_err(|e| Failure::Copy(e.to_string()))
    }));
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(_) => Err(Failure::Panicked),
    };
    Verdict { tag: job.tag, outcome }
}
