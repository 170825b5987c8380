//! The scrub: every file of the store, or one version's, checked completely.
//!
//! Owns `verify` (what `granary verify` runs) and `verify_shard` (one shard file, completely:
//! BLAKE3 and every CRC32C). Needs no lock, so readers can run it. Never: changes a file (repair
//! does).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::shard::{BLOCK_BYTES, DATA_OFFSET, ShardMeta};
use crate::store::{ObjectKind, StorePaths, VersionSpec};

use super::file_len;

/// A file that failed a check.
#[derive(Debug)]
pub struct Failure {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub error: Error,
}

/// What a scrub found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Shard files whose BLAKE3 id and every CRC matched.
    pub shards_ok: u64,
    /// Manifest files whose id matched.
    pub manifests_ok: u64,
    /// Ref files that decoded and point at existing manifests.
    pub refs_ok: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Everything that failed.
    pub failures: Vec<Failure>,
}

/// The scrub behind [`super::Granary::verify`]; needs no lock, so readers can run it too.
pub fn verify(paths: &StorePaths, spec: Option<&VersionSpec>) -> Result<VerifyReport> {
    paths.check()?;
    let mut report = VerifyReport::default();
    type Objects = Vec<(ObjectId, PathBuf)>;
    let (manifests, shards): (Objects, Objects) = match spec {
        Some(spec) => {
            let (id, _) = paths.resolve(spec)?;
            let manifest = paths.read_manifest(id)?;
            let shards = manifest.entries().iter().map(|e| (e.shard.0, paths.shard(e.shard))).collect();
            (vec![(id.0, paths.manifest(id))], shards)
        }
        None => {
            for name in paths.list_refs()? {
                let checked = paths.read_ref(&name).and_then(|log| {
                    log.versions().iter().try_for_each(|v| {
                        if paths.manifest(v.manifest).exists() {
                            Ok(())
                        } else {
                            Err(Error::NotFound { what: format!("manifest {} of {name}@{}", v.manifest, v.number) })
                        }
                    })
                });
                match checked {
                    Ok(()) => report.refs_ok += 1,
                    Err(error) => report.failures.push(Failure { path: paths.ref_file(&name), error }),
                }
            }
            (paths.list_objects(ObjectKind::Manifest)?, paths.list_objects(ObjectKind::Shard)?)
        }
    };
    for (id, path) in manifests {
        match paths.read_manifest(ManifestId(id)) {
            Ok(_) => {
                report.manifests_ok += 1;
                report.bytes += file_len(&path)?;
            }
            Err(error) => report.failures.push(Failure { path, error }),
        }
    }
    for (id, path) in shards {
        match verify_shard(&path, ShardId(id)) {
            Ok(meta) => {
                report.shards_ok += 1;
                report.bytes += meta.file_bytes();
            }
            Err(error) => report.failures.push(Failure { path, error }),
        }
    }
    Ok(report)
}

/// Checks one shard file completely: its metadata, every data block's CRC, and the BLAKE3 hash
/// of the whole file against `id`. Streams the file once after reading its metadata.
pub fn verify_shard(path: &Path, id: ShardId) -> Result<ShardMeta> {
    let meta = ShardMeta::read(path)?;
    let mut file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; 8 << 20];
    let data = DATA_OFFSET..meta.footer().index_offset;
    let mut offset = 0u64;
    loop {
        let n = read_full(&mut file, &mut buf).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            break;
        }
        let chunk = &buf[..n];
        hasher.update(chunk);
        // Chunks are block-aligned (the buffer is a whole number of blocks and only the file's
        // end is short), so every data block falls in one chunk.
        let start = offset.max(data.start);
        let end = (offset + n as u64).min(data.end);
        if start < end {
            let first_block = (start - DATA_OFFSET) / BLOCK_BYTES as u64;
            let bytes = &chunk[(start - offset) as usize..(end - offset) as usize];
            meta.check_blocks(first_block, bytes).map_err(|(block, expected, actual)| Error::ChecksumMismatch {
                shard: id,
                block,
                expected,
                actual,
            })?;
        }
        offset += n as u64;
    }
    if offset != meta.file_bytes() {
        return Err(Error::io("read", path, std::io::Error::other("the file changed length while being verified")));
    }
    let actual = ObjectId::from_hash(hasher.finalize());
    if actual != id.0 {
        return Err(Error::HashMismatch { path: path.to_owned(), expected: id.0, actual });
    }
    Ok(meta)
}

/// Reads until `buf` is full or the file ends; returns the bytes read.
fn read_full(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read(&mut buf[done..]) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
