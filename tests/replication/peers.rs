//! Peers and membership: who may join (the cluster key, a flood of keyless connections), what
//! they may send (oversized, corrupt, replayed frames; wrong bytes for an id), how nodes find
//! each other and heal after a partition, a node's checks before it listens, and `status`.

use super::*;

#[test]
fn a_peer_without_the_cluster_key_is_refused() {
    let mut cluster = Cluster::new(2);
    cluster.start(0);
    // A client with another key: refused at the handshake, with a clear error.
    let wrong = ClusterKey::from_secret(b"not the cluster secret at all").unwrap();
    let client = NodeClient::new(cluster.nodes[0].listen, wrong);
    let error = client.status().unwrap_err().to_string();
    assert!(error.contains("cluster key"), "{error}");
    // A node with another key never becomes a peer.
    let other_key = cluster.dir.path().join("other.key");
    std::fs::write(&other_key, "another secret of enough length").unwrap();
    let peers = vec![cluster.nodes[0].listen.to_string()];
    cluster.nodes[1].args = vec![];
    let key_file = std::mem::replace(&mut cluster.key_file, other_key);
    cluster.start_with(1, &peers);
    cluster.key_file = key_file;
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(cluster.peers_up(0), 0, "{}", cluster.status(0));
    assert!(cluster.stat(0, "security", "connections-refused").unwrap() >= 2, "{}", cluster.status(0));
    report("a peer with a wrong key", 0, None);
}

#[test]
fn oversized_corrupt_and_replayed_frames_are_rejected() {
    use granary::replication::frame::{Frame, RECORD_BYTES_MAX};
    let mut cluster = Cluster::new(1);
    cluster.start(0);
    let client = NodeClient::new(cluster.nodes[0].listen, cluster.key());
    let closed = |result: granary::Result<bool>| result.unwrap();
    // An oversized length prefix: the node drops the connection without reading on.
    assert!(closed(client.with_channel(|mut channel| {
        Box::pin(async move {
            channel.send_raw_for_tests(&u32::MAX.to_le_bytes()).await.ok();
            Ok(channel.recv().await.is_err())
        })
    })));
    // A corrupt frame: a record of the right size whose bytes do not authenticate.
    assert!(closed(client.with_channel(|mut channel| {
        Box::pin(async move {
            let mut record = (100u32).to_le_bytes().to_vec();
            record.extend_from_slice(&[0x5a; 100]);
            channel.send_raw_for_tests(&record).await.ok();
            Ok(channel.recv().await.is_err())
        })
    })));
    // A replayed record: sent once (and answered), then the same bytes again. (Frame 1 of each
    // direction is the Hello; a client's incarnation is 0.)
    assert!(closed(client.with_channel(|mut channel| {
        Box::pin(async move {
            let record = channel.send_with_seq_for_tests(&Frame::StatusRequest { request: 1 }, 0, 2).await.unwrap();
            assert!(matches!(channel.recv().await, Ok(Frame::Status { .. })));
            channel.send_raw_for_tests(&record).await.ok();
            Ok(channel.recv().await.is_err())
        })
    })));
    // A well-encrypted frame that repeats a sequence number (a peer replaying its own message).
    assert!(closed(client.with_channel(|mut channel| {
        Box::pin(async move {
            channel.send_with_seq_for_tests(&Frame::StatusRequest { request: 1 }, 0, 2).await.unwrap();
            assert!(matches!(channel.recv().await, Ok(Frame::Status { .. })));
            channel.send_with_seq_for_tests(&Frame::StatusRequest { request: 2 }, 0, 2).await.unwrap();
            Ok(channel.recv().await.is_err())
        })
    })));
    // Before the handshake: a length prefix over the handshake's cap, from a plain socket.
    {
        use std::io::{Read, Write};
        let mut raw = std::net::TcpStream::connect(cluster.nodes[0].listen).unwrap();
        raw.write_all(&(RECORD_BYTES_MAX as u32 + 1).to_le_bytes()).unwrap();
        raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(raw.read(&mut buf).unwrap_or(0), 0, "the node answered a bogus handshake");
    }
    // The node is unharmed and counted each one.
    let status = cluster.status(0);
    assert!(cluster.status_json(0)["id"].is_u64(), "{status}");
    assert!(cluster.stat(0, "security", "frames-rejected").unwrap() >= 4, "{status}");
    assert!(cluster.stat(0, "security", "connections-refused").unwrap() >= 1, "{status}");
    report("oversized, corrupt and replayed frames", 0, None);
}

#[test]
fn a_peer_that_sends_wrong_bytes_for_an_id_is_demoted() {
    let mut cluster = Cluster::new(3);
    ingest_tokens(cluster.root(0), "tokens", 4, 512, 512 << 10);
    ingest_tokens(cluster.root(2), "tokens", 4, 512, 512 << 10);
    cluster.nodes[0].env = vec![("GRANARY_FAULT_CORRUPT_SENDS".into(), "1".into())];
    cluster.nodes[0].args = vec!["--replicator-options".into(), "mode=sync".into()];
    for i in 0..3 {
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..3).all(|i| c.peers_up(i) == 2));
    let started = Instant::now();
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3"]);
    assert!(out.status.success(), "replicate failed: {}\n{}", String::from_utf8_lossy(&out.stderr), cluster.logs());
    let converge = started.elapsed();
    let status = cluster.status(1);
    assert!(cluster.stat(1, "transfers", "demotions").unwrap() >= 1, "{status}");
    assert!(cluster.stat(1, "transfers", "verify-failures").unwrap() >= 1, "{status}");
    let demoted = cluster.status_json(1)["peers"].as_array().unwrap().iter().any(|p| p["demoted"] == true);
    assert!(demoted, "{status}");
    let shards = shards_of(cluster.root(0), "tokens");
    let held = cluster.verified_shards(1);
    assert!(shards.iter().all(|s| held.contains(s)), "node 1 lacks shards");
    report("a peer that sends wrong bytes", cluster.lost("tokens", &[1, 2]), converge);
}

#[test]
fn nodes_find_each_other_through_the_launchers_rendezvous() {
    let mut cluster = Cluster::new(3);
    let rendezvous = cluster.nodes[0].listen;
    for i in 0..3 {
        cluster.nodes[i].env = vec![
            ("WORLD_SIZE".into(), "6".into()),
            ("LOCAL_WORLD_SIZE".into(), "2".into()),
            ("GROUP_RANK".into(), i.to_string()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), (rendezvous.port() - 1).to_string()),
        ];
    }
    for i in 0..3 {
        cluster.start_with(i, &[]);
    }
    let converge =
        cluster.wait("every node to see the others", Duration::from_secs(30), |c| (0..3).all(|i| c.peers_up(i) == 2));
    for i in 0..3 {
        assert_eq!(cluster.status_json(i)["id"], serde_json::json!(i), "node ids are the node ranks");
    }
    report("launcher membership", 0, converge);
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Network namespaces of one test: a switch (a bridge) and one namespace per node, each joined
/// to the switch by a veth pair. Removed on drop.
struct Netns {
    prefix: String,
    n: usize,
}

impl Netns {
    /// The namespaces, or `None` where this process may not make them (not root, no iproute2).
    fn create(n: usize) -> Option<Netns> {
        // Only root may make namespaces.
        let root = Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0");
        if !root || !ip(&["-V"]) {
            return None;
        }
        let prefix = format!("gr{}", std::process::id() % 100_000);
        let netns = Netns { prefix, n };
        let p = &netns.prefix;
        let sw = format!("{p}sw");
        let ok = ip(&["netns", "add", &sw])
            && ip(&["-n", &sw, "link", "set", "lo", "up"])
            && ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])
            && ip(&["-n", &sw, "link", "set", "br0", "up"]);
        if !ok {
            return None;
        }
        for i in 0..n {
            let (ns, a, b) = (format!("{p}n{i}"), format!("{p}v{i}a"), format!("{p}v{i}b"));
            let addr = format!("{}/24", netns.ip_of(i));
            let ok = ip(&["netns", "add", &ns])
                && ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])
                && ip(&["link", "set", &a, "netns", &ns])
                && ip(&["link", "set", &b, "netns", &sw])
                && ip(&["-n", &sw, "link", "set", &b, "master", "br0"])
                && ip(&["-n", &sw, "link", "set", &b, "up"])
                && ip(&["-n", &ns, "addr", "add", &addr, "dev", &a])
                && ip(&["-n", &ns, "link", "set", &a, "up"])
                && ip(&["-n", &ns, "link", "set", "lo", "up"]);
            assert!(ok, "could not set up network namespace {ns}");
        }
        Some(netns)
    }

    /// Node `i`'s address: a private range, inside this test's own namespaces only.
    fn ip_of(&self, i: usize) -> String {
        format!("10.231.{}.{}", std::process::id() % 250, i + 1)
    }

    fn ns(&self, i: usize) -> String {
        format!("{}n{i}", self.prefix)
    }

    /// Cuts (or restores) node `i`'s link to the switch: its packets are dropped, connections hang.
    fn set_link(&self, i: usize, up: bool) {
        let (sw, b) = (format!("{}sw", self.prefix), format!("{}v{i}b", self.prefix));
        assert!(ip(&["-n", &sw, "link", "set", &b, if up { "up" } else { "down" }]));
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for i in 0..self.n {
            ip(&["netns", "del", &self.ns(i)]);
        }
        ip(&["netns", "del", &format!("{}sw", self.prefix)]);
    }
}

#[test]
fn a_partitioned_node_heals_and_converges() {
    let netns = Netns::create(3);
    if !crate::common::machine_has(netns.is_some(), "network namespaces (root and iproute2)") {
        return;
    }
    let Some(netns) = netns else { return };
    let mut cluster = Cluster::new(3);
    for i in 0..3 {
        cluster.nodes[i].listen = format!("{}:7000", netns.ip_of(i)).parse().unwrap();
        cluster.nodes[i].netns = Some(netns.ns(i));
    }
    ingest_tokens(cluster.root(0), "tokens", 7, 512, 512 << 10);
    for i in 0..3 {
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(30), |c| (0..3).all(|i| c.peers_up(i) == 2));
    // Asynchronous mode (the default): the copies are made in the background.
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v1 = shards_of(cluster.root(0), "tokens");
    cluster.wait("3 copies of version 1", Duration::from_secs(60), |c| {
        (0..3).all(|i| {
            let held = c.verified_shards(i);
            v1.iter().all(|s| held.contains(s))
        })
    });
    // Partition node 2; a new version is ingested on node 0 (beside its running node) and
    // replicated to the nodes that are reachable.
    netns.set_link(2, false);
    cluster.wait("node 2 seen down", Duration::from_secs(30), |c| c.peers_up(0) == 1 && c.peers_up(1) == 1);
    let input = cluster.dir.path().join("more.bin");
    write_records(&input, &(0..256).map(|i| bytes(99_000 + i, 4096)).collect::<Vec<_>>());
    let out = cluster.command(0).arg("--root").arg(cluster.root(0)).args(INGEST_TOKENS).arg(&input).output().unwrap();
    assert!(out.status.success(), "ingest beside a running node failed: {}", String::from_utf8_lossy(&out.stderr));
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v2 = shards_of(cluster.root(0), "tokens");
    assert!(v2.len() > v1.len());
    cluster.wait("version 2 on the reachable nodes", Duration::from_secs(60), |c| {
        (0..2).all(|i| {
            let held = c.verified_shards(i);
            v2.iter().all(|s| held.contains(s))
        })
    });
    assert!(!v2.iter().all(|s| cluster.verified_shards(2).contains(s)), "node 2 got data through a partition");
    // Heal: node 2 catches up, ref and shards, without anyone asking.
    let healed = Instant::now();
    netns.set_link(2, true);
    let converge = cluster.wait("node 2 to converge", Duration::from_secs(60), |c| {
        let held = c.verified_shards(2);
        let latest = StorePaths::new(c.root(2))
            .read_ref(&granary::DatasetName::new("tokens").unwrap())
            .map(|log| log.latest().number)
            .unwrap_or(0);
        latest == 2 && v2.iter().all(|s| held.contains(s))
    });
    assert!(healed.elapsed() >= converge);
    // The lag of those copies (asynchronous mode) is measured and reported.
    cluster.wait("node 0 to report the lag", Duration::from_secs(20), |c| {
        c.stat(0, "replication", "lag-last-ms").is_some() && c.stat(0, "replication", "under-replicated") == Some(0)
    });
    report("a partitioned node heals", cluster.lost("tokens", &[0, 1, 2]), converge);
}

/// Runs `granary serve` on a fresh store with `args` added, expecting it to refuse to start:
/// returns its one line of stderr, after checking that it exited non-zero without listening.
/// `SELF` in an argument stands for its listen address's port.
fn serve_refused(cluster: &Cluster, args: &[&str]) -> String {
    let root = cluster.dir.path().join(format!("refused-{}", free_port()));
    let port = free_port();
    let listen = SocketAddr::from(([127, 0, 0, 1], port));
    let args: Vec<String> = args.iter().map(|a| a.replace("SELF", &port.to_string())).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(&root)
        .args(["serve", "--listen", &listen.to_string(), "--cluster-key"])
        .arg(&cluster.key_file)
        .args(&args)
        .env_remove("GRANARY_ROOT")
        .env_remove("GRANARY_CLUSTER_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    // A node that listens records its address: that, not a connection to the port (which a
    // process of another test may have taken since `free_port` let it go), tells it started.
    let recorded = root.join("replication").join("listen");
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) || recorded.exists() {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("serve {args:?} started: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!out.status.success(), "serve {args:?} exited 0: {stderr}");
    assert_eq!(stderr.lines().count(), 1, "serve {args:?}: not one line: {stderr:?}");
    assert!(stderr.starts_with("granary: error: "), "{stderr:?}");
    assert!(!recorded.exists(), "serve {args:?} recorded a listen address");
    stderr.trim_end().to_owned()
}

#[test]
fn a_node_checks_its_options_plugins_and_peers_before_it_listens() {
    let cluster = Cluster::new(1);
    // The plugins' own rules, found by running them once before the node listens.
    let cases: &[(&[&str], &[&str])] = &[
        (&["--replicator-options", "mode=banana"], &["replicator", "mode=banana", "unknown mode \"banana\""]),
        (&["--replicator-options", "frobnicate=1"], &["frobnicate", "known: buckets, mode"]),
        (&["--replicator-options", "buckets=-5"], &["buckets=\"-5\" is not a valid value"]),
        (&["--replicator-options", "buckets=0"], &["buckets must be in 1..=1048576"]),
        (&["--evictor-options", "ways=4"], &["evictor", "unknown option \"ways\""]),
        (&["--cache-bytes", "1M", "--evictor", "sieve", "--evictor-options", "ways=4"], &["unknown option \"ways\""]),
        // Names that are no plugin, listing the built-ins of the kind asked for.
        (&["--evictor", "nosuch"], &["no evictor plugin \"nosuch\"", "lru, fifo, sieve, s3-fifo, plan-aware"]),
        (&["--replicator", "nosuch"], &["no replicator plugin \"nosuch\"", "(rendezvous)"]),
        (&["--evictor", "rendezvous"], &["rendezvous", "replicator"]),
    ];
    for (args, needles) in cases {
        let line = serve_refused(&cluster, args);
        for needle in *needles {
            assert!(line.contains(needle), "serve {args:?}: {line:?} lacks {needle:?}");
        }
    }
    // Itself among its peers, by address or by a name for it.
    for peers in ["127.0.0.2:9,127.0.0.1:SELF", "localhost:SELF"] {
        let line = serve_refused(&cluster, &["--peers", peers]);
        assert!(line.contains("names this node itself"), "{line}");
    }
}

#[test]
fn a_flood_of_keyless_connections_does_not_starve_the_clusters_own_clients() {
    use std::net::Ipv4Addr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let mut cluster = Cluster::new(2);
    ingest_tokens(cluster.root(0), "tokens", 9, 256, 256 << 10);
    for i in 0..2 {
        cluster.nodes[i].args =
            vec!["--replicator-options".into(), "mode=sync".into(), "--node-id".into(), i.to_string()];
        cluster.start(i);
    }
    cluster.wait("peers up", Duration::from_secs(20), |c| c.peers_up(0) == 1 && c.peers_up(1) == 1);
    // About 800 connections a second to node 0 from 200 other local addresses, each sending
    // nothing and held open for 2 s (what a node without the key, or a port scanner, does).
    let target = cluster.nodes[0].listen;
    let stop = Arc::new(AtomicBool::new(false));
    let (opened, told_busy) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let flood = {
        let (stop, opened, told_busy) = (Arc::clone(&stop), Arc::clone(&opened), Arc::clone(&told_busy));
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
            runtime.block_on(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                let mut n = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    for _ in 0..8 {
                        n += 1;
                        let source = Ipv4Addr::new(127, 0, 0, 2 + (n % 200) as u8);
                        let (opened, told_busy) = (Arc::clone(&opened), Arc::clone(&told_busy));
                        tokio::spawn(async move {
                            use tokio::io::AsyncReadExt;
                            let socket = tokio::net::TcpSocket::new_v4().unwrap();
                            socket.bind(SocketAddr::new(source.into(), 0)).unwrap();
                            let Ok(mut stream) = socket.connect(target).await else { return };
                            opened.fetch_add(1, Ordering::Relaxed);
                            let mut answer = Vec::new();
                            let read = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut answer));
                            if read.await.is_ok_and(|r| r.is_ok()) && answer == [0, 0, 0, 0] {
                                told_busy.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                    }
                }
            });
        })
    };
    std::thread::sleep(Duration::from_secs(2));
    // Meanwhile the cluster's own clients get through, every time: status, and a replicate
    // (which also opens connections between the nodes).
    let started = Instant::now();
    let mut n_status = 0;
    while started.elapsed() < Duration::from_secs(6) {
        let out = cluster.cli(0, &["status"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "status failed during the flood (after {n_status}): {stderr}");
        n_status += 1;
    }
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "2"]);
    assert!(out.status.success(), "replicate failed during the flood: {}", String::from_utf8_lossy(&out.stderr));
    let flooded_for = started.elapsed() + Duration::from_secs(2);
    let status = cluster.status(0);
    stop.store(true, Ordering::Relaxed);
    flood.join().unwrap();
    let opened = opened.load(Ordering::Relaxed);
    let rate = opened as f64 / flooded_for.as_secs_f64();
    println!("{opened} keyless connections ({rate:.0}/s); {n_status} status calls, all answered");
    assert!(rate > 400.0, "the flood was only {rate:.0} connections/s");
    // The flood was felt, and refused connections were told the node is busy (an empty record),
    // not left to guess a wrong key.
    assert!(cluster.stat(0, "security", "connections-busy").unwrap() > 100, "{status}");
    assert!(told_busy.load(Ordering::Relaxed) > 100, "{} connections told busy", told_busy.load(Ordering::Relaxed));
    assert_eq!(cluster.peers_up(0), 1, "{}", cluster.status(0));
    report("a flood of keyless connections", cluster.lost("tokens", &[0, 1]), None);
}

#[test]
fn status_is_a_readable_report_by_default_and_json_with_stable_keys_for_scripts() {
    let mut cluster = Cluster::new(3);
    ingest_tokens(cluster.root(0), "tokens", 10, 256, 256 << 10);
    for i in 0..3 {
        cluster.nodes[i].args =
            vec!["--replicator-options".into(), "mode=sync".into(), "--node-id".into(), i.to_string()];
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..3).all(|i| c.peers_up(i) == 2));
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    cluster.kill(2);
    cluster.wait("node 2 seen down", Duration::from_secs(20), |c| c.peers_up(0) == 1);
    // For people: sentences and aligned lines, no raw key-value dump.
    let out = cluster.cli(0, &["status"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    println!("{text}");
    let listen = |i: usize| cluster.nodes[i].listen.to_string();
    assert!(text.starts_with("node 0 (incarnation "), "{text}");
    assert!(text.contains(&format!("on {}, serving {}", listen(0), cluster.root(0).display())), "{text}");
    assert!(text.contains("peers: 1 of 2 up"), "{text}");
    let line = |needle: &str| text.lines().find(|l| l.contains(needle)).unwrap_or_default().to_owned();
    assert!(line(&listen(1)).contains("node 1") && line(&listen(1)).contains(" up for "), "{text}");
    assert!(line(&listen(2)).contains("node 2") && line(&listen(2)).contains(" DOWN for "), "{text}");
    assert!(line(&listen(2)).contains("last error: "), "{text}");
    assert!(text.contains("tokens at 2 copies of each shard"), "{text}");
    assert!(text.contains("transfers: ") && text.contains("security: "), "{text}");
    for raw in ["for-ms", "uptime-ms", "lag-max-ms", "connections-refused", "demoted no"] {
        assert!(!text.contains(raw), "the report still shows the raw key {raw:?}:\n{text}");
    }
    // For scripts: JSON, one object, with these keys and types (a script may rely on them).
    let out = cluster.cli(0, &["status", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status --json is JSON");
    let object = json.as_object().expect("an object");
    for key in [
        "id",
        "incarnation",
        "uptime_ms",
        "objects",
        "under_replicated",
        "unavailable",
        "lag_oldest_ms",
        "lag_max_ms",
        "pending_fetches",
        "copies_made",
        "copies_failed",
        "objects_received",
        "bytes_sent",
        "verify_failures",
        "demotions",
        "connections_refused",
        "connections_busy",
        "frames_rejected",
        "repairs",
        "cache_bytes",
        "cache_bytes_max",
        "cache_objects",
        "evicted",
        "kept_last_copy",
    ] {
        assert!(object.get(key).is_some_and(serde_json::Value::is_u64), "{key} is not a number in {json:#}");
    }
    assert_eq!(json["id"], 0);
    assert_eq!(json["listen"], listen(0));
    assert_eq!(json["root"], cluster.root(0).to_str().unwrap());
    assert_eq!(json["goals"], serde_json::json!([{"dataset": "tokens", "replicas": 2}]));
    assert!(json["events"].as_array().is_some_and(|e| e.iter().all(serde_json::Value::is_string)), "{json:#}");
    let peers = json["peers"].as_array().expect("peers");
    assert_eq!(peers.len(), 2, "{json:#}");
    for peer in peers {
        for (key, is) in [
            ("id", serde_json::Value::is_u64 as fn(&serde_json::Value) -> bool),
            ("addr", serde_json::Value::is_string),
            ("up", serde_json::Value::is_boolean),
            ("for_ms", serde_json::Value::is_u64),
            ("objects", serde_json::Value::is_u64),
            ("demoted", serde_json::Value::is_boolean),
            ("last_error", serde_json::Value::is_string),
        ] {
            assert!(peer.get(key).is_some_and(is), "peer key {key} in {peer:#}");
        }
    }
    let by_id = |id: u64| peers.iter().find(|p| p["id"] == id).expect("the peer").clone();
    assert_eq!((by_id(1)["up"].clone(), by_id(1)["addr"].clone()), (true.into(), listen(1).into()));
    assert_eq!(by_id(2)["up"], false);
    report("status for people and for scripts", 0, None);
}
