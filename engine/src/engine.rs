//! The engine: the one place that wires store, catalog, ingest and the read path together.
//!
//! `Granary` is a store opened for writing (it holds the store lock and the sled catalog). It
//! ingests, lists, verifies, repairs and collects garbage. Reading needs no `Granary`:
//! `Dataset::open` works from the files alone, so every rank of a trainer can read while one
//! process writes.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::catalog::{Catalog, ObjectEntry};
use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::ingest::{Ingest, IngestOptions, manifest_entry};
use crate::read::Dataset;
use crate::shard::{BLOCK_BYTES, DATA_OFFSET, ShardMeta};
use crate::store::{DatasetName, ObjectKind, RefLog, Store, StorePaths, VersionSpec};

/// One dataset version as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VersionSummary {
    /// The version number.
    pub number: u64,
    /// Its manifest.
    pub manifest: ManifestId,
    /// Counts and layout, when the catalog has the manifest.
    pub entry: Option<ObjectEntry>,
}

/// One dataset as listed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DatasetSummary {
    /// The name.
    pub name: DatasetName,
    /// Live versions, oldest first.
    pub versions: Vec<VersionSummary>,
}

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

/// What a catalog rebuild did.
#[derive(Debug, Default)]
pub struct RepairReport {
    /// Shards cataloged.
    pub shards: u64,
    /// Manifests cataloged.
    pub manifests: u64,
    /// Datasets cataloged.
    pub datasets: u64,
    /// Temp files of dead writers removed (when the store was opened, or by the repair).
    pub tmp_removed: usize,
    /// Files that failed verification, moved to `quarantine/`, with why.
    pub quarantined: Vec<(PathBuf, String)>,
    /// Objects referenced but missing (a version that cannot be read until they return).
    pub missing: Vec<String>,
}

/// What garbage collection removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Shard files removed.
    pub shards: u64,
    /// Manifest files removed.
    pub manifests: u64,
    /// Bytes freed.
    pub bytes: u64,
}

/// A store opened for writing.
pub struct Granary {
    store: Store,
    catalog: Catalog,
}

impl Granary {
    /// Opens an existing store for writing.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        Self::open_inner(root.into(), false)
    }

    /// Opens the store at `root` for writing, creating it if needed.
    pub fn create(root: impl Into<PathBuf>) -> Result<Self> {
        Self::open_inner(root.into(), true)
    }

    /// Opens (or, with `create`, creates) the store for writing, waiting up to `wait` while
    /// another writer holds it: an ingest, or a replication node publishing what arrived.
    pub fn open_waiting(root: impl Into<PathBuf>, create: bool, wait: std::time::Duration) -> Result<Self> {
        let root = root.into();
        let started = std::time::Instant::now();
        loop {
            match Self::open_inner(root.clone(), create) {
                Err(e) if e.is_busy() && started.elapsed() < wait => {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => return other,
            }
        }
    }

    fn open_inner(root: PathBuf, create: bool) -> Result<Self> {
        // Before the lock and the clean-up of tmp/: a forked child that cannot open the catalog
        // must not touch the store at all.
        Catalog::check_process()?;
        let store = Store::open(root, create)?;
        let catalog = Catalog::open_sled(&store.paths().catalog_dir())?;
        let granary = Self { store, catalog };
        granary.reconcile_datasets()?;
        Ok(granary)
    }

    /// After a crash between a ref's rename and its catalog entry, the ref file (the commit
    /// point) is ahead of the catalog: bring the catalog's datasets in line with the ref files.
    fn reconcile_datasets(&self) -> Result<()> {
        let names = self.store.paths().list_refs()?;
        let mut changed = false;
        for name in &names {
            // A damaged ref must not lock everyone out: `verify` reports it and `repair`
            // quarantines it, and both need the store to open.
            let log = match self.store.paths().read_ref(name) {
                Ok(log) => log,
                Err(e) if e.is_corruption() => continue,
                Err(e) => return Err(e),
            };
            if self.catalog.dataset(name)?.as_ref() != Some(&log) {
                self.catalog.put_dataset(name, &log)?;
                changed = true;
            }
        }
        for (name, _) in self.catalog.datasets()? {
            if names.binary_search(&name).is_err() {
                self.catalog.remove_dataset(&name)?;
                changed = true;
            }
        }
        if changed {
            self.catalog.flush()?;
        }
        Ok(())
    }

    /// The store's paths.
    pub fn paths(&self) -> &StorePaths {
        self.store.paths()
    }

    /// The catalog.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// Starts ingesting records of `layout` into dataset `name`.
    pub fn ingest(
        &mut self,
        name: DatasetName,
        layout: crate::shard::Layout,
        options: IngestOptions,
    ) -> Result<Ingest<'_>> {
        Ingest::begin(&self.store, &self.catalog, name, layout, options)
    }

    /// Opens a dataset version for reading.
    pub fn open_dataset(&self, spec: &VersionSpec) -> Result<Arc<Dataset>> {
        Dataset::open(self.store.paths(), spec)
    }

    /// Every dataset and its versions, from the catalog.
    pub fn datasets(&self) -> Result<Vec<DatasetSummary>> {
        let mut out = Vec::new();
        for (name, log) in self.catalog.datasets()? {
            let mut versions = Vec::new();
            for version in log.versions() {
                let entry = self.catalog.manifest(version.manifest)?;
                versions.push(VersionSummary { number: version.number, manifest: version.manifest, entry });
            }
            out.push(DatasetSummary { name, versions });
        }
        Ok(out)
    }

    /// Removes version `number` of `name`, or the whole dataset when `None`. Its files stay until
    /// `gc` (other versions may share them).
    pub fn remove(&mut self, name: &DatasetName, number: Option<u64>) -> Result<()> {
        let log = self.store.paths().read_ref(name)?;
        let remaining = match number {
            None => None,
            Some(number) => {
                if log.version(number).is_none() {
                    return Err(Error::NotFound { what: format!("version {number} of dataset {name}") });
                }
                log.without(number)
            }
        };
        match remaining {
            Some(log) => {
                self.store.write_ref(name, &log)?;
                self.catalog.put_dataset(name, &log)?;
            }
            None => {
                self.store.remove_ref(name)?;
                self.catalog.remove_dataset(name)?;
            }
        }
        self.catalog.flush()
    }

    /// Removes every manifest and shard that no live version references.
    pub fn gc(&mut self) -> Result<GcReport> {
        let (live_manifests, live_shards) = self.live_objects()?;
        let mut report = GcReport::default();
        for (id, path) in self.store.paths().list_objects(ObjectKind::Manifest)? {
            if !live_manifests.contains(&id) {
                report.bytes += file_len(&path)?;
                self.store.remove_object(ObjectKind::Manifest, id)?;
                self.catalog.remove_manifest(ManifestId(id))?;
                report.manifests += 1;
            }
        }
        for (id, path) in self.store.paths().list_objects(ObjectKind::Shard)? {
            if !live_shards.contains(&id) {
                report.bytes += file_len(&path)?;
                self.store.remove_object(ObjectKind::Shard, id)?;
                self.catalog.remove_shard(ShardId(id))?;
                report.shards += 1;
            }
        }
        self.catalog.flush()?;
        Ok(report)
    }

    /// The manifests and shards reachable from the refs.
    fn live_objects(&self) -> Result<(BTreeSet<ObjectId>, BTreeSet<ObjectId>)> {
        let (mut manifests, mut shards) = (BTreeSet::new(), BTreeSet::new());
        for name in self.store.paths().list_refs()? {
            for version in self.store.paths().read_ref(&name)?.versions() {
                if manifests.insert(version.manifest.0) {
                    let manifest = self.store.paths().read_manifest(version.manifest)?;
                    shards.extend(manifest.entries().iter().map(|entry| entry.shard.0));
                }
            }
        }
        Ok((manifests, shards))
    }

    /// Full scrub: BLAKE3 and every CRC of each shard, the id of each manifest, each ref. With a
    /// spec, only that version's manifest and shards; otherwise every file in the store.
    pub fn verify(&self, spec: Option<&VersionSpec>) -> Result<VerifyReport> {
        verify(self.store.paths(), spec)
    }

    /// Publishes `file` (a synced file on the store's filesystem, outside `shards/` and
    /// `manifests/`) as object `id` of `kind`, and catalogs it. The caller has hashed the file's
    /// bytes to `id` (replication streams and hashes them as they arrive); this checks that they
    /// decode as what they claim to be (a shard's metadata, a manifest), so a well-formed id
    /// cannot smuggle in bytes the read path would refuse later. Returns false when an intact
    /// copy was already there (the file is then removed).
    pub fn adopt_object(&mut self, kind: ObjectKind, id: ObjectId, file: &Path) -> Result<bool> {
        let entry = match kind {
            ObjectKind::Shard => {
                let meta = ShardMeta::read(file)?;
                ObjectEntry {
                    n_records: meta.n_records(),
                    n_shards: 1,
                    file_bytes: meta.file_bytes(),
                    layout: meta.layout().clone(),
                }
            }
            ObjectKind::Manifest => {
                let bytes = std::fs::read(file).map_err(|e| Error::io("read", file, e))?;
                let manifest = crate::manifest::Manifest::decode(&bytes)
                    .map_err(|source| Error::Format { path: file.to_owned(), source })?;
                manifest_entry(&manifest)
            }
        };
        let published = self.store.publish(kind, id, file)?;
        match kind {
            ObjectKind::Shard => self.catalog.put_shard(ShardId(id), &entry)?,
            ObjectKind::Manifest => self.catalog.put_manifest(ManifestId(id), &entry)?,
        }
        self.catalog.flush()?;
        Ok(published)
    }

    /// Moves object `id` to `quarantine/` (it failed verification) and forgets it in the catalog.
    /// Returns where it went, or `None` when there was no such file.
    pub fn quarantine_object(&mut self, kind: ObjectKind, id: ObjectId) -> Result<Option<PathBuf>> {
        let path = self.store.paths().object(kind, id);
        if !path.exists() {
            return Ok(None);
        }
        let moved = self.store.quarantine(&path)?;
        self.forget_in_catalog(kind, id)?;
        Ok(Some(moved))
    }

    /// Deletes object `id` (a cached copy that another node holds) and forgets it.
    pub fn forget_object(&mut self, kind: ObjectKind, id: ObjectId) -> Result<()> {
        match self.store.remove_object(kind, id) {
            Ok(()) => {}
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        self.forget_in_catalog(kind, id)
    }

    fn forget_in_catalog(&mut self, kind: ObjectKind, id: ObjectId) -> Result<()> {
        match kind {
            ObjectKind::Shard => self.catalog.remove_shard(ShardId(id))?,
            ObjectKind::Manifest => self.catalog.remove_manifest(ManifestId(id))?,
        }
        self.catalog.flush()
    }

    /// Adopts `log` as dataset `name`'s ref when it extends the local one (or there is none):
    /// it holds the local latest version with the same manifest, its own latest is newer, every
    /// version number the two share names the same manifest (one history, not two datasets that
    /// happen to share a name), and every manifest it names is stored here. Older local versions
    /// that `log` lacks were removed where it comes from, and go. Returns whether it was adopted;
    /// a ref that is not ahead is left as it is (refs only move forward), and one that does not
    /// extend this history is refused, never merged: a person decides which history to keep.
    pub fn adopt_ref(&mut self, name: &DatasetName, log: &RefLog) -> Result<bool> {
        for version in log.versions() {
            if !self.store.paths().manifest(version.manifest).exists() {
                return Err(Error::NotFound {
                    what: format!("manifest {} of {name}@{}", version.manifest, version.number),
                });
            }
        }
        match self.store.paths().read_ref(name) {
            Ok(local) if local.latest().number >= log.latest().number => return Ok(false),
            Ok(local) => {
                let latest = local.latest();
                if log.version(latest.number).is_none_or(|theirs| theirs.manifest != latest.manifest) {
                    return Err(Error::invalid_input(format!(
                        "dataset {name}: the offered ref does not hold this node's latest version {} ({}): \
                         two histories",
                        latest.number, latest.manifest
                    )));
                }
                for version in local.versions() {
                    if let Some(theirs) = log.version(version.number)
                        && theirs.manifest != version.manifest
                    {
                        return Err(Error::invalid_input(format!(
                            "dataset {name}: version {} is manifest {} here and {} in the offered ref: two histories",
                            version.number, version.manifest, theirs.manifest
                        )));
                    }
                }
            }
            Err(Error::NotFound { .. }) => {}
            // A damaged local ref is replaced by the good one.
            Err(e) if e.is_corruption() => {}
            Err(e) => return Err(e),
        }
        self.store.write_ref(name, log)?;
        self.catalog.put_dataset(name, log)?;
        self.catalog.flush()?;
        Ok(true)
    }

    /// Rebuilds the catalog from a scan of the files, verifying each one; files that fail are
    /// quarantined, never deleted.
    pub fn repair(&mut self) -> Result<RepairReport> {
        let paths = self.store.paths().clone();
        let tmp_removed = self.store.stale_tmp_removed() + self.store.clean_tmp()?;
        let mut report = RepairReport { tmp_removed, ..RepairReport::default() };
        self.catalog.clear()?;
        let mut shards = BTreeSet::new();
        for (id, path) in paths.list_objects(ObjectKind::Shard)? {
            match verify_shard(&path, ShardId(id)) {
                Ok(meta) => {
                    let entry = ObjectEntry {
                        n_records: meta.n_records(),
                        n_shards: 1,
                        file_bytes: meta.file_bytes(),
                        layout: meta.layout().clone(),
                    };
                    self.catalog.put_shard(ShardId(id), &entry)?;
                    shards.insert(id);
                    report.shards += 1;
                }
                Err(e) if e.is_corruption() => {
                    self.store.quarantine(&path)?;
                    report.quarantined.push((path, e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        let mut manifests = BTreeSet::new();
        for (id, path) in paths.list_objects(ObjectKind::Manifest)? {
            match paths.read_manifest(ManifestId(id)) {
                Ok(manifest) => {
                    for entry in manifest.entries() {
                        if !shards.contains(&entry.shard.0) {
                            report.missing.push(format!("shard {} (listed by manifest {id})", entry.shard));
                        }
                    }
                    self.catalog.put_manifest(ManifestId(id), &manifest_entry(&manifest))?;
                    manifests.insert(id);
                    report.manifests += 1;
                }
                Err(e) if e.is_corruption() => {
                    self.store.quarantine(&path)?;
                    report.quarantined.push((path, e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        for name in paths.list_refs()? {
            match paths.read_ref(&name) {
                Ok(log) => {
                    for version in log.versions() {
                        if !manifests.contains(&version.manifest.0) {
                            report
                                .missing
                                .push(format!("manifest {} (version {} of {name})", version.manifest, version.number));
                        }
                    }
                    self.catalog.put_dataset(&name, &log)?;
                    report.datasets += 1;
                }
                Err(e) if e.is_corruption() => {
                    let path = paths.ref_file(&name);
                    self.store.quarantine(&path)?;
                    report.quarantined.push((path, e.to_string()));
                }
                Err(e) => return Err(e),
            }
        }
        self.catalog.flush()?;
        Ok(report)
    }
}

/// Every dataset and its versions, read from the ref and manifest files (no lock, no catalog):
/// what `ls` shows while another process holds the store.
pub fn datasets_from_files(paths: &StorePaths) -> Result<Vec<DatasetSummary>> {
    paths.check()?;
    let mut out = Vec::new();
    for name in paths.list_refs()? {
        let log = paths.read_ref(&name)?;
        let mut versions = Vec::new();
        for version in log.versions() {
            let entry = paths.read_manifest(version.manifest).ok().map(|manifest| manifest_entry(&manifest));
            versions.push(VersionSummary { number: version.number, manifest: version.manifest, entry });
        }
        out.push(DatasetSummary { name, versions });
    }
    Ok(out)
}

/// The scrub behind [`Granary::verify`]; needs no lock, so readers can run it too.
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

fn file_len(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?.len())
}
