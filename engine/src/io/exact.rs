//! One range of one file read whole into memory the caller holds, through any backend:
//! `read_exact`. The memory tier's fills read their extents so, through a backend of their own,
//! and meet the faults a `FaultIo` around it injects as the reader's reads do.
//!
//! Owns `read_exact` and its stream. Never: keeps a file open past the call (the backend's files
//! are all closed after it: the backend is the caller's for this read alone), or looks at the
//! bytes (the caller checks them).

use std::path::Path;

use super::{Dest, FileId, FileOpener, Io, Next, ReadOp, ReadStream};
use crate::error::{Error, Result};
use crate::shard::BLOCK_BYTES;

/// Reads `into.len()` bytes of `path` from `offset` into `into`, in ops of the backend's op size
/// at most, all in flight at once as its queue allows. Straight into `into` (no copy) when it is
/// block-aligned, as a mapping is; through the backend's buffers otherwise. `offset` and the
/// length must be multiples of the block size. A short file, a failed op or a fault injected
/// into one is an error naming the file and offset; `into` then holds no promise.
pub fn read_exact(io: &mut dyn Io, path: &Path, offset: u64, into: &mut [u8]) -> Result<()> {
    if !offset.is_multiple_of(BLOCK_BYTES as u64) || !into.len().is_multiple_of(BLOCK_BYTES) {
        return Err(Error::invalid_input(format!(
            "a read of {} bytes at offset {offset} of {} is not block-aligned",
            into.len(),
            path.display()
        )));
    }
    if into.is_empty() {
        return Ok(());
    }
    let op_bytes = io.op_bytes_max().min(OP_BYTES_CAP) / BLOCK_BYTES * BLOCK_BYTES;
    if op_bytes == 0 {
        return Err(Error::invalid_input(format!("backend {} reads less than a block per op", io.name())));
    }
    let file = io.open(path)?;
    let n_ops = into.len().div_ceil(op_bytes);
    let mut stream = Exact {
        file,
        offset,
        base: into.as_mut_ptr(),
        len: into.len(),
        direct: (into.as_ptr() as usize).is_multiple_of(BLOCK_BYTES),
        op_bytes,
        issued: 0,
        done: vec![false; n_ops],
        _into: std::marker::PhantomData,
    };
    let outcome = io.read_stream(&mut stream);
    debug_assert!(outcome.is_err() || stream.issued == n_ops, "a stream that ends well issued every op");
    let outcome = outcome.and_then(|()| {
        if stream.done.iter().all(|&done| done) {
            Ok(())
        } else {
            Err(Error::invalid_input(format!("backend {} ended a read of {} early", io.name(), path.display())))
        }
    });
    let closed = io.close_all();
    outcome.and(closed)
}

/// The longest op `read_exact` issues (an op's length is a `u32`).
const OP_BYTES_CAP: usize = 1 << 30;

/// The stream of one `read_exact`: op `i` covers `[i * op_bytes, (i + 1) * op_bytes)` of the
/// range, clipped to its end.
struct Exact<'a> {
    file: FileId,
    offset: u64,
    /// `into`'s start: written by the backend (ops straight into it) or by `complete`; nothing
    /// else touches it while the stream lives (`_into` holds the caller's borrow).
    base: *mut u8,
    len: usize,
    direct: bool,
    op_bytes: usize,
    issued: usize,
    done: Vec<bool>,
    _into: std::marker::PhantomData<&'a mut [u8]>,
}

impl Exact<'_> {
    /// Op `seq`'s place in the range, checked against what completed: each op once, at its length.
    fn finish(&mut self, seq: u64, completed: usize) -> Result<usize> {
        let i = usize::try_from(seq)
            .ok()
            .filter(|&i| i < self.issued && !self.done[i])
            .ok_or_else(|| Error::invalid_input(format!("op {seq} completed twice, or was never issued")))?;
        let start = i * self.op_bytes;
        let expected = self.op_bytes.min(self.len - start);
        if completed != expected {
            return Err(Error::invalid_input(format!("op {seq} completed with {completed} bytes, not {expected}")));
        }
        self.done[i] = true;
        Ok(start)
    }
}

impl ReadStream for Exact<'_> {
    fn next_op(&mut self, _: &mut dyn FileOpener) -> Result<Next> {
        let start = self.issued * self.op_bytes;
        if start >= self.len {
            return Ok(Next::Done);
        }
        let len = self.op_bytes.min(self.len - start);
        let op = ReadOp {
            file: self.file,
            offset: self.offset + start as u64,
            len: u32::try_from(len).map_err(|_| Error::invalid_input("an op over 4 GiB"))?,
        };
        self.issued += 1;
        if !self.direct {
            return Ok(Next::Op(op));
        }
        // `start < len`: inside the caller's memory.
        let at = std::ptr::NonNull::new(self.base.wrapping_add(start)).expect("inside a live slice");
        #[allow(unsafe_code, reason = "an op straight into the caller's memory")]
        // SAFETY: `at` is block-aligned (`direct`: the base is, and `start` is a multiple of
        // the op size, itself of the block size); its `len` bytes lie inside `into`, which the
        // caller lent mutably for the whole call (`_into`) and which nothing reads or writes
        // until `read_stream` returns: the ops' ranges do not overlap, and `complete_into` only
        // marks the op done.
        let dest = unsafe { Dest::new(at) };
        Ok(Next::Into(op, dest))
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
        if self.direct {
            return Err(Error::invalid_input(format!("op {seq} was to be read into the caller's memory")));
        }
        let start = self.finish(seq, bytes.len())?;
        #[allow(unsafe_code, reason = "a copy into the caller's memory")]
        // SAFETY: `finish` checked that `bytes.len()` bytes from `start` lie inside `into`
        // (lent mutably for the whole call, written by nothing else: no op reads into it when
        // `direct` is false), and the backend's buffer does not overlap it.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.base.add(start), bytes.len());
        }
        Ok(())
    }

    fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
        if !self.direct {
            return Err(Error::invalid_input(format!("op {seq} was to be read into the backend's buffers")));
        }
        self.finish(seq, bytes.len()).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{AlignedBuf, Fault, FaultIo, IoConfig};

    fn file_of(bytes: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..bytes).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, &data).expect("write");
        (dir, path, data)
    }

    #[test]
    fn a_range_reads_whole_aligned_or_not_through_every_backend() {
        let (_dir, path, data) = file_of(40 * 4096);
        for backend in [crate::io::Backend::Pread, crate::io::Backend::Auto] {
            // Ops of 16 KiB: the range takes several, in flight together.
            let mut io = IoConfig { backend, queue_depth: 4, op_bytes_max: 16 << 10, ..IoConfig::default() }
                .build()
                .expect("a backend");
            let mut aligned = AlignedBuf::new(36 * 4096).expect("memory");
            read_exact(&mut *io, &path, 4096, aligned.as_mut_slice()).expect("aligned");
            assert_eq!(aligned.as_mut_slice(), &data[4096..37 * 4096], "{backend:?}");
            let mut unaligned = vec![0u8; 36 * 4096 + 1];
            read_exact(&mut *io, &path, 8192, &mut unaligned[1..]).expect("unaligned");
            assert_eq!(&unaligned[1..], &data[8192..38 * 4096], "{backend:?}");
        }
    }

    #[test]
    fn short_files_misaligned_ranges_and_injected_faults_are_errors() {
        let (_dir, path, _) = file_of(8 * 4096);
        let mut io = IoConfig { op_bytes_max: 8192, ..IoConfig::default() }.build().expect("a backend");
        let mut buf = AlignedBuf::new(16 * 4096).expect("memory");
        assert!(read_exact(&mut *io, &path, 0, buf.as_mut_slice()).is_err(), "past the end");
        assert!(read_exact(&mut *io, &path, 100, &mut buf.as_mut_slice()[..4096]).is_err(), "misaligned");
        let mut faulty = FaultIo::new(io, vec![Fault::FailRead { op: 2, errno: libc::EIO }]);
        let failed = read_exact(&mut faulty, &path, 0, &mut buf.as_mut_slice()[..8 * 4096]).unwrap_err();
        assert!(
            failed.to_string().contains("Input/output error") || failed.to_string().contains("os error 5"),
            "{failed}"
        );
        // The op numbering goes on: the next read meets no fault.
        read_exact(&mut faulty, &path, 0, &mut buf.as_mut_slice()[..8 * 4096]).expect("no fault left");
    }
}
