//! The scrub: every file checked on its own, then every live version checked for readability.
//!
//! Owns `verify` (what `granary verify` runs) and `verify_shard` (one shard file, completely). A
//! whole-store scrub checks each file (BLAKE3 and every CRC32C of each shard, the id of each
//! manifest, each fragment whole against its id, each ref and ref history), then walks every live version, from its ref, or from its
//! history where the ref is damaged or lost, and names each version some record of which
//! cannot be read: a file can be sound while the version that needs it is not, because another
//! file it lists is gone. A shard held here only as erasure-coded fragments (a node of a coded
//! dataset) is counted as such, not as missing: its other fragments are on other nodes, which
//! the scrub does not reach. Needs no lock, so readers can run it. Never: changes a file (repair
//! does).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::shard::{BLOCK_BYTES, DATA_OFFSET, ShardMeta};
use crate::store::{DatasetName, ObjectKind, RefLog, StorePaths, VersionSpec};

use super::file_len;

/// A file that failed a check.
#[derive(Debug)]
pub struct Failure {
    /// The file.
    pub path: PathBuf,
    /// What is wrong.
    pub error: Error,
}

/// Why a live version cannot be read in full.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Hurt {
    /// The ref is damaged; its history still names this version (`repair` rebuilds the ref).
    RefDamaged,
    /// The ref file is gone; its history still names this version (`repair` restores it).
    RefLost,
    /// The ref is damaged and there is no history to rebuild it from: the versions it named
    /// are unknown.
    RefUnrecoverable,
    /// The version's manifest is missing.
    ManifestMissing(ManifestId),
    /// The version's manifest failed its check.
    ManifestDamaged(ManifestId),
    /// A shard the version lists is missing.
    ShardMissing(ShardId),
    /// A shard the version lists failed its check.
    ShardDamaged(ShardId),
}

impl fmt::Display for Hurt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RefDamaged => f.write_str("its ref is damaged (`granary repair` rebuilds it from the ref's history)"),
            Self::RefLost => f.write_str("its ref file is gone (`granary repair` restores it from the ref's history)"),
            Self::RefUnrecoverable => f.write_str("its ref is damaged and has no history to rebuild it from"),
            Self::ManifestMissing(id) => write!(f, "manifest {id} is missing"),
            Self::ManifestDamaged(id) => write!(f, "manifest {id} is damaged"),
            Self::ShardMissing(id) => write!(f, "shard {id} is missing"),
            Self::ShardDamaged(id) => write!(f, "shard {id} is damaged"),
        }
    }
}

/// A live dataset version that cannot be read in full, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    /// The dataset.
    pub name: DatasetName,
    /// The version, when it is known (not for a damaged ref without a history).
    pub number: Option<u64>,
    /// What is wrong.
    pub hurt: Hurt,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.number {
            Some(number) => write!(f, "{}@{number}: {}", self.name, self.hurt),
            None => write!(f, "{}: {}", self.name, self.hurt),
        }
    }
}

/// What a scrub found.
#[derive(Debug, Default)]
pub struct VerifyReport {
    /// Shard files whose BLAKE3 id and every CRC matched.
    pub shards_ok: u64,
    /// Manifest files whose id matched.
    pub manifests_ok: u64,
    /// Fragment files (erasure coding) that checked out whole against their id (whole-store
    /// scrub only).
    pub fragments_ok: u64,
    /// Ref files that decoded.
    pub refs_ok: u64,
    /// Shards of live versions that are not here but at the origin of an attached dataset
    /// (whole-store scrub only; a version's scrub fetches and checks them), once per version.
    pub shards_at_origin: u64,
    /// Shards of live versions that are not here whole but as erasure-coded fragments that
    /// checked out (whole-store scrub only), once per version: the rest of each shard's
    /// fragments are on other nodes, which this scrub does not reach (`granary get
    /// --cluster-key` rebuilds a shard from any `k`).
    pub shards_as_fragments: u64,
    /// Live versions every record of which can be read, here or from fragments (whole-store
    /// scrub only).
    pub versions_ok: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Shards read through the page cache (its pages dropped first) because the file system
    /// refused O_DIRECT: the rest were read from the device.
    pub shards_through_cache: u64,
    /// Files that failed.
    pub failures: Vec<Failure>,
    /// Live versions that cannot be read in full (whole-store scrub only).
    pub unreadable: Vec<Unreadable>,
}

impl VerifyReport {
    /// Whether everything checked out.
    pub fn is_clean(&self) -> bool {
        self.failures.is_empty() && self.unreadable.is_empty()
    }
}

/// The outcome of checking one object file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Checked {
    Sound,
    Damaged,
}

/// The scrub behind [`super::Granary::verify`]; needs no lock, so readers can run it too. With
/// a spec, only that version's manifest and shards; otherwise every file in the store and the
/// readability of every live version.
pub fn verify(paths: &StorePaths, spec: Option<&VersionSpec>) -> Result<VerifyReport> {
    verify_through(paths, spec, None)
}

/// Where the shards of attached datasets come from (the origin cache), for a scrub.
pub trait ShardFetcher {
    /// Whether shard `id` can be fetched (an attached dataset names it).
    fn can_fetch(&self, id: ShardId) -> bool;
    /// Makes shard `id` present here, checked against its id.
    fn fetch(&self, id: ShardId) -> Result<()>;
}

/// [`verify`], with the shards of attached datasets in reach through `fetcher`: a version's
/// scrub fetches each such shard that is not here and checks it like the rest; the whole-store
/// scrub counts them as at their origin (`shards_at_origin`) rather than missing.
pub fn verify_through(
    paths: &StorePaths,
    spec: Option<&VersionSpec>,
    fetcher: Option<&dyn ShardFetcher>,
) -> Result<VerifyReport> {
    paths.check()?;
    let mut report = VerifyReport::default();
    type ObjectFiles = Vec<(ObjectId, PathBuf)>;
    let (manifests, shards): (ObjectFiles, ObjectFiles) = match spec {
        Some(spec) => {
            let (id, _) = paths.resolve(spec)?;
            let manifest = paths.read_manifest(id)?;
            let shards = manifest.entries().iter().map(|e| (e.shard.0, paths.shard(e.shard))).collect();
            (vec![(id.0, paths.manifest(id))], shards)
        }
        None => (paths.list_objects(ObjectKind::Manifest)?, paths.list_objects(ObjectKind::Shard)?),
    };
    let mut checked_manifests = BTreeMap::new();
    for (id, path) in manifests {
        match paths.read_manifest(ManifestId(id)) {
            Ok(_) => {
                report.manifests_ok += 1;
                report.bytes += file_len(&path)?;
                checked_manifests.insert(id, Checked::Sound);
            }
            Err(error) => {
                report.failures.push(Failure { path, error });
                checked_manifests.insert(id, Checked::Damaged);
            }
        }
    }
    let mut checked_shards = BTreeMap::new();
    for (id, path) in shards {
        let fetchable = fetcher.filter(|f| f.can_fetch(ShardId(id)));
        if let Some(fetcher) = fetchable
            && !path.exists()
            && let Err(error) = fetcher.fetch(ShardId(id))
        {
            report.failures.push(Failure { path, error });
            checked_shards.insert(id, Checked::Damaged);
            continue;
        }
        match verify_shard_from_disk(&path, ShardId(id)) {
            Ok((meta, direct)) => {
                report.shards_ok += 1;
                report.shards_through_cache += u64::from(!direct);
                report.bytes += meta.file_bytes();
                checked_shards.insert(id, Checked::Sound);
            }
            Err(error) => {
                report.failures.push(Failure { path, error });
                checked_shards.insert(id, Checked::Damaged);
            }
        }
    }
    // Shards of which a fragment here checked out.
    let mut fragment_shards = BTreeSet::new();
    if spec.is_none() {
        for (id, path) in paths.list_objects(ObjectKind::Fragment)? {
            match crate::erasure::FragmentFile::open(&path, id).and_then(|fragment| fragment.check_all()) {
                Ok(header) => {
                    report.fragments_ok += 1;
                    report.bytes += header.file_bytes();
                    fragment_shards.insert(header.shard.0);
                }
                // Removed (a node dropped it) between the listing and the check.
                Err(Error::NotFound { .. }) => {}
                Err(error) => report.failures.push(Failure { path, error }),
            }
        }
        let checked =
            Checks { manifests: &checked_manifests, shards: &checked_shards, fragments: &fragment_shards, fetcher };
        for name in paths.list_names()? {
            check_dataset(paths, &name, &checked, &mut report)?;
        }
    }
    Ok(report)
}

/// What the file scan found, by id: absent ids are files that do not exist.
struct Checks<'a> {
    manifests: &'a BTreeMap<ObjectId, Checked>,
    shards: &'a BTreeMap<ObjectId, Checked>,
    /// Shards not here whole of which a fragment here checked out.
    fragments: &'a BTreeSet<ObjectId>,
    fetcher: Option<&'a dyn ShardFetcher>,
}

/// Checks the ref and history of `name` and the readability of each of its live versions.
fn check_dataset(
    paths: &StorePaths,
    name: &DatasetName,
    checked: &Checks<'_>,
    report: &mut VerifyReport,
) -> Result<()> {
    let history = match paths.read_history(name) {
        Ok(history) => history,
        Err(error) if error.is_corruption() => {
            report.failures.push(Failure { path: paths.history_file(name), error });
            None
        }
        Err(error) => return Err(error),
    };
    let from_history = history.as_ref().and_then(|h| h.replay());
    let (live, hurt): (Option<RefLog>, Option<Hurt>) = match paths.read_ref(name) {
        Ok(log) => {
            report.refs_ok += 1;
            (Some(log), None)
        }
        Err(Error::NotFound { .. }) => (from_history, Some(Hurt::RefLost)),
        Err(error) if error.is_corruption() => {
            report.failures.push(Failure { path: paths.ref_file(name), error });
            match from_history {
                Some(log) => (Some(log), Some(Hurt::RefDamaged)),
                None => {
                    report.unreadable.push(Unreadable {
                        name: name.clone(),
                        number: None,
                        hurt: Hurt::RefUnrecoverable,
                    });
                    (None, None)
                }
            }
        }
        Err(error) => return Err(error),
    };
    let Some(live) = live else { return Ok(()) };
    for version in live.versions() {
        let unreadable = |hurt| Unreadable { name: name.clone(), number: Some(version.number), hurt };
        let before = report.unreadable.len();
        if let Some(hurt) = &hurt {
            report.unreadable.push(unreadable(hurt.clone()));
        }
        let manifest_id = version.manifest;
        match checked.manifests.get(&manifest_id.0) {
            None => report.unreadable.push(unreadable(Hurt::ManifestMissing(manifest_id))),
            Some(Checked::Damaged) => report.unreadable.push(unreadable(Hurt::ManifestDamaged(manifest_id))),
            Some(Checked::Sound) => {
                let manifest = paths.read_manifest(manifest_id)?;
                for entry in manifest.entries() {
                    match checked.shards.get(&entry.shard.0) {
                        Some(Checked::Sound) => {}
                        Some(Checked::Damaged) => report.unreadable.push(unreadable(Hurt::ShardDamaged(entry.shard))),
                        None if checked.fetcher.is_some_and(|f| f.can_fetch(entry.shard)) => {
                            report.shards_at_origin += 1;
                        }
                        // Erasure-coded: this node holds a fragment; the others are elsewhere.
                        None if checked.fragments.contains(&entry.shard.0) => report.shards_as_fragments += 1,
                        None => report.unreadable.push(unreadable(Hurt::ShardMissing(entry.shard))),
                    }
                }
            }
        }
        if report.unreadable.len() == before {
            report.versions_ok += 1;
        }
    }
    Ok(())
}

/// Checks one shard file completely: its metadata, every data block's CRC, and the BLAKE3 hash
/// of the whole file against `id`. Streams the file once after reading its metadata, from the
/// device (`open_from_disk`): a block damaged on disk fails here whatever the page cache holds.
pub fn verify_shard(path: &Path, id: ShardId) -> Result<ShardMeta> {
    verify_shard_from_disk(path, id).map(|(meta, _)| meta)
}

/// `verify_shard`, and whether the bytes were read with O_DIRECT (false: the file system
/// refused it, and the file's cached pages were dropped before an ordinary read instead).
pub fn verify_shard_from_disk(path: &Path, id: ShardId) -> Result<(ShardMeta, bool)> {
    let meta = ShardMeta::read(path)?;
    let (mut file, direct) = open_from_disk(path)?;
    let mut hasher = blake3::Hasher::new();
    // Page-aligned and a whole number of blocks, as O_DIRECT needs.
    let mut buf = crate::io::AlignedBuf::new(8 << 20)?;
    let data = DATA_OFFSET..meta.footer().index_offset;
    let mut offset = 0u64;
    loop {
        let n = read_full(&mut file, buf.as_mut_slice()).map_err(|e| Error::io("read", path, e))?;
        if n == 0 {
            break;
        }
        let chunk = &buf.as_slice()[..n];
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
        if n < buf.len() {
            // O_DIRECT reads whole blocks: a short read is the file's end.
            break;
        }
    }
    if offset != meta.file_bytes() {
        return Err(Error::io("read", path, std::io::Error::other("the file changed length while being verified")));
    }
    let actual = ObjectId::from_hash(hasher.finalize());
    if actual != id.0 {
        return Err(Error::HashMismatch { path: path.to_owned(), expected: id.0, actual });
    }
    Ok((meta, direct))
}

/// `path` opened to read what the device holds rather than what the page cache holds: with
/// O_DIRECT, or where the file system refuses it (EINVAL: tmpfs before Linux 6.6, some FUSE
/// mounts), opened plainly after its clean cached pages are dropped (`POSIX_FADV_DONTNEED`;
/// pages another process keeps mapped or dirty stay). The second says which.
fn open_from_disk(path: &Path) -> Result<(File, bool)> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
        Ok(file) => return Ok((file, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(Error::io("open", path, e)),
    }
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file.metadata().map_err(|e| Error::io("stat", path, e))?.len();
    crate::io::advise(&file, 0, len, crate::io::Advice::DontNeed).map_err(|e| Error::io("fadvise", path, e))?;
    Ok((file, false))
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
