//! `attach` and `detach`: a dataset of an origin made readable in a local store, and undone.
//!
//! Attaching fetches the version's manifest (checked against its id), then every shard's
//! metadata only (header, index and checksum table, footer: a few KiB each, checked against the
//! digest the manifest records), publishes the manifest, records the attachment in
//! `origin/attached/<name>` and then writes the local ref. Record data stays at the origin until
//! a reader needs it (`OriginCache`). The records it writes (`origin/attached/<name>`,
//! `origin/cache`) are `store::attached`'s, which reads them back.
//!
//! Owns `attach`, `detach`, their reports, and `shard_metas_at_origins` (attached shards'
//! metadata read again for a reader of lengths: packing). Never: fetches record data, or
//! touches a dataset that was not attached (a local name is refused).

use std::collections::HashSet;

use super::{FETCH_TRIES, Origin};
use crate::engine::Granary;
use crate::error::{Error, Result};
use crate::id::{ManifestId, ShardId};
use crate::manifest::Manifest;
use crate::shard::{Layout, ShardMeta};
use crate::store::attached::{
    ATTACH_HEADER, CACHE_HEADER, attached_dir, attachment, cache_bound, cache_settings, encode_record, origin_dir,
};
use crate::store::{DatasetName, ObjectKind, RefLog, VersionSpec, replace_file};

/// Threads checking shard metadata at the origin at once.
const META_THREADS: usize = 8;

/// What an attach did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachReport {
    /// The dataset and the version attached.
    pub name: DatasetName,
    /// The version's number (the origin's).
    pub number: u64,
    /// Its manifest.
    pub manifest: ManifestId,
    /// Shards, and their bytes: the dataset's size.
    pub shards: usize,
    /// Bytes of its shard files.
    pub dataset_bytes: u64,
    /// The store's cache bound now (0: none).
    pub cache_bytes: u64,
}

/// Attaches version `spec` (`NAME` or `NAME@N`) of `origin` to the store `granary` holds, and
/// sets the store's cache bound and evictor plugin when `cache_bytes` and `evictor` are given
/// (an evictor that does not load is refused here, not at the first read). Attaching a name again moves it to
/// the origin's version asked for (the same origin only).
pub fn attach(
    granary: &mut Granary,
    origin: &Origin,
    spec: &VersionSpec,
    cache_bytes: Option<u64>,
    evictor: Option<&str>,
) -> Result<AttachReport> {
    let paths = granary.paths().clone();
    let (name, number) = match spec {
        VersionSpec::Latest(name) => (name.clone(), None),
        VersionSpec::Numbered(name, number) => (name.clone(), Some(*number)),
        VersionSpec::Manifest(_) => {
            return Err(Error::invalid_input(format!("attach takes NAME or NAME@N, not a manifest id ({spec})")));
        }
    };
    let attached = attachment(&paths, &name)?;
    if let Some(attached) = &attached
        && attached.url != origin.url()
    {
        return Err(Error::invalid_input(format!(
            "dataset {name} is attached to {} here, not {}: detach it first",
            attached.url,
            origin.url()
        )));
    }
    let local = match paths.read_ref(&name) {
        Ok(log) => Some(log),
        Err(Error::NotFound { .. }) => None,
        Err(e) => return Err(e),
    };
    if local.is_some() && attached.is_none() {
        return Err(Error::invalid_input(format!(
            "dataset {name} exists here and was not attached: attach under another name, or remove it first"
        )));
    }
    let Some((log, _)) = origin.read_ref(&name)? else {
        return Err(Error::NotFound { what: format!("dataset {name} at {}", origin.url()) });
    };
    let version = match number {
        None => log.latest(),
        Some(n) => log.version(n).ok_or_else(|| Error::NotFound { what: format!("{name}@{n} at {}", origin.url()) })?,
    };
    let (manifest, bytes) = origin.manifest(version.manifest)?;
    let bound = match cache_bytes {
        Some(bound) => bound,
        None => cache_bound(&paths)?,
    };
    if bound > 0
        && let Some(big) = manifest.entries().iter().find(|e| e.file_bytes > bound)
    {
        return Err(Error::invalid_input(format!(
            "shard {} of {name} is {} bytes, more than the whole cache ({bound} bytes): give --cache-bytes at \
             least the largest shard",
            big.shard, big.file_bytes
        )));
    }
    if let Some(evictor) = evictor {
        let host = crate::policy::PolicyHost::new(crate::policy::Limits::default(), None)?;
        host.evictor(Some(evictor), &[], 1)?;
    }
    check_shard_metas(origin, &manifest)?;

    let dir = origin_dir(&paths);
    let incoming = dir.join("incoming");
    std::fs::create_dir_all(&incoming).map_err(|e| Error::io("create directory", &incoming, e))?;
    std::fs::create_dir_all(attached_dir(&paths))
        .map_err(|e| Error::io("create directory", attached_dir(&paths), e))?;
    if !paths.manifest(version.manifest).exists() {
        let tmp = incoming.join(format!("{}-{}.manifest", std::process::id(), version.manifest.0.short(16)));
        // Locked until adopted, as every file under `incoming/`.
        let mut locked = super::create_locked(&tmp)?;
        std::io::Write::write_all(&mut locked, &bytes).map_err(|e| Error::io("write", &tmp, e))?;
        let adopted = granary.adopt_object(ObjectKind::Manifest, version.manifest.0, &tmp);
        drop(locked);
        if adopted.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        adopted?;
    }
    if cache_bytes.is_some() || evictor.is_some() {
        let mut settings = cache_settings(&paths)?;
        settings.bytes = bound;
        if let Some(evictor) = evictor {
            settings.evictor = Some(evictor.to_owned());
        }
        let bytes = settings.bytes.to_string();
        let mut fields = vec![("bytes", bytes.as_str())];
        if let Some(evictor) = &settings.evictor {
            fields.push(("evictor", evictor.as_str()));
        }
        let record = encode_record(CACHE_HEADER, &fields);
        replace_file(&dir, &dir.join("cache"), record.as_bytes(), true)?;
    }
    // The attachment before the ref: a reader that finds the ref finds where its shards are.
    let record = encode_record(ATTACH_HEADER, &[("url", origin.url())]);
    replace_file(&attached_dir(&paths), &attached_dir(&paths).join(name.as_str()), record.as_bytes(), true)?;
    let mut versions = local.map(|log| log.versions().to_vec()).unwrap_or_default();
    if !versions.iter().any(|v| v.number == version.number) {
        versions.push(version);
        versions.sort_by_key(|v| v.number);
        let log = RefLog::from_versions(versions).ok_or_else(|| {
            Error::invalid_input(format!("{name}: the origin's version {} does not fit the ref here", version.number))
        })?;
        adopt_ref_or_write(granary, &name, &log)?;
    }
    Ok(AttachReport {
        name,
        number: version.number,
        manifest: version.manifest,
        shards: manifest.entries().len(),
        dataset_bytes: manifest.entries().iter().map(|e| e.file_bytes).sum(),
        cache_bytes: bound,
    })
}

/// Writes `log` as `name`'s ref; it must move the ref forward (refs only do).
fn adopt_ref_or_write(granary: &mut Granary, name: &DatasetName, log: &RefLog) -> Result<()> {
    if granary.adopt_ref(name, log)? {
        return Ok(());
    }
    Err(Error::invalid_input(format!(
        "{name}@{} is older than the version attached here: refs only move forward (detach, then attach it)",
        log.latest().number
    )))
}

/// Checks every shard's metadata at the origin against the manifest, `META_THREADS` at once.
fn check_shard_metas(origin: &Origin, manifest: &Manifest) -> Result<()> {
    let entries = manifest.entries();
    let failed = parking_lot::Mutex::new(None);
    std::thread::scope(|scope| {
        for first in 0..META_THREADS.min(entries.len()) {
            let failed = &failed;
            scope.spawn(move || {
                for entry in entries.iter().skip(first).step_by(META_THREADS) {
                    if failed.lock().is_some() {
                        return;
                    }
                    if let Err(e) = check_shard_meta(origin, manifest, entry) {
                        *failed.lock() = Some(e);
                        return;
                    }
                }
            });
        }
    });
    match failed.into_inner() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Checks shard `entry`'s metadata (header, footer, index, checksum table) at the origin against
/// its manifest: metadata that fails to decode or differs is read again (damaged on the way),
/// up to `FETCH_TRIES` times.
fn check_shard_meta(origin: &Origin, manifest: &Manifest, entry: &crate::manifest::ManifestEntry) -> Result<()> {
    fetch_shard_meta(origin, manifest.layout(), entry).map(drop)
}

/// The metadata of shards `wanted` (an index of the caller's, and the shard's manifest entry)
/// of attached datasets of the store at `paths`, read from their origins (`META_THREADS` at
/// once) and checked against their entries and `layout`, without the shards' data: what a
/// reader of lengths (packing) needs of shards the cache does not hold.
pub fn shard_metas_at_origins(
    paths: &crate::store::StorePaths,
    wanted: &[(usize, crate::manifest::ManifestEntry)],
    layout: &Layout,
) -> Result<Vec<(usize, ShardMeta)>> {
    let shards = crate::store::attached::store_shards(paths)?;
    let mut origins: std::collections::HashMap<String, Origin> = std::collections::HashMap::new();
    let mut jobs = Vec::with_capacity(wanted.len());
    for (index, entry) in wanted {
        let Some((_, url)) = shards.attached.get(&entry.shard) else {
            return Err(Error::NotFound {
                what: format!("shard {} (not here, and no attached dataset names it)", entry.shard),
            });
        };
        if !origins.contains_key(url) {
            origins.insert(url.clone(), Origin::open(url)?);
        }
        jobs.push((*index, *entry, url.clone()));
    }
    let out = parking_lot::Mutex::new(Vec::with_capacity(jobs.len()));
    let failed = parking_lot::Mutex::new(None);
    std::thread::scope(|scope| {
        for first in 0..META_THREADS.min(jobs.len()) {
            let (jobs, origins, out, failed) = (&jobs, &origins, &out, &failed);
            scope.spawn(move || {
                for (index, entry, url) in jobs.iter().skip(first).step_by(META_THREADS) {
                    if failed.lock().is_some() {
                        return;
                    }
                    let Some(origin) = origins.get(url) else { return };
                    match fetch_shard_meta(origin, layout, entry) {
                        Ok(meta) => out.lock().push((*index, meta)),
                        Err(e) => {
                            *failed.lock() = Some(e);
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = failed.into_inner() {
        return Err(e);
    }
    let mut out = out.into_inner();
    out.sort_unstable_by_key(|(index, _)| *index);
    Ok(out)
}

/// Shard `entry`'s metadata read at `origin` and checked against the entry and `layout` (read
/// again when it fails, up to `FETCH_TRIES` times).
fn fetch_shard_meta(origin: &Origin, layout: &Layout, entry: &crate::manifest::ManifestEntry) -> Result<ShardMeta> {
    let id = entry.shard;
    let mut problem = String::new();
    for _ in 0..FETCH_TRIES {
        // Err(Ok): the bytes read do not decode; Err(Err): the origin failed a read.
        let meta = ShardMeta::load(
            entry.file_bytes,
            |offset, len| origin.shard_range(id, offset..offset + len).map_err(Err),
            |e| Ok(format!("metadata: {e}")),
        );
        match meta {
            Ok(meta)
                if meta.digest() == entry.meta_digest
                    && meta.n_records() == entry.n_records
                    && meta.layout() == layout =>
            {
                return Ok(meta);
            }
            Ok(_) => problem = "its metadata is not the one its manifest records".to_owned(),
            Err(Err(e)) => return Err(e),
            Err(Ok(bad)) => problem = bad,
        }
    }
    Err(Error::Origin {
        origin: origin.url().to_owned(),
        op: "check",
        detail: format!("shard {id}: {problem} (in {FETCH_TRIES} reads)"),
    })
}

/// What a detach did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DetachReport {
    /// Cached shards deleted (no other dataset here names them).
    pub shards_removed: usize,
    /// Their bytes.
    pub bytes_removed: u64,
}

/// Detaches dataset `name`: its ref and attachment go, and so do its cached shards that no other
/// dataset here names. The origin is not touched.
pub fn detach(granary: &mut Granary, name: &DatasetName) -> Result<DetachReport> {
    let paths = granary.paths().clone();
    if attachment(&paths, name)?.is_none() {
        return Err(Error::NotFound { what: format!("an attachment of {name} (see `granary ls`)") });
    }
    let mut dropped: HashSet<ShardId> = HashSet::new();
    match paths.read_ref(name) {
        Ok(log) => {
            for version in log.versions() {
                if let Ok(manifest) = paths.read_manifest(version.manifest) {
                    dropped.extend(manifest.entries().iter().map(|e| e.shard));
                }
            }
            granary.remove(name, None)?;
        }
        Err(Error::NotFound { .. }) => {}
        Err(e) => return Err(e),
    }
    let record = attached_dir(&paths).join(name.as_str());
    std::fs::remove_file(&record).map_err(|e| Error::io("remove", &record, e))?;
    crate::store::sync_dir(&attached_dir(&paths))?;
    for other in paths.list_refs()? {
        for version in paths.read_ref(&other)?.versions() {
            for entry in paths.read_manifest(version.manifest)?.entries() {
                dropped.remove(&entry.shard);
            }
        }
    }
    let _lock = super::cache::lock_cache(&paths)?;
    let mut report = DetachReport { shards_removed: 0, bytes_removed: 0 };
    for shard in dropped {
        let path = paths.shard(shard);
        let bytes = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        match std::fs::remove_file(&path) {
            Ok(()) => {
                report.shards_removed += 1;
                report.bytes_removed += bytes;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("remove", &path, e)),
        }
    }
    Ok(report)
}
