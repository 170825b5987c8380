//! The engine: the one place that wires store, catalog, ingest and the read path together.
//!
//! `Granary` is a store opened for writing (it holds the store lock and the sled catalog). It
//! ingests, lists and removes here; it verifies (`verify.rs`), repairs (`repair.rs`) and
//! collects garbage (`collect.rs`) in the files beside this one. Reading needs no `Granary`:
//! `Dataset::open` works from the files alone, so every rank of a trainer can read while one
//! process writes. A catalog sled cannot read is rebuilt from the files when a writer opens
//! the store (the repair's path, said once on stderr): the catalog is a cache of the files.
//!
//! Owns: `Granary` (a `Store` and its `Catalog` held together: opening, waiting for another writer,
//! bringing the catalog and the histories in line with the ref files at open), listing
//! (`DatasetSummary`, and `datasets_from_files`, without a lock), removing versions, and adopting,
//! quarantining and forgetting objects and refs that arrived from elsewhere (a replication node's
//! transfers, an attached origin's manifests and refs). Never: is needed to read (`Dataset::open`
//! reads the files), or talks to a peer or an origin itself (they call it to publish what they
//! fetched).

mod collect;
mod repair;
mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use collect::{GC_GRACE_DEFAULT, GcOptions, GcReport};
pub use repair::RepairReport;
pub use verify::{
    Failure, Hurt, ShardFetcher, Unreadable, VerifyReport, verify, verify_shard, verify_shard_from_disk, verify_through,
};

/// What `forget_quarantined` puts before the name of a quarantined ref or history it lets go of.
pub const FORGOTTEN_PREFIX: &str = "forgotten-";

use crate::catalog::{Catalog, ObjectEntry};
use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::ingest::{Ingest, IngestOptions, manifest_entry};
use crate::read::Dataset;
use crate::shard::ShardMeta;
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
        Self::open_waiting_telling(root, create, wait, &mut |_| {})
    }

    /// `open_waiting`, calling `waiting` once, with the error that made it wait (it names the
    /// lock's holder), before it starts to wait: a command line says at once that it waits.
    pub fn open_waiting_telling(
        root: impl Into<PathBuf>,
        create: bool,
        wait: std::time::Duration,
        waiting: &mut dyn FnMut(&Error),
    ) -> Result<Self> {
        let root = root.into();
        let started = std::time::Instant::now();
        let mut told = false;
        loop {
            match Self::open_inner(root.clone(), create) {
                Err(e) if e.is_busy() && started.elapsed() < wait => {
                    if !told {
                        waiting(&e);
                        told = true;
                    }
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
        let dir = store.paths().catalog_dir();
        // The catalog is a cache of the files: one sled cannot read (a crash in the middle of
        // its own write) is rebuilt from them here, as `repair` would, without a person.
        let catalog = match Catalog::open_sled(&dir) {
            Ok(catalog) => catalog,
            Err(Error::Catalog { detail }) => return Self::rebuild_at_open(store, &detail),
            Err(e) => return Err(e),
        };
        let granary = Self { store, catalog };
        match granary.reconcile_datasets() {
            Ok(()) => Ok(granary),
            Err(Error::Catalog { detail }) => {
                let Self { store, catalog } = granary;
                drop(catalog);
                Self::rebuild_at_open(store, &detail)
            }
            Err(e) => Err(e),
        }
    }

    /// Rebuilds the catalog of `store` (locked here) that sled could not read (`detail`), saying
    /// so once on stderr: the damaged catalog goes to quarantine, as `granary repair` leaves it.
    fn rebuild_at_open(store: Store, detail: &str) -> Result<Self> {
        let dir = store.paths().catalog_dir();
        let (granary, report) = Self::repair_opened(store).map_err(|e| catalog_unreadable(&dir, e))?;
        let kept = match &report.catalog_quarantined {
            Some((moved, _)) => format!(" (the damaged one is kept at {})", moved.display()),
            None => String::new(),
        };
        eprintln!(
            "granary: the catalog {} could not be read ({detail}); rebuilt it from the store's files{kept}",
            dir.display()
        );
        Ok(granary)
    }

    /// After a crash between a ref's rename and its catalog entry, the ref file (the commit
    /// point) is ahead of the catalog: bring the catalog's datasets in line with the ref files.
    /// After a crash between a history append and a ref's rename, or in a store written before
    /// histories, the history differs from its ref: bring it in line too.
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
            self.store.sync_history(name, &log)?;
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
                let rest = log.without(number);
                debug_assert!(rest.as_ref().is_none_or(|rest| rest.version(number).is_none()), "{number} removed");
                rest
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

    /// Lets gc remove the data that quarantined refs and histories of dataset `name` name,
    /// when `name` has no ref: they are renamed `forgotten-*` in `quarantine/` (kept for a person
    /// to read, no longer pinning anything). Returns how many were marked.
    pub fn forget_quarantined(&mut self, name: &DatasetName) -> Result<usize> {
        let paths = self.store.paths().clone();
        if paths.ref_file(name).exists() {
            return Ok(0);
        }
        let mut n = 0;
        for text in collect::quarantined_ref_texts(&paths)?.into_iter().filter(|t| &t.name == name) {
            let file_name = text.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let target = paths.quarantine_dir().join(format!("{FORGOTTEN_PREFIX}{file_name}"));
            std::fs::rename(&text.path, &target).map_err(|e| Error::io("rename", &text.path, e))?;
            n += 1;
        }
        if n > 0 {
            crate::store::sync_dir(&paths.quarantine_dir())?;
        }
        Ok(n)
    }

    /// Full scrub: BLAKE3 and every CRC of each shard, the id of each manifest, each ref. With a
    /// spec, only that version's manifest and shards; otherwise every file in the store and the
    /// readability of every live version.
    pub fn verify(&self, spec: Option<&VersionSpec>) -> Result<VerifyReport> {
        verify(self.store.paths(), spec)
    }

    /// Publishes `file` (a synced file on the store's filesystem, outside `shards/`,
    /// `manifests/` and `fragments/`) as object `id` of `kind`, and catalogs it. The caller has hashed the file's
    /// bytes to `id` (replication streams and hashes them as they arrive); this checks that they
    /// decode as what they claim to be (a shard's metadata, a manifest, a fragment whose header
    /// and blocks check out and name the fragment `id` is), so a well-formed id
    /// cannot smuggle in bytes the read path would refuse later. Returns false when an intact
    /// copy was already there (the file is then removed).
    pub fn adopt_object(&mut self, kind: ObjectKind, id: ObjectId, file: &Path) -> Result<bool> {
        let entry = match kind {
            ObjectKind::Shard => {
                let meta = ShardMeta::read(file)?;
                Some(ObjectEntry {
                    n_records: meta.n_records(),
                    n_shards: 1,
                    file_bytes: meta.file_bytes(),
                    layout: meta.layout().clone(),
                })
            }
            ObjectKind::Manifest => {
                let bytes = std::fs::read(file).map_err(|e| Error::io("read", file, e))?;
                let manifest = crate::manifest::Manifest::decode(&bytes)
                    .map_err(|source| Error::Format { path: file.to_owned(), source })?;
                Some(manifest_entry(&manifest))
            }
            ObjectKind::Fragment => {
                check_fragment_file(id, file)?;
                None
            }
        };
        let published = self.store.publish(kind, id, file)?;
        match (kind, entry) {
            (ObjectKind::Shard, Some(entry)) => self.catalog.put_shard(ShardId(id), &entry)?,
            (ObjectKind::Manifest, Some(entry)) => self.catalog.put_manifest(ManifestId(id), &entry)?,
            // Fragments are not cataloged: the store's directory lists them.
            _ => {}
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
            ObjectKind::Fragment => return Ok(()),
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
        // Refs only move forward: what is replaced is older, or damaged, or absent.
        debug_assert!(
            self.store.paths().read_ref(name).map_or(true, |local| local.latest().number < log.latest().number),
            "{name}: a ref adopted over a newer one"
        );
        self.store.write_ref(name, log)?;
        self.catalog.put_dataset(name, log)?;
        self.catalog.flush()?;
        Ok(true)
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

/// `Error::NeedsRepair` for an error that says the catalog cannot be read; other errors as
/// they are.
fn catalog_unreadable(dir: &Path, error: Error) -> Error {
    match error {
        Error::Catalog { detail } => {
            Error::NeedsRepair { what: format!("the catalog {} cannot be read", dir.display()), detail }
        }
        other => other,
    }
}

fn file_len(path: &Path) -> Result<u64> {
    Ok(std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?.len())
}

/// Checks fragment file `file` whole against fragment `id` (`FragmentFile`: the header, which
/// must name `id`'s shard, coding and index, and the length first, then every block a piece at
/// a time, so a file is never read whole into memory).
pub(crate) fn check_fragment_file(id: ObjectId, file: &Path) -> Result<crate::erasure::FragmentHeader> {
    crate::erasure::FragmentFile::open(file, id)?.check_all()
}
