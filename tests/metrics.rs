//! Metrics as a monitoring stack sees them: a real Prometheus (Debian's package) scrapes two
//! `granary serve` processes and this process's loader on loopback, and its HTTP API shows the
//! series following the workload: the bytes of one epoch, one verify failure and one repair for
//! a damaged shard, a killed peer going down. `promtool check metrics` checks each exposition.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use granary::metrics::{Endpoint, Registry};
use granary::replication::{ClusterKey, NodeClient};
use granary::{
    Dataset, Loader, LoaderConfig, Order, PlanSource, Position, StorePaths, Target, TierSetting, VersionSpec,
};

const RECORDS: usize = 256;
const RECORD_BYTES: usize = 4096;

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `prometheus` and `promtool` on the PATH, or `None` when this machine lacks them (and is not
/// CI: `common::machine_has`; `make test` installs them).
fn prometheus_tools() -> Option<(PathBuf, PathBuf)> {
    let find = |name: &str| {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
            .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/sbin")])
            .map(|dir| dir.join(name))
            .find(|path| path.is_file())
    };
    let tools = find("prometheus").zip(find("promtool"));
    common::machine_has(tools.is_some(), "prometheus and promtool (Debian: apt-get install prometheus)")
        .then_some(tools)
        .flatten()
}

/// A GET over HTTP/1.0 on loopback: the status code and the body.
fn get(addr: SocketAddr, target: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(stream, "GET {target} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let code = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body.to_owned()))
}

/// Percent-encodes a query string value.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    addr: SocketAddr,
    process: Killed,
}

impl Prometheus {
    fn start(binary: &Path, dir: &Path, jobs: &[(&str, &[SocketAddr])]) -> Prometheus {
        let mut config = String::from("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\nscrape_configs:\n");
        for (job, targets) in jobs {
            let targets: Vec<String> = targets.iter().map(|addr| format!("'{addr}'")).collect();
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                targets.join(", ")
            ));
        }
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], free_ports(1)[0]));
        let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
        let process = Command::new(binary)
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut prometheus = Prometheus { addr, process: Killed(process) };
        let started = Instant::now();
        while get(addr, "/-/ready").is_none_or(|(code, _)| code != 200) {
            if let Some(status) = prometheus.process.0.try_wait().unwrap() {
                panic!("prometheus exited with {status}: {}", prometheus.log(dir));
            }
            assert!(started.elapsed() < Duration::from_secs(60), "prometheus did not start: {}", prometheus.log(dir));
            std::thread::sleep(Duration::from_millis(100));
        }
        prometheus
    }

    fn log(&self, dir: &Path) -> String {
        std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
    }

    /// The value of instant query `expr` (its first series), if it has one.
    fn query(&self, expr: &str) -> Option<f64> {
        let (code, body) = get(self.addr, &format!("/api/v1/query?query={}", encode(expr)))?;
        assert_eq!(code, 200, "query {expr}: {body}");
        let json: serde_json::Value = serde_json::from_str(&body).ok()?;
        json["data"]["result"].get(0)?["value"][1].as_str()?.parse().ok()
    }

    /// Waits until `expr` equals `want`, through Prometheus' scrapes.
    fn wait_for(&self, expr: &str, want: f64) {
        let started = Instant::now();
        loop {
            let have = self.query(expr);
            if have == Some(want) {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(60), "{expr}: {have:?}, expected {want}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
}

/// `promtool check metrics` on a scrape of `addr` (the text format, with its lint).
fn promtool_accepts(promtool: &Path, addr: SocketAddr, secret: &str) {
    let (code, body) = get(addr, "/metrics").expect("the endpoint answers");
    assert_eq!(code, 200);
    assert!(body.contains("granary_"), "{body}");
    assert!(!body.contains(secret), "the cluster secret is in the exposition of {addr}");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check.stdin.take().unwrap().write_all(body.as_bytes()).unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool rejects the exposition of {addr}:\n{}{}\n{body}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn serve(root: &Path, key: &Path, listen: SocketAddr, peer: SocketAddr, metrics: SocketAddr, log: &Path) -> Killed {
    let child = Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(root)
        .args(["serve", "--listen", &listen.to_string(), "--peers", &peer.to_string()])
        .args(["--metrics", &metrics.to_string()])
        .args(["--heartbeat-ms", "100", "--down-after-ms", "800", "--replicator-options", "mode=sync"])
        .arg("--cluster-key")
        .arg(key)
        .env_remove("GRANARY_ROOT")
        .env_remove("GRANARY_CLUSTER_KEY")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let child = Killed(child);
    let started = Instant::now();
    while get(metrics, "/metrics").is_none() {
        assert!(started.elapsed() < Duration::from_secs(30), "{}", std::fs::read_to_string(log).unwrap_or_default());
        std::thread::sleep(Duration::from_millis(50));
    }
    child
}

#[test]
fn prometheus_sees_the_bytes_of_an_epoch_a_repair_and_a_peer_going_down() {
    let Some((prometheus, promtool)) = prometheus_tools() else { return };
    let dir = tempdir();
    let secret = format!("a cluster secret for the metrics test of {}", dir.path().display());
    let key_file = dir.path().join("cluster.key");
    std::fs::write(&key_file, &secret).unwrap();
    let key = ClusterKey::from_secret(secret.as_bytes()).unwrap();
    let roots: Vec<PathBuf> = (0..2).map(|i| dir.path().join(format!("node{i}"))).collect();
    for root in &roots {
        drop(granary::Granary::create(root).unwrap());
    }
    let records: Vec<Vec<u8>> = (0..RECORDS).map(|i| bytes(7_000 + i as u64, RECORD_BYTES)).collect();
    ingest(
        &mut granary::Granary::open(&roots[0]).unwrap(),
        "tokens",
        tokens_layout(2048),
        small_shards(256 << 10),
        &records,
    );

    let ports = free_ports(4);
    let listen: Vec<SocketAddr> = ports[..2].iter().map(|&p| SocketAddr::from(([127, 0, 0, 1], p))).collect();
    let metrics: Vec<SocketAddr> = ports[2..].iter().map(|&p| SocketAddr::from(([127, 0, 0, 1], p))).collect();
    let mut nodes: Vec<Option<Killed>> = (0..2)
        .map(|i| {
            let log = dir.path().join(format!("node{i}.log"));
            Some(serve(&roots[i], &key_file, listen[i], listen[1 - i], metrics[i], &log))
        })
        .collect();

    // This process's loader is scraped too, from a registry of the test's own.
    let registry = Registry::default();
    let endpoint = Endpoint::start("127.0.0.1:0", registry.clone(), None).unwrap();
    let prom_dir = dir.path().join("prometheus");
    std::fs::create_dir(&prom_dir).unwrap();
    let prom = Prometheus::start(&prometheus, &prom_dir, &[("node", &metrics[..]), ("loader", &[endpoint.addr()])]);
    let node0 = format!("instance=\"{}\"", metrics[0]);
    prom.wait_for(&format!("sum(granary_peer_up{{{node0}}})"), 1.0);
    prom.wait_for("count(up{job=\"loader\"} == 1)", 1.0);

    // Both nodes hold every shard; then one of node 1's is damaged.
    let out = Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(&roots[0])
        .args(["replicate", "tokens", "--replicas", "2", "--cluster-key"])
        .arg(&key_file)
        .env_remove("GRANARY_CLUSTER_KEY")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dataset = Dataset::open(&StorePaths::new(&roots[1]), &VersionSpec::parse("tokens").unwrap()).unwrap();
    let victim = dataset.shard_path(1);
    let mut file = std::fs::read(&victim).unwrap();
    file[4096 + 99] ^= 0x08;
    std::fs::write(&victim, &file).unwrap();

    // One epoch on node 1, repaired from node 0. From disk: with the tier, the damaged block
    // may also be found as copied out of the page cache first (two reads that found it).
    let config = LoaderConfig {
        batch_size: 32,
        plan: PlanSource::Native(Order::Sequential),
        epochs: Some(1),
        target: Target::Host,
        tier: TierSetting::Off,
        repair: Some(Arc::new(NodeClient::for_store(&roots[1], key).unwrap())),
        metrics: granary::metrics::Setting::Registry(registry.clone()),
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(Arc::clone(&dataset), config, Position::default()).unwrap();
    let mut delivered = 0;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            assert_eq!(batch.record(i), &records[index as usize][..]);
        }
        delivered += batch.data().len();
    }
    assert_eq!(delivered, RECORDS * RECORD_BYTES);
    drop(loader);
    // The loader has ended: its counters stay in the registry's totals.
    let after = registry.gather();
    let labels = [("rank", "0"), ("dataset", "tokens@1")];
    assert_eq!(after.value("granary_loader_delivered", &labels), Some((RECORDS * RECORD_BYTES) as f64));
    assert_eq!(after.value("granary_read_verify_failures", &labels), Some(1.0));
    assert_eq!(after.value("granary_loader_queued_batches", &labels), None, "its gauges went with it");

    // Prometheus has it: the epoch's bytes, one failure, one repair (kept after the loader
    // ended), and the node's repair.
    prom.wait_for("granary_loader_delivered_bytes_total", (RECORDS * RECORD_BYTES) as f64);
    prom.wait_for("granary_loader_batches_total", (RECORDS / 32) as f64);
    prom.wait_for("granary_read_verify_failures_total", 1.0);
    prom.wait_for("granary_read_shards_repaired_total", 1.0);
    prom.wait_for(&format!("granary_node_repairs_total{{instance=\"{}\"}}", metrics[1]), 1.0);
    prom.wait_for("count(granary_loader_step_stall_seconds_bucket)", 13.0);
    // Every shard was read (one twice over, after its repair), and the hottest are named.
    let shards = dataset.n_shards() as f64;
    prom.wait_for("sum(granary_shards_by_reads{reads_at_most=\"+Inf\"})", shards);
    prom.wait_for("sum(granary_shards_by_reads{reads_at_most=\"0\"})", 0.0);
    prom.wait_for("count(granary_shard_reads)", shards.min(16.0));
    prom.wait_for("sum(granary_shard_reads) >= bool 256", 1.0);
    // The copies went from node 0 to node 1, counted on both sides and per peer.
    prom.wait_for(&format!("sum(granary_peer_sent_bytes_total{{{node0}}}) > bool 0"), 1.0);
    prom.wait_for(&format!("sum(granary_node_received_bytes_total{{instance=\"{}\"}}) > bool 0", metrics[1]), 1.0);

    for addr in [metrics[0], endpoint.addr()] {
        promtool_accepts(&promtool, addr, &secret);
    }

    // Node 1 is killed: node 0 reports it down, and Prometheus its target down.
    nodes[1] = None;
    prom.wait_for(&format!("sum(granary_peer_up{{{node0}}})"), 0.0);
    prom.wait_for(&format!("up{{instance=\"{}\"}}", metrics[1]), 0.0);
    drop(nodes);
}

#[test]
fn connections_that_send_half_a_request_cannot_blind_the_endpoint() {
    // 70 connections from this address, each sending half a request head and then nothing (each
    // would hold its slot until the 10 s head timeout): a scraper arriving after them is
    // answered at once, as each new connection makes room by closing the oldest that never
    // sent a request.
    let registry = Registry::default();
    let endpoint = Endpoint::start("127.0.0.1:0", registry, None).unwrap();
    let addr = endpoint.addr();
    let mut idle: Vec<TcpStream> = (0..70)
        .map(|_| {
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap();
            stream.write_all(b"GET /metrics HTTP/1.1\r\nHo").unwrap();
            stream
        })
        .collect();
    // Let the endpoint accept them all.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    for _ in 0..3 {
        let (code, _) = get(addr, "/metrics").expect("a scrape is answered past the idle connections");
        assert_eq!(code, 200);
    }
    assert!(started.elapsed() < Duration::from_secs(5), "scraped in {:?}", started.elapsed());
    // The oldest idle ones were closed to make the room: a read sees their end.
    let closed = idle
        .iter_mut()
        .filter_map(|stream| {
            stream.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
            let closed = match stream.read(&mut [0u8; 64]) {
                Ok(0) => true,
                Err(e) => !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                Ok(_) => false,
            };
            closed.then_some(())
        })
        .count();
    assert!(closed >= 70 - 32, "{closed} of 70 idle connections closed (32 per address at most stay)");
}
