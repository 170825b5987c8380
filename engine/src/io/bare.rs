//! The bare reader: the least a program can do to read the same bytes with io_uring and O_DIRECT.
//!
//! Benchmarks measure the engine against it on the same files, offsets, op sizes and queue
//! depth: registered buffers, registered files, a full queue, no checksum, no copy, no planning.
//! It is the disk's limit as the engine's ops see it. Not for production reads: it checks
//! nothing and fails on the first short read.
//!
//! Owns: `BareReader` (a ring with its registered buffers and files) and `BareOp`. Never: checks,
//! copies or plans, retries a short read, or unmaps its buffers while a read may be in flight
//! (after a ring failure they are leaked).
#![allow(unsafe_code, reason = "io_uring submission hands the kernel raw pointers into the reader's own buffers")]

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use super::AlignedBuf;
use crate::error::{Error, Result};

/// One read of the bare reader: `len` bytes at `offset` of file number `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BareOp {
    /// Index of the file in the order it was opened.
    pub file: u32,
    /// Byte offset, block-aligned.
    pub offset: u64,
    /// Bytes, block-aligned and at most the reader's op size.
    pub len: u32,
}

/// A minimal io_uring O_DIRECT reader.
pub struct BareReader {
    ring: io_uring::IoUring,
    /// `None` once leaked: after a ring failure with reads in flight, the kernel may still write.
    arena: Option<AlignedBuf>,
    queue_depth: usize,
    op_bytes: usize,
    files: Vec<File>,
}

impl BareReader {
    /// A reader with `queue_depth` slots of `op_bytes` bytes, registered with the ring.
    pub fn new(queue_depth: u32, op_bytes: usize) -> Result<Self> {
        let ring = io_uring::IoUring::new(queue_depth).map_err(|e| Error::io("io_uring_setup", "bare reader", e))?;
        let queue_depth = queue_depth as usize;
        let mut arena = AlignedBuf::new(queue_depth * op_bytes)?;
        let base = arena.as_mut_ptr();
        let iovecs: Vec<libc::iovec> = (0..queue_depth)
            .map(|slot| libc::iovec {
                // SAFETY: slot * op_bytes < arena.len(): the pointer stays in the mapping.
                iov_base: unsafe { base.add(slot * op_bytes) }.cast(),
                iov_len: op_bytes,
            })
            .collect();
        // SAFETY: the iovecs lie in `arena`, owned by the reader and unmapped only after the ring
        // is closed (field order), and `run` never returns with a read in flight.
        unsafe { ring.submitter().register_buffers(&iovecs) }
            .map_err(|e| Error::io("register buffers", "bare reader", e))?;
        Ok(Self { ring, arena: Some(arena), queue_depth, op_bytes, files: Vec::new() })
    }

    /// Opens files with O_DIRECT and registers them, in order.
    pub fn open_all(&mut self, paths: &[&Path]) -> Result<()> {
        for path in paths {
            let file = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .map_err(|e| Error::io("open", *path, e))?;
            self.files.push(file);
        }
        let fds: Vec<i32> = self.files.iter().map(AsRawFd::as_raw_fd).collect();
        self.ring.submitter().register_files(&fds).map_err(|e| Error::io("register files", "bare reader", e))
    }

    /// Reads every op with the queue kept full; returns the bytes read.
    pub fn run(&mut self, ops: &[BareOp]) -> Result<u64> {
        for op in ops {
            assert!(op.len as usize <= self.op_bytes && (op.file as usize) < self.files.len());
        }
        let Some(arena) = self.arena.as_mut() else {
            return Err(Error::io("read", "bare reader", std::io::Error::other("the ring failed earlier")));
        };
        let base = arena.as_mut_ptr();
        let mut free: Vec<usize> = (0..self.queue_depth).collect();
        let (mut next, mut in_flight, mut bytes) = (0, 0, 0u64);
        let mut failure = None;
        while next < ops.len() || in_flight > 0 {
            while failure.is_none() && next < ops.len() {
                let Some(slot) = free.pop() else { break };
                let op = ops[next];
                // SAFETY: slot < queue_depth: the target is slot `slot` of the arena.
                let target = unsafe { base.add(slot * self.op_bytes) };
                let entry =
                    io_uring::opcode::ReadFixed::new(io_uring::types::Fixed(op.file), target, op.len, slot as u16)
                        .offset(op.offset)
                        .build()
                        .user_data(((slot as u64) << 32) | u64::from(op.len));
                // SAFETY: the slot is used by this op alone until its completion is reaped, and
                // the arena outlives every op (the loop drains before returning).
                let pushed = unsafe { self.ring.submission().push(&entry) };
                assert!(pushed.is_ok(), "one queue entry per slot always fits");
                next += 1;
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => {
                    // Reads may still be in flight: never unmap memory the kernel may write.
                    std::mem::forget(self.arena.take());
                    return Err(Error::io("io_uring_enter", "bare reader", e));
                }
            }
            for cqe in self.ring.completion() {
                let slot = (cqe.user_data() >> 32) as usize;
                let len = cqe.user_data() & 0xffff_ffff;
                debug_assert!(in_flight > 0, "a completion for an op submitted");
                in_flight -= 1;
                free.push(slot);
                if u64::try_from(cqe.result()).ok() == Some(len) {
                    bytes += len;
                } else {
                    failure.get_or_insert(cqe.result());
                }
            }
        }
        match failure {
            None => Ok(bytes),
            Some(result) => {
                Err(Error::io("read", "bare reader", std::io::Error::other(format!("a read returned {result}"))))
            }
        }
    }
}
