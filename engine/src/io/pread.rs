//! The portable backend: positioned reads, one op at a time, through the page cache.
//!
//! It is the fallback where io_uring is unavailable and the oracle the conformance suite holds
//! the io_uring backend to.
//!
//! Owns: `PreadIo`: its open files, by `FileId`, and one buffer of `op_bytes_max` bytes;
//! interrupted, short and EAGAIN reads are retried (EAGAIN up to `AGAIN_RETRIES_MAX` times). Never:
//! keeps more than one op in flight, or opens a file with O_DIRECT.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::{AlignedBuf, FileId, FileOpener, Io, Next, ReadStream, check_op, closed, read_error, stalled};
use crate::error::{Error, Result};

/// Retries of EAGAIN before an op fails.
const AGAIN_RETRIES_MAX: u32 = 64;

/// Positioned reads with `pread`.
pub struct PreadIo {
    files: Files,
    buf: AlignedBuf,
    op_bytes_max: usize,
}

impl PreadIo {
    /// A backend whose ops are at most `op_bytes_max` bytes.
    pub fn new(op_bytes_max: usize) -> Result<Self> {
        Ok(Self { files: Files(Vec::new()), buf: AlignedBuf::new(op_bytes_max)?, op_bytes_max })
    }
}

impl Io for PreadIo {
    fn name(&self) -> &'static str {
        "pread"
    }

    fn queue_depth(&self) -> usize {
        1
    }

    fn op_bytes_max(&self) -> usize {
        self.op_bytes_max
    }

    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.files.open(path)
    }

    fn close_all(&mut self) -> Result<()> {
        self.files.0.clear();
        Ok(())
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        FileOpener::close(&mut self.files, file)
    }

    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
        let mut seq = 0;
        loop {
            let (op, dest) = match stream.next_op(&mut self.files)? {
                Next::Op(op) => (op, None),
                Next::Into(op, dest) => (op, Some(dest)),
                Next::Wait if stream.idle()? => continue,
                Next::Wait => return Err(stalled()),
                Next::Done => return Ok(()),
            };
            check_op(&op, self.op_bytes_max, self.files.0.len())?;
            let (file, path) = &self.files.0[op.file.0 as usize];
            let file = file.as_ref().ok_or_else(|| closed(path))?;
            match dest {
                Some(dest) => {
                    #[allow(unsafe_code, reason = "an op into the stream's memory")]
                    // SAFETY: the stream promised `len` writable bytes at `dest` that nothing
                    // else touches until `complete_into` for this op returns (`Dest::new`); the
                    // slice lives only until then.
                    let buf = unsafe { std::slice::from_raw_parts_mut(dest.as_ptr(), op.len as usize) };
                    read_full(file, buf, op.offset).map_err(|e| read_error(path, &op, e))?;
                    stream.complete_into(seq, buf)?;
                }
                None => {
                    let buf = &mut self.buf.as_mut_slice()[..op.len as usize];
                    read_full(file, buf, op.offset).map_err(|e| read_error(path, &op, e))?;
                    stream.complete(seq, buf)?;
                }
            }
            seq += 1;
        }
    }
}

/// The open files, in `FileId` order.
struct Files(Vec<(Option<File>, PathBuf)>);

impl FileOpener for Files {
    fn open(&mut self, path: &Path) -> Result<FileId> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let id = FileId(u32::try_from(self.0.len()).map_err(|_| Error::invalid_input("too many open files"))?);
        self.0.push((Some(file), path.to_owned()));
        Ok(id)
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        if let Some((open, _)) = self.0.get_mut(file.0 as usize) {
            *open = None;
        }
        Ok(())
    }
}

/// Fills `buf` from `offset`, retrying interruptions, short reads and EAGAIN.
fn read_full(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    let mut again = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && again < AGAIN_RETRIES_MAX => again += 1,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
