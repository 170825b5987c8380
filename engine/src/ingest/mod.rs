//! Ingest: records in, shards and a new dataset version out.
//!
//! Owns the `Ingest` session (records are streamed into a `ShardWriter`, shards roll over at a
//! target size, each finished shard is synced, published and cataloged at once, so memory stays
//! bounded whatever the dataset size), `RecordSink` (where a format reader's records go: an
//! `Ingest`, or a check that only looks at them) and the sources in `sources` (fixed-size record files,
//! directory trees, WebDataset tars), `megatron` (Megatron-LM indexed datasets), and behind the
//! `formats` feature `parquet` (Parquet files), `mds` (Mosaic Streaming's MDS) and `litdata`
//! (LitData's optimized chunks), whose samples are named as `parts` names them. Commit order, the crash-safety contract: shard files durable
//! -> shard entries -> manifest file durable -> manifest entry -> catalog flush -> ref history
//! line durable -> ref file durable -> dataset entry -> catalog flush. A crash at any point leaves
//! the previous version current and no partial file visible; published but unreferenced files
//! are garbage that `granary gc` removes after its grace period. Deduplication trusts files, not
//! the catalog: a shard or manifest already stored is kept only if it hashes to its id, and the
//! shards an append reuses must be on disk at their recorded length. A session dropped without
//! `commit` (a source that failed, a caller that gave up) removes what only it wrote: its partial
//! shard and the shard files it newly published (not those it found already stored). Never:
//! reads records back (the read path does) or decides placement.

#[cfg(feature = "formats")]
mod arrow_rows;
#[cfg(feature = "formats")]
mod arrow_stream;
#[cfg(feature = "formats")]
mod arrow_temporal;
#[cfg(feature = "formats")]
mod digests;
#[cfg(feature = "formats")]
mod litdata;
#[cfg(feature = "formats")]
mod mds;
mod megatron;
#[cfg(feature = "formats")]
mod parquet;
#[cfg(feature = "formats")]
mod parts;
mod sources;

use std::fs::File;
use std::io::Read;
use std::path::PathBuf;

#[cfg(feature = "formats")]
pub use self::parquet::{Nulls, ParquetIngested, ParquetInput, RowsIngested, records_from_parquet};
#[cfg(feature = "formats")]
pub use arrow_stream::{ArrowInput, records_from_arrow};
#[cfg(feature = "formats")]
pub use litdata::{LitDataInput, records_from_litdata};
#[cfg(feature = "formats")]
pub use mds::{MdsInput, records_from_mds};
pub use megatron::{MegatronIndex, records_from_megatron};
pub use sources::{
    Progress, SampleSink, check_regular_files, expand_tar_inputs, files_from_dir, records_from_files,
    samples_from_tars, tar_samples,
};

use crate::catalog::{Catalog, ObjectEntry};
use crate::error::{Error, Result};
use crate::id::{ManifestId, ShardId};
use crate::manifest::{Manifest, ManifestEntry};
use crate::shard::{Layout, ShardWriter, WRITE_CHUNK_BYTES};
use crate::store::{DatasetName, ObjectKind, RefLog, Store};

/// Default shard size target: 64 MiB of record data.
pub const SHARD_BYTES_TARGET_DEFAULT: u64 = 64 << 20;
/// Default cap on records per shard: bounds the writer's record index at 8 MiB.
pub const SHARD_RECORDS_MAX_DEFAULT: u64 = 1 << 20;

/// Whether a new version extends the current one, replaces its records, or must not exist
/// yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IngestMode {
    /// The new version is the current version's shards followed by the new ones.
    #[default]
    Append,
    /// The new version holds only the new records.
    Replace,
    /// A new dataset; for one that exists, exactly the records its current version holds (no
    /// version is added: the same ingest run twice changes nothing), anything else refused
    /// with `Error::IngestIntent` before a version is written. What the CLI and Python do
    /// unless told to append or replace.
    New,
}

/// How to ingest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IngestOptions {
    /// A shard is closed once it holds at least this many bytes of record data.
    pub shard_bytes_target: u64,
    /// A shard is closed once it holds this many records.
    pub shard_records_max: u64,
    /// Append to or replace the current version.
    pub mode: IngestMode,
}

impl Default for IngestOptions {
    fn default() -> Self {
        Self {
            shard_bytes_target: SHARD_BYTES_TARGET_DEFAULT,
            shard_records_max: SHARD_RECORDS_MAX_DEFAULT,
            mode: IngestMode::Append,
        }
    }
}

/// What an ingest did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IngestStats {
    /// Records pushed.
    pub records: u64,
    /// Record bytes pushed.
    pub bytes: u64,
    /// Shard files newly published.
    pub shards_published: u64,
    /// Shards whose identical content was already stored.
    pub shards_deduplicated: u64,
}

/// A committed dataset version.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Committed {
    /// The dataset.
    pub name: DatasetName,
    /// Its new (or, when nothing changed, current) version number.
    pub version: u64,
    /// The version's manifest.
    pub manifest: ManifestId,
    /// Records in the version.
    pub n_records: u64,
    /// Shards in the version.
    pub n_shards: usize,
    /// What this ingest did.
    pub stats: IngestStats,
    /// The version already held exactly these records: none was added.
    pub unchanged: bool,
}

struct OpenShard {
    writer: ShardWriter<File>,
    tmp: PathBuf,
}

/// Where a format reader's records go (`records_from_parquet` and the other readers of the
/// `formats` feature): an [`Ingest`] writes them into shards; a check or a fuzz target may only
/// look at them. Whatever the sink, the reader has checked the record before it hands it over.
pub trait RecordSink {
    /// Takes one record; an error stops the reader, which returns it.
    fn push(&mut self, record: &[u8]) -> Result<()>;
}

impl RecordSink for Ingest<'_> {
    fn push(&mut self, record: &[u8]) -> Result<()> {
        Ingest::push(self, record)
    }
}

/// An ingest in progress. Dropping it without `commit` leaves the dataset as it was and
/// removes the files only it wrote.
pub struct Ingest<'g> {
    store: &'g Store,
    catalog: &'g Catalog,
    name: DatasetName,
    layout: Layout,
    options: IngestOptions,
    log: Option<RefLog>,
    entries: Vec<ManifestEntry>,
    shard: Option<OpenShard>,
    scratch: Vec<u8>,
    stats: IngestStats,
    /// Shards this session published as new files: nothing refers to them until `commit`.
    new_shards: Vec<ShardId>,
}

impl<'g> Ingest<'g> {
    pub(crate) fn begin(
        store: &'g Store,
        catalog: &'g Catalog,
        name: DatasetName,
        layout: Layout,
        options: IngestOptions,
    ) -> Result<Self> {
        if options.shard_bytes_target == 0 || options.shard_records_max == 0 {
            return Err(Error::invalid_input("shard size target and records per shard must be positive"));
        }
        let log = match store.paths().read_ref(&name) {
            Ok(log) => Some(log),
            Err(Error::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        let mut entries = Vec::new();
        if let (Some(log), IngestMode::Append) = (&log, options.mode) {
            let current = store.paths().read_manifest(log.latest().manifest)?;
            if current.layout() != &layout {
                return Err(Error::invalid_input(format!(
                    "dataset {name} holds {} records; cannot append {layout} records (ingest under another name, or replace)",
                    current.layout()
                )));
            }
            // The new version reuses these shards: each must be on disk, whole, or the version
            // would be committed unreadable.
            for entry in current.entries() {
                check_present(store, entry, log.latest().manifest)?;
            }
            entries.extend_from_slice(current.entries());
        }
        Ok(Self {
            store,
            catalog,
            name,
            layout,
            options,
            log,
            entries,
            shard: None,
            scratch: Vec::new(),
            stats: IngestStats::default(),
            new_shards: Vec::new(),
        })
    }

    /// The layout records must fit.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Appends one record.
    pub fn push(&mut self, record: &[u8]) -> Result<()> {
        self.open_shard()?.writer.push(record)?;
        self.after_push(record.len() as u64)
    }

    /// Appends one record of `len` bytes streamed from `source`.
    pub fn push_from(&mut self, source: &mut impl Read, len: u64) -> Result<()> {
        if self.scratch.is_empty() {
            self.scratch = vec![0u8; WRITE_CHUNK_BYTES];
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let pushed = self.open_shard().and_then(|shard| shard.writer.push_from(source, len, &mut scratch));
        self.scratch = scratch;
        pushed?;
        self.after_push(len)
    }

    /// What was pushed so far.
    pub fn stats(&self) -> &IngestStats {
        &self.stats
    }

    /// Seals the last shard and publishes the new version. When the version would equal the
    /// current one (nothing pushed in append mode, the same records again in new or replace
    /// mode), no version is added (`unchanged`). In new mode, records other than the current
    /// version's are `Error::IngestIntent`, and nothing is added.
    pub fn commit(mut self) -> Result<Committed> {
        self.seal_shard()?;
        let manifest = Manifest::new(self.layout.clone(), std::mem::take(&mut self.entries));
        let (id, _) = manifest.encode();
        let latest = self.log.as_ref().map(RefLog::latest);
        if self.options.mode == IngestMode::New
            && let Some(latest) = latest.filter(|latest| latest.manifest != id)
        {
            // Dropped on return: the shards only this session wrote go with it.
            let held = self.catalog.manifest(latest.manifest).ok().flatten().map(|entry| entry.n_records);
            let same_count_shard_bytes = match self.store.paths().read_manifest(latest.manifest) {
                Ok(current) if current.n_records() == manifest.n_records() && current.layout() == manifest.layout() => {
                    current.entries().iter().map(|e| e.file_bytes).max()
                }
                _ => None,
            };
            return Err(Error::IngestIntent {
                name: self.name.to_string(),
                version: latest.number,
                records: held,
                incoming: manifest.n_records(),
                same_count_shard_bytes,
            });
        }
        // From here on the shards are referenced (by the current version when nothing changed,
        // or by the manifest about to be published): a failure leaves them to `granary gc`.
        self.new_shards.clear();
        let stats = std::mem::take(&mut self.stats);
        let committed = |version, unchanged| Committed {
            name: self.name.clone(),
            version,
            manifest: id,
            n_records: manifest.n_records(),
            n_shards: manifest.entries().len(),
            stats: stats.clone(),
            unchanged,
        };
        // Published even when the version is the current one: an identical manifest already
        // stored is kept only if its bytes hash to its id, so a lost or damaged one is written
        // again here rather than trusted because the ref or the catalog names it.
        let published = self.store.publish_manifest(&manifest)?;
        assert_eq!(published, id);
        self.catalog.put_manifest(id, &manifest_entry(&manifest))?;
        self.catalog.flush()?;
        if let Some(latest) = latest.filter(|latest| latest.manifest == id) {
            return Ok(committed(latest.number, true));
        }
        let log = match &self.log {
            Some(log) => log
                .with_next(id)
                .ok_or_else(|| Error::invalid_input(format!("dataset {} has used every version number", self.name)))?,
            None => RefLog::first(id),
        };
        self.store.write_ref(&self.name, &log)?;
        self.catalog.put_dataset(&self.name, &log)?;
        self.catalog.flush()?;
        Ok(committed(log.latest().number, false))
    }

    fn open_shard(&mut self) -> Result<&mut OpenShard> {
        if self.shard.is_none() {
            let (file, tmp) = self.store.create_tmp()?;
            let writer = ShardWriter::new(file, tmp.clone(), self.layout.clone())?;
            self.shard = Some(OpenShard { writer, tmp });
        }
        Ok(self.shard.as_mut().expect("opened above"))
    }

    fn after_push(&mut self, len: u64) -> Result<()> {
        self.stats.records += 1;
        self.stats.bytes += len;
        let writer = &self.shard.as_ref().expect("a record was just pushed into it").writer;
        if writer.data_bytes() >= self.options.shard_bytes_target
            || writer.n_records() >= self.options.shard_records_max
        {
            self.seal_shard()?;
        }
        Ok(())
    }

    /// Finishes, syncs and publishes the open shard, if any.
    fn seal_shard(&mut self) -> Result<()> {
        let Some(OpenShard { writer, tmp }) = self.shard.take() else { return Ok(()) };
        let (file, written) = writer.finish()?;
        file.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
        drop(file);
        if self.store.publish(ObjectKind::Shard, written.id.0, &tmp)? {
            self.stats.shards_published += 1;
            self.new_shards.push(written.id);
        } else {
            self.stats.shards_deduplicated += 1;
        }
        let entry = ObjectEntry {
            n_records: written.n_records,
            n_shards: 1,
            file_bytes: written.file_bytes,
            layout: self.layout.clone(),
        };
        self.catalog.put_shard(written.id, &entry)?;
        self.entries.push(ManifestEntry {
            shard: written.id,
            n_records: written.n_records,
            file_bytes: written.file_bytes,
            meta_digest: written.meta_digest,
        });
        Ok(())
    }
}

impl Drop for Ingest<'_> {
    /// Without `commit`: removes the partial shard and the shards only this session wrote, the
    /// catalog entry before the file (an entry never names a missing file). Best effort: what
    /// cannot be removed is left to `granary gc`, as after a crash.
    fn drop(&mut self) {
        if let Some(OpenShard { writer, tmp }) = self.shard.take() {
            drop(writer);
            let _ = std::fs::remove_file(&tmp);
        }
        for id in std::mem::take(&mut self.new_shards) {
            if self.catalog.remove_shard(id).is_ok() {
                let _ = self.store.remove_object(ObjectKind::Shard, id.0);
            }
        }
    }
}

/// Checks that the shard of `entry` (listed by `manifest`) is on disk with the length the
/// manifest records: a version that reuses it is then readable as far as a cheap check can tell
/// (its metadata digest is checked when it is opened, every block when it is read).
fn check_present(store: &Store, entry: &ManifestEntry, manifest: ManifestId) -> Result<()> {
    let path = store.paths().shard(entry.shard);
    match std::fs::metadata(&path) {
        Ok(meta) if meta.len() == entry.file_bytes => Ok(()),
        Ok(meta) => Err(Error::Format {
            path,
            source: crate::error::FormatError::Truncated {
                region: "shard",
                detail: format!("{} bytes where its manifest records {}", meta.len(), entry.file_bytes),
            },
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::MissingShard { shard: entry.shard, manifest }),
        Err(e) => Err(Error::io("stat", &path, e)),
    }
}

/// The catalog entry of a manifest.
pub(crate) fn manifest_entry(manifest: &Manifest) -> ObjectEntry {
    ObjectEntry {
        n_records: manifest.n_records(),
        n_shards: manifest.entries().len() as u64,
        file_bytes: manifest.file_bytes(),
        layout: manifest.layout().clone(),
    }
}
