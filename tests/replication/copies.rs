//! Copies: a replication factor reached and restored, transfers that fail midway, damaged shards
//! repaired on read, the read cache.

use super::*;

#[test]
fn a_dataset_ingested_on_one_node_reaches_its_replication_factor_verified() {
    // Four nodes start; a fifth (already in their peer lists) joins at the end.
    let mut cluster = Cluster::new(5);
    let records = ingest_tokens(cluster.root(0), "tokens", 1, 1024, 512 << 10);
    // Synchronous mode: `replicate` returns only once every copy is verified on its node.
    for i in 0..4 {
        cluster.nodes[i].args = vec!["--replicator-options".into(), "mode=sync".into()];
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..4).all(|i| c.peers_up(i) == 3));
    let started = Instant::now();
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3"]);
    assert!(out.status.success(), "replicate failed: {}\n{}", String::from_utf8_lossy(&out.stderr), cluster.logs());
    let converge = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("synchronous"), "{stdout}");
    // No waiting: synchronous mode means the copies are there, verified, now.
    let shards = shards_of(cluster.root(0), "tokens");
    assert!(shards.len() >= 8, "{} shards", shards.len());
    let holdings: Vec<BTreeSet<ShardId>> = (0..4).map(|i| cluster.verified_shards(i)).collect();
    for shard in &shards {
        let copies = holdings.iter().filter(|h| h.contains(shard)).count();
        assert!(copies >= 3, "shard {shard} has {copies} verified copies");
    }
    // Every node knows the dataset (ref and manifest came along) and reads what it holds.
    for i in 1..4 {
        let dataset = Dataset::open(&StorePaths::new(cluster.root(i)), &VersionSpec::parse("tokens").unwrap()).unwrap();
        assert_eq!(dataset.n_records(), records.len() as u64);
    }
    report("ingest on one node reaches 3 copies on 4 nodes", cluster.lost("tokens", &[0, 1, 2, 3]), converge);

    // An ingest beside the running node, with --replicas: the command acknowledges once the
    // copies of the new version are verified on their nodes.
    let input = cluster.dir.path().join("more.bin");
    write_records(&input, &(0..512).map(|i| bytes(77_000 + i, 4096)).collect::<Vec<_>>());
    let out = cluster.cli(0, &[INGEST_TOKENS, &["--replicas", "3", input.to_str().unwrap()]].concat());
    assert!(
        out.status.success(),
        "ingest --replicas failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        cluster.logs()
    );
    let v2 = shards_of(cluster.root(0), "tokens");
    let holdings: Vec<BTreeSet<ShardId>> = (0..4).map(|i| cluster.verified_shards(i)).collect();
    for shard in &v2 {
        let copies = holdings.iter().filter(|h| h.contains(shard)).count();
        assert!(copies >= 3, "version 2: shard {shard} has {copies} verified copies right after the ingest");
    }

    // A node joins: the replicator's repair plan gives it its share, and no shard drops below 3.
    let joined = Instant::now();
    cluster.start(4);
    let converge = cluster.wait("the new node to get its share", Duration::from_secs(60), |c| {
        let held: Vec<BTreeSet<ShardId>> = (0..5).map(|i| c.verified_shards(i)).collect();
        !held[4].is_empty()
            && v2.iter().all(|s| held.iter().filter(|h| h.contains(s)).count() >= 3)
            && c.stat(0, "replication", "under-replicated") == Some(0)
    });
    assert!(joined.elapsed() >= converge);
    report("a node joins", cluster.lost("tokens", &[0, 1, 2, 3, 4]), converge);
}

#[test]
fn replicate_waits_for_the_copies_when_asked_to_for_one_call() {
    // Nodes in asynchronous mode (the replicator's setting): `replicate --mode sync` waits for
    // every copy this once; `--mode async` on another dataset returns once they are scheduled.
    let mut cluster = Cluster::new(3);
    ingest_tokens(cluster.root(0), "tokens", 3, 512, 256 << 10);
    ingest_tokens(cluster.root(0), "later", 4, 256, 256 << 10);
    for i in 0..3 {
        cluster.nodes[i].args = vec!["--replicator-options".into(), "mode=async".into()];
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..3).all(|i| c.peers_up(i) == 2));
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3", "--mode", "sync"]);
    assert!(out.status.success(), "replicate failed: {}\n{}", String::from_utf8_lossy(&out.stderr), cluster.logs());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("synchronous"), "{stdout}");
    let shards = shards_of(cluster.root(0), "tokens");
    for i in 1..3 {
        let held = cluster.verified_shards(i);
        assert!(shards.iter().all(|s| held.contains(s)), "node {i} lacks copies right after a synchronous call");
    }
    let out = cluster.cli(0, &["replicate", "later", "--replicas", "3", "--mode", "async"]);
    assert!(out.status.success(), "replicate failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("asynchronous"));
    let later = shards_of(cluster.root(0), "later");
    cluster.wait("the scheduled copies", Duration::from_secs(30), |c| {
        (1..3).all(|i| {
            let held = c.verified_shards(i);
            later.iter().all(|s| held.contains(s))
        })
    });
    let out = cluster.cli(0, &["replicate", "later", "--replicas", "3", "--mode", "sometimes"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("sometimes"));
}

#[test]
fn more_replicas_than_nodes_is_refused_and_never_reported_as_confirmed() {
    let mut cluster = Cluster::new(3);
    ingest_tokens(cluster.root(0), "tokens", 3, 256, 512 << 10);
    for i in 0..3 {
        cluster.nodes[i].args = vec!["--replicator-options".into(), "mode=sync".into()];
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..3).all(|i| c.peers_up(i) == 2));
    // Five copies on three nodes can never exist: refused up front, naming what there is, and
    // no goal is left behind for the reconciler to chase.
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "5"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "replicate --replicas 5 on 3 nodes succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("confirmed"), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(
        stderr.contains("5 copies") && stderr.contains("3 nodes") && stderr.contains("3 failure domains"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert_eq!(cluster.status_json(0)["goals"], serde_json::json!([]), "{}", cluster.status(0));
    // The same through ingest --replicas: refused before the copies, after the commit.
    let input = cluster.dir.path().join("more.bin");
    write_records(&input, &(0..16).map(|i| bytes(31_000 + i, 4096)).collect::<Vec<_>>());
    let out = cluster.cli(0, &[INGEST_TOKENS, &["--replicas", "4", input.to_str().unwrap()]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("4 copies") && stderr.contains("3 nodes"), "{stderr}");
    // Three copies while one of the three nodes is down: a goal the job can meet later, but a
    // synchronous replicate cannot confirm it now. It says how many copies exist and fails.
    cluster.kill(2);
    cluster.wait("node 2 seen down", Duration::from_secs(20), |c| c.peers_up(0) == 1);
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "3"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "replicate --replicas 3 with 2 nodes up succeeded: {stdout}");
    assert!(!stdout.contains("confirmed"), "{stdout}");
    assert!(stderr.contains("fewer than 3 copies (as few as 2) with 2 nodes up"), "{stderr}");
    report("more replicas than nodes", cluster.lost("tokens", &[0, 1]), None);
}

#[test]
fn a_node_killed_mid_transfer_leaves_no_partial_shard_and_another_peer_finishes() {
    let mut cluster = Cluster::new(3);
    // Nodes 0 and 2 hold the same dataset (content-addressed: the same shards); node 1 none.
    ingest_tokens(cluster.root(0), "tokens", 2, 2048, 4 << 20);
    ingest_tokens(cluster.root(2), "tokens", 2, 2048, 4 << 20);
    // Node 0 sends slowly, so that it dies in the middle of a transfer: 4 s after each MiB
    // keeps a 4 MiB shard's partial file in node 1's incoming/ for about 16 s, while node 2
    // starts and is seen, on a loaded machine too (0.4 s per MiB was not always enough), and
    // stays below the receiver's 10 s deadline for the next record, so node 1 waits for node 0
    // rather than giving up on it before the kill.
    cluster.nodes[0].env = vec![("GRANARY_FAULT_SEND_DELAY_MS".into(), "4000".into())];
    cluster.nodes[0].args = vec!["--replicator-options".into(), "mode=sync".into()];
    // Node 2 starts once the transfers from node 0 are under way, so node 0 is the only source
    // node 1 is first told of.
    cluster.start(0);
    cluster.start_with(1, &[cluster.nodes[0].listen.to_string()]);
    cluster.wait("nodes 0 and 1 up", Duration::from_secs(20), |c| c.peers_up(0) == 1 && c.peers_up(1) == 1);
    let mut replicate = cluster
        .command(0)
        .arg("--root")
        .arg(cluster.root(0))
        .args(["replicate", "tokens", "--replicas", "3", "--cluster-key"])
        .arg(&cluster.key_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Node 1 pulls from node 0: partial shard files appear in incoming/ (the manifest's, which
    // comes first and is one short piece, does not count: it is done after one delay).
    let incoming = cluster.root(1).join("incoming");
    let partial = |_: &Cluster| {
        std::fs::read_dir(&incoming).unwrap().flatten().any(|e| {
            e.file_name().to_string_lossy().ends_with(".shard.part") && e.metadata().is_ok_and(|m| m.len() > 0)
        })
    };
    cluster.wait("a transfer to node 1 under way", Duration::from_secs(30), partial);
    cluster.start(2);
    cluster.wait("node 1 to see node 2", Duration::from_secs(20), |c| c.peers_up(1) == 2);
    assert!(partial(&cluster), "the transfers ended before node 0 could be killed\n{}", cluster.logs());
    // Nothing partial is visible meanwhile.
    cluster.verified_shards(1);
    cluster.kill(0);
    let _ = replicate.kill();
    let _ = replicate.wait();
    let shards = shards_of(cluster.root(2), "tokens");
    let converge = cluster.wait("node 1 to hold every shard", Duration::from_secs(60), |c| {
        let held = c.verified_shards(1);
        shards.iter().all(|s| held.contains(s))
    });
    let leftovers: Vec<_> = std::fs::read_dir(&incoming).unwrap().flatten().map(|e| e.path()).collect();
    assert!(leftovers.is_empty(), "partial files left in incoming/: {leftovers:?}");
    // Node 1 kept what node 0 had sent and resumed from node 2 where node 0 stopped.
    let log = std::fs::read_to_string(&cluster.nodes[1].log).unwrap();
    assert!(log.contains("resuming the transfer"), "no resumed transfer:\n{log}");
    report("a node killed mid-transfer; another peer finishes", cluster.lost("tokens", &[1, 2]), converge);
}

#[test]
fn a_damaged_local_shard_is_repaired_on_read_without_changing_the_order() {
    let mut cluster = Cluster::new(2);
    let records = ingest_tokens(cluster.root(0), "tokens", 3, 256, 256 << 10);
    for i in 0..2 {
        cluster.nodes[i].args = vec!["--replicator-options".into(), "mode=sync".into()];
        cluster.start(i);
    }
    cluster.wait("peers up", Duration::from_secs(20), |c| c.peers_up(0) == 1 && c.peers_up(1) == 1);
    let out = cluster.cli(0, &["replicate", "tokens", "--replicas", "2"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Flip one bit in a data block of one of node 1's shards.
    let paths = StorePaths::new(cluster.root(1));
    let dataset = Dataset::open(&paths, &VersionSpec::parse("tokens").unwrap()).unwrap();
    let victim = dataset.shard_path(1);
    let mut file = std::fs::read(&victim).unwrap();
    file[4096 + 1234] ^= 0x10;
    std::fs::write(&victim, &file).unwrap();
    // A reader on node 1 with the node as its repair hook reads everything, in a shuffled order.
    let started = Instant::now();
    let mut reader = Reader::new(Arc::clone(&dataset), IoConfig::default().build().unwrap());
    reader.set_repair(Arc::new(NodeClient::for_store(cluster.root(1), cluster.key()).unwrap()));
    let plan = granary::EpochPlan::new(records.len() as u64, 9, 0, granary::Order::Shuffled);
    let order: Vec<u64> = (0..records.len() as u64).map(|p| plan.record_at(p)).collect();
    let batches: Vec<Vec<u64>> = order.chunks(32).map(<[u64]>::to_vec).collect();
    let mut seen = Vec::new();
    reader
        .read_batches(batches.iter(), 2, &mut |batch| {
            for (i, &index) in batch.indices().iter().enumerate() {
                assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
                seen.push(index);
            }
            Ok(())
        })
        .unwrap();
    let converge = started.elapsed();
    assert_eq!(seen, order, "the sample order changed");
    // The damaged file is in quarantine; a verified copy is in its place.
    let quarantined = std::fs::read_dir(cluster.root(1).join("quarantine")).unwrap().count();
    assert_eq!(quarantined, 1);
    verify_shard(&victim, dataset.shard_id(1)).unwrap();
    assert!(cluster.stat(1, "transfers", "repairs").unwrap() >= 1);
    // The command line does the same: damage another shard and `get` a record from it.
    let victim = dataset.shard_path(2);
    let mut file = std::fs::read(&victim).unwrap();
    file[4096] ^= 0x01;
    std::fs::write(&victim, &file).unwrap();
    let index = (0..records.len() as u64).find(|&i| dataset.locate(i).unwrap().0 == 2).unwrap();
    let out = cluster.cli(1, &["get", "tokens", &index.to_string()]);
    assert!(out.status.success(), "get failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.stdout, records[index as usize]);
    report("a damaged shard repaired on read", cluster.lost("tokens", &[0, 1]), converge);
}

#[test]
fn the_read_cache_evicts_by_plugin_but_keeps_the_last_known_copy() {
    let mut cluster = Cluster::new(3);
    ingest_tokens(cluster.root(0), "tokens", 5, 512, 256 << 10);
    ingest_tokens(cluster.root(2), "other", 6, 256, 256 << 10);
    // Node 1 knows both datasets (their refs and manifests) but holds no shard.
    for (from, name) in [(0, "tokens"), (2, "other")] {
        let src = StorePaths::new(cluster.root(from));
        let dst = cluster.root(1).to_owned();
        let log = src.read_ref(&granary::DatasetName::new(name).unwrap()).unwrap();
        for version in log.versions() {
            let target = StorePaths::new(&dst).manifest(version.manifest);
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::copy(src.manifest(version.manifest), target).unwrap();
        }
        std::fs::create_dir_all(dst.join("refs")).unwrap();
        std::fs::write(dst.join("refs").join(name), log.encode()).unwrap();
    }
    let tokens = Dataset::open(&StorePaths::new(cluster.root(0)), &VersionSpec::parse("tokens").unwrap()).unwrap();
    let shard_bytes = std::fs::metadata(tokens.shard_path(0)).unwrap().len();
    cluster.nodes[1].args =
        vec!["--cache-bytes".into(), (3 * shard_bytes).to_string(), "--evictor".into(), "lru".into()];
    for i in 0..3 {
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..3).all(|i| c.peers_up(i) == 2));
    let started = Instant::now();
    // Reads one record of every shard of `name` on node 1, which fetches what it lacks.
    let read_all = |cluster: &Cluster, name: &str| {
        let dataset = Dataset::open(&StorePaths::new(cluster.root(1)), &VersionSpec::parse(name).unwrap()).unwrap();
        let mut reader = Reader::new(Arc::clone(&dataset), IoConfig::default().build().unwrap());
        reader.set_repair(Arc::new(NodeClient::for_store(cluster.root(1), cluster.key()).unwrap()));
        for shard in 0..dataset.n_shards() {
            let index = (0..dataset.n_records()).find(|&i| dataset.locate(i).unwrap().0 == shard).unwrap();
            reader.get(index).unwrap();
        }
        dataset.n_shards()
    };
    // Reading every shard of `tokens` on node 1 fetches each from node 0 into the cache, which
    // holds three: the others are evicted (node 0 still has them).
    let n = read_all(&cluster, "tokens");
    assert!(n >= 6, "{n} shards");
    assert!(cluster.verified_shards(1).len() <= 3, "the cache outgrew its bound: {}", cluster.status(1));
    assert!(cluster.stat(1, "cache", "evicted").unwrap() >= (n - 3) as u64);
    // With node 0 gone, its shards in node 1's cache are the last copies up: reading `other`
    // (from node 2) makes them victims, and they are kept.
    cluster.kill(0);
    cluster.wait("node 0 down", Duration::from_secs(10), |c| c.peers_up(1) == 1);
    let kept_before = cluster.verified_shards(1).len();
    read_all(&cluster, "other");
    assert!(cluster.stat(1, "cache", "kept-last-copy").unwrap() >= 1, "{}", cluster.status(1));
    let tokens_shards: BTreeSet<ShardId> = shards_of(cluster.root(0), "tokens").into_iter().collect();
    let still: usize = cluster.verified_shards(1).intersection(&tokens_shards).count();
    assert_eq!(still, kept_before, "a last copy was deleted");
    // The cache entries outlive a restart: node 1, restarted with room for one shard, evicts
    // the entries of its earlier life that no longer fit (every one has a copy elsewhere).
    let cached_file = cluster.root(1).join("replication").join("cached");
    let cached: BTreeSet<ShardId> = std::fs::read_to_string(&cached_file)
        .unwrap()
        .lines()
        .map(|line| ShardId(granary::ObjectId::parse_hex(line).unwrap()))
        .collect();
    assert!(cached.len() >= 2, "{} cache entries recorded", cached.len());
    assert!(cached.is_subset(&cluster.verified_shards(1)));
    cluster.kill(1);
    cluster.start(0);
    cluster.nodes[1].args = vec!["--cache-bytes".into(), shard_bytes.to_string(), "--evictor".into(), "lru".into()];
    cluster.start(1);
    cluster.wait("the old cache entries evicted", Duration::from_secs(30), |c| {
        c.verified_shards(1).intersection(&cached).count() <= 1
    });
    assert_eq!(cluster.verified_shards(1).intersection(&tokens_shards).count(), kept_before, "a kept copy went");
    report("cache eviction keeps the last copy", 0, started.elapsed());
}

/// Sends `signal` (`STOP`, `CONT`) to node `i`'s process.
fn signal(cluster: &Cluster, i: usize, signal: &str) {
    let pid = cluster.nodes[i].child.as_ref().expect("node running").id();
    let ok = Command::new("kill").args([&format!("-{signal}"), &pid.to_string()]).status().unwrap().success();
    assert!(ok, "kill -{signal} {pid}");
}

#[test]
fn replicate_fails_naming_the_peer_as_soon_as_a_peer_stops_mid_transfer() {
    let mut cluster = Cluster::new(2);
    ingest_tokens(cluster.root(0), "tokens", 8, 1024, 4 << 20);
    // Node 0 sends slowly (2 s per MiB), so node 1 is still pulling a 4 MiB shard when it stops.
    cluster.nodes[0].env = vec![("GRANARY_FAULT_SEND_DELAY_MS".into(), "2000".into())];
    for i in 0..2 {
        cluster.nodes[i].args =
            vec!["--replicator-options".into(), "mode=sync".into(), "--node-id".into(), i.to_string()];
        cluster.start(i);
    }
    cluster.wait("peers up", Duration::from_secs(20), |c| c.peers_up(0) == 1 && c.peers_up(1) == 1);
    let mut replicate = cluster
        .command(0)
        .arg("--root")
        .arg(cluster.root(0))
        .args(["replicate", "tokens", "--replicas", "2", "--cluster-key"])
        .arg(&cluster.key_file)
        .env_remove("GRANARY_CLUSTER_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let incoming = cluster.root(1).join("incoming");
    cluster.wait("a transfer to node 1 under way", Duration::from_secs(30), |_| {
        std::fs::read_dir(&incoming).is_ok_and(|dir| {
            dir.flatten().any(|e| {
                e.file_name().to_string_lossy().ends_with(".shard.part") && e.metadata().is_ok_and(|m| m.len() > 0)
            })
        })
    });
    // Node 1 stops (SIGSTOP: its sockets stay open, nothing answers). Node 0's heartbeat finds
    // it down within seconds; replicate must end then, not when its transfer's deadline passes
    // (more than two minutes).
    signal(&cluster, 1, "STOP");
    let stopped = Instant::now();
    while replicate.try_wait().unwrap().is_none() {
        if stopped.elapsed() > Duration::from_secs(60) {
            let _ = replicate.kill();
            signal(&cluster, 1, "CONT");
            panic!("replicate still silent {} s after node 1 stopped:\n{}", 60, cluster.logs());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let took = stopped.elapsed();
    let out = replicate.wait_with_output().unwrap();
    signal(&cluster, 1, "CONT");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "replicate succeeded with a stopped peer: {}", String::from_utf8_lossy(&out.stdout));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("node 1") && stderr.contains("is down"), "the peer is not named: {stderr}");
    assert!(took < Duration::from_secs(15), "replicate ended {took:?} after node 1 stopped: {stderr}");
    println!("replicate ended {:.1} s after its peer stopped: {}", took.as_secs_f64(), stderr.trim_end());
    report("a peer stops mid-transfer", 0, took);
}
