//! Garbage collection: which object files no dataset needs, and removing them.
//!
//! Owns `GcOptions` and the rule behind `granary gc`. An object is kept when a live version
//! reaches it (from a ref, or from a ref history where the ref is gone), when a version a ref
//! history added or removed within the grace period reaches it, when a damaged ref or history
//! quarantined within the grace period names it, or when its file is younger than the grace
//! period (git keeps unreachable objects two weeks for the same reasons: a ref damaged or
//! changed by mistake can be put back while its data is still there). `--prune-now` sets the
//! grace to zero: then only live versions keep objects, and what a quarantined ref or history
//! names of a dataset that has no ref now: that dataset's data is kept by every gc, `--prune-now`
//! included, until its ref is restored or the user forgets it by name (`granary rm NAME` marks
//! its quarantined refs forgotten, `Granary::forget_quarantined`). Invariant: gc never runs over damage it
//! cannot see through: a damaged ref or an unreadable manifest of a live version stops it before
//! anything is removed. A fragment is kept as its shard would be (by the shard its header
//! names), and kept when that header does not check out. Never: removes a ref, a quarantined file
//! or anything outside `shards/`, `manifests/`, `fragments/` and the histories of removed
//! datasets.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::store::{ObjectKind, QUARANTINED_HISTORY_PREFIX, QUARANTINED_REF_PREFIX, StorePaths};

use super::{Granary, file_len};

/// How long unreachable objects, and what refs pointed at, are kept by default: 14 days.
pub const GC_GRACE_DEFAULT: Duration = Duration::from_secs(14 * 24 * 60 * 60);

/// How garbage collection runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GcOptions {
    /// Keep what refs pointed at, what damaged refs named and objects written within this long
    /// ago.
    pub grace: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        Self { grace: GC_GRACE_DEFAULT }
    }
}

impl GcOptions {
    /// No grace period: remove every object no live version reaches (`gc --prune-now`).
    pub fn prune_now() -> Self {
        Self { grace: Duration::ZERO }
    }
}

/// What garbage collection removed and kept.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct GcReport {
    /// Shard files removed.
    pub shards: u64,
    /// Manifest files removed.
    pub manifests: u64,
    /// Fragment files removed (a fragment goes with its shard).
    pub fragments: u64,
    /// Fragment files kept because their header does not check out (`verify` names them).
    pub kept_damaged: u64,
    /// Bytes freed.
    pub bytes: u64,
    /// Objects no live version reaches, kept for the grace period.
    pub kept_in_grace: u64,
    /// Histories of removed datasets forgotten (their last change older than the grace period).
    pub histories: u64,
    /// Objects kept, whatever the grace, because a quarantined ref or history of a dataset
    /// without a ref names them.
    pub kept_quarantined: u64,
    /// Those datasets' names.
    pub quarantined_datasets: BTreeSet<String>,
}

/// Objects to keep.
#[derive(Default)]
struct Keep {
    manifests: BTreeSet<ObjectId>,
    shards: BTreeSet<ObjectId>,
}

impl Keep {
    fn contains(&self, kind: ObjectKind, id: ObjectId) -> bool {
        match kind {
            ObjectKind::Manifest => self.manifests.contains(&id),
            ObjectKind::Shard => self.shards.contains(&id),
            // A fragment goes with its shard (`fragment_shard`).
            ObjectKind::Fragment => false,
        }
    }
}

/// The shard a fragment file's header names; `None` when the header cannot be read or does not
/// check out (gc keeps such a file: `verify` reports it and `repair` quarantines it).
fn fragment_shard(path: &Path) -> Option<ObjectId> {
    use std::io::Read;
    let mut block = vec![0u8; crate::shard::BLOCK_BYTES];
    fs::File::open(path).and_then(|mut file| file.read_exact(&mut block)).ok()?;
    crate::erasure::FragmentHeader::decode(&block).ok().map(|(header, _)| header.shard.0)
}

impl Granary {
    /// Removes every manifest and shard that no live version reaches and that the grace period
    /// does not protect (see the module doc), and the histories of datasets removed before it.
    pub fn gc(&mut self, options: GcOptions) -> Result<GcReport> {
        let now = SystemTime::now();
        let cutoff = now.checked_sub(options.grace).unwrap_or(SystemTime::UNIX_EPOCH);
        let cutoff_unix_secs = cutoff.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let paths = self.store.paths().clone();
        let (live, recent, pinned) = objects_to_keep(&paths, cutoff_unix_secs, options.grace > Duration::ZERO)?;
        let mut report = GcReport { quarantined_datasets: pinned.names, ..GcReport::default() };
        for kind in [ObjectKind::Manifest, ObjectKind::Shard, ObjectKind::Fragment] {
            for (id, path) in paths.list_objects(kind)? {
                // A fragment is kept as its shard is.
                let (keep_as, of) = match kind {
                    ObjectKind::Fragment => match fragment_shard(&path) {
                        Some(shard) => (ObjectKind::Shard, shard),
                        None => {
                            report.kept_damaged += 1;
                            continue;
                        }
                    },
                    _ => (kind, id),
                };
                if live.contains(keep_as, of) {
                    continue;
                }
                if pinned.keep.contains(keep_as, of) {
                    report.kept_quarantined += 1;
                    continue;
                }
                if recent.contains(keep_as, of) || (options.grace > Duration::ZERO && modified(&path)? >= cutoff) {
                    report.kept_in_grace += 1;
                    continue;
                }
                // What a live version reaches, or a quarantined ref pins, is never removed.
                debug_assert!(!live.contains(keep_as, of) && !pinned.keep.contains(keep_as, of));
                report.bytes += file_len(&path)?;
                self.store.remove_object(kind, id)?;
                match kind {
                    ObjectKind::Manifest => {
                        self.catalog.remove_manifest(ManifestId(id))?;
                        report.manifests += 1;
                    }
                    ObjectKind::Shard => {
                        self.catalog.remove_shard(ShardId(id))?;
                        report.shards += 1;
                    }
                    ObjectKind::Fragment => report.fragments += 1,
                }
            }
        }
        self.catalog.flush()?;
        for name in paths.list_histories()? {
            if paths.ref_file(&name).exists() {
                continue;
            }
            let Some(history) = paths.read_history(&name)? else { continue };
            let last = history.entries().iter().map(|e| e.unix_secs).max().unwrap_or(0);
            if history.replay().is_none() && (last < cutoff_unix_secs || options.grace.is_zero()) {
                self.store.remove_history(&name)?;
                report.histories += 1;
            }
        }
        Ok(report)
    }
}

/// What quarantined refs and histories of datasets without a ref keep, whatever the grace.
#[derive(Default)]
struct Pinned {
    keep: Keep,
    names: BTreeSet<String>,
}

/// What gc keeps: what live versions reach, what only the grace period (or a lost ref's
/// history) keeps, and what quarantined refs pin; see the module doc. Fails, before anything is
/// removed, on a damaged ref or history, or an unreadable manifest of a live version.
fn objects_to_keep(paths: &StorePaths, cutoff_unix_secs: u64, grace: bool) -> Result<(Keep, Keep, Pinned)> {
    let needs_repair = |what: String, error: Error| Error::NeedsRepair { what, detail: error.to_string() };
    // Manifests that must be read (live versions), and those kept only if they are there.
    let mut live = BTreeSet::new();
    let mut recent = BTreeSet::new();
    for name in paths.list_names()? {
        match paths.read_ref(&name) {
            Ok(log) => live.extend(log.versions().iter().map(|v| (v.manifest, format!("{name}@{}", v.number)))),
            Err(Error::NotFound { .. }) => {}
            Err(e) if e.is_corruption() => {
                return Err(needs_repair(format!("the ref of dataset {name} is damaged"), e));
            }
            Err(e) => return Err(e),
        }
        match paths.read_history(&name) {
            Ok(Some(history)) => {
                // Live in the history but not in a ref: a lost ref that `repair` restores.
                let since = if grace { cutoff_unix_secs } else { u64::MAX };
                recent.extend(history.manifests_since(since));
                if history.damaged_lines() > 0 {
                    recent.extend(manifest_ids_in(&paths.history_file(&name))?);
                }
            }
            Ok(None) => {}
            Err(e) if e.is_corruption() => {
                return Err(needs_repair(format!("the ref history of dataset {name} is damaged"), e));
            }
            Err(e) => return Err(e),
        }
    }
    let mut pinned_ids = Vec::new();
    let mut pinned = Pinned::default();
    for quarantined in quarantined_ref_texts(paths)? {
        if !paths.ref_file(&quarantined.name).exists() {
            // Its dataset has no ref: kept until restored or forgotten, whatever the grace. A
            // ref too damaged to name any manifest (cut short) could have named any of them:
            // every manifest no live version reaches is kept, with its shards.
            pinned.names.insert(quarantined.name.to_string());
            let named = manifest_ids_in(&quarantined.path)?;
            if named.is_empty() {
                pinned_ids.extend(paths.list_objects(ObjectKind::Manifest)?.into_iter().map(|(id, _)| ManifestId(id)));
            }
            pinned_ids.extend(named);
        } else if grace && quarantined.ctime_unix_secs >= cutoff_unix_secs {
            recent.extend(manifest_ids_in(&quarantined.path)?);
        }
    }
    let mut keep_live = Keep::default();
    for (id, version) in &live {
        let manifest = paths
            .read_manifest(*id)
            .map_err(|e| needs_repair(format!("manifest {id} of {version} cannot be read; nothing was removed"), e))?;
        keep_live.manifests.insert(id.0);
        keep_live.shards.extend(manifest.entries().iter().map(|e| e.shard.0));
    }
    debug_assert_eq!(keep_live.manifests.len(), live.iter().map(|(id, _)| id).collect::<BTreeSet<_>>().len());
    let mut keep_recent = Keep::default();
    keep_what_is_there(paths, recent, &keep_live, &mut keep_recent)?;
    keep_what_is_there(paths, pinned_ids, &keep_live, &mut pinned.keep)?;
    Ok((keep_live, keep_recent, pinned))
}

/// Adds to `keep` the manifests `ids` that `live` does not keep already, and the shards those
/// still here list: versions no ref names any more keep what of them is still there.
fn keep_what_is_there(
    paths: &StorePaths,
    ids: impl IntoIterator<Item = ManifestId>,
    live: &Keep,
    keep: &mut Keep,
) -> Result<()> {
    for id in ids {
        if live.manifests.contains(&id.0) || !keep.manifests.insert(id.0) {
            continue;
        }
        match paths.read_manifest(id) {
            Ok(manifest) => keep.shards.extend(manifest.entries().iter().map(|e| e.shard.0)),
            Err(e) if matches!(e, Error::NotFound { .. }) || e.is_corruption() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A ref or history that `repair` moved to `quarantine/` (`ref-NAME.*`, `history-NAME.*`).
pub(crate) struct QuarantinedRefText {
    pub(crate) name: crate::store::DatasetName,
    pub(crate) path: std::path::PathBuf,
    /// When it was moved (a move changes a file's ctime, not its mtime).
    pub(crate) ctime_unix_secs: u64,
}

/// The refs and histories in `quarantine/` that are not marked forgotten.
pub(crate) fn quarantined_ref_texts(paths: &StorePaths) -> Result<Vec<QuarantinedRefText>> {
    use std::os::unix::fs::MetadataExt;
    let dir = paths.quarantine_dir();
    let entries = match fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("read directory", &dir, e)),
    };
    let mut texts = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("read directory", &dir, e))?;
        let path = entry.path();
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        let Some(rest) = file_name
            .strip_prefix(QUARANTINED_REF_PREFIX)
            .or_else(|| file_name.strip_prefix(QUARANTINED_HISTORY_PREFIX))
        else {
            continue;
        };
        // `NAME.PID-N`: the suffix the move added follows the last dot.
        let Some(name) = rest.rsplit_once('.').and_then(|(name, _)| crate::store::DatasetName::new(name).ok()) else {
            continue;
        };
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
        if !meta.is_file() {
            continue;
        }
        texts.push(QuarantinedRefText { name, path, ctime_unix_secs: u64::try_from(meta.ctime()).unwrap_or(0) });
    }
    Ok(texts)
}

/// Every 64-hex-digit word in a text file, read as a manifest id: what a damaged ref or history
/// may still name.
fn manifest_ids_in(path: &Path) -> Result<Vec<ManifestId>> {
    const REF_TEXT_BYTES_MAX: u64 = 64 << 20;
    if file_len(path)? > REF_TEXT_BYTES_MAX {
        return Ok(Vec::new());
    }
    let bytes = fs::read(path).map_err(|e| Error::io("read", path, e))?;
    Ok(bytes
        .split(|b| !b.is_ascii_hexdigit())
        .filter_map(|word| std::str::from_utf8(word).ok().and_then(ObjectId::parse_hex))
        .map(ManifestId)
        .collect())
}

fn modified(path: &Path) -> Result<SystemTime> {
    fs::metadata(path).and_then(|m| m.modified()).map_err(|e| Error::io("stat", path, e))
}
