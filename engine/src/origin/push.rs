//! `push`: publishes a dataset version of a local store to an origin.
//!
//! Owns: `push`, its `PushReport`, and the `Progress` its callback is told.
//!
//! Order: every shard the origin lacks (each checked against its id here first, so a damaged
//! local copy is never published), then the manifest, then the ref, with a conditional put. An
//! interrupted push leaves only whole objects under content ids, which no ref names until the
//! last step: a reader of the origin sees the version whole or not at all, and pushing again
//! sends what is still missing. Never: takes the store's write lock (it only reads the store).

use super::Origin;
use crate::error::{Error, Result};
use crate::store::{DatasetName, ObjectKind, RefLog, StorePaths, Version, VersionSpec, hash_file};

/// What a push did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushReport {
    /// The dataset and version pushed.
    pub name: DatasetName,
    /// Its number, the same at the origin as here.
    pub number: u64,
    /// Shards uploaded, and shards the origin already had.
    pub shards_uploaded: usize,
    /// Shards the origin already had.
    pub shards_present: usize,
    /// Bytes uploaded (shards and manifest).
    pub bytes_uploaded: u64,
    /// Whether the origin's ref changed (false: it already named this version).
    pub ref_written: bool,
}

/// Pushes version `spec` (a name, or `name@N`) of the store at `paths` to `origin`. `progress`
/// is told the total bytes to upload once, then each chunk sent.
pub fn push(
    paths: &StorePaths,
    spec: &VersionSpec,
    origin: &Origin,
    progress: &dyn Fn(Progress),
) -> Result<PushReport> {
    paths.check()?;
    let (manifest_id, version) = paths.resolve(spec)?;
    let Some((name, number)) = version else {
        return Err(Error::invalid_input(format!(
            "push takes a dataset name (NAME or NAME@N), not a manifest id ({spec}): the origin's ref needs one"
        )));
    };
    let manifest = paths.read_manifest(manifest_id)?;
    let shards: Vec<_> = manifest.entries().iter().map(|entry| entry.shard.0).collect();
    let held = origin.sizes_of(ObjectKind::Shard, &shards)?;
    let mut missing = Vec::new();
    for (entry, held) in manifest.entries().iter().zip(held) {
        if held != Some(entry.file_bytes)
            && !missing.iter().any(|e: &&crate::manifest::ManifestEntry| e.shard == entry.shard)
        {
            missing.push(entry);
        }
    }
    let total: u64 = missing.iter().map(|entry| entry.file_bytes).sum();
    progress(Progress::Total(total));
    let mut report = PushReport {
        name: name.clone(),
        number,
        shards_uploaded: 0,
        shards_present: shards.len() - missing.len(),
        bytes_uploaded: 0,
        ref_written: false,
    };
    for entry in missing {
        let file = paths.shard(entry.shard);
        if !file.exists() {
            return Err(Error::MissingShard { shard: entry.shard, manifest: manifest_id });
        }
        let actual = hash_file(&file)?;
        if actual != entry.shard.0 {
            return Err(Error::HashMismatch { path: file, expected: entry.shard.0, actual });
        }
        origin.upload(ObjectKind::Shard, entry.shard.0, &file, &|n| progress(Progress::Sent(n)))?;
        report.shards_uploaded += 1;
        report.bytes_uploaded += entry.file_bytes;
    }
    let manifest_file = paths.manifest(manifest_id);
    if origin.size_of(ObjectKind::Manifest, manifest_id.0)?.is_none() {
        let actual = hash_file(&manifest_file)?;
        if actual != manifest_id.0 {
            return Err(Error::HashMismatch { path: manifest_file, expected: manifest_id.0, actual });
        }
        origin.upload(ObjectKind::Manifest, manifest_id.0, &manifest_file, &|_| {})?;
        report.bytes_uploaded += std::fs::metadata(&manifest_file).map(|m| m.len()).unwrap_or(0);
    }
    let pushed = Version { number, manifest: manifest_id };
    report.ref_written = match origin.read_ref(&name)? {
        None => {
            let log = RefLog::from_versions(vec![pushed]).expect("one version numbered from 1 up is a ref");
            origin.write_ref(&name, &log, None)?;
            true
        }
        Some((log, etag)) => match log.version(number) {
            Some(there) if there.manifest == manifest_id => false,
            Some(there) => {
                return Err(Error::invalid_input(format!(
                    "{name}@{number} at {} is manifest {}, not {manifest_id} as here: two histories of one \
                     name; push under another name",
                    origin.url(),
                    there.manifest
                )));
            }
            None => {
                let mut versions = log.versions().to_vec();
                versions.push(pushed);
                versions.sort_by_key(|v| v.number);
                let log = RefLog::from_versions(versions).expect("distinct numbers, sorted, from 1 up");
                origin.write_ref(&name, &log, Some(etag))?;
                true
            }
        },
    };
    Ok(report)
}

/// What a push tells its progress callback.
#[derive(Clone, Copy, Debug)]
pub enum Progress {
    /// The bytes it is about to upload, once.
    Total(u64),
    /// Bytes just sent.
    Sent(u64),
}
