//! What the fuzz targets share: a dataset directory unpacked from the fuzzer's bytes, for the
//! readers that take a directory (MDS, LitData) or files (Parquet).
//!
//! The bytes are one flags byte (each target reads it its own way), then files, each a `u8`
//! name length, the name, a `u32` little-endian length and the contents; a file whose contents
//! run past the end keeps what there is. `scripts/fuzz-format-seeds.py` packs real datasets this way
//! for the seeds. Owns: the unpacking into a directory of the process's own. Never: writes
//! outside that directory (a name that is not one plain file name is passed over).

use std::path::{Path, PathBuf};

/// The directory of this process's inputs, emptied and filled with the files packed in `data`;
/// returns it with the flags byte.
pub fn unpack(data: &[u8]) -> (PathBuf, u8) {
    let dir = scratch();
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("the fuzz scratch directory");
    let Some((&flags, mut rest)) = data.split_first() else { return (dir, 0) };
    while let Some((&name_len, after)) = rest.split_first() {
        let name_len = usize::from(name_len).min(after.len());
        let (name, after) = after.split_at(name_len);
        let Some(len) = after.get(..4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize) else { break };
        let after = &after[4..];
        let (contents, after) = after.split_at(len.min(after.len()));
        if let Some(name) = plain_name(name) {
            std::fs::write(dir.join(name), contents).expect("a fuzz input file");
        }
        rest = after;
    }
    (dir, flags)
}

/// `name` when it names a plain file in a directory: letters, digits, `.`, `_`, `-`, and not
/// `.` or `..`.
fn plain_name(name: &[u8]) -> Option<&str> {
    let name = std::str::from_utf8(name).ok()?;
    let plain = !name.is_empty()
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    plain.then_some(name)
}

/// A directory of this process's own, in memory where the machine has `/dev/shm`.
fn scratch() -> PathBuf {
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() };
    base.join(format!("granary-fuzz-{}", std::process::id()))
}

/// A sink that only counts what a reader hands over.
#[derive(Default)]
pub struct Count {
    pub records: u64,
    pub bytes: u64,
}

impl granary::ingest::RecordSink for Count {
    fn push(&mut self, record: &[u8]) -> granary::Result<()> {
        self.records += 1;
        self.bytes += record.len() as u64;
        Ok(())
    }
}
