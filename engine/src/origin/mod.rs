//! The object-store origin: dataset versions published to, and read back from, object storage
//! (S3 and S3-compatible servers, GCS, Azure, local files, memory) through the `object_store`
//! crate.
//!
//! Owns: opening an origin from a URL (credentials from each cloud's usual environment, never
//! from the URL), the layout in the bucket (the local store's: `shards/ab/<id>.shard`,
//! `manifests/ab/<id>.manifest`, `refs/<name>` under the URL's path), and the operations on it:
//! existence by id, uploads (multipart for large objects), ranged reads, a shard fetched whole
//! into a local file and checked against its id, and refs written with a conditional put so two
//! pushers cannot silently overwrite each other. `push` (publishing), `attach` (a dataset made
//! readable here) and `cache` (the bounded set of shards fetched for readers) build on it.
//! Invariants: nothing fetched is used before its bytes hashed to the id that named them; the
//! URL shown in messages is the one given, which carries no credentials (one that does is
//! refused). Never: writes into the local store itself (callers publish what it fetched), or
//! prints, logs or returns a credential.

mod attach;
mod cache;
mod credentials;
mod pace;
mod push;

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path as FsPath;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion, WriteMultipart};

pub use crate::read::CacheStats;
pub use crate::store::attached::{Attachment, CacheSettings, attachment, attachments, cache_bound, cache_settings};
pub use attach::{AttachReport, DetachReport, attach, detach, shard_metas_at_origins};
pub use cache::OriginCache;
pub use push::{Progress as PushProgress, PushReport, push};

use crate::error::{Error, Result};
use crate::id::{ManifestId, ObjectId, ShardId};
use crate::manifest::Manifest;
use crate::store::{DatasetName, ObjectKind, RefLog};

/// Objects up to this size are uploaded in one request; larger ones in parts.
const SINGLE_PUT_BYTES_MAX: u64 = 16 << 20;
/// The size of each part of a multipart upload (S3 wants at least 5 MiB but the last).
const PART_BYTES: usize = 16 << 20;
/// Parts of one upload in flight at once.
const PARTS_IN_FLIGHT: usize = 4;
/// The size of each ranged read of a shard fetch: the shard split `RANGES_IN_FLIGHT` ways, so
/// that a small shard is fetched in parallel too, but at least `RANGE_BYTES_MIN` (each request
/// pays the origin's latency) and at most `RANGE_BYTES_MAX` (the size cloud providers advise).
const RANGE_BYTES_MIN: u64 = 1 << 20;
const RANGE_BYTES_MAX: u64 = 8 << 20;
/// Ranged reads of one shard in flight at once.
const RANGES_IN_FLIGHT: usize = 8;
/// Existence checks in flight at once.
const LOOKUPS_IN_FLIGHT: usize = 32;
/// Tries at fetching one shard (or reading one manifest or shard's metadata) whose bytes did
/// not check against its id.
pub const FETCH_TRIES: u32 = 3;
/// Tries at one request that failed in a way that may pass: a connection dropped, a body cut
/// short, an error a wrapper or server calls generic. An HTTP client retries the errors it
/// knows to be transient itself, with backoff, below this.
const REQUEST_TRIES: u32 = 3;
/// The wait before the first retry of a request; each later one waits 4 times longer.
const REQUEST_BACKOFF: Duration = Duration::from_millis(100);
/// A request that took this long to fail has been retried by its HTTP client already: it is
/// not tried again here (a dead origin is reported in about a minute, not three).
const SLOW_FAILURE: Duration = Duration::from_secs(5);

/// One object store holding (or about to hold) datasets in a store's layout.
pub struct Origin {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    /// The URL as given (checked to carry no credentials), for messages.
    shown: String,
    runtime: Arc<tokio::runtime::Runtime>,
    /// For a `file://` origin, its directory: the local file system cannot replace an object
    /// conditionally, so ref updates there are serialised by a lock file instead.
    local_dir: Option<std::path::PathBuf>,
    /// Requests tried again after a transient failure.
    retries: Arc<AtomicU64>,
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Origin").field("url", &self.shown).finish_non_exhaustive()
    }
}

impl Origin {
    /// The origin at `url`: `s3://bucket/prefix` (S3 or an S3-compatible server: `AWS_ENDPOINT`,
    /// `AWS_ALLOW_HTTP`, credentials from `AWS_*` or the instance), `gs://`, `az://` (each from
    /// its cloud's environment), `file:///path` or `memory://` (empty, and gone with this
    /// value). A URL with a user, a password or a query is refused: credentials come from the
    /// environment, never from a URL that would end up in logs and shell histories.
    pub fn open(url: &str) -> Result<Self> {
        // Before a client is built: reqwest panics on one without a TLS provider.
        install_tls_provider();
        // The text is not repeated: a malformed URL may still hold a secret.
        let parsed = url::Url::parse(url).map_err(|e| Error::invalid_input(format!("the origin is not a URL: {e}")))?;
        if !parsed.username().is_empty() || parsed.password().is_some() || parsed.query().is_some() {
            // Not even the URL goes into the message: it holds the secret.
            return Err(Error::invalid_input(
                "an origin URL carries no credentials (no user, password or query): give them through \
                 the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, \
                 AZURE_STORAGE_ACCOUNT_KEY, ...)",
            ));
        }
        let shown = parsed.to_string();
        let bad = |e: object_store::Error| Error::Origin {
            origin: shown.clone(),
            op: "open",
            detail: redact(&e.to_string()),
        };
        let prefix = || Path::from_url_path(parsed.path()).map_err(|e| bad(e.into()));
        let (store, prefix): (Arc<dyn ObjectStore>, Path) = match parsed.scheme() {
            "s3" | "s3a" => {
                let var = |name: &str| std::env::var(name).ok();
                check_s3_endpoint(
                    &shown,
                    var("AWS_ENDPOINT_URL").or_else(|| var("AWS_ENDPOINT")).as_deref(),
                    var("AWS_ALLOW_HTTP").as_deref(),
                )?;
                credentials::check_s3_credentials(&shown)?;
                let store = object_store::aws::AmazonS3Builder::from_env()
                    .with_url(url)
                    // Refs are written with If-Match / If-None-Match.
                    .with_conditional_put(object_store::aws::S3ConditionalPut::ETagMatch)
                    .build()
                    .map_err(bad)?;
                (Arc::new(store), prefix()?)
            }
            "gs" => {
                let store =
                    object_store::gcp::GoogleCloudStorageBuilder::from_env().with_url(url).build().map_err(bad)?;
                (Arc::new(store), prefix()?)
            }
            "az" | "azure" | "abfs" | "abfss" => {
                let store =
                    object_store::azure::MicrosoftAzureBuilder::from_env().with_url(url).build().map_err(bad)?;
                (Arc::new(store), prefix()?)
            }
            "file" => {
                let (store, prefix) = object_store::parse_url(&parsed).map_err(bad)?;
                let dir = parsed.to_file_path().map_err(|()| Error::Origin {
                    origin: shown.clone(),
                    op: "open",
                    detail: "not a local path".to_owned(),
                })?;
                let mut origin = Self::with_store(Arc::from(store), prefix, shown)?;
                origin.local_dir = Some(dir);
                return Ok(origin);
            }
            "memory" => (Arc::new(object_store::memory::InMemory::new()), prefix()?),
            other => {
                return Err(Error::invalid_input(format!(
                    "origin {shown}: unknown scheme {other:?} (s3://, gs://, az://, file://, memory://)"
                )));
            }
        };
        Self::with_store(store, prefix, shown)
    }

    /// An origin over `store` (a wrapper that adds latency or faults, in tests and benchmarks),
    /// its objects under `prefix`, shown as `shown`.
    pub fn with_store(store: Arc<dyn ObjectStore>, prefix: Path, shown: String) -> Result<Self> {
        install_tls_provider();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("granary-origin")
            .enable_all()
            .build()
            .map_err(|e| Error::Origin { origin: shown.clone(), op: "start its runtime", detail: e.to_string() })?;
        Ok(Self { store, prefix, shown, runtime: Arc::new(runtime), local_dir: None, retries: Arc::default() })
    }

    /// The URL, as given (it carries no credentials).
    pub fn url(&self) -> &str {
        &self.shown
    }

    /// Requests tried again so far after a transient failure.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    fn error(&self, op: &'static str, what: impl std::fmt::Display, e: impl std::fmt::Display) -> Error {
        Error::Origin { origin: self.shown.clone(), op, detail: redact(&format!("{what}: {e}")) }
    }

    fn object_path(&self, kind: ObjectKind, id: ObjectId) -> Path {
        let hex = id.to_string();
        let (dir, suffix) = match kind {
            ObjectKind::Shard => ("shards", "shard"),
            ObjectKind::Manifest => ("manifests", "manifest"),
            ObjectKind::Fragment => ("fragments", "fragment"),
        };
        self.prefix.clone().join(dir).join(&hex[..2]).join(format!("{hex}.{suffix}"))
    }

    fn ref_path(&self, name: &DatasetName) -> Path {
        self.prefix.clone().join("refs").join(name.as_str())
    }

    /// The size of object `id` at the origin, or `None` when it has none.
    pub fn size_of(&self, kind: ObjectKind, id: ObjectId) -> Result<Option<u64>> {
        let path = self.object_path(kind, id);
        match self.runtime.block_on(retrying(&self.retries, || self.store.head(&path))) {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error("look up", format_args!("{} {id}", kind.noun()), e)),
        }
    }

    /// The sizes of objects `ids` at the origin (`None` for each it lacks), looked up
    /// `LOOKUPS_IN_FLIGHT` at a time.
    pub fn sizes_of(&self, kind: ObjectKind, ids: &[ObjectId]) -> Result<Vec<Option<u64>>> {
        self.runtime.block_on(async {
            let mut sizes = vec![None; ids.len()];
            let mut tasks = tokio::task::JoinSet::new();
            let mut next = 0;
            loop {
                while next < ids.len() && tasks.len() < LOOKUPS_IN_FLIGHT {
                    let (store, path, at) = (Arc::clone(&self.store), self.object_path(kind, ids[next]), next);
                    let retries = Arc::clone(&self.retries);
                    tasks.spawn(async move { (at, retrying(&retries, || store.head(&path)).await) });
                    next += 1;
                }
                let Some(done) = tasks.join_next().await else { break };
                let (at, result) = done.map_err(|e| self.error("look up", kind.noun(), e))?;
                match result {
                    Ok(meta) => sizes[at] = Some(meta.size),
                    Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => return Err(self.error("look up", format_args!("{} {}", kind.noun(), ids[at]), e)),
                }
            }
            Ok(sizes)
        })
    }

    /// Uploads the file at `file` as object `id`; `sent` is told each chunk's bytes as it
    /// leaves. Objects are named by their content, so an upload is idempotent (and tried again
    /// whole after a transient failure), and one cut short leaves nothing under the name (a
    /// multipart upload is aborted, or never completed).
    pub fn upload(&self, kind: ObjectKind, id: ObjectId, file: &FsPath, sent: &dyn Fn(u64)) -> Result<()> {
        let path = self.object_path(kind, id);
        let what = format_args!("{} {id}", kind.noun()).to_string();
        let source = File::open(file).map_err(|e| Error::io("open", file, e))?;
        let bytes = source.metadata().map_err(|e| Error::io("stat", file, e))?.len();
        if bytes <= SINGLE_PUT_BYTES_MAX {
            let data = PutPayload::from(std::fs::read(file).map_err(|e| Error::io("read", file, e))?);
            self.runtime
                .block_on(retrying(&self.retries, || self.store.put(&path, data.clone())))
                .map_err(|e| self.error("upload", &what, e))?;
            sent(bytes);
            return Ok(());
        }
        // An upload tried again re-sends its first parts: only bytes past the furthest any
        // attempt reached are reported.
        let reported = std::cell::Cell::new(0u64);
        let reached = |at: u64| {
            if at > reported.get() {
                sent(at - reported.get());
                reported.set(at);
            }
        };
        let (mut attempt, mut wait) = (1, REQUEST_BACKOFF);
        loop {
            let started = Instant::now();
            match self.runtime.block_on(self.upload_parts(&path, &source, bytes, &reached)) {
                Ok(()) => return Ok(()),
                Err(PartsFailed::Read(e)) => return Err(Error::io("read", file, e)),
                Err(PartsFailed::Store(op, e)) => {
                    if attempt >= REQUEST_TRIES || !is_transient(&e) || started.elapsed() >= SLOW_FAILURE {
                        return Err(self.error(op, &what, e));
                    }
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(wait);
                    (attempt, wait) = (attempt + 1, wait * 4);
                }
            }
        }
    }

    /// One multipart upload of `source` (`bytes` long) to `path`, aborted when it fails;
    /// `reached` is told how far into the file the parts handed over go.
    async fn upload_parts(
        &self,
        path: &Path,
        source: &File,
        bytes: u64,
        reached: &dyn Fn(u64),
    ) -> std::result::Result<(), PartsFailed> {
        let upload = self.store.put_multipart(path).await.map_err(|e| PartsFailed::Store("start upload", e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; PART_BYTES];
        let mut at = 0u64;
        while at < bytes {
            let n = usize::try_from((bytes - at).min(PART_BYTES as u64)).unwrap_or(PART_BYTES);
            if let Err(e) = source.read_exact_at(&mut buf[..n], at) {
                writer.abort().await.ok();
                return Err(PartsFailed::Read(e));
            }
            if let Err(e) = writer.wait_for_capacity(PARTS_IN_FLIGHT).await {
                writer.abort().await.ok();
                return Err(PartsFailed::Store("upload", e));
            }
            writer.write(&buf[..n]);
            at += n as u64;
            reached(at);
        }
        writer.finish().await.map(|_| ()).map_err(|e| PartsFailed::Store("finish upload", e))
    }

    /// Dataset `name`'s ref at the origin and the version of the object that holds it (for a
    /// conditional update), or `None` when the origin has no such dataset.
    pub fn read_ref(&self, name: &DatasetName) -> Result<Option<(RefLog, UpdateVersion)>> {
        let path = self.ref_path(name);
        let what = format!("ref {name}");
        let got = self.runtime.block_on(retrying(&self.retries, || async {
            let got = self.store.get(&path).await?;
            let version = UpdateVersion { e_tag: got.meta.e_tag.clone(), version: got.meta.version.clone() };
            Ok((version, got.bytes().await?))
        }));
        let (version, bytes) = match got {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.error("read", &what, e)),
        };
        let log = RefLog::decode(&bytes).map_err(|e| self.error("decode", &what, e))?;
        Ok(Some((log, version)))
    }

    /// Writes dataset `name`'s ref: created when `expected` is `None` (and refused if one
    /// appeared meanwhile), otherwise replaced only while it is still the version read.
    pub fn write_ref(&self, name: &DatasetName, log: &RefLog, expected: Option<UpdateVersion>) -> Result<()> {
        let path = self.ref_path(name);
        let mode = match expected {
            None => PutMode::Create,
            Some(version) => PutMode::Update(version),
        };
        let conflict = || Error::Origin {
            origin: self.shown.clone(),
            op: "write",
            detail: format!(
                "ref {name}: another push changed it since it was read; nothing was overwritten \
                 (push again to add this version to the new ref)"
            ),
        };
        // The local file system has no conditional replace: under a lock file beside the refs,
        // the ref read again must still be the one read before.
        let lock = match (&mode, &self.local_dir) {
            (PutMode::Update(version), Some(dir)) => {
                let lock = lock_exclusive(&dir.join("refs"), ".lock")?;
                match self.read_ref(name)? {
                    Some((_, now)) if now.e_tag == version.e_tag => {}
                    _ => return Err(conflict()),
                }
                Some(lock)
            }
            _ => None,
        };
        let mode = if lock.is_some() { PutMode::Overwrite } else { mode };
        let options = PutOptions { mode, ..PutOptions::default() };
        let encoded = log.encode();
        let payload = PutPayload::from(encoded.clone().into_bytes());
        let retried_before = self.retries();
        match self
            .runtime
            .block_on(retrying(&self.retries, || self.store.put_opts(&path, payload.clone(), options.clone())))
        {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                // A try that failed on the way back may have written the ref: then the
                // conflict is with this very write.
                if self.retries() != retried_before
                    && let Some((now, _)) = self.read_ref(name)?
                    && now.encode() == encoded
                {
                    return Ok(());
                }
                Err(conflict())
            }
            Err(e) => Err(self.error("write", format_args!("ref {name}"), e)),
        }
    }

    /// Manifest `id`, checked against its id (read again when its bytes do not match, up to
    /// `FETCH_TRIES` times) and decoded.
    pub fn manifest(&self, id: ManifestId) -> Result<(Manifest, Vec<u8>)> {
        let path = self.object_path(ObjectKind::Manifest, id.0);
        let what = format!("manifest {id}");
        let mut tries = 0;
        let bytes = loop {
            let bytes = self
                .runtime
                .block_on(retrying(&self.retries, || async { self.store.get(&path).await?.bytes().await }))
                .map_err(|e| self.error("read", &what, e))?;
            let actual = ObjectId::of(&bytes);
            if actual == id.0 {
                break bytes;
            }
            tries += 1;
            if tries >= FETCH_TRIES {
                return Err(self.error(
                    "read",
                    &what,
                    format_args!("its bytes hash to {actual} in {FETCH_TRIES} tries: damaged at the origin"),
                ));
            }
        };
        let manifest = Manifest::decode(&bytes).map_err(|e| self.error("decode", &what, e))?;
        Ok((manifest, bytes.to_vec()))
    }

    /// Bytes `range` of shard `id` (a reply of another length is a transient failure).
    pub fn shard_range(&self, id: ShardId, range: Range<u64>) -> Result<Vec<u8>> {
        let path = self.object_path(ObjectKind::Shard, id.0);
        self.runtime
            .block_on(retrying(&self.retries, || exact_range(&*self.store, &path, range.clone())))
            .map(|bytes| bytes.to_vec())
            .map_err(|e| self.error("read", format_args!("shard {id}"), e))
    }

    /// Fetches shard `id` (`file_bytes` long) whole into `file` with ranged reads in parallel,
    /// syncs it, and checks that its bytes hash to `id`. Returns the file, locked (flock,
    /// exclusive) from its creation until the caller drops it: a cache opened meanwhile by
    /// another process knows it is not a killed fetch's. On a mismatch the file holds bytes that
    /// must not be used (the caller removes it and may try again).
    pub fn fetch_shard(&self, id: ShardId, file_bytes: u64, file: &FsPath) -> Result<File> {
        let path = self.object_path(ObjectKind::Shard, id.0);
        let what = format!("shard {id}");
        let out = Arc::new(create_locked(file)?);
        let range_bytes = file_bytes.div_ceil(RANGES_IN_FLIGHT as u64).clamp(RANGE_BYTES_MIN, RANGE_BYTES_MAX);
        self.runtime.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            let mut next = 0u64;
            let mut result = Ok(());
            loop {
                while next < file_bytes && tasks.len() < RANGES_IN_FLIGHT && result.is_ok() {
                    let range = next..(next + range_bytes).min(file_bytes);
                    next = range.end;
                    let (store, path, out) = (Arc::clone(&self.store), path.clone(), Arc::clone(&out));
                    let retries = Arc::clone(&self.retries);
                    tasks.spawn(async move {
                        let bytes = retrying(&retries, || exact_range(&*store, &path, range.clone()))
                            .await
                            .map_err(|e| e.to_string())?;
                        tokio::task::spawn_blocking(move || out.write_all_at(&bytes, range.start))
                            .await
                            .map_err(|e| e.to_string())?
                            .map_err(|e| format!("write: {e}"))
                    });
                }
                let Some(done) = tasks.join_next().await else { break };
                let done = done.map_err(|e| e.to_string()).and_then(|r| r);
                if let Err(e) = done
                    && result.is_ok()
                {
                    result = Err(self.error("fetch", &what, e));
                }
            }
            debug_assert!(result.is_err() || next == file_bytes, "every range of the shard asked for");
            result
        })?;
        out.sync_all().map_err(|e| Error::io("fsync", file, e))?;
        let actual = crate::store::hash_file(file)?;
        if actual != id.0 {
            return Err(Error::HashMismatch { path: file.to_owned(), expected: id.0, actual });
        }
        Arc::into_inner(out).ok_or_else(|| self.error("fetch", &what, "a range was still being written"))
    }
}

/// Why a multipart upload failed: reading the local file, or a request (named by `.0`).
enum PartsFailed {
    Read(std::io::Error),
    Store(&'static str, object_store::Error),
}

/// Whether a request that failed with `e` may pass when tried again: not when the object is
/// missing or exists, a condition failed, or access, the path or the operation was refused.
fn is_transient(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::Generic { .. } | object_store::Error::JoinError { .. })
}

/// `request` made, and made again (up to `REQUEST_TRIES` in all, waiting longer each time) while
/// it fails quickly with a transient error; each retry counted in `retries`.
async fn retrying<T, Fut>(retries: &AtomicU64, mut request: impl FnMut() -> Fut) -> object_store::Result<T>
where
    Fut: Future<Output = object_store::Result<T>>,
{
    let (mut attempt, mut wait) = (1, REQUEST_BACKOFF);
    loop {
        let started = Instant::now();
        match request().await {
            Err(e) if attempt < REQUEST_TRIES && is_transient(&e) && started.elapsed() < SLOW_FAILURE => {
                retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(wait).await;
                (attempt, wait) = (attempt + 1, wait * 4);
            }
            done => return done,
        }
    }
}

/// Bytes `range` of the object at `path`; a reply of another length is a (transient) error.
async fn exact_range(store: &dyn ObjectStore, path: &Path, range: Range<u64>) -> object_store::Result<bytes::Bytes> {
    let bytes = store.get_range(path, range.clone()).await?;
    if bytes.len() as u64 != range.end - range.start {
        return Err(object_store::Error::Generic {
            store: "origin",
            source: format!("{} bytes for the range {range:?}", bytes.len()).into(),
        });
    }
    Ok(bytes)
}

/// Creates (or truncates) `path` for writing and takes an exclusive flock on it, held while the
/// returned file lives: files under `origin/incoming/` are locked by the process writing them.
pub(crate) fn create_locked(path: &FsPath) -> Result<File> {
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io("create", path, e))?;
    crate::io::flock(&file, libc::LOCK_EX).map_err(|e| Error::io("lock", path, e))?;
    Ok(file)
}

/// Creates `dir` if need be and takes an exclusive flock on its file `name` (blocking), held
/// while the returned file lives: the origin cache's `origin/LOCK`, a `file://` origin's refs.
pub(crate) fn lock_exclusive(dir: &FsPath, name: &str) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
    let path = dir.join(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| Error::io("open", &path, e))?;
    crate::io::flock(&file, libc::LOCK_EX).map_err(|e| Error::io("lock", &path, e))?;
    Ok(file)
}

/// Environment variables whose values are credentials (or name them, like an access key id a
/// server may echo back in an error body).
const CREDENTIAL_VARIABLES: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
];

/// `text` with the value of every credential variable set here replaced, so that an error a
/// server or client library wrote (a signature mismatch that echoes the request, say) cannot
/// carry one into a message.
/// Refuses, before any request, an S3 endpoint given as plain `http://` without `AWS_ALLOW_HTTP`:
/// the client would refuse it at the first request with "HTTP error: builder error", which
/// names neither the endpoint nor the setting.
fn check_s3_endpoint(origin: &str, endpoint: Option<&str>, allow_http: Option<&str>) -> Result<()> {
    let Some(endpoint) = endpoint.filter(|e| e.trim_start().to_ascii_lowercase().starts_with("http://")) else {
        return Ok(());
    };
    if allow_http.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes")) {
        return Ok(());
    }
    // The host alone: an endpoint URL may carry a user or a query.
    let host = url::Url::parse(endpoint.trim()).ok().and_then(|u| u.host_str().map(str::to_owned)).unwrap_or_default();
    Err(Error::invalid_input(format!(
        "origin {origin}: the S3 endpoint (AWS_ENDPOINT) is plain HTTP (http://{host}...): set AWS_ALLOW_HTTP=true \
         to use it without TLS (an S3-compatible server on a trusted network), or give an https:// endpoint"
    )))
}

fn redact(text: &str) -> String {
    let values: Vec<String> = CREDENTIAL_VARIABLES.iter().filter_map(|variable| std::env::var(variable).ok()).collect();
    without_xml_body(&redact_values(text, &values))
}

/// `text` with an S3 error's XML body (what a server answered a failed request with, quoted
/// whole by the client) cut down to its code and message, and what to do where the code says
/// (issue 40: a missing bucket printed a long XML document).
fn without_xml_body(text: &str) -> String {
    let Some(at) = text.find("<?xml").or_else(|| text.find("<Error>")) else { return text.to_owned() };
    let body = &text[at..];
    let element = |name: &str| {
        let open = format!("<{name}>");
        let start = body.find(&open)? + open.len();
        let end = body[start..].find("</")? + start;
        Some(body[start..end].trim().to_owned())
    };
    let code = element("Code").unwrap_or_else(|| "an error".to_owned());
    let mut out = text[..at].trim_end().to_owned();
    out.push(' ');
    out.push_str(&code);
    if let Some(message) = element("Message") {
        out.push_str(": ");
        out.push_str(&message);
    }
    if code == "NoSuchBucket" {
        out.push_str(" (create the bucket first, or check the bucket name in the URL)");
    }
    out
}

/// `text` with each of `values` (those of 4 bytes or more) replaced by `[redacted]`.
fn redact_values(text: &str, values: &[String]) -> String {
    let mut out = text.to_owned();
    for value in values.iter().filter(|value| value.len() >= 4) {
        out = out.replace(value.as_str(), "[redacted]");
    }
    out
}

/// Makes ring rustls's process-wide provider, once: reqwest is built without one of its own
/// (see the workspace's Cargo.toml), and building an `object_store` HTTP client without one
/// panics. `Origin::open` calls it; call it before building a client of your own for
/// [`Origin::with_store`]. A provider installed first by another part of the process serves
/// as well.
pub fn install_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_s3_error_body_is_cut_to_its_code_and_message() {
        let text = "upload: PUT http://h/b/x - Server returned non-2xx status code: 404 Not Found: <?xml \
                    version=\"1.0\" encoding=\"utf-8\"?> <Error><Code>NoSuchBucket</Code><Message>The specified \
                    bucket does not exist</Message><BucketName>b</BucketName><RequestId>r</RequestId></Error>";
        let short = without_xml_body(text);
        assert_eq!(
            short,
            "upload: PUT http://h/b/x - Server returned non-2xx status code: 404 Not Found: NoSuchBucket: The \
             specified bucket does not exist (create the bucket first, or check the bucket name in the URL)"
        );
        assert_eq!(without_xml_body("no body here"), "no body here");
        assert_eq!(without_xml_body("x: <Error><Code>SlowDown</Code></Error>"), "x: SlowDown");
    }

    #[test]
    fn a_plain_http_endpoint_without_allow_http_is_refused_naming_the_setting() {
        let refused = check_s3_endpoint("s3://b/p", Some("http://user:pw@127.0.0.1:9000"), None).unwrap_err();
        let text = refused.to_string();
        assert!(text.contains("AWS_ALLOW_HTTP=true") && text.contains("127.0.0.1"), "{text}");
        assert!(!text.contains("pw"), "the endpoint's credentials stay out: {text}");
        assert!(check_s3_endpoint("s3://b/p", Some("http://127.0.0.1:9000"), Some("false")).is_err());
        for allowed in ["true", "TRUE", "1"] {
            assert!(check_s3_endpoint("s3://b/p", Some("http://127.0.0.1:9000"), Some(allowed)).is_ok());
        }
        assert!(check_s3_endpoint("s3://b/p", Some("https://s3.example"), None).is_ok());
        assert!(check_s3_endpoint("s3://b/p", None, None).is_ok());
    }

    #[test]
    fn credentials_in_an_error_text_are_replaced() {
        let values = vec!["AKIAEXAMPLE".to_owned(), "s3cr3t/value+x".to_owned(), "ab".to_owned()];
        let text = "403: <AWSAccessKeyId>AKIAEXAMPLE</AWSAccessKeyId> key s3cr3t/value+x; ab stays";
        let out = redact_values(text, &values);
        assert!(!out.contains("AKIAEXAMPLE") && !out.contains("s3cr3t"), "{out}");
        assert!(out.contains("[redacted]") && out.contains("ab stays"), "{out}");
    }

    #[test]
    fn a_url_with_credentials_is_refused_without_repeating_it() {
        for url in ["s3://AKIA:hunter2@bucket/x", "s3://bucket/x?sig=hunter2", "s3://alice@bucket/x", "::hunter2"] {
            let error = Origin::open(url).unwrap_err().to_string();
            assert!(!error.contains("hunter2") && !error.contains("AKIA") && !error.contains("alice"), "{error}");
        }
    }
}
