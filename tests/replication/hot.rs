//! Hot shards: a Zipf-skewed read trace over three nodes gives the most read shards
//! `hot-replicas` copies, lets them go when the reads move elsewhere, and never leaves a shard
//! below its factor.

use std::collections::BTreeMap;

use super::*;

/// Reads per shard of a Zipf trace (exponent 1.5) over `shards`, the `rank`-th of `order` the
/// `rank + 1`-th most read: 100 000 reads in all.
fn zipf(shards: &[ShardId], order: &[usize]) -> Vec<(ShardId, u64)> {
    let weights: Vec<f64> = (1..=shards.len()).map(|r| 1.0 / (r as f64).powf(1.5)).collect();
    let total: f64 = weights.iter().sum();
    order.iter().zip(&weights).map(|(&i, w)| (shards[i], (100_000.0 * w / total).round() as u64)).collect()
}

/// The shards the rendezvous replicator calls hot in `trace` (above 4 x the mean).
fn hot_of(trace: &[(ShardId, u64)]) -> BTreeSet<ShardId> {
    let mean = trace.iter().map(|&(_, n)| n as f64).sum::<f64>() / trace.len() as f64;
    trace.iter().filter(|&&(_, n)| n as f64 > 4.0 * mean).map(|&(shard, _)| shard).collect()
}

/// Verified copies of each shard on `nodes`.
fn copies(cluster: &Cluster, nodes: &[usize], shards: &[ShardId]) -> BTreeMap<ShardId, usize> {
    let held: Vec<BTreeSet<ShardId>> = nodes.iter().map(|&i| cluster.verified_shards(i)).collect();
    shards.iter().map(|s| (*s, held.iter().filter(|h| h.contains(s)).count())).collect()
}

#[test]
fn hot_shards_reach_hot_replicas_and_cool_ones_drop_back_to_the_factor() {
    // Node 3 (of weight 0: the table puts no copy on it) ingests and replicates with factor 1,
    // then leaves: nodes 0-2 hold each shard once.
    let mut cluster = Cluster::new(4);
    ingest_tokens(cluster.root(3), "tokens", 5, 32 * 16, 64 << 10);
    for i in 0..4 {
        let weight = if i == 3 { "0" } else { "1" };
        cluster.nodes[i].args =
            ["--replicator-options", "hot-replicas=3", "--heat-window-ms", "1000", "--weight", weight]
                .into_iter()
                .map(String::from)
                .collect();
        cluster.start(i);
    }
    cluster.wait("every peer up", Duration::from_secs(20), |c| (0..4).all(|i| c.peers_up(i) == 3));
    let out = cluster.cli(3, &["replicate", "tokens", "--replicas", "1", "--mode", "sync"]);
    assert!(out.status.success(), "replicate failed: {}\n{}", String::from_utf8_lossy(&out.stderr), cluster.logs());
    let shards = shards_of(cluster.root(3), "tokens");
    assert_eq!(shards.len(), 32);
    cluster.kill(3);
    let nodes = [0, 1, 2];
    cluster.wait("one copy of each shard on nodes 0-2, node 3 down", Duration::from_secs(60), |c| {
        nodes.iter().all(|&i| c.peers_up(i) == 2) && copies(c, &nodes, &shards).values().all(|&n| n == 1)
    });

    // Readers beside the three nodes report a Zipf trace, a third each, every 200 ms.
    let clients: Vec<NodeClient> =
        nodes.iter().map(|&i| NodeClient::new(cluster.nodes[i].listen, cluster.key())).collect();
    let order: Vec<usize> = (0..32).collect();
    let trace = zipf(&shards, &order);
    let hot = hot_of(&trace);
    assert!((1..=4).contains(&hot.len()), "{} hot shards", hot.len());
    let report_reads = |trace: &[(ShardId, u64)]| {
        for (i, client) in clients.iter().enumerate() {
            let part: Vec<(ShardId, u64)> =
                trace.iter().map(|&(s, n)| (s, n / 3 + u64::from(i == 0) * (n % 3))).collect();
            client.report_reads(&part).unwrap();
        }
    };
    let mut lowest = usize::MAX;
    let mut converged = |cluster: &Cluster, trace: &[(ShardId, u64)], hot: &BTreeSet<ShardId>| {
        report_reads(trace);
        let now = copies(cluster, &nodes, &shards);
        lowest = lowest.min(*now.values().min().unwrap());
        now.iter().all(|(shard, &n)| if hot.contains(shard) { n == 3 } else { n == 1 })
    };
    let started = Instant::now();
    let heated =
        cluster.wait("the hot shards to reach 3 copies", Duration::from_secs(60), |c| converged(c, &trace, &hot));
    // The status names the hot shards and their copies (as this node last heard of them).
    cluster.wait("node 0's status to show the hot copies", Duration::from_secs(20), |c| {
        let status = c.status_json(0);
        let first = &status["hot_shards"][0];
        status["hot_shards_total"].as_u64() == Some(hot.len() as u64)
            && (first["copies"].as_u64(), first["copies_wanted"].as_u64()) == (Some(3), Some(3))
    });
    let text = String::from_utf8_lossy(&cluster.cli(0, &["status"]).stdout).into_owned();
    assert!(text.contains("hot shards:"), "{text}");

    // The reads move to other shards: the old hot ones go back to one copy, the new ones get 3.
    let moved: Vec<usize> = (0..32).rev().collect();
    let trace = zipf(&shards, &moved);
    let hot_now = hot_of(&trace);
    assert!(hot_now.is_disjoint(&hot));
    let cooled =
        cluster.wait("the copies to follow the reads", Duration::from_secs(60), |c| converged(c, &trace, &hot_now));
    assert!(lowest >= 1, "a shard fell below its factor");
    let holds: u64 = nodes.iter().filter_map(|&i| cluster.stat(i, "hot", "hot_copies_here")).sum();
    assert_eq!(holds, 2 * hot_now.len() as u64, "the hot copies recorded are the new ones'");
    println!(
        "hot shards: {} hot reached 3 copies in {:.1} s; after the reads moved, {:.1} s to follow (window 1 s)",
        hot.len(),
        heated.as_secs_f64(),
        cooled.as_secs_f64()
    );
    report("hot shards over 3 nodes", cluster.lost("tokens", &nodes), started.elapsed());
}
