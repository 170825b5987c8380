//! Datasets in object storage, against a real S3 API: `moto_server` (moto in server mode, from
//! PyPI; `.ci/run` installs it, `GRANARY_MOTO_SERVER` names it when it is not on PATH) on a
//! loopback port of its own. push -> attach on an empty store -> every shard read back through a
//! cache a quarter of the dataset, checked, and the records equal the input; a second history
//! under one name, a damaged object at the origin and credentials in a URL are refused, and
//! none of them delivers a byte or prints a secret.

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
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

#[test]
fn a_pushed_dataset_is_read_back_whole_through_a_cache_a_quarter_its_size() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 480, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let url = format!("s3://{BUCKET}/datasets");
    let pushed = moto.ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("8 shards uploaded"), "{pushed}");
    // Again: nothing to send, the ref already names the version.
    let again = moto.ok(&source, &["push", "tok", &url]);
    assert!(again.contains("0 shards uploaded") && again.contains("8 already there"), "{again}");

    let bound = dataset_bytes / 4;
    let attached = moto.ok(&here, &["attach", "tok", &url, "--cache-bytes", &bound.to_string()]);
    assert!(attached.contains("attached tok@1") && attached.contains("8 shards"), "{attached}");
    assert_eq!(shard_bytes_here(&here), 0, "attach fetches metadata only");
    let listed = moto.ok(&here, &["ls"]);
    assert!(listed.contains(&format!("tok: attached from {url}")), "{listed}");

    // Every shard fetched, checked (BLAKE3 and every block) and within the bound all along.
    let verified = moto.ok(&here, &["verify", "tok"]);
    assert!(verified.contains("verified 8 shards") && verified.contains(": 0 failures"), "{verified}");
    assert!(shard_bytes_here(&here) <= bound, "{} bytes cached, bound {bound}", shard_bytes_here(&here));

    // Records read back through the cache equal the input, shard after shard (the cache
    // fetches and evicts on the way), and the bound holds after each.
    for index in (0..480).step_by(7) {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        assert!(out.status.success(), "get {index}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout, input[index * RECORD..(index + 1) * RECORD], "record {index}");
        assert!(shard_bytes_here(&here) <= bound, "over the bound after record {index}");
    }

    let detached = moto.ok(&here, &["detach", "tok"]);
    assert!(detached.contains("detached tok"), "{detached}");
    assert_eq!(shard_bytes_here(&here), 0, "detach removes the cached shards");
    assert!(moto.err(&here, &["get", "tok", "0"]).contains("tok"));
}

#[test]
fn a_second_history_under_one_name_is_refused_and_the_origin_keeps_the_first() {
    let moto = Moto::start();
    let dir = tempdir();
    let (first, second, here) = (dir.path().join("first"), dir.path().join("second"), dir.path().join("here"));
    let input = store_with(&first, 64, 1);
    store_with(&second, 64, 1000);
    let url = format!("s3://{BUCKET}/shared");
    moto.ok(&first, &["push", "tok", &url]);
    let refused = moto.err(&second, &["push", "tok", &url]);
    assert!(refused.contains("two histories"), "{refused}");
    moto.ok(&here, &["attach", "tok", &url]);
    let out = moto.granary(&here, &["get", "tok", "5"]);
    assert_eq!(out.stdout, input[5 * RECORD..6 * RECORD], "the first push's record");
}

#[test]
fn a_damaged_shard_at_the_origin_is_named_and_never_delivered() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    store_with(&source, 64, 1);
    let url = format!("s3://{BUCKET}/damaged");
    moto.ok(&source, &["push", "tok", &url]);
    moto.ok(&here, &["attach", "tok", &url]);
    // The origin's copy of the first shard gets one data byte flipped (metadata intact, so the
    // attach's check passed; only the shard's BLAKE3 can tell).
    let shard = shard_files(&source).into_iter().min().unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[4096 + 100] ^= 0x01;
    let name = shard.file_name().unwrap().to_str().unwrap().to_owned();
    let id = name.trim_end_matches(".shard");
    let damaged = dir.path().join("damaged.shard");
    std::fs::write(&damaged, &bytes).unwrap();
    moto.origin("damaged").upload(ObjectKind::Shard, ObjectId::parse_hex(id).unwrap(), &damaged, &|_| {}).unwrap();
    // Whichever records that shard holds: ask for each shard's first record until one fails.
    let mut failed = None;
    for index in (0..64).step_by(8) {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        if !out.status.success() {
            assert!(out.stdout.is_empty(), "bytes delivered from a damaged shard");
            failed = Some(String::from_utf8_lossy(&out.stderr).into_owned());
            break;
        }
    }
    let failed = failed.expect("a record of the damaged shard failed");
    assert!(failed.contains(id) && failed.contains("did not hash to its id"), "{failed}");
    assert!(
        !shard_files(&here).iter().any(|f| f.file_name().unwrap() == name.as_str()),
        "the damaged shard was published here"
    );
    assert!(std::fs::read_dir(here.join("origin/incoming")).unwrap().next().is_none(), "partial files left");
}

#[test]
fn credentials_in_an_origin_url_are_refused_without_being_repeated() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 8, 1);
    for url in ["s3://AKIAEXAMPLE:do-not-print@bucket/x", "s3://bucket/x?X-Amz-Signature=do-not-print"] {
        let refused = moto.err(&source, &["push", "tok", url]);
        assert!(refused.contains("carries no credentials"), "{refused}");
    }
    assert!(moto.err(&source, &["push", "tok", "memory://x"]).contains("memory://"));
    assert!(moto.err(&source, &["push", "tok", "ftp://host/x"]).contains("unknown scheme"));
}

#[test]
fn bench_cache_runs_end_to_end_at_a_small_scale() {
    let dir = tempdir();
    let out = granary_ok(
        dir.path(),
        &[
            "bench",
            "cache",
            "--generate",
            "4MiB",
            "--shard-bytes",
            "128KiB",
            "--batch",
            "8",
            "--step-ms",
            "1",
            "--latency-ms",
            "1",
            "--bandwidth",
            "256MiB",
        ],
    );
    for evictor in ["plan-aware", "lru", "s3-fifo"] {
        let row =
            out.lines().find(|line| line.starts_with(evictor)).unwrap_or_else(|| panic!("no {evictor} row: {out}"));
        let ratio: f64 = row.split_whitespace().nth(4).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("{row}"));
        // Near or above Belady's minimum for the trace it read (a pinned shard may hold the
        // cache over its bound for a moment, so a little below is possible).
        assert!(ratio > 0.8, "{row}");
    }
    // The baseline: LRU not told the plan fetches nothing ahead.
    let baseline = out.lines().find(|line| line.starts_with("lru no plan")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(baseline.split_whitespace().nth(12), Some("0"), "{baseline}");
}

#[test]
fn a_file_origin_takes_a_second_version_and_refuses_a_stale_ref() {
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let (input, url) = pushed_to_file(dir.path(), &source, 16, 1);
    // A pusher that read the ref before another pusher changed it is refused.
    let origin = Origin::open(&url).unwrap();
    let name = granary::DatasetName::new("tok").unwrap();
    let (first, stale) = origin.read_ref(&name).unwrap().unwrap();
    // A second version: the first's records and 16 more.
    let more = dir.path().join("more.bin");
    std::fs::write(&more, (16..32).flat_map(|i| bytes(1 + i as u64, RECORD)).collect::<Vec<u8>>()).unwrap();
    granary_ok(
        &source,
        &["ingest", "records", "--name", "tok", "--append", "--record-bytes", "4096", more.to_str().unwrap()],
    );
    let pushed = granary_ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("pushed tok@2") && pushed.contains("ref written"), "{pushed}");
    let refused = origin.write_ref(&name, &first, Some(stale)).unwrap_err().to_string();
    assert!(refused.contains("another push changed it"), "{refused}");
    assert_eq!(origin.read_ref(&name).unwrap().unwrap().0.latest().number, 2, "the newer ref stands");
    let attached = granary_ok(&here, &["attach", "tok@1", &url]);
    assert!(attached.contains("attached tok@1"), "{attached}");
    assert_eq!(granary(&here, &["get", "tok@1", "3"]).stdout, input[3 * RECORD..4 * RECORD]);
    let moved = granary_ok(&here, &["attach", "tok", &url]);
    assert!(moved.contains("attached tok@2"), "{moved}");
    assert_eq!(granary(&here, &["get", "tok@2", "20"]).stdout, bytes(21, RECORD));
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

#[test]
fn transient_failures_are_retried_and_flipped_bits_refetched_never_delivered() {
    use granary::loader::{Loader, LoaderConfig, PlanSource, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 256, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let faulty = Arc::new(Faulty::default());
    let origin = Arc::new(
        Origin::with_store(
            Arc::clone(&faulty) as Arc<dyn object_store::ObjectStore>,
            object_store::path::Path::from("faulty"),
            "memory://faulty".to_owned(),
        )
        .unwrap(),
    );
    let spec = VersionSpec::parse("tok").unwrap();
    // Every upload's first try and the ref's reply fail: the push still lands, whole.
    let pushed = granary::origin::push(&StorePaths::new(&source), &spec, &origin, &|_| {}).unwrap();
    assert_eq!((pushed.shards_uploaded, pushed.ref_written), (4, true), "{pushed:?}");
    let after_push = origin.retries();
    assert!(after_push >= 5, "{after_push} retries: each shard's, the manifest's and the ref's first put failed");

    let bound = dataset_bytes / 2;
    {
        let mut granary = granary::Granary::create(&here).unwrap();
        // Every metadata read fails once, then comes back damaged once: read again until sound.
        granary::origin::attach(&mut granary, &origin, &spec, Some(bound), None).unwrap();
    }
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    let dataset = granary::Dataset::open(&paths, &spec).unwrap();
    let config = LoaderConfig {
        batch_size: 16,
        seed: 3,
        plan: PlanSource::Partitioner { plugin: None, options: Vec::new() },
        epochs: Some(2),
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(dataset, config, granary::Position::default()).unwrap();
    let mut seen = 0;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            let index = usize::try_from(index).unwrap();
            assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            seen += 1;
        }
    }
    assert_eq!(seen, 2 * 256, "two epochs, every record");
    let stats = cache.stats();
    assert!(stats.refetches > 0, "flipped shards were refetched: {stats:?}");
    let seen_by_loader = loader.stats().cache.expect("the loader reports its cache's counters");
    assert_eq!(seen_by_loader.refetches, stats.refetches);
    assert!(seen_by_loader.waited > 0 && seen_by_loader.hit_ratio() < 1.0, "{seen_by_loader:?}");
    assert!(origin.retries() > after_push, "fetches retried");
    assert!(Faulty::count(&faulty.flipped) > 0 && Faulty::count(&faulty.failed) > 0);
    assert!(shard_bytes_here(&here) <= bound, "over the bound: {} of {bound}, {stats:?}", shard_bytes_here(&here));
    // Nothing damaged was kept.
    assert_shards_whole(&here);
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

#[test]
fn a_fetch_or_a_push_killed_mid_way_leaves_nothing_partial_and_the_next_run_finishes() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 2048, 1);
    let url = format!("s3://{BUCKET}/killed");
    let ids: Vec<(ObjectId, u64)> = shard_files(&source)
        .iter()
        .map(|f| {
            let name = f.file_name().unwrap().to_str().unwrap().trim_end_matches(".shard");
            (ObjectId::parse_hex(name).unwrap(), std::fs::metadata(f).unwrap().len())
        })
        .collect();

    // Pushes killed after a while, each longer: the origin holds whole shards or none, and no
    // ref before every shard and the manifest are there.
    let origin = moto.origin("killed");
    let name = granary::DatasetName::new("tok").unwrap();
    for wait_ms in [100, 250] {
        let mut push = moto.spawn(&source, &["push", "tok", &url]);
        std::thread::sleep(Duration::from_millis(wait_ms));
        push.kill().unwrap();
        push.wait().unwrap();
        let sizes = origin.sizes_of(ObjectKind::Shard, &ids.iter().map(|&(id, _)| id).collect::<Vec<_>>()).unwrap();
        for (&(id, bytes), size) in ids.iter().zip(&sizes) {
            assert!(size.is_none() || *size == Some(bytes), "shard {id}: {size:?} of {bytes} bytes at the origin");
        }
        if origin.read_ref(&name).unwrap().is_some() {
            assert!(sizes.iter().all(Option::is_some), "a ref before all its shards");
        }
    }
    let pushed = moto.ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("pushed tok@1"), "{pushed}");

    // Reads killed mid-fetch: nothing unverified is ever published, and the next read finishes.
    let bound = shard_bytes_here(&source) / 4;
    moto.ok(&here, &["attach", "tok", &url, "--cache-bytes", &bound.to_string()]);
    for wait_ms in [100, 250, 450] {
        let mut verify = moto.spawn(&here, &["verify", "tok"]);
        std::thread::sleep(Duration::from_millis(wait_ms));
        verify.kill().unwrap();
        verify.wait().unwrap();
        assert_shards_whole(&here);
    }
    let verified = moto.ok(&here, &["verify", "tok"]);
    assert!(verified.contains(": 0 failures"), "{verified}");
    assert_shards_whole(&here);
    let left: Vec<_> = std::fs::read_dir(here.join("origin/incoming")).unwrap().collect();
    assert!(left.is_empty(), "parts of killed fetches left behind: {left:?}");
    for index in [0usize, 777, 2047] {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        assert_eq!(out.stdout, input[index * RECORD..(index + 1) * RECORD], "record {index}");
    }
}

#[test]
fn the_default_plan_is_windowed_when_the_dataset_does_not_fit_the_cache() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 1024, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let spec = VersionSpec::parse("tok").unwrap();
    let bound = dataset_bytes / 4;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    // The default plan (the elastic partitioner's global shuffle), no window asked for.
    let config = LoaderConfig {
        batch_size: 16,
        seed: 5,
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(granary::Dataset::open(&paths, &spec).unwrap(), config, Default::default()).unwrap();
    assert_every_record_read(&mut loader, &input);
    // A full shuffle would need every shard at every step, and fetch the dataset many times
    // over through a quarter cache; windowed, each shard comes about once. (1.00-1.06 x while
    // readers kept evicted shards open to the end of an epoch, past the bound; since they let
    // go within a batch or two, a window sliding over these tiny shards, 4 batches' worth
    // each, fetches up to 3 of the 16 again: 1.19 x. Shards of 4 MiB fetch nothing twice:
    // `python/bench/cache_disk.py`, BENCHMARKS.md.)
    let fetched = cache.stats().bytes_from_origin;
    assert!(
        fetched as f64 <= 1.25 * dataset_bytes as f64,
        "{fetched} bytes from the origin for a dataset of {dataset_bytes}: {:?}",
        cache.stats()
    );
}

#[test]
fn two_processes_sharing_a_store_fetch_each_shard_once() {
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    store_with(&source, 512, 1);
    let n_shards = shard_files(&source).len() as u64;
    // Slow enough that the two readers' fetches overlap.
    let throttle =
        object_store::throttle::ThrottleConfig { wait_get_per_call: Duration::from_millis(30), ..Default::default() };
    let slow = object_store::throttle::ThrottledStore::new(object_store::memory::InMemory::new(), throttle);
    let origin = pushed_and_attached(Arc::new(slow), &source, &here, 0);
    let spec = VersionSpec::parse("tok").unwrap();
    let paths = StorePaths::new(&here);
    let ids: Vec<granary::ShardId> = {
        let manifest = paths.read_manifest(paths.resolve(&spec).unwrap().0).unwrap();
        manifest.entries().iter().map(|e| e.shard).collect()
    };
    // Two caches of one store, as two processes have: each its own fetches in flight, the
    // claims under origin/incoming/ between them (flock works between open files).
    let caches: Vec<_> = (0..2)
        .map(|_| granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap())
        .collect();
    std::thread::scope(|scope| {
        for cache in &caches {
            let ids = &ids;
            scope.spawn(move || {
                for &id in ids {
                    cache.fetch(id).unwrap();
                }
            });
        }
    });
    let fetched: u64 = caches.iter().map(|cache| cache.stats().shards_fetched).sum();
    assert_eq!(fetched, n_shards, "each shard fetched once between the two");
    assert_shards_whole(&here);
    assert!(std::fs::read_dir(here.join("origin/incoming")).unwrap().next().is_none(), "claims left behind");
}

/// A repair hook that only listens to the plan it is told (the store it serves is whole).
#[derive(Debug, Default)]
struct PlanHeard(std::sync::Mutex<Vec<(u64, Vec<Vec<granary::ShardId>>)>>);

impl granary::ShardSource for PlanHeard {
    fn repair(&self, shard: granary::ShardId, _: &granary::Error) -> granary::Result<()> {
        panic!("shard {shard} needed repair in a whole store")
    }

    fn wants_plan(&self) -> bool {
        true
    }

    fn plan(&self, first_step: u64, shards_by_step: &[Vec<granary::ShardId>]) {
        self.0.lock().unwrap().push((first_step, shards_by_step.to_vec()));
    }
}

#[test]
fn the_cache_hears_the_plan_of_every_rank_of_its_node() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 1024, 1);
    let spec = VersionSpec::parse("tok").unwrap();
    let dataset = granary::Dataset::open(&StorePaths::new(&source), &spec).unwrap();
    let config = |rank, local_world_size, repair| LoaderConfig {
        batch_size: 16,
        seed: 9,
        world: granary::World::new(rank, 2).unwrap(),
        local_world_size: Some(local_world_size),
        epochs: Some(1),
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair,
        ..LoaderConfig::default()
    };
    // Every step's shards, per rank.
    let steps = |rank| {
        let mut loader = Loader::new(Arc::clone(&dataset), config(rank, 1, None), Default::default()).unwrap();
        let mut steps = Vec::new();
        while let Some(batch) = loader.next() {
            let mut shards: Vec<_> =
                batch.unwrap().indices().iter().map(|&i| dataset.shard_id(dataset.locate(i).unwrap().0)).collect();
            shards.sort();
            shards.dedup();
            steps.push(shards);
        }
        steps
    };
    let (mine, neighbour) = (steps(0), steps(1));

    // Rank 0 of a node of two: its hook hears its own plan, then rank 1's (from a thread).
    let heard = Arc::new(PlanHeard::default());
    let repair = Some(Arc::clone(&heard) as Arc<dyn granary::ShardSource>);
    let mut loader = Loader::new(Arc::clone(&dataset), config(0, 2, repair), Default::default()).unwrap();
    while loader.next().is_some() {}
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard.0.lock().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the neighbour's plan never came");
        std::thread::sleep(Duration::from_millis(10));
    }
    let heard = heard.0.lock().unwrap();
    let sorted = |plan: &Vec<Vec<granary::ShardId>>| -> Vec<Vec<granary::ShardId>> {
        plan.iter()
            .map(|shards| {
                let mut shards = shards.clone();
                shards.sort();
                shards
            })
            .collect()
    };
    assert_eq!(heard.len(), 2, "this rank's epoch, then the neighbour's");
    assert_eq!((heard[0].0, sorted(&heard[0].1)), (0, mine));
    assert_eq!((heard[1].0, sorted(&heard[1].1)), (0, neighbour));
}

/// A `granary serve` of the store at `root` on loopback, killed on drop.
struct Serve(Child);

impl Serve {
    fn start(root: &Path, key_file: &Path, listen: std::net::SocketAddr, peer: std::net::SocketAddr) -> Serve {
        let log = std::fs::File::create(root.with_extension("log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_granary"))
            .arg("--root")
            .arg(root)
            .args(["serve", "--listen", &listen.to_string(), "--peers", &peer.to_string(), "--cluster-key"])
            .arg(key_file)
            .args(["--heartbeat-ms", "100", "--down-after-ms", "800"])
            .env_remove("GRANARY_ROOT")
            .env_remove("GRANARY_CLUSTER_KEY")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut serve = Serve(child);
        let listen_file = root.join("replication").join("listen");
        let started = Instant::now();
        while std::fs::read_to_string(&listen_file).ok().is_none_or(|t| t.trim() != listen.to_string()) {
            assert!(serve.0.try_wait().unwrap().is_none(), "serve {} exited", root.display());
            assert!(started.elapsed() < Duration::from_secs(30), "serve {} did not start", root.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        serve
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

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

#[test]
fn a_shard_a_peer_holds_comes_from_the_peer_and_the_rest_from_the_origin_at_once() {
    use granary::replication::{ClusterKey, NodeClient};

    const KEY: &str = "a cluster secret of this test, long enough";
    let dir = tempdir();
    let source = dir.path().join("source");
    let (input, url) = pushed_to_file(dir.path(), &source, 256, 3);
    let dataset_bytes = shard_bytes_here(&source);
    let n_shards = shard_files(&source).len();
    assert!(n_shards >= 4, "{n_shards} shards");
    let key_file = dir.path().join("cluster.key");
    std::fs::write(&key_file, KEY).unwrap();
    let key = ClusterKey::from_secret(KEY.as_bytes()).unwrap();
    let roots = [dir.path().join("a"), dir.path().join("b")];
    let listen = [0, 1].map(|_| {
        std::net::SocketAddr::from((
            [127, 0, 0, 1],
            TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port(),
        ))
    });
    for root in &roots {
        granary_ok(root, &["attach", "tok", &url]);
    }
    let mut serves: Vec<Option<Serve>> =
        (0..2).map(|i| Some(Serve::start(&roots[i], &key_file, listen[i], listen[1 - i]))).collect();
    let client = |i: usize| Arc::new(NodeClient::new(listen[i], key.clone()));

    // Node a's reader finds no peer with the shards: they come from the origin.
    let first = read_all_through(&roots[0], Some(client(0)), &input);
    assert_eq!((first.bytes_from_origin, first.bytes_from_peers), (dataset_bytes, 0), "{first:?}");
    // Once node b hears node a list them (a rescan, a heartbeat), b's reader gets every shard
    // from a, checked, and nothing from the origin.
    let started = Instant::now();
    loop {
        let (a, b) = (client(0).status().unwrap(), client(1).status().unwrap());
        if a.objects > n_shards && b.peers.first().is_some_and(|p| p.up && p.objects == a.objects) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "b never heard a's shards: {a:?} {b:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let second = read_all_through(&roots[1], Some(client(1)), &input);
    assert_eq!((second.bytes_from_origin, second.bytes_from_peers), (0, dataset_bytes), "{second:?}");
    assert_eq!(second.shards_from_peers, n_shards as u64);
    assert_shards_whole(&roots[1]);

    // With node a gone and b's copies evicted, b's node holds no peer that lists them: it says
    // so at once (it does not wait for a source, as it does for a shard only peers have) and
    // every shard comes from the origin.
    serves[0] = None;
    for file in shard_files(&roots[1]) {
        std::fs::remove_file(file).unwrap();
    }
    // Until b's heartbeat finds a down, a still counts as a source; after, none is left, and a
    // node that waited for a source would wait 10 s per shard.
    let started = Instant::now();
    while client(1).status().unwrap().peers.first().is_some_and(|p| p.up) {
        assert!(started.elapsed() < Duration::from_secs(30), "b never found a down");
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    let third = read_all_through(&roots[1], Some(client(1)), &input);
    assert_eq!((third.bytes_from_origin, third.bytes_from_peers), (dataset_bytes, 0), "{third:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{n_shards} shards took {:?}: the node waited for a peer per shard",
        started.elapsed()
    );
    drop(serves);
}

#[test]
fn a_large_upload_tried_again_reports_its_bytes_once() {
    let dir = tempdir();
    let file = dir.path().join("large.shard");
    let data = bytes(7, 20 << 20);
    std::fs::write(&file, &data).unwrap();
    let id = ObjectId::from_bytes(*blake3::hash(&data).as_bytes());
    let faulty = Arc::new(Faulty::default());
    let origin = Origin::with_store(
        Arc::clone(&faulty) as Arc<dyn object_store::ObjectStore>,
        object_store::path::Path::from("faulty"),
        "memory://faulty".to_owned(),
    )
    .unwrap();
    let sent = std::sync::atomic::AtomicU64::new(0);
    origin
        .upload(ObjectKind::Shard, id, &file, &|n| {
            sent.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
    // In parts, the first upload failed at its end and the second went whole.
    assert_eq!(Faulty::count(&faulty.failed), 1);
    assert!(origin.retries() >= 1);
    assert_eq!(sent.into_inner(), data.len() as u64, "progress counts each byte once");
    assert_eq!(origin.size_of(ObjectKind::Shard, id).unwrap(), Some(data.len() as u64));
}

#[test]
fn a_store_mounted_read_only_serves_its_cached_shards_and_names_the_rest() {
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let (input, url) = pushed_to_file(dir.path(), &source, 256, 9);
    granary_ok(&here, &["attach", "tok", &url]);
    // Record 1's shard is cached; record 200's is not.
    assert_eq!(granary(&here, &["get", "tok", "1"]).stdout, input[RECORD..2 * RECORD]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // The store bind-mounted read-only over itself, in a mount namespace of this test's own.
    let script = format!(
        "mount --bind {here} {here} && mount -o remount,ro,bind {here} && \
         {granary} --root {here} get tok 1 -o {out}/1; echo \"rc=$?\"; \
         {granary} --root {here} get tok 200 -o {out}/200; echo \"rc=$?\"",
        here = here.display(),
        granary = env!("CARGO_BIN_EXE_granary"),
        out = out.display(),
    );
    let run = Command::new("unshare").args(["--mount", "sh", "-c", &script]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "unshare: {stdout}{stderr}");
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["rc=0", "rc=1"], "{stdout}{stderr}");
    assert_eq!(std::fs::read(out.join("1")).unwrap(), &input[RECORD..2 * RECORD]);
    assert!(!out.join("200").exists() || std::fs::read(out.join("200")).unwrap().is_empty());
    assert!(stderr.contains("cannot be written here") && stderr.contains("cannot be fetched from"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_shard_needed_sooner_stays_whatever_the_evictor_chooses() {
    use granary::ShardSource;
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    // Four shards of 64 records, all of one size.
    store_with(&source, 256, 4);
    let paths = StorePaths::new(&here);
    let spec = VersionSpec::parse("tok").unwrap();
    let entries = {
        let source_paths = StorePaths::new(&source);
        source_paths.read_manifest(source_paths.resolve(&spec).unwrap().0).unwrap().entries().to_vec()
    };
    assert!(entries.len() == 4 && entries.iter().all(|e| e.file_bytes == entries[0].file_bytes));
    let bound = 2 * entries[0].file_bytes;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let cache = granary::origin::OriginCache::open_with(&paths, Some("lru"), &[], &[origin]).unwrap().unwrap();
    let (a, b, c) = (entries[0].shard, entries[1].shard, entries[2].shard);
    // The plan: a at steps 0 and 5, b at 1 and 50, c at 10.
    let mut steps = vec![Vec::new(); 51];
    steps[0].push(a);
    steps[1].push(b);
    steps[5].push(a);
    steps[10].push(c);
    steps[50].push(b);
    cache.add_plan(0, &steps);
    for shard in [a, b] {
        cache.fetch(shard).unwrap();
        cache.accessed(&[shard]);
    }
    // At step 2, c comes: LRU would evict a, the least recently used, which is needed at
    // step 5, before c; b (step 50) goes instead.
    cache.fetch(c).unwrap();
    assert!(paths.shard(a).exists(), "a, needed sooner than c, was evicted");
    assert!(!paths.shard(b).exists(), "b, needed last, was kept");
    assert!(paths.shard(c).exists());
    assert!(shard_bytes_here(&here) <= bound);
}

#[test]
fn a_push_to_a_missing_bucket_says_so_in_one_line_without_the_xml() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 16, 9);
    let err = moto.err(&source, &["push", "tok", "s3://granary-no-such-bucket/x"]);
    assert!(err.contains("NoSuchBucket") && err.contains("create the bucket first"), "{err}");
    assert!(!err.contains("<?xml") && !err.contains("<Error>") && err.lines().count() == 1, "{err}");
}

/// A reader with no S3 credentials in its environment (issue 40: a 403 from the metadata
/// address, or three minutes of retries where it drops packets) is told within seconds what to
/// set; with them set, the same command goes on to the bucket.
#[test]
fn no_credentials_and_no_metadata_service_say_what_to_set_within_seconds() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 16, 9);
    moto.ok(&source, &["push", "tok", &format!("s3://{BUCKET}/creds")]);
    // A "metadata service" the kernel accepts connections for and that never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let root = dir.path().join("reader");
    for profile in [false, true] {
        let mut command = moto.command(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")]);
        command
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env("AWS_METADATA_ENDPOINT", &endpoint);
        if profile {
            command.env("AWS_PROFILE", "training");
        }
        let started = Instant::now();
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
        assert!(
            stderr.contains("no S3 credentials")
                && stderr.contains("did not answer within 2 s")
                && stderr.contains("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
                && stderr.contains("AWS_SKIP_SIGNATURE=true"),
            "{stderr}"
        );
        assert_eq!(stderr.contains("AWS_PROFILE is set"), profile, "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
    // A metadata address nothing listens on is as quick, and says so.
    drop(silent);
    let out = moto
        .command(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env("AWS_METADATA_ENDPOINT", &endpoint)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("could not be reached"), "{stderr}");
    // With the keys, the same attach reads the bucket.
    let attached = moto.ok(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")]);
    assert!(!attached.is_empty());
}

/// The bytes of shard files under `root/shards` this process holds though they are gone from
/// their directory (evicted, still open or mapped): the space `df` counts that a listing does not.
fn held_after_removal(root: &Path) -> u64 {
    use std::collections::HashMap;
    let shards = root.join("shards").canonicalize().unwrap();
    let under = |target: &str| target.starts_with(shards.to_str().unwrap()) && target.ends_with(" (deleted)");
    // By (device, inode): a file both open and mapped is counted once.
    let mut held: HashMap<String, u64> = HashMap::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else { continue };
        if under(&target.to_string_lossy()) {
            // Through the descriptor: a stat of the open (deleted) file.
            if let Ok(meta) = std::fs::metadata(entry.path()) {
                use std::os::unix::fs::MetadataExt;
                held.insert(format!("{:x}:{}", meta.dev(), meta.ino()), meta.len());
            }
        }
    }
    for line in std::fs::read_to_string("/proc/self/maps").unwrap().lines() {
        let fields: Vec<&str> = line.splitn(6, ' ').collect();
        let [range, _, _, _, inode, path] = fields[..] else { continue };
        if !under(path.trim_start()) {
            continue;
        }
        let (start, end) = range.split_once('-').unwrap();
        let len = u64::from_str_radix(end, 16).unwrap() - u64::from_str_radix(start, 16).unwrap();
        // A whole-file mapping: its length is the file's, to a page. The device field is
        // "major:minor" in hex, not the stat one: keyed by inode alone then, the store's one file system.
        let key = held.keys().find(|k| k.ends_with(&format!(":{inode}"))).cloned().unwrap_or(format!("map:{inode}"));
        let entry = held.entry(key).or_insert(0);
        *entry = (*entry).max(len);
    }
    held.values().sum()
}

/// Issue 40: a reader kept the shards its cache evicted open until its epoch ended, so the
/// store's file system held several times the cache's bound (60 MiB of deleted files under a
/// 16 MiB bound, and ENOSPC on a disk where the bound fit). Read as a trainer does, with the
/// default loader (tier and plan) over three epochs, what is on disk (the cached files and the
/// ones gone but held) stays within the bound, but for the shards of the batches in flight.
#[test]
fn an_epoch_through_a_quarter_cache_holds_no_more_disk_than_the_bound() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 2048, 3);
    let dataset_bytes = shard_bytes_here(&source);
    let bound = dataset_bytes / 4;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    let dataset = granary::Dataset::open(&paths, &VersionSpec::parse("tok").unwrap()).unwrap();
    let largest = dataset.manifest().entries().iter().map(|e| e.file_bytes).max().unwrap();
    let config = LoaderConfig {
        batch_size: 16,
        seed: 2,
        target: Target::Host,
        epochs: Some(3),
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(dataset, config, Default::default()).unwrap();
    let (mut peak, mut peak_held, mut batches) = (0_u64, 0_u64, 0_u64);
    let mut seen = vec![0_u32; input.len() / RECORD];
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            let index = usize::try_from(index).unwrap();
            assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            seen[index] += 1;
        }
        drop(batch);
        let held = held_after_removal(&here);
        peak_held = peak_held.max(held);
        peak = peak.max(shard_bytes_here(&here) + held);
        batches += 1;
    }
    assert!(seen.iter().all(|&n| n == 3), "every record once an epoch");
    let fetched = cache.stats().bytes_from_origin;
    println!(
        "{batches} batches; on disk at most {peak} bytes ({peak_held} of them removed but held) for a bound of \
         {bound} and shards of {largest}; fetched {:.2} x the data",
        fetched as f64 / dataset_bytes as f64
    );
    // The shards of the batches in flight may be held past their eviction (a loader reads a few
    // batches ahead), and one more is being published: two shards over, at most.
    assert!(
        peak <= bound + 2 * largest,
        "on disk {peak} bytes ({peak_held} held after removal) for a bound of {bound}"
    );
    // Each epoch fetches the dataset about once, as before.
    assert!(fetched as f64 <= 3.0 * 1.15 * dataset_bytes as f64, "{:?}", cache.stats());
}
