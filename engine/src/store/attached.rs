//! The store's records of its attached datasets: which datasets are read from an origin (and
//! from which URL), the origin cache's settings, and the shards each side names.
//!
//! Owns the files under `origin/` that say what is attached (`origin/attached/<name>`:
//! `granary-attach 1`, `url <URL>`, a CRC32C line; `origin/cache`: `granary-cache 1`, `bytes
//! <N>` (the bound; 0 is none), optionally `evictor <NAME or PATH>`, a CRC32C line; see
//! docs/format.md), their encoding, and `store_shards` (the attached shards and the local ones,
//! from refs, manifests and these records), which the origin cache and a replication node both
//! read. Plain files of the store, below both of those wings. Never: talks to an origin,
//! fetches or evicts anything (`origin/` does), or writes a ref or manifest.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use super::{DatasetName, StorePaths};
use crate::error::{Error, FormatError, Result};
use crate::id::ShardId;

pub(crate) const ATTACH_HEADER: &str = "granary-attach 1";
pub(crate) const CACHE_HEADER: &str = "granary-cache 1";

/// The `origin/` directory of a store.
pub fn origin_dir(paths: &StorePaths) -> PathBuf {
    paths.root().join("origin")
}

pub(crate) fn attached_dir(paths: &StorePaths) -> PathBuf {
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
pub struct StoreShards {
    /// Shards attached datasets name: their bytes and the attachment's URL.
    pub attached: HashMap<ShardId, (u64, String)>,
    /// Shards a local dataset names.
    pub local: HashSet<ShardId>,
}

impl StoreShards {
    /// The shards the cache owns: attached ones that no local dataset names.
    pub fn cached(&self) -> HashSet<ShardId> {
        self.attached.keys().filter(|id| !self.local.contains(id)).copied().collect()
    }
}

/// Reads which shards of the store at `paths` are attached and which local (an attach cut short
/// before its ref names none yet).
pub fn store_shards(paths: &StorePaths) -> Result<StoreShards> {
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

pub(crate) fn encode_record(header: &str, fields: &[(&str, &str)]) -> String {
    let mut text = format!("{header}\n");
    for (key, value) in fields {
        text.push_str(&format!("{key} {value}\n"));
    }
    let crc = crc32c::crc32c(text.as_bytes());
    text.push_str(&format!("crc32c {crc:08x}\n"));
    text
}

pub(crate) fn decode_record(bytes: &[u8], header: &str) -> Result<Vec<(String, String)>, FormatError> {
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

pub(crate) fn field<'a>(fields: &'a [(String, String)], key: &'static str) -> Result<&'a str, FormatError> {
    fields
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
        .ok_or(FormatError::Inconsistent { field: key, detail: "missing".to_owned() })
}
