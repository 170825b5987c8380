//! A dataset version opened for reading: its manifest, its shards' metadata, where each record
//! lies, and the per-shard read counts of the process.
//!
//! Owns `Dataset` (opened from a name or a manifest id through the files alone, no catalog) and
//! the process-wide shard read counters. Never: reads record data, or writes anything.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, FormatError, Result};
use crate::id::{ManifestId, ShardId};
use crate::manifest::Manifest;
use crate::shard::{Layout, ShardMeta};
use crate::store::{DatasetName, StorePaths, VersionSpec};

/// An opened, immutable dataset version. Shared between readers.
pub struct Dataset {
    paths: StorePaths,
    manifest_id: ManifestId,
    manifest: Manifest,
    version: Option<(DatasetName, u64)>,
    /// The named versions it is made of: itself, or a concatenation's parts.
    parts: Vec<(DatasetName, u64)>,
    /// `record_starts[s]` is the dataset index of shard `s`'s first record; one extra at the end.
    record_starts: Vec<u64>,
    metas: Vec<OnceLock<Arc<ShardMeta>>>,
    /// Records read from each shard by this process's readers (the metrics' hot shards):
    /// shared by every `Dataset` of this manifest in the process.
    shard_reads: Arc<[std::sync::atomic::AtomicU64]>,
}

type ShardReadsTable = std::collections::HashMap<ManifestId, std::sync::Weak<[std::sync::atomic::AtomicU64]>>;

/// The per-shard read counts of every manifest open in this process.
static SHARD_READS: OnceLock<parking_lot::Mutex<ShardReadsTable>> = OnceLock::new();

/// In a forked child: the reads counted so far were the parent's. (A table the fork caught
/// locked is left as it is.)
pub(crate) fn forget_shard_reads() {
    let Some(table) = SHARD_READS.get().and_then(|table| table.try_lock()) else { return };
    for counts in table.values().filter_map(std::sync::Weak::upgrade) {
        for count in counts.iter() {
            count.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The per-shard read counts of manifest `manifest`, so that every `Dataset` of one version in
/// the process counts into the same ones.
pub(super) fn shard_reads_of(manifest: ManifestId, shards: usize) -> Arc<[std::sync::atomic::AtomicU64]> {
    let mut table = SHARD_READS.get_or_init(Default::default).lock();
    table.retain(|_, counts| counts.strong_count() > 0);
    if let Some(counts) = table.get(&manifest).and_then(std::sync::Weak::upgrade)
        && counts.len() == shards
    {
        return counts;
    }
    let counts: Arc<[std::sync::atomic::AtomicU64]> =
        (0..shards).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
    table.insert(manifest, Arc::downgrade(&counts));
    counts
}

impl Dataset {
    /// Opens the version `spec` of the store at `paths`, reading its ref and manifest files.
    pub fn open(paths: &StorePaths, spec: &VersionSpec) -> Result<Arc<Self>> {
        paths.check()?;
        let (manifest_id, version) = paths.resolve(spec)?;
        let manifest = paths.read_manifest(manifest_id)?;
        Ok(Arc::new(Self::from_manifest(paths.clone(), manifest_id, manifest, version)))
    }

    /// A dataset over an already-verified manifest.
    pub fn from_manifest(
        paths: StorePaths,
        manifest_id: ManifestId,
        manifest: Manifest,
        version: Option<(DatasetName, u64)>,
    ) -> Self {
        let mut record_starts = Vec::with_capacity(manifest.entries().len() + 1);
        let mut start = 0;
        record_starts.push(0);
        for entry in manifest.entries() {
            start += entry.n_records;
            record_starts.push(start);
        }
        let metas = manifest.entries().iter().map(|_| OnceLock::new()).collect();
        let shard_reads = shard_reads_of(manifest_id, manifest.entries().len());
        let parts = version.iter().cloned().collect();
        Self { paths, manifest_id, manifest, version, parts, record_starts, metas, shard_reads }
    }

    /// The records of `parts` one after the other (a mixture's sources), as one dataset: their
    /// shards in order, under an id that is the digest of theirs. The parts share a layout and
    /// a store.
    pub fn concatenation(parts: &[Arc<Dataset>]) -> Result<Self> {
        let first = parts.first().ok_or_else(|| Error::invalid_input("a concatenation of no datasets"))?;
        let mut entries = Vec::new();
        let mut digest = blake3::Hasher::new();
        digest.update(b"granary concatenation 1");
        for part in parts {
            if part.layout() != first.layout() {
                return Err(Error::invalid_input(format!(
                    "{} holds {} records and {} holds {}: a mixture's sources share one layout",
                    part.label(),
                    part.layout(),
                    first.label(),
                    first.layout()
                )));
            }
            if part.paths().root() != first.paths().root() {
                return Err(Error::invalid_input("a mixture's sources are datasets of one store"));
            }
            digest.update(part.manifest_id().0.as_bytes());
            entries.extend(part.manifest().entries().iter().cloned());
        }
        let id = ManifestId(crate::id::ObjectId::from_hash(digest.finalize()));
        let manifest = Manifest::new(first.layout().clone(), entries);
        let mut dataset = Self::from_manifest(first.paths().clone(), id, manifest, None);
        dataset.parts = parts.iter().flat_map(|part| part.parts.iter().cloned()).collect();
        Ok(dataset)
    }

    /// The named versions it is made of: its own name and version when opened by name, a
    /// concatenation's parts' (empty when opened by manifest id).
    pub fn parts(&self) -> &[(DatasetName, u64)] {
        &self.parts
    }

    /// `name@version`, or the manifest id's first digits.
    pub fn label(&self) -> String {
        match &self.version {
            Some((name, version)) => format!("{name}@{version}"),
            None => self.manifest_id.0.short(12),
        }
    }

    /// Records in the version.
    pub fn n_records(&self) -> u64 {
        self.manifest.n_records()
    }

    /// What the records are.
    pub fn layout(&self) -> &Layout {
        self.manifest.layout()
    }

    /// The store it is read from.
    pub fn paths(&self) -> &StorePaths {
        &self.paths
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The version's id.
    pub fn manifest_id(&self) -> ManifestId {
        self.manifest_id
    }

    /// The dataset name and version number, when opened by name.
    pub fn version(&self) -> Option<&(DatasetName, u64)> {
        self.version.as_ref()
    }

    /// Shards in the version.
    pub fn n_shards(&self) -> usize {
        self.metas.len()
    }

    /// Records this process's readers have read from each shard of this version (counted as
    /// batches are planned, from disk or the memory tier; a batch read again after a repair
    /// counts again), by shard index.
    pub fn shard_reads(&self) -> Vec<u64> {
        self.shard_reads.iter().map(|reads| reads.load(std::sync::atomic::Ordering::Relaxed)).collect()
    }

    /// The counts behind `shard_reads`, shared by the version's `Dataset`s in this process.
    pub(crate) fn shard_read_counts(&self) -> &Arc<[std::sync::atomic::AtomicU64]> {
        &self.shard_reads
    }

    /// Counts `records` reads of shard `shard`.
    pub(crate) fn count_reads(&self, shard: usize, records: u64) {
        if let Some(reads) = self.shard_reads.get(shard) {
            reads.fetch_add(records, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The id of shard `shard`.
    pub fn shard_id(&self, shard: usize) -> ShardId {
        self.manifest.entries()[shard].shard
    }

    /// The file of shard `shard`.
    pub fn shard_path(&self, shard: usize) -> PathBuf {
        self.paths.shard(self.shard_id(shard))
    }

    /// The shard holding dataset record `index`, and the record's index within it.
    pub fn locate(&self, index: u64) -> Result<(usize, u64)> {
        if index >= self.n_records() {
            return Err(Error::RecordOutOfRange { index, n_records: self.n_records() });
        }
        // The last shard whose first record is <= index (empty shards are skipped over).
        let shard = self.record_starts.partition_point(|&start| start <= index) - 1;
        Ok((shard, index - self.record_starts[shard]))
    }

    /// The shard a read error is about, when it names one: a damaged block or file, a missing
    /// file, a failed read of its file.
    pub fn shard_of_error(&self, error: &Error) -> Option<usize> {
        let by_id = |id: ShardId| (0..self.n_shards()).find(|&s| self.shard_id(s) == id);
        let by_path = |path: &std::path::Path| {
            let path = path.to_string_lossy();
            // A failed read names its file and then the offset.
            (0..self.n_shards()).find(|&s| path.starts_with(self.shard_path(s).to_string_lossy().as_ref()))
        };
        match error {
            Error::ChecksumMismatch { shard, .. } | Error::MissingShard { shard, .. } => by_id(*shard),
            Error::Format { path, .. } | Error::HashMismatch { path, .. } | Error::Io { path, .. } => by_path(path),
            _ => None,
        }
    }

    /// The verified metadata of shard `shard`, read on first use and checked against the
    /// manifest (length, record count, layout), so a truncated or swapped file fails here.
    pub fn shard_meta(&self, shard: usize) -> Result<&Arc<ShardMeta>> {
        if let Some(meta) = self.metas[shard].get() {
            return Ok(meta);
        }
        let path = self.shard_path(shard);
        let entry = &self.manifest.entries()[shard];
        let meta = ShardMeta::read(&path).map_err(|e| match e {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Error::MissingShard { shard: entry.shard, manifest: self.manifest_id }
            }
            other => other,
        })?;
        let mismatch = |field: &'static str, detail: String| Error::Format {
            path: path.clone(),
            source: FormatError::Inconsistent { field, detail },
        };
        if meta.file_bytes() != entry.file_bytes {
            return Err(mismatch(
                "file_bytes",
                format!("{}, the manifest says {}", meta.file_bytes(), entry.file_bytes),
            ));
        }
        if meta.n_records() != entry.n_records {
            return Err(mismatch("n_records", format!("{}, the manifest says {}", meta.n_records(), entry.n_records)));
        }
        if meta.digest() != entry.meta_digest {
            return Err(mismatch(
                "metadata digest",
                format!(
                    "{}, the manifest says {}: this file is not shard {}",
                    meta.digest(),
                    entry.meta_digest,
                    entry.shard
                ),
            ));
        }
        if meta.layout() != self.layout() {
            return Err(mismatch("layout", format!("{}, the manifest says {}", meta.layout(), self.layout())));
        }
        // Two threads may both load it; both results are the same verified bytes.
        Ok(self.metas[shard].get_or_init(|| Arc::new(meta)))
    }
}
