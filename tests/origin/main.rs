//! Datasets in object storage, against a real S3 API: `moto_server` (moto in server mode, from
//! PyPI; `.ci/run` installs it, `GRANARY_MOTO_SERVER` names it when it is not on PATH) on a
//! loopback port of its own. This file holds the harness (the server, an origin that fails on
//! purpose, stores pushed and attached) and what the subjects share; `push.rs` (publishing and
//! attaching), `faults.rs` (what goes wrong at or on the way to an origin) and `cache.rs` (the
//! origin cache under readers) the tests. None of them delivers a byte that was not checked or
//! prints a secret.

#[path = "../common/mod.rs"]
mod common;
mod cache;
mod faults;
mod push;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;
use granary::ObjectId;
use granary::origin::Origin;
use granary::store::ObjectKind;
use std::sync::Arc;

const BUCKET: &str = "granary-test";
const RECORD: usize = 4096;

/// A moto S3 server on a free loopback port, stopped on drop.
struct Moto {
    child: Child,
    port: u16,
}

impl Moto {
    fn start() -> Self {
        let program = std::env::var("GRANARY_MOTO_SERVER").unwrap_or_else(|_| "moto_server".to_owned());
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let child = Command::new(&program)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{program}: {e}: these tests need moto's S3 server (pip install 'moto[server]'; .ci/run does)")
            });
        let moto = Self { child, port };
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "moto_server did not listen on {port} within 30 s");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(moto.http("PUT", &format!("/{BUCKET}"), b""), 200, "create the bucket");
        moto
    }

    /// One plain HTTP request (moto takes unsigned ones); returns the status. Sent again when
    /// the connection fails (moto's server, busy with a test's parallel clients, was seen to
    /// reset one before answering); every request the tests send this way is idempotent.
    fn http(&self, method: &str, path: &str, body: &[u8]) -> u16 {
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.port,
            body.len()
        );
        let once = || -> std::io::Result<String> {
            let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
            stream.write_all(head.as_bytes())?;
            stream.write_all(body)?;
            let mut reply = String::new();
            stream.read_to_string(&mut reply)?;
            Ok(reply)
        };
        let mut tries = 0;
        let reply = loop {
            match once() {
                Ok(reply) => break reply,
                Err(e) if tries < 4 => {
                    eprintln!("moto: {method} {path}: {e}; again");
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("moto: {method} {path}: {e}"),
            }
        };
        reply.split_whitespace().nth(1).and_then(|code| code.parse().ok()).unwrap_or(0)
    }

    /// An origin over this server under `prefix`, with a client built here (the test process's
    /// environment has no credentials).
    fn origin(&self, prefix: &str) -> Origin {
        granary::origin::install_tls_provider();
        let s3 = object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(BUCKET)
            .with_region("us-east-1")
            .with_endpoint(format!("http://127.0.0.1:{}", self.port))
            .with_allow_http(true)
            .with_access_key_id("granary-test-key")
            .with_secret_access_key("granary-test-secret-do-not-print")
            .build()
            .unwrap();
        Origin::with_store(Arc::new(s3), object_store::path::Path::from(prefix), format!("s3://{BUCKET}/{prefix}"))
            .unwrap()
    }

    /// `granary --root ROOT ARGS` with this server's endpoint and (made-up) credentials.
    fn granary(&self, root: &Path, args: &[&str]) -> Output {
        self.command(root, args).output().unwrap()
    }

    fn command(&self, root: &Path, args: &[&str]) -> Command {
        let mut command = Command::new(env!("CARGO_BIN_EXE_granary"));
        command
            .arg("--root")
            .arg(root)
            .args(args)
            .env("AWS_ACCESS_KEY_ID", "granary-test-key")
            .env("AWS_SECRET_ACCESS_KEY", "granary-test-secret-do-not-print")
            .env("AWS_REGION", "us-east-1")
            .env("AWS_ENDPOINT", format!("http://127.0.0.1:{}", self.port))
            .env("AWS_ALLOW_HTTP", "true");
        command
    }

    /// `granary --root ROOT ARGS` started, not waited for (to be killed mid-way).
    fn spawn(&self, root: &Path, args: &[&str]) -> Child {
        self.command(root, args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
    }

    fn ok(&self, root: &Path, args: &[&str]) -> String {
        let out = self.granary(root, args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "granary {args:?}: {stderr}");
        assert!(!stderr.contains("do-not-print"), "a secret in stderr: {stderr}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn err(&self, root: &Path, args: &[&str]) -> String {
        let out = self.granary(root, args);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(!out.status.success(), "granary {args:?} should fail");
        assert!(out.stdout.is_empty(), "granary {args:?} printed {} bytes on failure", out.stdout.len());
        assert!(!stderr.contains("do-not-print"), "a secret in stderr: {stderr}");
        stderr
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store with dataset `tok`: `n` records of 4 KiB in shards of 256 KiB; returns the input.
fn store_with(root: &Path, n: usize, seed: u64) -> Vec<u8> {
    let input: Vec<u8> = (0..n).flat_map(|i| bytes(seed + i as u64, RECORD)).collect();
    let file = root.with_extension("bin");
    std::fs::write(&file, &input).unwrap();
    granary_ok(
        root,
        &[
            "ingest",
            "records",
            "--name",
            "tok",
            "--record-bytes",
            "4096",
            "--shard-bytes",
            "256KiB",
            file.to_str().unwrap(),
        ],
    );
    input
}

/// `tok` of `n` records (seeded by `seed`) made at `source` and pushed to a `file://` origin
/// under `dir`: the records and the origin's URL.
fn pushed_to_file(dir: &Path, source: &Path, n: usize, seed: u64) -> (Vec<u8>, String) {
    let input = store_with(source, n, seed);
    let url = format!("file://{}", dir.join("origin").display());
    granary_ok(source, &["push", "tok", &url]);
    (input, url)
}

/// Bytes of the shard files under `root` (one removed between the listing and its look counts
/// nothing).
fn shard_bytes_here(root: &Path) -> u64 {
    shard_files(root).iter().map(|f| std::fs::metadata(f).map_or(0, |m| m.len())).sum()
}

/// An object store over memory that fails and damages requests on purpose. Per request (its
/// operation, path and range), the first call fails with a transient error (a ref's put after
/// it was written: the reply lost on the way back), and the second read of a shard or manifest
/// comes back with one bit flipped; later calls pass.
#[derive(Debug, Default)]
struct Faulty {
    inner: object_store::memory::InMemory,
    calls: std::sync::Mutex<std::collections::HashMap<String, u32>>,
    failed: std::sync::atomic::AtomicU64,
    flipped: std::sync::atomic::AtomicU64,
}

impl std::fmt::Display for Faulty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Faulty({})", self.inner)
    }
}

impl Faulty {
    /// How many times request `key` has been made, this one included.
    fn call(&self, key: String) -> u32 {
        let mut calls = self.calls.lock().unwrap();
        let n = calls.entry(key).or_default();
        *n += 1;
        *n
    }

    fn fail(&self) -> object_store::Error {
        self.failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        object_store::Error::Generic { store: "faulty", source: "connection reset (injected)".into() }
    }

    fn count(counter: &std::sync::atomic::AtomicU64) -> u64 {
        counter.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// A multipart upload that fails when completed, when told to.
#[derive(Debug)]
struct FailsAtEnd {
    upload: Box<dyn object_store::MultipartUpload>,
    fail: Option<object_store::Error>,
}

#[async_trait::async_trait]
impl object_store::MultipartUpload for FailsAtEnd {
    fn put_part(&mut self, data: object_store::PutPayload) -> object_store::UploadPart {
        self.upload.put_part(data)
    }

    async fn complete(&mut self) -> object_store::Result<object_store::PutResult> {
        match self.fail.take() {
            Some(e) => Err(e),
            None => self.upload.complete().await,
        }
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.upload.abort().await
    }
}

#[async_trait::async_trait]
impl object_store::ObjectStore for Faulty {
    async fn put_opts(
        &self,
        location: &object_store::path::Path,
        payload: object_store::PutPayload,
        opts: object_store::PutOptions,
    ) -> object_store::Result<object_store::PutResult> {
        if self.call(format!("put {location}")) == 1 {
            if location.as_ref().contains("/refs/") {
                self.inner.put_opts(location, payload, opts).await?;
            }
            return Err(self.fail());
        }
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &object_store::path::Path,
        opts: object_store::PutMultipartOptions,
    ) -> object_store::Result<Box<dyn object_store::MultipartUpload>> {
        let upload = self.inner.put_multipart_opts(location, opts).await?;
        // The first upload of an object fails at its end, after every part went.
        let fail = self.call(format!("multipart {location}")) == 1;
        Ok(Box::new(FailsAtEnd { upload, fail: fail.then(|| self.fail()) }))
    }

    async fn get_opts(
        &self,
        location: &object_store::path::Path,
        options: object_store::GetOptions,
    ) -> object_store::Result<object_store::GetResult> {
        let call = self.call(format!("get {location} {:?} {}", options.range, options.head));
        if call == 1 {
            return Err(self.fail());
        }
        let damage = call == 2 && !options.head && !location.as_ref().contains("/refs/");
        let got = self.inner.get_opts(location, options).await?;
        if !damage {
            return Ok(got);
        }
        let object_store::GetResult { meta, range, attributes, extensions, .. } = &got;
        let (meta, range, attributes, extensions) =
            (meta.clone(), range.clone(), attributes.clone(), extensions.clone());
        let mut bytes = got.bytes().await?.to_vec();
        let middle = bytes.len() / 2;
        if let Some(byte) = bytes.get_mut(middle) {
            *byte ^= 0x10;
            self.flipped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        let stream = futures::stream::once(async move { Ok(bytes::Bytes::from(bytes)) });
        Ok(object_store::GetResult {
            payload: object_store::GetResultPayload::Stream(Box::pin(stream)),
            meta,
            range,
            attributes,
            extensions,
        })
    }

    fn delete_stream(
        &self,
        locations: futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::path::Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> futures::stream::BoxStream<'static, object_store::Result<object_store::ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&object_store::path::Path>,
    ) -> object_store::Result<object_store::ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &object_store::path::Path,
        to: &object_store::path::Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

/// An origin over `store` (shown as `memory://test`), `tok` of the store at `source` pushed to
/// it and attached to a new store at `here` with a cache of `bound` bytes (0: none).
fn pushed_and_attached(
    store: Arc<dyn object_store::ObjectStore>,
    source: &Path,
    here: &Path,
    bound: u64,
) -> Arc<Origin> {
    let origin = Arc::new(
        Origin::with_store(store, object_store::path::Path::from("test"), "memory://test".to_owned()).unwrap(),
    );
    let spec = granary::store::VersionSpec::parse("tok").unwrap();
    granary::origin::push(&granary::store::StorePaths::new(source), &spec, &origin, &|_| {}).unwrap();
    let mut granary = granary::Granary::create(here).unwrap();
    granary::origin::attach(&mut granary, &origin, &spec, Some(bound), None).unwrap();
    origin
}

/// Every shard file under `root` hashes to the id it is named by.
fn assert_shards_whole(root: &Path) {
    for file in shard_files(root) {
        let name = file.file_name().unwrap().to_str().unwrap().trim_end_matches(".shard").to_owned();
        assert_eq!(blake3::hash(&std::fs::read(&file).unwrap()).to_hex().as_str(), name, "{}", file.display());
    }
}

/// A repair hook that only listens to the plan it is told (the store it serves is whole).
#[derive(Debug, Default)]
struct PlanHeard(std::sync::Mutex<Vec<(u64, Vec<Vec<granary::ShardId>>)>>);

/// Reads every record of `tok` at `root` through a loader whose repair hook is `node` (the
/// store's origin cache wraps it); checks them against `input`; returns the cache's counters.
fn read_all_through(root: &Path, node: Option<Arc<dyn granary::ShardSource>>, input: &[u8]) -> granary::CacheStats {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let paths = StorePaths::new(root);
    let config = LoaderConfig {
        batch_size: 16,
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair: node,
        ..LoaderConfig::default()
    };
    let dataset = granary::Dataset::open(&paths, &VersionSpec::parse("tok").unwrap()).unwrap();
    let mut loader = Loader::new(dataset, config, Default::default()).unwrap();
    assert_every_record_read(&mut loader, input);
    loader.stats().cache.expect("an attached dataset is read through the cache")
}

/// Reads `loader` to its end: every record of `input` comes once, equal to the input.
fn assert_every_record_read(loader: &mut granary::loader::Loader, input: &[u8]) {
    let mut seen = vec![false; input.len() / RECORD];
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            let index = usize::try_from(index).unwrap();
            assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            assert!(!std::mem::replace(&mut seen[index], true), "record {index} twice");
        }
    }
    assert!(seen.iter().all(|&s| s), "every record once");
}

/// The shard files under `root/shards` this process holds though they are gone from their
/// directory (evicted, still open or mapped: the space `df` counts that a listing does not),
/// each with the path it had and its bytes.
fn held_files(root: &Path) -> Vec<(PathBuf, u64)> {
    use std::collections::HashMap;
    let shards = root.join("shards").canonicalize().unwrap();
    let deleted = |target: &str| {
        target.strip_suffix(" (deleted)").filter(|path| path.starts_with(shards.to_str().unwrap())).map(PathBuf::from)
    };
    // By (device, inode): a file both open and mapped is counted once.
    let mut held: HashMap<String, (PathBuf, u64)> = HashMap::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        if let Some(path) = deleted(&target.to_string_lossy()) {
            // Through the descriptor: a stat of the open (deleted) file.
            if let Ok(meta) = std::fs::metadata(entry.path()) {
                use std::os::unix::fs::MetadataExt;
                held.insert(format!("{:x}:{}", meta.dev(), meta.ino()), (path, meta.len()));
            }
        }
    }
    for line in std::fs::read_to_string("/proc/self/maps").unwrap().lines() {
        let fields: Vec<&str> = line.splitn(6, ' ').collect();
        let [range, _, _, _, inode, path] = fields[..] else { continue };
        let Some(path) = deleted(path.trim_start()) else { continue };
        let (start, end) = range.split_once('-').unwrap();
        let len = u64::from_str_radix(end, 16).unwrap() - u64::from_str_radix(start, 16).unwrap();
        // A whole-file mapping: its length is the file's, to a page. The device field is
        // "major:minor" in hex, not the stat one: keyed by inode alone then, the store's one file system.
        let key = held.keys().find(|k| k.ends_with(&format!(":{inode}"))).cloned().unwrap_or(format!("map:{inode}"));
        let entry = held.entry(key).or_insert((path, 0));
        entry.1 = entry.1.max(len);
    }
    held.into_values().collect()
}
