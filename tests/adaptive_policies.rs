//! Policies from measurements (`granary:policy@0.2.0`): a partitioner that rebalances rank
//! weights at deterministic steps without changing the global order, bounded per point; a
//! replicator that gives hot shards more copies; and plugins built against `@0.1.0` (the
//! previous release's built-ins, kept as fixtures) that keep working as they did.
#![cfg(feature = "policy")]

use std::path::PathBuf;

use granary::policy::builtin::built_plugin_path;
use granary::policy::{
    EpochSpec, Limits, NodeInfo, NodeSpace, Partitioner, PolicyHost, RankInfo, RankMeasure, RebalancePoint,
    ReplicationMode, Replicator, ShardHeat, WitVersion, sim,
};

fn host() -> PolicyHost {
    PolicyHost::new(Limits { backoff_base: std::time::Duration::from_millis(1), ..Limits::default() }, None).unwrap()
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/plugins-0.1.0").join(format!("{name}.wasm"))
}

fn options(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

fn ranks(weights: &[u32]) -> Vec<RankInfo> {
    weights.iter().enumerate().map(|(id, &weight)| RankInfo { id: id as u32, node: 0, weight, up: true }).collect()
}

fn nodes(n: u32) -> Vec<NodeInfo> {
    (0..n).map(|id| NodeInfo { id, weight: 1, failure_domain: id, up: true }).collect()
}

#[test]
fn plugins_built_against_0_1_0_keep_working_as_they_did() {
    let host = host();
    let old_elastic = host.load_file(&fixture("partitioner_elastic")).unwrap();
    let old_lru = host.load_file(&fixture("evictor_lru")).unwrap();
    let old_rendezvous = host.load_file(&fixture("replicator_rendezvous")).unwrap();
    for plugin in [&old_elastic, &old_lru, &old_rendezvous] {
        assert_eq!(plugin.wit_version(), WitVersion::V0_1, "{plugin:?}");
    }
    assert_eq!(host.load("elastic").unwrap().wit_version(), WitVersion::V0_2);

    // The same plans as the current elastic with equal weights, and no rebalance.
    let shards = sim::synthetic_shards(13, 97).unwrap();
    let spec = EpochSpec { seed: 5, epoch: 1, batch_size: 16, start: 48 };
    let mut old = Partitioner::new(old_elastic, &[], None).unwrap();
    let mut new = Partitioner::new(host.load("elastic").unwrap(), &[], None).unwrap();
    assert_eq!(
        old.plan(&shards, &ranks(&[1, 1, 1]), &nodes(1), spec).unwrap(),
        new.plan(&shards, &ranks(&[1, 1, 1]), &nodes(1), spec).unwrap()
    );
    assert!(!old.can_rebalance() && new.can_rebalance());
    let point = RebalancePoint {
        step: 10,
        weights: vec![(0, 1), (1, 1)],
        measured: vec![
            RankMeasure { rank: 0, records: 10, busy_nanos: 10 },
            RankMeasure { rank: 1, records: 10, busy_nanos: 10 },
        ],
    };
    let mut old_alone = Partitioner::new(host.load_file(&fixture("partitioner_elastic")).unwrap(), &[], None).unwrap();
    let refused = old_alone.rebalance(&point).unwrap_err().to_string();
    assert!(refused.contains("0.1.0"), "{refused}");

    // The same evictions as the current LRU.
    let keys: Vec<u64> = (0..400u64).map(|i| (i * 7919) % 61).collect();
    let mut outcomes = Vec::new();
    for plugin in [host.load_file(&fixture("evictor_lru")).unwrap(), host.load("lru").unwrap()] {
        let mut evictor = granary::policy::Evictor::new(plugin, &[], None, 16).unwrap();
        let outcome = evictor.access(&keys, &vec![1; keys.len()], &vec![u64::MAX; keys.len()]).unwrap();
        evictor.snapshot_now().unwrap();
        outcomes.push((outcome, evictor.evict(4).unwrap()));
    }
    assert_eq!(outcomes[0], outcomes[1]);

    // The same placement as the current rendezvous, and no per-shard goals.
    let mut old = Replicator::new(old_rendezvous, &[], None).unwrap();
    let mut new = Replicator::new(host.load("rendezvous").unwrap(), &[], None).unwrap();
    assert_eq!(old.place(&nodes(5), 2).unwrap(), new.place(&nodes(5), 2).unwrap());
    let heat = vec![ShardHeat { key: 1, bytes: 10, reads: 1000, holders: vec![0, 1], previous: Vec::new() }];
    assert!(old.adapt(&nodes(5), &[], 2, &heat).unwrap().is_empty());
}

#[test]
fn a_straggler_is_rebalanced_to_near_the_ideal_and_every_record_is_read_once() {
    let host = host();
    let elastic = host.load("elastic").unwrap();
    let shards = sim::synthetic_shards(100, 1000).unwrap();
    let straggler = Some(sim::Straggler { rank: 3, factor: 3.0, from_step: 100 });
    let config =
        sim::RebalanceSim { ranks: 4, batch: 32, every: 25, straggler, resume_at: Some(333), resume_ranks: Some(3) };
    let outcome = sim::rebalance(&elastic, &[], &shards, &config).unwrap();
    let (rebalanced, fixed) = (&outcome.rebalanced, &outcome.fixed);
    assert!(rebalanced.exactly_once && fixed.exactly_once);
    assert!(rebalanced.vs_ideal() < 1.10, "rebalanced: {:.3} x the ideal", rebalanced.vs_ideal());
    // Without rebalancing every step waits for the slow rank: 3 x its share, against the ideal's
    // share of (3 + 1/3) ranks' speed: 2.5 x once slowed.
    assert!(fixed.vs_ideal() > 2.2, "fixed: {:.3} x the ideal", fixed.vs_ideal());
    assert_eq!(outcome.resumed_same_order, Some(true));
    // The slow rank ends with about a third of the others' share; no rank is starved.
    let w = &rebalanced.last_weights;
    let ratio = f64::from(w[3]) / f64::from(w[0]);
    assert!((0.25..0.45).contains(&ratio), "weights {w:?}");
    assert!(rebalanced.records_per_rank.iter().all(|&n| n > 0));
    // Resuming at other steps and on other world sizes reads the same global order.
    for (step, ranks) in [(0, 4), (1, 2), (100, 5), (101, 4), (780, 1)] {
        let config = sim::RebalanceSim { resume_at: Some(step), resume_ranks: Some(ranks), ..config.clone() };
        let outcome = sim::rebalance(&elastic, &[], &shards, &config).unwrap();
        assert_eq!(outcome.resumed_same_order, Some(true), "resumed at step {step} on {ranks} ranks");
    }
}

#[test]
fn a_rebalance_moves_each_share_by_at_most_the_bound_and_bad_answers_are_refused() {
    let host = host();
    for max_change in ["2", "1.5", "4"] {
        let mut elastic =
            Partitioner::new(host.load("elastic").unwrap(), &options(&[("max-change", max_change)]), None).unwrap();
        // Rank 1 measured a thousand times slower: its share falls by the bound, no further.
        let point = RebalancePoint {
            step: 50,
            weights: vec![(0, 100), (1, 100), (2, 100)],
            measured: vec![
                RankMeasure { rank: 0, records: 1000, busy_nanos: 1_000_000 },
                RankMeasure { rank: 1, records: 1000, busy_nanos: 1_000_000_000 },
                RankMeasure { rank: 2, records: 1000, busy_nanos: 1_000_000 },
            ],
        };
        let weights = elastic.rebalance(&point).unwrap();
        let total: u32 = weights.iter().map(|&(_, w)| w).sum();
        let share = f64::from(weights[1].1) / f64::from(total);
        let bound: f64 = max_change.parse().unwrap();
        let before = 1.0 / 3.0;
        assert!(share >= before / bound * 0.999, "max-change {max_change}: share {share}");
        assert!(share < before, "max-change {max_change}: the slow rank's share falls");
        // The same inputs give the same weights (every rank computes them alike).
        assert_eq!(elastic.rebalance(&point).unwrap(), weights);
        // The next plan splits each step by them, in the same global order.
        let shards = sim::synthetic_shards(4, 100).unwrap();
        let spec = EpochSpec { seed: 1, epoch: 0, batch_size: 10, start: 0 };
        let plain = elastic.plan(&shards, &ranks(&[1, 1, 1]), &nodes(1), spec).unwrap();
        let weighted_ranks: Vec<RankInfo> =
            weights.iter().map(|&(id, weight)| RankInfo { id, node: 0, weight, up: true }).collect();
        let weighted = elastic.plan(&shards, &weighted_ranks, &nodes(1), spec).unwrap();
        let shares = granary::plan::step_shares(30, &weights.iter().map(|&(_, w)| w).collect::<Vec<_>>());
        let interleave = |plans: &[granary::policy::RankPlan], shares: &[u64]| {
            let mut iters: Vec<_> = plans.iter().map(|p| p.records()).collect();
            let mut out = Vec::new();
            while out.len() < 400 {
                for (iter, &n) in iters.iter_mut().zip(shares) {
                    out.extend(iter.by_ref().take(n as usize));
                }
            }
            out
        };
        assert_eq!(interleave(&weighted, &shares), interleave(&plain, &[10, 10, 10]));
    }
    // A hostile rebalance is refused, named, and the fallback (the built-in elastic) answers.
    let hostile = host.load_file(&built_plugin_path("hostile_partitioner")).unwrap();
    let point = RebalancePoint {
        step: 5,
        weights: vec![(0, 1), (1, 1)],
        measured: vec![RankMeasure { rank: 0, ..Default::default() }, RankMeasure { rank: 1, ..Default::default() }],
    };
    for behave in ["zero", "huge", "missing", "twice"] {
        let mut partitioner = Partitioner::new(
            hostile.clone(),
            &options(&[("behave", "valid"), ("rebalance", behave)]),
            Some(host.load("elastic").unwrap()),
        )
        .unwrap();
        let weights = partitioner.rebalance(&point).unwrap();
        assert!(
            weights.len() == 2 && weights[0].1 == weights[1].1,
            "{behave}: the fallback keeps the unmeasured ranks' equal shares: {weights:?}"
        );
        let status = partitioner.status();
        assert!(status.failures > 0, "{behave}: {status:?}");
        let last = status.recent.last().map(ToString::to_string).unwrap_or_default();
        assert!(last.contains("rebalance"), "{behave}: {last}");
    }
}

#[test]
fn hot_shards_get_more_copies_and_cool_ones_drop_back_to_the_factor() {
    let host = host();
    let mut replicator =
        Replicator::new(host.load("rendezvous").unwrap(), &options(&[("hot-replicas", "3")]), None).unwrap();
    let nodes = nodes(3);
    let placement = replicator.place(&nodes, 1).unwrap();
    // Zipf reads over 64 shards: the hottest few are far above the mean.
    let heat: Vec<ShardHeat> = (0..64u64)
        .map(|i| {
            let key = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            ShardHeat {
                key,
                bytes: 1 << 20,
                reads: (100_000.0 / (i + 1) as f64) as u64,
                holders: placement.nodes(key).to_vec(),
                previous: Vec::new(),
            }
        })
        .collect();
    let space: Vec<NodeSpace> = (0..3).map(|id| NodeSpace { id, free_bytes: 1 << 40 }).collect();
    let goals = replicator.adapt(&nodes, &space, 1, &heat).unwrap();
    let mean = heat.iter().map(|h| h.reads as f64).sum::<f64>() / 64.0;
    let hot: Vec<u64> = heat.iter().filter(|h| h.reads as f64 > 4.0 * mean).map(|h| h.key).collect();
    assert!(!hot.is_empty() && hot.len() < 8, "{hot:?}");
    assert_eq!(goals.iter().map(|g| g.key).collect::<Vec<_>>(), hot);
    for goal in &goals {
        assert_eq!(goal.nodes.len(), 3);
        assert_eq!(goal.nodes[0], placement.nodes(goal.key)[0], "the table's node stays first");
        assert_eq!(goal.mode, ReplicationMode::Synchronous);
    }
    // A shard hot at the previous answer stays hot until it falls below half the line; then no
    // goal (back to the factor). One that was not hot needs the whole line.
    let first = goals[0].key;
    let with_extra = |reads: u64| {
        let mut heat = heat.clone();
        heat[0] = ShardHeat { key: first, bytes: 1 << 20, reads, holders: vec![0, 1, 2], previous: vec![0, 1, 2] };
        heat
    };
    let line = 4.0 * mean;
    let warm = with_extra((line * 0.6) as u64);
    assert!(replicator.adapt(&nodes, &space, 1, &warm).unwrap().iter().any(|g| g.key == first));
    let cold = with_extra((line * 0.3) as u64);
    assert!(!replicator.adapt(&nodes, &space, 1, &cold).unwrap().iter().any(|g| g.key == first));
    let mut warm_but_new = warm.clone();
    warm_but_new[0].previous.clear();
    assert!(!replicator.adapt(&nodes, &space, 1, &warm_but_new).unwrap().iter().any(|g| g.key == first));
    // No room on the other nodes: no extra copy.
    let full: Vec<NodeSpace> =
        (0..3).map(|id| NodeSpace { id, free_bytes: if id == 0 { 1 << 40 } else { 0 } }).collect();
    for goal in replicator.adapt(&nodes, &full, 1, &heat).unwrap() {
        let holders = &heat.iter().find(|h| h.key == goal.key).unwrap().holders;
        assert!(goal.nodes.iter().all(|n| holders.contains(n) || *n == 0), "{goal:?}");
    }
    // Without the option: no goals.
    let mut plain = Replicator::new(host.load("rendezvous").unwrap(), &[], None).unwrap();
    assert!(plain.adapt(&nodes, &space, 1, &heat).unwrap().is_empty());
}
