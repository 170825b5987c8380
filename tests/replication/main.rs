//! Replication between `granary serve` processes on loopback (and in network namespaces for the
//! partition): copies reach their factor verified, a node killed mid-transfer leaves no partial
//! shard and another peer finishes, a partitioned node heals and converges, a damaged shard is
//! repaired on read, a peer without the key is refused, a peer that sends wrong bytes is demoted,
//! launcher (torchrun) membership, and the cache's last-copy rule (`copies.rs`); erasure-coded
//! fragments placed, read back, rebuilt and left behind (`coded.rs`); hot shards given more
//! copies and letting them go (`hot.rs`). Each scenario prints the
//! data lost (always 0, or the test fails) and its time to converge. This file is the harness:
//! `Cluster` (the nodes, their command lines and status) and the helpers both use.

#[path = "../common/mod.rs"]
mod common;
mod coded;
mod copies;
mod hot;
mod peers;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use granary::engine::verify_shard;
use granary::replication::{ClusterKey, NodeClient};
use granary::store::ObjectKind;
use granary::{Dataset, Granary, IoConfig, Reader, ShardId, StorePaths, VersionSpec};

const KEY: &str = "a cluster secret for the tests, 42 bytes!!";

/// A port nothing listens on now (`free_ports`).
fn free_port() -> u16 {
    free_ports(1)[0]
}

struct NodeProc {
    root: PathBuf,
    listen: SocketAddr,
    child: Option<Child>,
    log: PathBuf,
    env: Vec<(String, String)>,
    args: Vec<String>,
    /// Run inside this network namespace.
    netns: Option<String>,
}

struct Cluster {
    dir: tempfile::TempDir,
    /// The cluster's secret: its own, so that a node of another test running meanwhile, which
    /// may listen on a port a stopped node of this one freed, is never taken for that node.
    secret: String,
    key_file: PathBuf,
    nodes: Vec<NodeProc>,
}

impl Cluster {
    /// `n` nodes with empty stores on loopback.
    fn new(n: usize) -> Cluster {
        let dir = tempdir();
        let key_file = dir.path().join("cluster.key");
        let secret = format!("{KEY} of {}", dir.path().display());
        std::fs::write(&key_file, &secret).unwrap();
        let ports = free_ports(n);
        let nodes = (0..n)
            .map(|i| {
                let root = dir.path().join(format!("node{i}"));
                drop(Granary::create(&root).unwrap());
                NodeProc {
                    root,
                    listen: SocketAddr::from(([127, 0, 0, 1], ports[i])),
                    child: None,
                    log: dir.path().join(format!("node{i}.log")),
                    env: Vec::new(),
                    args: Vec::new(),
                    netns: None,
                }
            })
            .collect();
        Cluster { dir, secret, key_file, nodes }
    }

    fn key(&self) -> ClusterKey {
        ClusterKey::from_secret(self.secret.as_bytes()).unwrap()
    }

    fn root(&self, i: usize) -> &Path {
        &self.nodes[i].root
    }

    fn command(&self, i: usize) -> Command {
        let node = &self.nodes[i];
        match &node.netns {
            Some(ns) => {
                let mut command = Command::new("ip");
                command.args(["netns", "exec", ns]).arg(env!("CARGO_BIN_EXE_granary"));
                command
            }
            None => Command::new(env!("CARGO_BIN_EXE_granary")),
        }
    }

    /// Starts node `i` with every other node as its peer, and waits until it listens.
    fn start(&mut self, i: usize) {
        let peers: Vec<String> =
            (0..self.nodes.len()).filter(|&j| j != i).map(|j| self.nodes[j].listen.to_string()).collect();
        self.start_with(i, &peers);
    }

    fn start_with(&mut self, i: usize, peers: &[String]) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.nodes[i].log).unwrap();
        let mut command = self.command(i);
        command
            .arg("--root")
            .arg(&self.nodes[i].root)
            .args(["serve", "--listen", &self.nodes[i].listen.to_string()])
            .arg("--cluster-key")
            .arg(&self.key_file)
            .args(["--heartbeat-ms", "100", "--down-after-ms", "800"])
            .args(&self.nodes[i].args)
            .envs(self.nodes[i].env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env_remove("GRANARY_ROOT")
            .env_remove("GRANARY_CLUSTER_KEY")
            .stdout(Stdio::null())
            .stderr(log);
        if !peers.is_empty() {
            command.arg("--peers").arg(peers.join(","));
        }
        let child = command.spawn().unwrap();
        self.nodes[i].child = Some(child);
        let listen_file = self.nodes[i].root.join("replication").join("listen");
        let started = Instant::now();
        while std::fs::read_to_string(&listen_file).ok().is_none_or(|t| t.trim() != self.nodes[i].listen.to_string()) {
            if let Some(status) = self.nodes[i].child.as_mut().unwrap().try_wait().unwrap() {
                panic!("node {i} exited with {status}:\n{}", self.logs());
            }
            assert!(started.elapsed() < Duration::from_secs(30), "node {i} did not start:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// The `granary` command line against node `i` (through its netns, if any).
    fn cli(&self, i: usize, args: &[&str]) -> std::process::Output {
        self.command(i)
            .arg("--root")
            .arg(&self.nodes[i].root)
            .args(args)
            .arg("--cluster-key")
            .arg(&self.key_file)
            .env_remove("GRANARY_ROOT")
            .env_remove("GRANARY_CLUSTER_KEY")
            .output()
            .unwrap()
    }

    /// Node `i`'s status report as `granary status --json` prints it ("" when it fails).
    fn status(&self, i: usize) -> String {
        let out = self.cli(i, &["status", "--json"]);
        if out.status.success() { String::from_utf8(out.stdout).unwrap() } else { String::new() }
    }

    fn status_json(&self, i: usize) -> serde_json::Value {
        serde_json::from_str(&self.status(i)).unwrap_or(serde_json::Value::Null)
    }

    /// The counter `key` of node `i`'s status (`_line` names the group of the text report it is
    /// in, for the reader; the JSON is flat).
    fn stat(&self, i: usize, _line: &str, key: &str) -> Option<u64> {
        self.status_json(i).get(key.replace('-', "_"))?.as_u64()
    }

    fn peers_up(&self, i: usize) -> usize {
        let status = self.status_json(i);
        let peers = status.get("peers").and_then(|p| p.as_array()).cloned().unwrap_or_default();
        peers.iter().filter(|p| p["up"] == serde_json::Value::Bool(true)).count()
    }

    fn logs(&self) -> String {
        let mut out = String::new();
        for (i, node) in self.nodes.iter().enumerate() {
            let text = std::fs::read_to_string(&node.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out.push_str(&format!("--- node {i} (last lines)\n"));
            for line in tail.into_iter().rev() {
                out.push_str(line);
                out.push('\n');
            }
        }
        out
    }

    /// Waits for `done`, polling; returns how long it took.
    fn wait(&self, what: &str, timeout: Duration, mut done: impl FnMut(&Cluster) -> bool) -> Duration {
        let started = Instant::now();
        while !done(self) {
            assert!(started.elapsed() < timeout, "timed out waiting for {what}:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(50));
        }
        started.elapsed()
    }

    /// The shards node `i` holds, each checked in full (BLAKE3 and every CRC): a file under
    /// `shards/` that is partial or damaged fails the test.
    fn verified_shards(&self, i: usize) -> BTreeSet<ShardId> {
        let paths = StorePaths::new(self.root(i));
        let mut out = BTreeSet::new();
        for (id, path) in paths.list_objects(ObjectKind::Shard).unwrap() {
            match verify_shard(&path, ShardId(id)) {
                Ok(_) => {
                    out.insert(ShardId(id));
                }
                // A file removed (evicted) between the listing and the check is not held.
                Err(granary::Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => panic!("node {i} has a visible shard that fails verification: {e}"),
            }
        }
        out
    }

    /// Shards of `name` on `root`'s manifest with no verified copy on any of `nodes`.
    fn lost(&self, name: &str, nodes: &[usize]) -> usize {
        let shards = shards_of(self.root(0), name);
        let held: BTreeSet<ShardId> = nodes.iter().flat_map(|&i| self.verified_shards(i)).collect();
        shards.iter().filter(|s| !held.contains(s)).count()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            if let Some(mut child) = self.nodes[i].child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// `granary ingest` of 4 KiB u16 records into dataset `tokens`, in 512 KiB shards (the input
/// file follows).
const INGEST_TOKENS: &[&str] = &[
    "ingest",
    "records",
    "--name",
    "tokens",
    "--append",
    "--record-bytes",
    "4096",
    "--dtype",
    "u16",
    "--shard-bytes",
    "512K",
];

fn shards_of(root: &Path, name: &str) -> Vec<ShardId> {
    let dataset = Dataset::open(&StorePaths::new(root), &VersionSpec::parse(name).unwrap()).unwrap();
    (0..dataset.n_shards()).map(|s| dataset.shard_id(s)).collect()
}

/// Ingests `n` records of 4 KiB (seeded) into `name` on `root`, in shards of `shard_bytes`.
fn ingest_tokens(root: &Path, name: &str, seed: u64, n: usize, shard_bytes: u64) -> Vec<Vec<u8>> {
    let mut granary = Granary::open(root).unwrap();
    let records: Vec<Vec<u8>> = (0..n).map(|i| bytes(seed * 1_000_003 + i as u64, 4096)).collect();
    ingest(&mut granary, name, tokens_layout(2048), small_shards(shard_bytes), &records);
    records
}

/// Prints a scenario's outcome (`cargo test --test replication -- --nocapture` shows them) and
/// fails it if any data was lost. `converge` is `None` where nothing has to converge.
fn report(scenario: &str, lost: usize, converge: impl Into<Option<Duration>>) {
    let converge = converge.into().map_or_else(|| "n/a".to_owned(), |d| format!("{:.2} s", d.as_secs_f64()));
    println!("replication scenario {scenario:?}: data lost {lost} shards, time to converge {converge}");
    assert_eq!(lost, 0, "{scenario}: data lost");
}
