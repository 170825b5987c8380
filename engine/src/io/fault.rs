//! A backend wrapper that injects faults, for tests: failed reads and flipped bits; and the
//! faults a loader's tier fills meet (`Fault::FailFill`: the fillers number their fills, and aim
//! a `FailRead` at a memory tier fill's first op through the `FaultIo` around their own backend,
//! or fail a page cache tier's fill, which issues no op, themselves).
//!
//! Ops are numbered across calls in submission order (the op's index plus the ops of earlier
//! calls), so a test can aim a fault at "the 17th op this reader issues"; fills are numbered in
//! the order a loader's fillers start them.
//!
//! Owns: `Fault` and `FaultIo` (the op numbering, the failed ops, the flipped bits). Never: numbers
//! fills (the tier's fillers do, and add the fault they aim), or changes a file: a flipped bit is in the
//! copy handed to the stream, or in the stream's own memory.

use std::path::Path;

use super::{FileId, FileOpener, Io, Next, ReadStream};
use crate::error::{Error, Result};

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Op number `op` fails with OS error `errno` (for example `libc::EIO`).
    FailRead {
        /// The op's number.
        op: u64,
        /// The error to report.
        errno: i32,
    },
    /// Bit `bit` of op number `op`'s bytes is flipped after the read, as a disk or DMA error would.
    FlipBit {
        /// The op's number.
        op: u64,
        /// The bit within the op's bytes (wraps around the op's length).
        bit: u64,
    },
    /// The tier's fill number `fill` (of this loader) fails with OS error `errno`, as a disk
    /// error under the fill's large read would. A loader whose faults are all of this kind keeps
    /// its tier (the other kinds act on disk reads, so their loader reads every record from disk).
    FailFill {
        /// The fill's number.
        fill: u64,
        /// The error to report.
        errno: i32,
    },
}

impl Fault {
    /// Whether the fault acts on the disk backend's reads (not on the tier's fills).
    pub fn on_reads(&self) -> bool {
        !matches!(self, Fault::FailFill { .. })
    }
}

/// Wraps a backend and injects `faults`.
pub struct FaultIo {
    inner: Box<dyn Io>,
    faults: Vec<Fault>,
    ops_issued: u64,
    scratch: Vec<u8>,
}

impl FaultIo {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Io>, faults: Vec<Fault>) -> Self {
        Self { inner, faults, ops_issued: 0, scratch: Vec::new() }
    }

    /// Ops issued through it so far: the number the next op gets.
    pub fn ops_issued(&self) -> u64 {
        self.ops_issued
    }

    /// Adds `fault` from now on: work numbered elsewhere (the tier's fills) aims one at the next
    /// op (`ops_issued`).
    pub fn add_fault(&mut self, fault: Fault) {
        self.faults.push(fault);
    }
}

impl Io for FaultIo {
    fn name(&self) -> &'static str {
        "fault-injecting"
    }

    fn queue_depth(&self) -> usize {
        self.inner.queue_depth()
    }

    fn op_bytes_max(&self) -> usize {
        self.inner.op_bytes_max()
    }

    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.inner.open(path)
    }

    fn close_all(&mut self) -> Result<()> {
        self.inner.close_all()
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        self.inner.close(file)
    }

    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
        let first = self.ops_issued;
        let mut faulty =
            FaultStream { inner: stream, faults: &self.faults, first, issued: 0, scratch: &mut self.scratch };
        let outcome = self.inner.read_stream(&mut faulty);
        self.ops_issued = first + faulty.issued;
        outcome
    }
}

struct FaultStream<'a> {
    inner: &'a mut dyn ReadStream,
    faults: &'a [Fault],
    first: u64,
    issued: u64,
    scratch: &'a mut Vec<u8>,
}

impl ReadStream for FaultStream<'_> {
    fn next_op(&mut self, files: &mut dyn FileOpener) -> Result<Next> {
        let next = self.inner.next_op(files)?;
        if matches!(next, Next::Op(_) | Next::Into(..)) {
            self.issued += 1;
        }
        Ok(next)
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
        let number = self.first + seq;
        let mut flipped = false;
        for fault in self.faults {
            match *fault {
                Fault::FailRead { op, errno } if op == number => {
                    return Err(Error::io("read", "fault injection", std::io::Error::from_raw_os_error(errno)));
                }
                Fault::FlipBit { op, bit } if op == number => {
                    if !flipped {
                        self.scratch.clear();
                        self.scratch.extend_from_slice(bytes);
                        flipped = true;
                    }
                    let bit = bit % (bytes.len() as u64 * 8);
                    self.scratch[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
                _ => {}
            }
        }
        if flipped { self.inner.complete(seq, self.scratch) } else { self.inner.complete(seq, bytes) }
    }

    fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
        // The bytes are the stream's own memory: a flipped bit lands there, as a DMA error would.
        let number = self.first + seq;
        for fault in self.faults {
            match *fault {
                Fault::FailRead { op, errno } if op == number => {
                    return Err(Error::io("read", "fault injection", std::io::Error::from_raw_os_error(errno)));
                }
                Fault::FlipBit { op, bit } if op == number => {
                    let bit = bit % (bytes.len() as u64 * 8);
                    bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
                _ => {}
            }
        }
        self.inner.complete_into(seq, bytes)
    }

    fn idle(&mut self) -> Result<bool> {
        self.inner.idle()
    }
}
