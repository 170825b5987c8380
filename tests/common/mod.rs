//! Helpers shared by the integration tests: stores in temp directories, deterministic data, and
//! the `granary` binary.
#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use granary::{Dataset, Dtype, FixedLayout, Granary, IngestOptions, Layout, VersionSpec};

/// A fresh temporary directory.
pub(crate) fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("granary-test-").tempdir().expect("a temp dir")
}

/// Deterministic pseudo-random bytes (xorshift64*), different for each seed.
pub(crate) fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

/// Reads `batches` through `reader`, `depth` in flight, and checks each delivered batch's bytes
/// against `records` (the model); `what` names the case in a failure.
pub(crate) fn read_as_the_model(
    reader: &mut granary::Reader,
    batches: &[Vec<u64>],
    depth: usize,
    records: &[Vec<u8>],
    what: &str,
) {
    let mut n = 0;
    reader
        .read_batches(batches, depth, &mut |batch| {
            let expected: Vec<u8> = batches[n].iter().flat_map(|&i| records[i as usize].clone()).collect();
            assert!(batch.data() == &expected[..], "{what}: batch {n} differs");
            n += 1;
            Ok(())
        })
        .expect("the read");
    assert_eq!(n, batches.len(), "{what}");
}

/// A little-endian u16 token layout of `tokens` per record.
pub(crate) fn tokens_layout(tokens: u64) -> Layout {
    Layout::Fixed(FixedLayout::new(Dtype::U16, &[tokens]).expect("a valid shape"))
}

/// Small shards, so a few megabytes make many of them.
pub(crate) fn small_shards(shard_bytes: u64) -> IngestOptions {
    IngestOptions { shard_bytes_target: shard_bytes, ..IngestOptions::default() }
}

/// A store in a temporary directory holding dataset `tokens`: `n` records of `tokens` u16 token
/// ids each (record `i` is `bytes(i, ..)`), in shards of about `shard_bytes`.
pub(crate) struct TokenStore {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) dataset: std::sync::Arc<Dataset>,
    pub(crate) records: Vec<Vec<u8>>,
}

/// Makes a `TokenStore`.
pub(crate) fn token_store(n: usize, tokens: u64, shard_bytes: u64) -> TokenStore {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).expect("a new store");
    let records: Vec<Vec<u8>> = (0..n).map(|i| bytes(i as u64, tokens as usize * 2)).collect();
    ingest(&mut granary, "tokens", tokens_layout(tokens), small_shards(shard_bytes), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("tokens").expect("a spec")).expect("the dataset");
    TokenStore { dir, dataset, records }
}

/// Ingests `records` as dataset `name` and returns the version number.
pub(crate) fn ingest(
    granary: &mut Granary,
    name: &str,
    layout: Layout,
    options: IngestOptions,
    records: &[Vec<u8>],
) -> u64 {
    let name = granary::DatasetName::new(name).expect("a valid name");
    let mut ingest = granary.ingest(name, layout, options).expect("ingest starts");
    for record in records {
        ingest.push(record).expect("push");
    }
    ingest.commit().expect("commit").version
}

/// Writes `records` back to back into `path`.
pub(crate) fn write_records(path: &Path, records: &[Vec<u8>]) {
    std::fs::write(path, records.concat()).expect("write input");
}

/// Runs the `granary` binary with `--root root` and `args`.
pub(crate) fn granary(root: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove("GRANARY_ROOT")
        .output()
        .expect("the granary binary runs")
}

/// Asserts success and returns stdout.
pub(crate) fn granary_ok(root: &Path, args: &[&str]) -> String {
    let out = granary(root, args);
    assert!(out.status.success(), "granary {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("utf-8 output")
}

/// Asserts failure with exactly one line on stderr, and returns that line.
pub(crate) fn granary_err(root: &Path, args: &[&str]) -> String {
    let out = granary(root, args);
    assert!(!out.status.success(), "granary {args:?} succeeded but should not have");
    let stderr = String::from_utf8(out.stderr).expect("utf-8 stderr");
    assert_eq!(stderr.lines().count(), 1, "granary {args:?}: expected one line on stderr, got {stderr:?}");
    assert!(stderr.starts_with("granary: error: "), "{stderr:?}");
    stderr.trim_end().to_owned()
}

/// Every shard file under the store.
pub(crate) fn shard_files(root: &Path) -> Vec<PathBuf> {
    granary::StorePaths::new(root)
        .list_objects(granary::store::ObjectKind::Shard)
        .expect("list shards")
        .into_iter()
        .map(|(_, path)| path)
        .collect()
}

/// Whether this machine has `what` (`available`) for a test that needs it: the one rule of
/// every skip in the suites. A test skips only where the machine lacks what it needs, saying
/// so on stderr, and never under `.ci/run` (which sets `GRANARY_CI`): CI has everything (root,
/// iproute2, cgroup v1's memory controller, mounts, prometheus), so there a lack fails.
pub(crate) fn machine_has(available: bool, what: &str) -> bool {
    if available {
        return true;
    }
    assert!(std::env::var_os("GRANARY_CI").is_none(), "this machine lacks {what}, which CI (GRANARY_CI) must have");
    eprintln!("skipped: this machine lacks {what}");
    false
}

/// Runs this test binary's ignored test `child` (exactly) inside a fresh cgroup v1 memory group
/// limited to `limit` bytes (no swap), with `envs`, and returns its output; `None` when this
/// machine cannot (not root, no v1 memory controller), which CI must not be.
pub(crate) fn run_in_memory_cgroup(limit: u64, child: &str, envs: &[(&str, &Path)]) -> Option<Output> {
    let memory = Path::new("/sys/fs/cgroup/memory");
    let root = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false);
    if !machine_has(root && memory.join("cgroup.procs").exists(), "root and cgroup v1's memory controller") {
        return None;
    }
    let group = memory.join(format!("granary-test-{}-{child}", std::process::id()));
    std::fs::create_dir(&group).unwrap();
    std::fs::write(group.join("memory.limit_in_bytes"), limit.to_string()).unwrap();
    let _ = std::fs::write(group.join("memory.swappiness"), "0");
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg("echo $$ > \"$GROUP/cgroup.procs\" && exec \"$@\"")
        .arg("sh")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", child, "--ignored", "--nocapture", "--test-threads", "1"])
        .env("GROUP", &group);
    for (name, value) in envs {
        command.env(name, value);
    }
    let out = command.output().unwrap();
    let _ = std::fs::remove_dir(&group);
    Some(out)
}

/// The numbers on the line of `out`'s standard output that starts with `marker`, after the child
/// of `run_in_memory_cgroup` succeeded (a panic names what it printed).
pub(crate) fn child_report(out: &Output, marker: &str) -> Vec<u64> {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the child failed ({:?}): {stdout} {stderr}", out.status);
    let line = stdout
        .lines()
        .find_map(|l| l.find(marker).map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no report from the child: {stdout} {stderr}"));
    line.split_whitespace().filter_map(|w| w.parse().ok()).collect()
}

/// A mount the test made, unmounted when dropped (lazily if it is still busy, so no test leaves
/// a mount behind).
pub(crate) struct Mounted(pub(crate) PathBuf);

impl Drop for Mounted {
    fn drop(&mut self) {
        let unmounted = Command::new("umount").arg(&self.0).status().is_ok_and(|s| s.success());
        if !unmounted {
            let _ = Command::new("umount").arg("-l").arg(&self.0).status();
        }
    }
}

/// A trainer's other allocations while it reads on: 224 MiB, 16 MiB at a time, with `read`
/// called 50 times after each and a pause for the kernel's reclaim; returns the memory, still
/// held (the caller measures while it is).
pub(crate) fn allocate_while_reading(mut read: impl FnMut()) -> Vec<Vec<u8>> {
    let mut hog: Vec<Vec<u8>> = Vec::new();
    for _ in 0..14 {
        hog.push(vec![1u8; 16 << 20]);
        for _ in 0..50 {
            read();
        }
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    hog
}

/// `n` distinct loopback ports nothing listens on now, from below the kernel's ephemeral range
/// (32768 and up on Linux): a port picked by binding port 0 is an ephemeral one, which an
/// outgoing connection of another test's process may take before the node that was to listen on
/// it starts (seen in CI as "Address already in use"). Picked at random, each checked free, none
/// handed out twice in this process.
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    use std::sync::Mutex;
    use std::time::{SystemTime, UNIX_EPOCH};
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut state = (u64::from(std::process::id()) << 32 | u64::from(nanos)) | 1;
    let mut ports = Vec::with_capacity(n);
    while ports.len() < n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let port = 20_000 + (state % 12_000) as u16;
        if given.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.push(port);
            ports.push(port);
        }
    }
    ports
}

/// A repair that puts the good bytes back as a new file under the shard's name (as a repair from
/// a peer does: written aside, then renamed over the damaged one).
#[derive(Debug)]
pub(crate) struct PutBack {
    pub(crate) path: std::path::PathBuf,
    pub(crate) good: Vec<u8>,
    pub(crate) repairs: std::sync::atomic::AtomicU64,
}

impl granary::ShardSource for PutBack {
    fn repair(&self, _shard: granary::ShardId, _cause: &granary::Error) -> granary::Result<()> {
        let aside = self.path.with_extension("repaired");
        std::fs::write(&aside, &self.good).map_err(|e| granary::Error::io("write", &aside, e))?;
        std::fs::rename(&aside, &self.path).map_err(|e| granary::Error::io("rename", &self.path, e))?;
        self.repairs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

/// Reads `loader`'s whole run, checking every record's bytes against `records`; how many were
/// read.
pub(crate) fn drain_checked(loader: &mut granary::Loader, records: &[Vec<u8>]) -> usize {
    let mut seen = 0;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
        }
        seen += batch.indices().len();
    }
    seen
}
