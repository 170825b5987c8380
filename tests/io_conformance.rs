//! One conformance suite that every `Io` backend passes: the bytes of every op, any queue depth,
//! errors for bad ops and end of file, a failing callback that stops the read without losing the
//! backend, a stream that waits with nothing in flight (an error, never a hang), and closing
//! every file (no descriptor kept, ids and fixed-file slots reusable), and one file closed
//! through the opener mid-stream while the others read on.

mod common;

use std::path::Path;

use common::*;
use granary::io::{Fault, FaultIo, FileId, FileOpener, Io, Next, ReadOp, ReadStream};
use granary::{Backend, Error, IoConfig};
use proptest::prelude::*;

const FILE_BYTES: usize = 1 << 20;

/// Builds a fresh backend.
type MakeIo = Box<dyn Fn() -> Box<dyn Io>>;

fn backends() -> Vec<(&'static str, MakeIo)> {
    let config = |backend, queue_depth, op_bytes_max, direct| IoConfig { backend, queue_depth, op_bytes_max, direct };
    vec![
        ("pread", Box::new(move || config(Backend::Pread, 1, 64 << 10, false).build().unwrap())),
        ("uring qd32 direct", Box::new(move || config(Backend::Uring, 32, 64 << 10, true).build().unwrap())),
        ("uring qd1", Box::new(move || config(Backend::Uring, 1, 64 << 10, true).build().unwrap())),
        ("uring qd7 buffered", Box::new(move || config(Backend::Uring, 7, 64 << 10, false).build().unwrap())),
        (
            "fault wrapper without faults",
            Box::new(move || {
                Box::new(FaultIo::new(config(Backend::Uring, 8, 64 << 10, true).build().unwrap(), vec![]))
            }),
        ),
    ]
}

fn files(dir: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    (0..3u64)
        .map(|i| {
            let path = dir.join(format!("f{i}"));
            let content = bytes(i + 7, FILE_BYTES);
            std::fs::write(&path, &content).unwrap();
            (path, content)
        })
        .collect()
}

/// Reads `ops` and returns each op's bytes, by op index, checking each op completes once.
fn read(io: &mut dyn Io, ops: &[ReadOp]) -> Result<Vec<Vec<u8>>, Error> {
    let mut out = vec![None; ops.len()];
    io.read(ops, &mut |i, bytes| {
        assert!(out[i].is_none(), "op {i} completed twice");
        out[i] = Some(bytes.to_vec());
        Ok(())
    })?;
    Ok(out.into_iter().map(|bytes| bytes.expect("every op completed")).collect())
}

fn op_strategy() -> impl Strategy<Value = (usize, u64, u32)> {
    (0usize..3, 0u64..(FILE_BYTES as u64 / 4096), 1u32..=16).prop_map(|(file, block, n)| {
        let n = n.min((FILE_BYTES as u64 / 4096 - block) as u32);
        (file, block * 4096, n * 4096)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn every_backend_returns_the_bytes_of_every_op(source in prop::collection::vec(op_strategy(), 0..200)) {
        let dir = tempdir();
        let files = files(dir.path());
        for (name, make) in backends() {
            let mut io = make();
            let ids: Vec<FileId> = files.iter().map(|(path, _)| io.open(path).unwrap()).collect();
            let ops: Vec<ReadOp> = source.iter().map(|&(f, offset, len)| ReadOp { file: ids[f], offset, len }).collect();
            let got = read(io.as_mut(), &ops).unwrap();
            for (bytes, &(f, offset, len)) in got.iter().zip(&source) {
                let expected = &files[f].1[offset as usize..offset as usize + len as usize];
                prop_assert!(bytes == expected, "{}: wrong bytes", name);
            }
        }
    }
}

#[test]
fn bad_ops_and_reads_past_the_end_are_errors_and_the_backend_survives() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let file = io.open(&files[0].0).unwrap();
        for bad in [
            ReadOp { file, offset: 1, len: 4096 },
            ReadOp { file, offset: 0, len: 100 },
            ReadOp { file, offset: 0, len: 0 },
            ReadOp { file, offset: 0, len: 128 << 10 },
            ReadOp { file: FileId(99), offset: 0, len: 4096 },
        ] {
            assert!(matches!(read(io.as_mut(), &[bad]), Err(Error::InvalidInput { .. })), "{name}: {bad:?}");
        }
        let past_end = ReadOp { file, offset: FILE_BYTES as u64, len: 4096 };
        match read(io.as_mut(), &[past_end]) {
            Err(Error::Io { op: "read", path, source }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{name}");
                assert!(path.to_string_lossy().contains("f0 at offset 1048576"), "{name}: {}", path.display());
            }
            other => panic!("{name}: expected end of file, got {other:?}"),
        }
        let good = ReadOp { file, offset: 8192, len: 8192 };
        assert_eq!(read(io.as_mut(), &[good]).unwrap()[0], files[0].1[8192..16384], "{name}");
        assert!(matches!(io.open(&dir.path().join("missing")), Err(Error::Io { op: "open", .. })), "{name}");
    }
}

#[test]
fn a_short_read_is_continued_and_ends_in_end_of_file() {
    // A file that ends 100 bytes into its second block: the read of that block comes back short,
    // the backend asks for the rest, and gets end of file.
    let dir = tempdir();
    let path = dir.path().join("short");
    let content = bytes(3, 4096 + 100);
    std::fs::write(&path, &content).unwrap();
    let buffered = |backend, queue_depth| IoConfig { backend, queue_depth, op_bytes_max: 8192, direct: false };
    for config in [buffered(Backend::Uring, 4), buffered(Backend::Uring, 1), buffered(Backend::Pread, 1)] {
        let mut io = config.build().unwrap();
        let file = io.open(&path).unwrap();
        match read(io.as_mut(), &[ReadOp { file, offset: 4096, len: 4096 }]) {
            Err(Error::Io { source, .. }) => assert_eq!(source.kind(), std::io::ErrorKind::UnexpectedEof, "{config:?}"),
            other => panic!("{config:?}: expected end of file, got {other:?}"),
        }
        assert_eq!(read(io.as_mut(), &[ReadOp { file, offset: 0, len: 4096 }]).unwrap()[0], content[..4096]);
    }
}

#[test]
fn a_failing_callback_stops_the_read_and_the_next_read_works() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let file = io.open(&files[1].0).unwrap();
        let ops: Vec<ReadOp> = (0..100).map(|i| ReadOp { file, offset: i * 4096, len: 4096 }).collect();
        let mut calls = 0;
        let outcome = io.read(&ops, &mut |_, _| {
            calls += 1;
            if calls == 10 { Err(Error::invalid_input("stop here")) } else { Ok(()) }
        });
        assert!(matches!(outcome, Err(Error::InvalidInput { ref detail }) if detail == "stop here"), "{name}");
        assert_eq!(calls, 10, "{name}: no callback after the failure");
        let got = read(io.as_mut(), &ops).unwrap();
        assert_eq!(got.concat(), files[1].1[..100 * 4096], "{name}");
    }
}

/// A stream that opens its file through the backend mid-stream, and asks to wait after `wait_at`
/// ops with nothing in flight.
struct Stalling<'a> {
    path: &'a Path,
    file: Option<FileId>,
    issued: u64,
    wait_at: u64,
    completed: u64,
}

impl ReadStream for Stalling<'_> {
    fn next_op(&mut self, files: &mut dyn FileOpener) -> granary::Result<Next> {
        if self.issued == self.wait_at {
            return Ok(Next::Wait);
        }
        let file = match self.file {
            Some(file) => file,
            None => *self.file.insert(files.open(self.path)?),
        };
        self.issued += 1;
        Ok(Next::Op(ReadOp { file, offset: 0, len: 4096 }))
    }

    fn complete(&mut self, _: u64, _: &[u8]) -> granary::Result<()> {
        self.completed += 1;
        Ok(())
    }
}

#[test]
fn a_stream_that_waits_with_nothing_in_flight_is_an_error_not_a_hang() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let mut stream = Stalling { path: &files[2].0, file: None, issued: 0, wait_at: 5, completed: 0 };
        let outcome = io.read_stream(&mut stream);
        assert!(matches!(outcome, Err(Error::InvalidInput { .. })), "{name}: {outcome:?}");
        assert_eq!(stream.completed, 5, "{name}: the ops before the stall completed");
    }
}

#[test]
fn injected_faults_hit_the_op_they_name() {
    let dir = tempdir();
    let files = files(dir.path());
    let inner = IoConfig { backend: Backend::Uring, queue_depth: 4, ..IoConfig::default() }.build().unwrap();
    let mut io = FaultIo::new(
        inner,
        vec![Fault::FlipBit { op: 12, bit: 8 * 4096 + 3 }, Fault::FailRead { op: 15, errno: libc::EIO }],
    );
    let file = io.open(&files[0].0).unwrap();
    let ops: Vec<ReadOp> = (0..10).map(|i| ReadOp { file, offset: i * 8192, len: 8192 }).collect();
    let first = read(&mut io, &ops).unwrap();
    assert_eq!(first.concat(), files[0].1[..10 * 8192]);
    let second = read(&mut io, &ops[..3]).unwrap();
    let mut expected = files[0].1[2 * 8192..3 * 8192].to_vec();
    expected[4096] ^= 1 << 3;
    assert_eq!(second[2], expected, "op 12 is the third op of the second read");
    let third = read(&mut io, &ops[..6]);
    assert!(matches!(third, Err(Error::Io { ref source, .. }) if source.raw_os_error() == Some(libc::EIO)));
}

#[test]
fn closing_every_file_forgets_their_ids_and_files_opened_after_read_their_own_bytes() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let old: Vec<FileId> = files.iter().map(|(path, _)| io.open(path).unwrap()).collect();
        let op = |file| ReadOp { file, offset: 4096, len: 8192 };
        assert_eq!(read(io.as_mut(), &[op(old[2])]).unwrap()[0], files[2].1[4096..12288], "{name}");
        // Removed while open, a file is still held (so the check below can see a leak)...
        std::fs::remove_file(&files[0].0).unwrap();
        assert!(held_open(&files[0].0), "{name}: an open file is not seen as held");
        io.close_all().unwrap();
        // ...and after the close nothing holds it: its space is free.
        assert!(!held_open(&files[0].0), "{name}: a closed file is still open");
        // The closed files' ids name nothing now, and the next file opened reads its own
        // bytes, not those of the file its id or slot had before.
        assert!(matches!(read(io.as_mut(), &[op(old[0])]), Err(Error::InvalidInput { .. })), "{name}");
        std::fs::write(&files[0].0, &files[1].1).unwrap();
        let new = io.open(&files[2].0).unwrap();
        assert_eq!(read(io.as_mut(), &[op(new)]).unwrap()[0], files[2].1[4096..12288], "{name}");
        let replaced = io.open(&files[0].0).unwrap();
        assert_eq!(read(io.as_mut(), &[op(replaced)]).unwrap()[0], files[1].1[4096..12288], "{name}");
        io.close_all().unwrap();
        io.close_all().unwrap();
        std::fs::write(&files[0].0, &files[0].1).unwrap();
    }
}

#[test]
fn closing_one_file_frees_it_and_leaves_the_others_readable() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let ids: Vec<FileId> = files.iter().map(|(path, _)| io.open(path).unwrap()).collect();
        let op = |file| ReadOp { file, offset: 4096, len: 8192 };
        std::fs::remove_file(&files[1].0).unwrap();
        assert!(held_open(&files[1].0), "{name}");
        io.close(ids[1]).unwrap();
        assert!(!held_open(&files[1].0), "{name}: a closed file is still open");
        // Its id reads nothing (a clear error); the others read their own bytes, and a file
        // opened afterwards gets an id of its own.
        let closed = read(io.as_mut(), &[op(ids[1])]).unwrap_err();
        assert!(closed.to_string().contains("closed"), "{name}: {closed}");
        for i in [0, 2] {
            assert_eq!(read(io.as_mut(), &[op(ids[i])]).unwrap()[0], files[i].1[4096..12288], "{name}");
        }
        std::fs::write(&files[1].0, &files[2].1).unwrap();
        let again = io.open(&files[1].0).unwrap();
        assert!(!ids.contains(&again), "{name}: an id reused before close_all");
        assert_eq!(read(io.as_mut(), &[op(again)]).unwrap()[0], files[2].1[4096..12288], "{name}");
        io.close_all().unwrap();
        std::fs::write(&files[1].0, &files[1].1).unwrap();
    }
}

/// Whether this process holds a descriptor of the removed file `path` (Linux: /proc/self/fd).
fn held_open(path: &Path) -> bool {
    let entries = std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd lists this process's descriptors");
    let deleted = format!("{} (deleted)", path.display());
    entries
        .flatten()
        .any(|entry| std::fs::read_link(entry.path()).is_ok_and(|target| target.to_string_lossy() == deleted))
}

/// A stream that reads two files, closes the first through the opener once its ops completed
/// (while ops on the second may be in flight), and reads the second to its end.
struct ClosingMidStream<'a> {
    paths: [&'a Path; 2],
    files: [Option<FileId>; 2],
    issued: u64,
    completed: u64,
    closed_while_held: Option<bool>,
    second: Vec<(u64, Vec<u8>)>,
}

impl ReadStream for ClosingMidStream<'_> {
    fn next_op(&mut self, opener: &mut dyn FileOpener) -> granary::Result<Next> {
        if self.files[0].is_none() && self.issued == 0 {
            self.files = [Some(opener.open(self.paths[0])?), Some(opener.open(self.paths[1])?)];
        }
        if self.issued < 4 {
            // Four ops on the first file; nothing more until they completed.
            self.issued += 1;
            let file = self.files[0].expect("opened above");
            return Ok(Next::Op(ReadOp { file, offset: (self.issued - 1) * 4096, len: 4096 }));
        }
        if self.closed_while_held.is_none() {
            if self.completed < 4 {
                return Ok(Next::Wait);
            }
            std::fs::remove_file(self.paths[0]).unwrap();
            let held = held_open(self.paths[0]);
            opener.close(self.files[0].take().expect("open"))?;
            self.closed_while_held = Some(held && !held_open(self.paths[0]));
        }
        if self.issued < 4 + 64 {
            self.issued += 1;
            let file = self.files[1].expect("opened above");
            return Ok(Next::Op(ReadOp { file, offset: (self.issued - 5) * 4096, len: 4096 }));
        }
        Ok(Next::Done)
    }

    fn complete(&mut self, seq: u64, bytes: &[u8]) -> granary::Result<()> {
        self.completed += 1;
        if seq >= 4 {
            self.second.push((seq - 4, bytes.to_vec()));
        }
        Ok(())
    }
}

#[test]
fn a_file_closed_mid_stream_is_let_go_and_the_others_read_on() {
    let dir = tempdir();
    let files = files(dir.path());
    for (name, make) in backends() {
        let mut io = make();
        let mut stream = ClosingMidStream {
            paths: [&files[0].0, &files[1].0],
            files: [None, None],
            issued: 0,
            completed: 0,
            closed_while_held: None,
            second: Vec::new(),
        };
        io.read_stream(&mut stream).unwrap();
        assert_eq!(stream.closed_while_held, Some(true), "{name}: the removed file was held, then let go");
        stream.second.sort_by_key(|(i, _)| *i);
        let second: Vec<u8> = stream.second.into_iter().flat_map(|(_, bytes)| bytes).collect();
        assert_eq!(second, files[1].1[..64 * 4096], "{name}");
        io.close_all().unwrap();
        std::fs::write(&files[0].0, &files[0].1).unwrap();
    }
}
