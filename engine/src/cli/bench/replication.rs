//! `granary bench replication`: one shard's transfer between two nodes on loopback (Noise,
//! verified, published) against a plain TCP copy of the same file in the same run; then the
//! time to restore the replication factor after a node is lost, and the time to rebuild a lost
//! node's erasure-coded fragments (4+2) of the same data; then a hot shard read by three loaders
//! on three nodes, with one copy and with three (as `hot-replicas=3` places them).
//!
//! Budget: the transfer is CPU-bound on loopback. The plain copy costs a read from the page
//! cache, two kernel copies and a write into the page cache per byte (and an fsync at the end,
//! as the node does); the node adds AES-256-GCM on each side (ring, AES-NI and carry-less
//! multiply: several GB/s per core), BLAKE3 on the receiver (4-5 GB/s per core, on a thread of
//! its own) and CRC32C on the sender (15-20 GB/s). Both ends share this machine's cores, so the
//! ratio is a CPU ratio, not a network one.
//!
//! Owns: `ReplicationArgs` and `replication` (the command), its scratch directory
//! `<root>/bench-replication/` (cleared at the start, removed at the end) with the stores and nodes
//! it runs there, the plain TCP copy it compares with, and `make_dataset` (random records, which
//! `bench cache` uses too). Never: listens or connects beyond loopback (127.0.0.1), or touches a
//! store outside its scratch directory.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Args;
use granary::policy::{Limits, PolicyHost};
use granary::replication::{ClusterKey, Membership, Node, NodeConfig};
use granary::{
    Dataset, DatasetName, Dtype, FixedLayout, Granary, IngestOptions, Layout, ShardId, StorePaths, VersionSpec,
};

use super::measure::{Xorshift, median};
use crate::cli::parse_size;
use crate::cli::show::bytes;

#[derive(Args)]
pub(crate) struct ReplicationArgs {
    /// Bytes of the shard that is transferred.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    shard_bytes: u64,
    /// Transfers of each kind; the table reports medians.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Bytes of the dataset whose replication factor is restored after a node loss (0: skip).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    restore_bytes: u64,
    /// Bytes of the hot shard three loaders read, with one copy and with three (0: skip).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    hot_bytes: u64,
}

const RECORD_BYTES: u64 = 4096;
const SECRET: &[u8] = b"granary bench replication secret";

/// Ingests `bytes` of random records into dataset `name` at `root`, in shards of `shard_bytes`.
pub(super) fn make_dataset(root: &Path, name: &str, bytes: u64, shard_bytes: u64, seed: u64) -> Result<()> {
    let mut granary = Granary::create(root)?;
    let layout = Layout::Fixed(FixedLayout::new(Dtype::U8, &[RECORD_BYTES])?);
    let options = IngestOptions { shard_bytes_target: shard_bytes, ..IngestOptions::default() };
    let mut ingest = granary.ingest(DatasetName::new(name)?, layout, options)?;
    let mut random = Xorshift::new(seed);
    let mut record = vec![0u8; RECORD_BYTES as usize];
    for _ in 0..bytes / RECORD_BYTES {
        random.fill(&mut record);
        ingest.push(&record)?;
    }
    ingest.commit()?;
    Ok(())
}

fn start_node(host: &PolicyHost, root: &Path, peers: Vec<SocketAddr>) -> Result<Node> {
    let key = ClusterKey::from_secret(SECRET)?;
    let listen: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
    let mut config = NodeConfig::new(root, listen, Membership::Peers(peers), key);
    config.heartbeat = Duration::from_millis(100);
    config.down_after = Duration::from_millis(1000);
    Ok(Node::start(config, host)?)
}

/// Waits until `node` sees `n_peers` peers up, each listing at least one object.
fn wait_for_peers(node: &Node, n_peers: usize) -> Result<()> {
    let started = Instant::now();
    while node.status().peers.iter().filter(|p| p.up && p.objects > 0).count() < n_peers {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("node {} did not see its peers within 30 s", node.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A plain TCP copy of `file` on loopback into `out`: read, send, receive, write, fsync.
fn plain_copy(file: &Path, out: &Path) -> Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let out = out.to_owned();
    let receiver = std::thread::spawn(move || -> Result<u64> {
        let (mut stream, _) = listener.accept()?;
        let mut sink = std::fs::File::create(&out)?;
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = stream.read(&mut buf)?;
            if n == 0 {
                break;
            }
            sink.write_all(&buf[..n])?;
            total += n as u64;
        }
        sink.sync_all()?;
        Ok(total)
    });
    let started = Instant::now();
    let mut stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let mut source = std::fs::File::open(file)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = source.read(&mut buf)?;
        if n == 0 {
            break;
        }
        stream.write_all(&buf[..n])?;
    }
    drop(stream);
    let received = receiver.join().map_err(|_| anyhow::anyhow!("the receiver panicked"))??;
    let elapsed = started.elapsed();
    if received != std::fs::metadata(file)?.len() {
        bail!("the plain copy received {received} bytes");
    }
    Ok(elapsed)
}

pub(crate) fn replication(root: &Path, args: &ReplicationArgs) -> Result<()> {
    if args.runs == 0 || args.shard_bytes < RECORD_BYTES {
        bail!("--runs must be positive and --shard-bytes at least {RECORD_BYTES}");
    }
    let work = root.join("bench-replication");
    if work.exists() {
        std::fs::remove_dir_all(&work).with_context(|| format!("clear {}", work.display()))?;
    }
    std::fs::create_dir_all(&work)?;
    let host = PolicyHost::new(Limits::default(), Some(work.join("plugin-cache")))?;

    // One shard of the asked size on node A.
    let store_a = work.join("a");
    make_dataset(&store_a, "one", args.shard_bytes, args.shard_bytes + (1 << 20), 1)?;
    let dataset = Dataset::open(&StorePaths::new(&store_a), &VersionSpec::parse("one")?)?;
    if dataset.n_shards() != 1 {
        bail!("expected one shard, made {}", dataset.n_shards());
    }
    let shard: ShardId = dataset.shard_id(0);
    let shard_path = dataset.shard_path(0);
    let file_bytes = std::fs::metadata(&shard_path)?.len();
    std::fs::read(&shard_path)?; // into the page cache: both copies read it warm
    let node_a = start_node(&host, &store_a, Vec::new())?;

    let (mut plain, mut engine) = (Vec::new(), Vec::new());
    for run in 0..args.runs {
        for plain_first in [run % 2 == 0, run % 2 != 0] {
            if plain_first {
                let out = work.join("plain.out");
                plain.push(plain_copy(&shard_path, &out)?);
                std::fs::remove_file(&out)?;
            } else {
                let store_b: PathBuf = work.join(format!("b{run}"));
                drop(Granary::create(&store_b)?);
                let node_b = start_node(&host, &store_b, vec![node_a.listen_addr()])?;
                wait_for_peers(&node_b, 1)?;
                let started = Instant::now();
                node_b.repair(shard)?;
                engine.push(started.elapsed());
                drop(node_b);
                granary::engine::verify_shard(&StorePaths::new(&store_b).shard(shard), shard)?;
                std::fs::remove_dir_all(&store_b)?;
            }
        }
    }
    drop(node_a);
    let gbps = |d: &Duration| file_bytes as f64 / d.as_secs_f64() / 1e9;
    let ratios: Vec<f64> = plain.iter().zip(&engine).map(|(p, e)| p.as_secs_f64() / e.as_secs_f64()).collect();
    outln!(
        "granary bench replication: one shard of {} between two nodes on loopback, {} runs, medians",
        bytes(file_bytes),
        args.runs
    )?;
    outln!()?;
    outln!("{:<58} {:>10}", "transfer", "GB/s")?;
    outln!(
        "{:<58} {:>10.2}",
        "plain TCP copy (read, send, receive, write, fsync)",
        median_f64(plain.iter().map(gbps).collect())
    )?;
    outln!(
        "{:<58} {:>10.2}",
        "node to node (Noise AES-GCM, CRC out, BLAKE3 in, publish)",
        median_f64(engine.iter().map(gbps).collect())
    )?;
    outln!(
        "{:<58} {:>10.3}   (target >= 0.7)",
        "ratio node / plain (median of per-run ratios)",
        median_f64(ratios.clone())
    )?;
    outln!("per-run ratios: {}", ratios.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(" "))?;

    if args.restore_bytes > 0 {
        restore(&host, &work, args)?;
        restore_coded(&host, &work, args)?;
    }
    if args.hot_bytes > 0 {
        hot_shard(&host, &work, args)?;
    }
    std::fs::remove_dir_all(&work).ok();
    Ok(())
}

/// Nodes on `roots` (the first holds the dataset `data` of `args.restore_bytes`), each with
/// the ones before it as peers, heartbeat 0.1 s, down after 1 s, the replicator's `options`;
/// returns once every node sees all the others up.
fn start_cluster(
    host: &PolicyHost,
    roots: &[PathBuf],
    args: &ReplicationArgs,
    options: &[(&str, &str)],
) -> Result<Vec<Option<Node>>> {
    make_dataset(&roots[0], "data", args.restore_bytes, args.shard_bytes, 7)?;
    for root in &roots[1..] {
        drop(Granary::create(root)?);
    }
    let key = ClusterKey::from_secret(SECRET)?;
    let mut nodes: Vec<Option<Node>> = Vec::new();
    let mut addrs = Vec::new();
    for root in roots {
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
        let mut config = NodeConfig::new(root, listen, Membership::Peers(addrs.clone()), key.clone());
        config.heartbeat = Duration::from_millis(100);
        config.down_after = Duration::from_millis(1000);
        config.replicator_options = options.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let node = Node::start(config, host)?;
        addrs.push(node.listen_addr());
        nodes.push(Some(node));
    }
    let started = Instant::now();
    let n = roots.len();
    while (0..n).any(|i| running(&nodes, i).status().peers.iter().filter(|p| p.up).count() < n - 1) {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the {n} nodes did not see each other within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(nodes)
}

fn running(nodes: &[Option<Node>], i: usize) -> &Node {
    nodes[i].as_ref().expect("a node that runs")
}

/// Three nodes, a dataset replicated twice (synchronously), one node dropped: how long until
/// every shard has two copies on the nodes left.
fn restore(host: &PolicyHost, work: &Path, args: &ReplicationArgs) -> Result<()> {
    let roots: Vec<PathBuf> = (0..3).map(|i| work.join(format!("r{i}"))).collect();
    let mut nodes = start_cluster(host, &roots, args, &[("mode", "sync")])?;
    let replicated = Instant::now();
    let report = running(&nodes, 0).replicate("data", 2)?;
    let replicate_time = replicated.elapsed();
    // Drop the node that holds the most copies other than the origin's.
    let held = |i: usize| StorePaths::new(&roots[i]).list_objects(granary::store::ObjectKind::Shard).map(|v| v.len());
    let victim = if held(1)? >= held(2)? { 1 } else { 2 };
    let survivor = 3 - victim;
    let before = held(survivor)?;
    let lost_at = Instant::now();
    nodes[victim] = None;
    let mut detected = None;
    loop {
        let status = running(&nodes, 0).status();
        if detected.is_none() && status.peers.iter().filter(|p| p.up).count() == 1 {
            detected = Some(lost_at.elapsed());
        }
        if detected.is_some() && status.converged() && running(&nodes, survivor).status().converged() {
            break;
        }
        if lost_at.elapsed() > Duration::from_secs(600) {
            bail!("the replication factor was not restored within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let restored = lost_at.elapsed();
    let copied = held(survivor)?.saturating_sub(before);
    let detected = detected.expect("set before the loop ends");
    let shard_file_bytes: u64 = {
        let dataset = Dataset::open(&StorePaths::new(&roots[0]), &VersionSpec::parse("data")?)?;
        (0..dataset.n_shards()).map(|s| dataset.manifest().entries()[s].file_bytes).sum::<u64>()
            / dataset.n_shards() as u64
    };
    outln!()?;
    outln!(
        "restore: {} in {} shards, 2 copies on 3 nodes ({}; {:.2} s); one node lost",
        bytes(args.restore_bytes),
        report.shards,
        if report.mode == granary::policy::ReplicationMode::Synchronous { "synchronous" } else { "asynchronous" },
        replicate_time.as_secs_f64()
    )?;
    outln!(
        "  detected after {:.2} s (heartbeat 0.1 s, down after 1 s); factor restored after {:.2} s: {} shards ({}) copied, {:.2} GB/s after detection",
        detected.as_secs_f64(),
        restored.as_secs_f64(),
        copied,
        bytes(copied as u64 * shard_file_bytes),
        (copied as u64 * shard_file_bytes) as f64 / (restored - detected).as_secs_f64().max(1e-9) / 1e9
    )?;
    drop(nodes);
    Ok(())
}

/// Seven nodes, the same data coded 4+2 (synchronously) by the node that ingested it, that node
/// lost (its whole copies with it): how long until every shard has six fragments again on the
/// six left, each lost fragment rebuilt from four others.
fn restore_coded(host: &PolicyHost, work: &Path, args: &ReplicationArgs) -> Result<()> {
    use granary::erasure::Coding;
    use granary::replication::frame::{Goal, ReplicateMode};
    const NODES: usize = 7;
    let roots: Vec<PathBuf> = (0..NODES).map(|i| work.join(format!("e{i}"))).collect();
    let mut nodes = start_cluster(host, &roots, args, &[])?;
    let coding = Coding::new(4, 2)?;
    let coded = Instant::now();
    let report = running(&nodes, 0).replicate_in("data", Goal::Coded(coding), ReplicateMode::Synchronous)?;
    let code_time = coded.elapsed();
    let fragments_of = |i: usize| StorePaths::new(&roots[i]).list_objects(granary::store::ObjectKind::Fragment);
    let lost_fragments = fragments_of(0)?.len();
    let before: usize = (1..NODES).map(fragments_of).collect::<granary::Result<Vec<_>>>()?.iter().map(Vec::len).sum();
    let complete = |status: &granary::replication::NodeStatus| {
        status.goals.iter().flat_map(|g| &g.versions).all(|v| v.shards_complete == v.shards)
    };
    let lost_at = Instant::now();
    nodes[0] = None;
    let mut detected = None;
    loop {
        let status = running(&nodes, 1).status();
        if detected.is_none() && status.peers.iter().filter(|p| p.up).count() == NODES - 2 {
            detected = Some(lost_at.elapsed());
        }
        if detected.is_some()
            && complete(&status)
            && (1..NODES).all(|i| running(&nodes, i).status().pending_fetches == 0)
        {
            break;
        }
        if lost_at.elapsed() > Duration::from_secs(600) {
            bail!("the lost fragments were not rebuilt within 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let restored = lost_at.elapsed();
    let detected = detected.expect("set before the loop ends");
    let after: usize = (1..NODES).map(fragments_of).collect::<granary::Result<Vec<_>>>()?.iter().map(Vec::len).sum();
    let shard_file_bytes: u64 = {
        let dataset = Dataset::open(&StorePaths::new(&roots[1]), &VersionSpec::parse("data")?)?;
        dataset.manifest().file_bytes() / dataset.n_shards().max(1) as u64
    };
    let fragment_bytes = coding.file_bytes(shard_file_bytes);
    outln!()?;
    outln!(
        "restore, coded: {} in {} shards as 4+2 fragments on {NODES} nodes (synchronous; {:.2} s); the node that coded them lost, with {lost_fragments} fragments and every whole copy",
        bytes(args.restore_bytes),
        report.shards,
        code_time.as_secs_f64()
    )?;
    outln!(
        "  detected after {:.2} s; every shard at 6 fragments after {:.2} s: {} fragments ({}) rebuilt, each from 4 read ({} read), {:.2} GB/s of fragments written after detection",
        detected.as_secs_f64(),
        restored.as_secs_f64(),
        after.saturating_sub(before),
        bytes(after.saturating_sub(before) as u64 * fragment_bytes),
        bytes(after.saturating_sub(before) as u64 * fragment_bytes * u64::from(coding.k())),
        (after.saturating_sub(before) as u64 * fragment_bytes) as f64
            / (restored - detected).as_secs_f64().max(1e-9)
            / 1e9
    )?;
    drop(nodes);
    Ok(())
}

/// A hot shard of `args.hot_bytes`, read whole by one loader on each of three nodes at once: with
/// one copy (on one of the three: the other two loaders' reads pull it from that node first) and
/// with a copy on every node (where `hot-replicas=3` puts them, pulled before the reads). Each
/// arrangement `args.runs` times in alternation, fresh nodes each run.
fn hot_shard(host: &PolicyHost, work: &Path, args: &ReplicationArgs) -> Result<()> {
    let (mut one, mut three) = (Vec::new(), Vec::new());
    for run in 0..args.runs.max(1) * 2 {
        let copies = if run % 2 == 0 { 1 } else { 3 };
        let dir = work.join(format!("hot{run}"));
        let took = hot_run(host, &dir, args.hot_bytes, copies)?;
        std::fs::remove_dir_all(&dir).ok();
        if copies == 1 { one.push(took) } else { three.push(took) }
    }
    let gbps = |d: &Duration| 3.0 * args.hot_bytes as f64 / d.as_secs_f64() / 1e9;
    let ratios: Vec<f64> = one.iter().zip(&three).map(|(o, t)| o.as_secs_f64() / t.as_secs_f64()).collect();
    outln!()?;
    outln!(
        "hot shard: one shard of {} read whole by 3 loaders on 3 nodes at once, {} runs, medians",
        bytes(args.hot_bytes),
        one.len()
    )?;
    outln!("{:<58} {:>10}", "copies", "GB/s read")?;
    outln!("{:<58} {:>10.2}", "1 copy (2 loaders pull it first)", median_f64(one.iter().map(gbps).collect()))?;
    outln!("{:<58} {:>10.2}", "3 copies (hot-replicas=3)", median_f64(three.iter().map(gbps).collect()))?;
    outln!("{:<58} {:>10.2}", "ratio 3 copies / 1 copy (median of per-run ratios)", median_f64(ratios.clone()))?;
    outln!("per-run ratios: {}", ratios.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(" "))?;
    Ok(())
}

/// One run of `hot_shard`: the time until all three loaders have read every record.
fn hot_run(host: &PolicyHost, dir: &Path, hot_bytes: u64, copies: usize) -> Result<Duration> {
    use granary::loader::{Loader, LoaderConfig, PlanSource, Target, TierSetting};
    use std::sync::Arc;
    // Node 3 (weight 0: the table gives it no copy) ingests the shard and places one copy on
    // the three others, then leaves.
    let roots: Vec<PathBuf> = (0..4).map(|i| dir.join(format!("n{i}"))).collect();
    make_dataset(&roots[3], "hot", hot_bytes, hot_bytes + (1 << 20), 11)?;
    for root in &roots[..3] {
        drop(Granary::create(root)?);
    }
    let key = ClusterKey::from_secret(SECRET)?;
    let mut nodes: Vec<Arc<Node>> = Vec::new();
    let mut addrs = Vec::new();
    for (i, root) in roots.iter().enumerate() {
        let listen: SocketAddr = "127.0.0.1:0".parse().expect("a valid address");
        let mut config = NodeConfig::new(root, listen, Membership::Peers(addrs.clone()), key.clone());
        config.heartbeat = Duration::from_millis(100);
        config.down_after = Duration::from_millis(500);
        config.weight = u32::from(i < 3);
        let node = Node::start(config, host)?;
        addrs.push(node.listen_addr());
        nodes.push(Arc::new(node));
    }
    let started = Instant::now();
    while nodes.iter().any(|n| n.status().peers.iter().filter(|p| p.up).count() < 3) {
        if started.elapsed() > Duration::from_secs(30) {
            bail!("the 4 nodes did not see each other within 30 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    nodes[3].replicate_in(
        "hot",
        granary::replication::frame::Goal::Replicas(1),
        granary::replication::frame::ReplicateMode::Synchronous,
    )?;
    let shard = Dataset::open(&StorePaths::new(&roots[3]), &VersionSpec::parse("hot")?)?.shard_id(0);
    drop(nodes.pop());
    let holds = |i: usize| StorePaths::new(&roots[i]).shard(shard).exists();
    let started = Instant::now();
    let spec = VersionSpec::parse("hot")?;
    // Every node has the dataset's ref (the replicate brought it), one holds the shard, and
    // each sees node 3 down (no read asks it).
    while (0..3).any(|i| Dataset::open(&StorePaths::new(&roots[i]), &spec).is_err())
        || (0..3).filter(|&i| holds(i)).count() != 1
        || nodes.iter().any(|n| n.status().peers.iter().filter(|p| p.up).count() != 2)
    {
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the shard did not settle on one of the three nodes within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if copies == 3 {
        for (i, node) in nodes.iter().enumerate() {
            if !holds(i) {
                node.repair(shard)?;
            }
        }
    }
    let reading = Instant::now();
    let readers: Vec<std::thread::JoinHandle<Result<u64>>> = (0..3)
        .map(|i| {
            let dataset = Dataset::open(&StorePaths::new(&roots[i]), &VersionSpec::parse("hot")?)?;
            let node: Arc<dyn granary::ShardSource> = Arc::clone(&nodes[i]) as Arc<dyn granary::ShardSource>;
            let config = LoaderConfig {
                batch_size: 256,
                plan: PlanSource::Native(granary::Order::Sequential),
                target: Target::Host,
                tier: TierSetting::Off,
                repair: Some(node),
                metrics: granary::metrics::Setting::Off,
                ..LoaderConfig::default()
            };
            Ok(std::thread::spawn(move || -> Result<u64> {
                let mut loader = Loader::new(dataset, config, granary::Position::default())?;
                let mut records = 0u64;
                while let Some(batch) = loader.next() {
                    records += batch?.len() as u64;
                }
                Ok(records)
            }))
        })
        .collect::<Result<_>>()?;
    for reader in readers {
        let records = reader.join().map_err(|_| anyhow::anyhow!("a reader panicked"))??;
        if records != hot_bytes / RECORD_BYTES {
            bail!("a loader read {records} records of {}", hot_bytes / RECORD_BYTES);
        }
    }
    Ok(reading.elapsed())
}

/// The median of rates or ratios; NaN when there are none.
fn median_f64(values: Vec<f64>) -> f64 {
    median(&values).unwrap_or(f64::NAN)
}
