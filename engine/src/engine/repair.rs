//! Repair: the catalog rebuilt from the files whatever state it is in, damaged files
//! quarantined, refs rebuilt from their histories.
//!
//! Owns `RepairReport` and `Granary::open_and_repair` (what `granary repair` runs). A catalog
//! sled cannot open or clear is moved to `quarantine/` and a new one is built; every shard and
//! manifest is verified and cataloged, or quarantined; a damaged or lost ref is rebuilt from
//! its history, and a history is brought in line with an intact ref (or, damaged, quarantined
//! and begun again from it). A file this process cannot read (permissions, an I/O error) is
//! reported and left alone, and the repair goes on with the rest, so one such file never
//! leaves the catalog empty. Invariant: nothing is deleted: a file that fails its check is
//! moved to `quarantine/`, where `gc` still honours what a ref or history there names for the
//! grace period. Never: fetches a missing object (replication does) or guesses a version no
//! ref or history records.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::catalog::{Catalog, ObjectEntry};
use crate::error::{Error, Result};
use crate::id::{ManifestId, ShardId};
use crate::ingest::manifest_entry;
use crate::store::{DatasetName, ObjectKind, RefHistory, RefLog, Store};

use super::{Granary, verify_shard};

/// What a repair did.
#[derive(Debug, Default)]
pub struct RepairReport {
    /// Shards cataloged.
    pub shards: u64,
    /// Manifests cataloged.
    pub manifests: u64,
    /// Fragment files that checked out (they are not cataloged).
    pub fragments: u64,
    /// Datasets cataloged.
    pub datasets: u64,
    /// Temp files of dead writers removed (when the store was opened, or by the repair).
    pub tmp_removed: usize,
    /// The catalog, when sled could not read it: where it was moved, and why.
    pub catalog_quarantined: Option<(PathBuf, String)>,
    /// Files that failed verification, moved to `quarantine/`, with why.
    pub quarantined: Vec<(PathBuf, String)>,
    /// Files this process could not read (permissions, an I/O error), with why: left where
    /// they are and not cataloged; the repair goes on with the rest.
    pub unreadable: Vec<(PathBuf, String)>,
    /// Refs written again from their history: damaged, or gone while the history still named
    /// live versions.
    pub refs_rebuilt: Vec<(DatasetName, RefLog)>,
    /// Datasets whose damaged ref had no history to rebuild it from: their versions are
    /// unknown (`gc` keeps their files until the ref is restored or the name forgotten).
    pub refs_lost: Vec<DatasetName>,
    /// Objects referenced but missing (a version that cannot be read until they return).
    pub missing: Vec<String>,
    /// Shards that manifests list that are here only as erasure-coded fragments (the other
    /// fragments on other nodes): not missing.
    pub shards_as_fragments: u64,
    /// Entries of `tmp/`, `refs/` and `history/` the store did not write, left alone (see
    /// `StorePaths::strays`).
    pub strays: Vec<PathBuf>,
}

impl RepairReport {
    /// Whether every live version can be read and every ref was kept or rebuilt.
    pub fn is_whole(&self) -> bool {
        self.missing.is_empty() && self.refs_lost.is_empty() && self.unreadable.is_empty()
    }
}

impl Granary {
    /// Opens the store at `root` for writing (waiting up to `wait` for another writer) whatever
    /// state its catalog is in, and repairs it: see the module doc.
    pub fn open_and_repair(root: impl Into<PathBuf>, wait: Duration) -> Result<(Self, RepairReport)> {
        Self::open_and_repair_telling(root, wait, &mut |_| {})
    }

    /// `open_and_repair`, calling `waiting` once, with the error that made it wait, before it
    /// starts to wait for the lock.
    pub fn open_and_repair_telling(
        root: impl Into<PathBuf>,
        wait: Duration,
        waiting: &mut dyn FnMut(&Error),
    ) -> Result<(Self, RepairReport)> {
        Catalog::check_process()?;
        let root = root.into();
        let started = Instant::now();
        let mut told = false;
        let store = loop {
            match Store::open(root.clone(), false) {
                Err(e) if e.is_busy() && started.elapsed() < wait => {
                    if !told {
                        waiting(&e);
                        told = true;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => break other?,
            }
        };
        Self::repair_opened(store)
    }

    /// Repairs the store `store` holds locked: see the module doc.
    pub(super) fn repair_opened(store: crate::store::Store) -> Result<(Self, RepairReport)> {
        let mut report = RepairReport::default();
        let dir = store.paths().catalog_dir();
        // The old catalog is kept only if sled can open and empty it; anything else about it
        // is damage, and it goes to quarantine whole.
        let catalog = match Catalog::open_sled(&dir).and_then(|catalog| catalog.clear().map(|()| catalog)) {
            Ok(catalog) => catalog,
            Err(e) if e.is_busy() || matches!(e, Error::CatalogForked { .. }) => return Err(e),
            Err(e) => {
                let moved = store.quarantine(&dir)?;
                let why = match e {
                    Error::Catalog { detail } => detail,
                    other => other.to_string(),
                };
                report.catalog_quarantined = Some((moved, why));
                Catalog::open_sled(&dir)?
            }
        };
        let mut granary = Self { store, catalog };
        granary.rebuild(&mut report)?;
        Ok((granary, report))
    }

    /// Rebuilds the catalog from a scan of the files, verifying each one; files that fail are
    /// quarantined, never deleted; refs are rebuilt from their histories.
    pub fn repair(&mut self) -> Result<RepairReport> {
        let mut report = RepairReport::default();
        self.catalog.clear()?;
        self.rebuild(&mut report)?;
        Ok(report)
    }

    /// Fills the (empty) catalog from the files: see [`Granary::repair`].
    fn rebuild(&mut self, report: &mut RepairReport) -> Result<()> {
        let paths = self.store.paths().clone();
        report.tmp_removed = self.store.stale_tmp_removed() + self.store.clean_tmp()?;
        report.strays = self.store.paths().strays()?;
        let mut shards = BTreeSet::new();
        // Shards that are here but could not be read: not missing, and not cataloged.
        let mut unreadable_shards = BTreeSet::new();
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
                Err(e) => {
                    unreadable_shards.insert(id);
                    report.unreadable.push((path, e.to_string()));
                }
            }
        }
        // Fragments are not cataloged: a damaged one is quarantined (the node rebuilds it).
        let mut fragment_shards = BTreeSet::new();
        for (id, path) in paths.list_objects(ObjectKind::Fragment)? {
            match crate::erasure::FragmentFile::open(&path, id).and_then(|fragment| fragment.check_all()) {
                Ok(header) => {
                    report.fragments += 1;
                    fragment_shards.insert(header.shard.0);
                }
                Err(e) if e.is_corruption() => {
                    self.store.quarantine(&path)?;
                    report.quarantined.push((path, e.to_string()));
                }
                Err(e) => report.unreadable.push((path, e.to_string())),
            }
        }
        let mut manifests = BTreeSet::new();
        for (id, path) in paths.list_objects(ObjectKind::Manifest)? {
            match paths.read_manifest(ManifestId(id)) {
                Ok(manifest) => {
                    for entry in manifest.entries() {
                        if fragment_shards.contains(&entry.shard.0) && !shards.contains(&entry.shard.0) {
                            // Erasure-coded: a fragment here, the others on other nodes.
                            report.shards_as_fragments += 1;
                        } else if !shards.contains(&entry.shard.0) && !unreadable_shards.contains(&entry.shard.0) {
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
                Err(e) => report.unreadable.push((path, e.to_string())),
            }
        }
        for name in paths.list_names()? {
            let Some(log) = self.repair_ref(&name, report)? else { continue };
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
        self.catalog.flush()
    }

    /// Brings the ref and the history of `name` back in line: an intact ref is the truth and
    /// its history follows it; a damaged or lost ref is rebuilt from its history. Returns the
    /// ref as it now stands.
    fn repair_ref(&mut self, name: &DatasetName, report: &mut RepairReport) -> Result<Option<RefLog>> {
        let paths = self.store.paths().clone();
        let history = match paths.read_history(name) {
            Ok(history) => history,
            Err(e) if e.is_corruption() => {
                self.store.quarantine_history(name)?;
                report.quarantined.push((paths.history_file(name), e.to_string()));
                None
            }
            Err(e) => return Err(e),
        };
        let rebuilt = history.as_ref().and_then(RefHistory::replay);
        let log = match paths.read_ref(name) {
            Ok(log) => log,
            Err(Error::NotFound { .. }) => match rebuilt {
                Some(log) => self.rebuild_ref(name, log, report)?,
                None => return Ok(None),
            },
            Err(e) if e.is_corruption() => {
                self.store.quarantine_ref(name)?;
                report.quarantined.push((paths.ref_file(name), e.to_string()));
                match rebuilt {
                    Some(log) => self.rebuild_ref(name, log, report)?,
                    None => {
                        report.refs_lost.push(name.clone());
                        return Ok(None);
                    }
                }
            }
            Err(e) => return Err(e),
        };
        // Lines that failed their checksum cannot be trusted to replay again: begin the history
        // anew from the ref (the old one stays in quarantine, where gc honours what it names).
        if let Some(damaged) = history.as_ref().filter(|h| h.damaged_lines() > 0) {
            self.store.quarantine_history(name)?;
            let why = format!("{} lines failed their checksum", damaged.damaged_lines());
            report.quarantined.push((paths.history_file(name), why));
        }
        self.store.sync_history(name, &log)?;
        Ok(Some(log))
    }

    fn rebuild_ref(&mut self, name: &DatasetName, log: RefLog, report: &mut RepairReport) -> Result<RefLog> {
        self.store.write_ref(name, &log)?;
        report.refs_rebuilt.push((name.clone(), log.clone()));
        Ok(log)
    }
}
