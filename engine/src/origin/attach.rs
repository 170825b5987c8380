//! `attach` and `detach`: a dataset of an origin made readable in a local store, and undone.
//!
//! Attaching fetches the version's manifest (checked against its id), then every shard's
//! metadata only (header, index and checksum table, footer: a few KiB each, checked against the
//! digest the manifest records), publishes the manifest, records the attachment in
//! `origin/attached/<name>` and then writes the local ref. Record data stays at the origin until
//! a reader needs it (`OriginCache`). Files (docs/format.md): `origin/attached/<name>` holds
//! `granary-attach 1`, `url <URL>`, a CRC32C line; `origin/cache` holds `granary-cache 1`,
//! `bytes <N>` (the bound; 0 is none), optionally `evictor <NAME or PATH>`, a CRC32C line. Never: fetches record data, or touches a
//! dataset that was not attached (a local name is refused).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::{FETCH_TRIES, Origin};
use crate::engine::Granary;
use crate::error::{Error, FormatError, Result};
use crate::id::{ManifestId, ShardId};
use crate::manifest::Manifest;
use crate::shard::ShardMeta;
use crate::store::{DatasetName, ObjectKind, RefLog, StorePaths, VersionSpec, replace_file};

const ATTACH_HEADER: &str = "granary-attach 1";
const CACHE_HEADER: &str = "granary-cache 1";
/// Threads checking shard metadata at the origin at once.
const META_THREADS: usize = 8;

/// The `origin/` directory of a store.
pub(crate) fn origin_dir(paths: &StorePaths) -> PathBuf {
    paths.root().join("origin")
}

fn attached_dir(paths: &StorePaths) -> PathBuf {
    origin_dir(paths).join("attached")
}

/// A dataset of this store that is read from an origin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The dataset.
    pub name: DatasetName,
    /// The origin's URL.
    pub url: String,
}

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

/// Every attachment of the store at `paths`, by name.
pub fn attachments(paths: &StorePaths) -> Result<Vec<Attachment>> {
    let dir = attached_dir(paths);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", &dir, e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::io("list", &dir, e))?;
        // Temp files of an interrupted write start with a dot: not a name.
        let Some(name) = entry.file_name().to_str().and_then(|n| DatasetName::new(n).ok()) else { continue };
        let path = entry.path();
        let bytes = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
        let fields =
            decode_record(&bytes, ATTACH_HEADER).map_err(|source| Error::Format { path: path.clone(), source })?;
        let url = field(&fields, "url").map_err(|source| Error::Format { path, source })?;
        out.push(Attachment { name, url: url.to_owned() });
    }
    out.sort_by(|a, b| a.name.as_str().cmp(b.name.as_str()));
    Ok(out)
}

/// The attachment of dataset `name`, if it is one.
pub fn attachment(paths: &StorePaths, name: &DatasetName) -> Result<Option<Attachment>> {
    Ok(attachments(paths)?.into_iter().find(|a| &a.name == name))
}

/// The shards of a store as its origin cache sees them: those its attached datasets name (their
/// bytes and the attachment's URL) and those a local dataset names (never evicted).
#[derive(Debug, Default)]
pub(crate) struct StoreShards {
    pub(crate) attached: HashMap<ShardId, (u64, String)>,
    pub(crate) local: HashSet<ShardId>,
}

impl StoreShards {
    /// The shards the cache owns: attached ones that no local dataset names.
    pub(crate) fn cached(&self) -> HashSet<ShardId> {
        self.attached.keys().filter(|id| !self.local.contains(id)).copied().collect()
    }
}

/// Reads which shards of the store at `paths` are attached and which local (an attach cut short
/// before its ref names none yet).
pub(crate) fn store_shards(paths: &StorePaths) -> Result<StoreShards> {
    let attached = attachments(paths)?;
    let mut out = StoreShards::default();
    for attachment in &attached {
        let log = match paths.read_ref(&attachment.name) {
            Ok(log) => log,
            Err(Error::NotFound { .. }) => continue,
            Err(e) => return Err(e),
        };
        for version in log.versions() {
            for entry in paths.read_manifest(version.manifest)?.entries() {
                out.attached.insert(entry.shard, (entry.file_bytes, attachment.url.clone()));
            }
        }
    }
    for name in paths.list_refs()? {
        if attached.iter().any(|a| a.name == name) {
            continue;
        }
        for version in paths.read_ref(&name)?.versions() {
            out.local.extend(paths.read_manifest(version.manifest)?.entries().iter().map(|e| e.shard));
        }
    }
    Ok(out)
}

/// The store's cache bound in bytes (0: none).
pub fn cache_bound(paths: &StorePaths) -> Result<u64> {
    Ok(cache_settings(paths)?.bytes)
}

/// How the store's cache is run: its bound and its evictor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheSettings {
    /// The bound in bytes (0: none).
    pub bytes: u64,
    /// The evictor plugin (a built-in name or a file); `None`: `plan-aware`.
    pub evictor: Option<String>,
}

/// The store's cache settings (`origin/cache`; the defaults when there is none).
pub fn cache_settings(paths: &StorePaths) -> Result<CacheSettings> {
    let path = origin_dir(paths).join("cache");
    let bytes = match std::fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(CacheSettings::default()),
        Err(e) => return Err(Error::io("read", &path, e)),
    };
    let fields = decode_record(&bytes, CACHE_HEADER).map_err(|source| Error::Format { path: path.clone(), source })?;
    let text = field(&fields, "bytes").map_err(|source| Error::Format { path: path.clone(), source })?;
    let bound = text.parse().map_err(|_| Error::Format {
        path,
        source: FormatError::Inconsistent { field: "bytes", detail: format!("{text:?} is not a number") },
    })?;
    let evictor = field(&fields, "evictor").ok().map(str::to_owned);
    Ok(CacheSettings { bytes: bound, evictor })
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
                    && meta.layout() == manifest.layout() =>
            {
                return Ok(());
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

fn encode_record(header: &str, fields: &[(&str, &str)]) -> String {
    let mut text = format!("{header}\n");
    for (key, value) in fields {
        text.push_str(&format!("{key} {value}\n"));
    }
    let crc = crc32c::crc32c(text.as_bytes());
    text.push_str(&format!("crc32c {crc:08x}\n"));
    text
}

fn decode_record(bytes: &[u8], header: &str) -> Result<Vec<(String, String)>, FormatError> {
    let region = "origin record";
    let text = std::str::from_utf8(bytes).map_err(|_| FormatError::BadMagic { region })?;
    let body_end = text
        .trim_end_matches('\n')
        .rfind('\n')
        .map(|at| at + 1)
        .ok_or(FormatError::Truncated { region, detail: "no checksum line".to_owned() })?;
    let (body, crc_line) = text.split_at(body_end);
    let expected = crc_line
        .trim_end()
        .strip_prefix("crc32c ")
        .and_then(|hex| u32::from_str_radix(hex, 16).ok())
        .ok_or(FormatError::Truncated { region, detail: "no checksum line".to_owned() })?;
    let actual = crc32c::crc32c(body.as_bytes());
    if expected != actual {
        return Err(FormatError::ChecksumMismatch { region, expected, actual });
    }
    let mut lines = body.lines();
    if lines.next() != Some(header) {
        return Err(FormatError::BadMagic { region });
    }
    Ok(lines.filter_map(|line| line.split_once(' ')).map(|(key, value)| (key.to_owned(), value.to_owned())).collect())
}

fn field<'a>(fields: &'a [(String, String)], key: &'static str) -> Result<&'a str, FormatError> {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .ok_or(FormatError::Inconsistent { field: key, detail: "missing".to_owned() })
}
