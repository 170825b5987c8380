//! A read backend built at its first disk read.
//!
//! Owns: `LazyIo`, which holds how to build a backend and builds it when a read stream first
//! asks for an op or a file, so a reader whose batches all come from memory (the memory tier)
//! never allocates or registers the backend's read slots. Until then it drives the stream itself
//! (batches served from memory still complete through it); the first op goes to the built
//! backend ahead of the rest of the stream.
//! Never: reads a byte itself, or builds a backend that was asked for nothing.

use std::path::Path;

use super::{FileId, FileOpener, Io, IoConfig, Next, ReadStream, stalled};
use crate::error::{Error, Result};

/// Builds a read backend.
pub type BuildIo = Box<dyn FnOnce() -> Result<Box<dyn Io>> + Send>;

/// A backend built at its first use. See the module documentation.
pub struct LazyIo {
    config: IoConfig,
    build: Option<BuildIo>,
    io: Option<Box<dyn Io>>,
    /// Why the build failed, for every later call.
    failed: Option<String>,
}

impl LazyIo {
    /// A backend that `build` makes when first needed; `config` is what it will be built with
    /// (its op size and queue depth are reported until then).
    pub fn new(config: IoConfig, build: BuildIo) -> Self {
        Self { config, build: Some(build), io: None, failed: None }
    }

    /// Whether the backend was built.
    pub fn is_started(&self) -> bool {
        self.io.is_some()
    }

    fn get(&mut self) -> Result<&mut Box<dyn Io>> {
        if self.io.is_none()
            && let Some(build) = self.build.take()
        {
            match build() {
                Ok(io) => self.io = Some(io),
                Err(e) => {
                    self.failed = Some(e.to_string());
                    return Err(e);
                }
            }
        }
        let failed = &self.failed;
        self.io.as_mut().ok_or_else(|| {
            Error::invalid_input(format!(
                "the disk backend failed to start: {}",
                failed.as_deref().unwrap_or("(no reason kept)")
            ))
        })
    }
}

/// Opens files for a stream driven before the backend exists: the first one builds it.
struct Opener<'a>(&'a mut LazyIo);

impl FileOpener for Opener<'_> {
    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.0.get()?.open(path)
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        // The backend was built by an open of this stream, and has no op in flight yet.
        self.0.get()?.close(file)
    }
}

/// The op a stream gave before the backend existed, then the stream.
struct Resumed<'a> {
    first: Option<Next>,
    rest: &'a mut dyn ReadStream,
}

impl ReadStream for Resumed<'_> {
    fn next_op(&mut self, files: &mut dyn FileOpener) -> Result<Next> {
        match self.first.take() {
            Some(next) => Ok(next),
            None => self.rest.next_op(files),
        }
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> Result<()> {
        self.rest.complete(seq, bytes)
    }

    fn complete_into(&mut self, seq: u64, bytes: &mut [u8]) -> Result<()> {
        self.rest.complete_into(seq, bytes)
    }

    fn idle(&mut self) -> Result<bool> {
        self.rest.idle()
    }
}

impl Io for LazyIo {
    fn name(&self) -> &'static str {
        self.io.as_ref().map_or("not started", |io| io.name())
    }

    fn queue_depth(&self) -> usize {
        self.io.as_ref().map_or(self.config.queue_depth as usize, |io| io.queue_depth())
    }

    fn op_bytes_max(&self) -> usize {
        self.io.as_ref().map_or(self.config.op_bytes_max, |io| io.op_bytes_max())
    }

    fn open(&mut self, path: &Path) -> Result<FileId> {
        self.get()?.open(path)
    }

    fn read_stream(&mut self, stream: &mut dyn ReadStream) -> Result<()> {
        if self.io.is_none() {
            let first = match stream.next_op(&mut Opener(self))? {
                Next::Done => return Ok(()),
                // Nothing is in flight here: a stream that waits now would wait forever.
                Next::Wait => return Err(stalled()),
                next @ (Next::Op(_) | Next::Into(..)) => next,
            };
            let io = self.get()?;
            return io.read_stream(&mut Resumed { first: Some(first), rest: stream });
        }
        self.get()?.read_stream(stream)
    }

    fn close_all(&mut self) -> Result<()> {
        self.io.as_mut().map_or(Ok(()), |io| io.close_all())
    }

    fn close(&mut self, file: FileId) -> Result<()> {
        self.io.as_mut().map_or(Ok(()), |io| io.close(file))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;
    use crate::io::{Backend, ReadOp};

    fn lazy(built: &Arc<AtomicBool>) -> (LazyIo, IoConfig) {
        let flag = Arc::clone(built);
        let config = IoConfig { backend: Backend::Pread, ..IoConfig::default() };
        let io = LazyIo::new(
            config,
            Box::new(move || {
                flag.store(true, Ordering::SeqCst);
                config.build()
            }),
        );
        (io, config)
    }

    /// Gives `n` ops of one block of `path` (opened through the backend), recording the bytes.
    struct Blocks<'a> {
        path: &'a Path,
        left: u64,
        got: Vec<u8>,
    }

    impl ReadStream for Blocks<'_> {
        fn next_op(&mut self, files: &mut dyn FileOpener) -> Result<Next> {
            if self.left == 0 {
                return Ok(Next::Done);
            }
            self.left -= 1;
            let file = files.open(self.path)?;
            Ok(Next::Op(ReadOp { file, offset: self.left * 4096, len: 4096 }))
        }

        fn complete(&mut self, _: u64, bytes: &[u8]) -> Result<()> {
            self.got.push(bytes[0]);
            Ok(())
        }
    }

    #[test]
    fn a_lazy_backend_starts_at_its_first_op_and_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, [[1u8; 4096], [2u8; 4096], [3u8; 4096]].concat()).unwrap();
        let built = Arc::new(AtomicBool::new(false));
        let (mut io, config) = lazy(&built);
        assert_eq!((io.name(), io.op_bytes_max()), ("not started", config.op_bytes_max));
        io.close_all().unwrap();
        // A stream with no op (every batch served from memory) builds nothing.
        io.read_stream(&mut Blocks { path: &path, left: 0, got: Vec::new() }).unwrap();
        assert!(!built.load(Ordering::SeqCst) && !io.is_started(), "nothing read, nothing built");
        let mut stream = Blocks { path: &path, left: 3, got: Vec::new() };
        io.read_stream(&mut stream).unwrap();
        assert!(built.load(Ordering::SeqCst) && io.is_started());
        assert_eq!(stream.got, [3, 2, 1], "the first op too, in order");
        assert_eq!(io.name(), config.build().unwrap().name());

        let mut failing = LazyIo::new(config, Box::new(|| Err(Error::invalid_input("no backend here"))));
        assert!(failing.open(&path).unwrap_err().to_string().contains("no backend here"));
        let again = failing.open(&path).unwrap_err().to_string();
        assert!(again.contains("failed to start") && again.contains("no backend here"), "and stays failed: {again}");
    }
}
