//! Policy plugins end to end: hostile plugins get clear errors while the host carries on, the
//! supervisor falls back, recovers and quarantines, hot swaps keep state, and the default
//! plugins keep their promises (permutations, world-size independence, small movement).
#![cfg(feature = "policy")]

mod common;

use std::time::{Duration, Instant};

use granary::policy::builtin::built_plugin_path;
use granary::policy::{
    CompiledFrom, EpochSpec, Evictor, Holding, Limits, NodeInfo, Partitioner, Plugin, PolicyHost, RankInfo, RankPlan,
    Replicator, conformance, sim,
};
use granary::{Error, PluginError};

fn host() -> PolicyHost {
    PolicyHost::new(Limits { backoff_base: Duration::from_millis(1), ..Limits::default() }, None).unwrap()
}

fn hostile_evictor(host: &PolicyHost) -> Plugin {
    host.load_file(&built_plugin_path("hostile_evictor")).unwrap()
}

fn behave(what: &str) -> Vec<(String, String)> {
    vec![("behave".to_owned(), what.to_owned())]
}

const KEYS: [u64; 8] = [1, 2, 3, 1, 4, 2, 5, 1];

/// FIFO with 3 slots on KEYS.
const FIFO_HITS: [bool; 8] = [false, false, false, true, false, true, false, false];

fn access(evictor: &mut Evictor) -> Result<Vec<bool>, Error> {
    evictor.access(&KEYS, &[1; 8], &[u64::MAX; 8]).map(|outcome| outcome.hits)
}

#[test]
fn hostile_evictors_get_clear_errors_and_the_fallback_answers() {
    // A small memory cap, so the memory bomb hits it well before the deadline.
    let limits = Limits { memory_bytes_max: 16 << 20, deadline_evict: Duration::from_millis(300), ..Limits::default() };
    let host = PolicyHost::new(limits, None).unwrap();
    let fifo = host.load("fifo").unwrap();
    type Expected = fn(&PluginError) -> bool;
    let cases: [(&str, Expected); 7] = [
        ("loop", |e| matches!(e, PluginError::Deadline { call: "access", .. })),
        ("grow", |e| matches!(e, PluginError::MemoryLimit { .. })),
        ("trap", |e| matches!(e, PluginError::Trap { detail, .. } if detail.contains("traps on purpose"))),
        ("recurse", |e| matches!(e, PluginError::Trap { .. } | PluginError::StackOverflow { .. })),
        ("bad-hits", |e| matches!(e, PluginError::InvalidOutput { detail, .. } if detail.contains("hit flags"))),
        ("bad-evict", |e| matches!(e, PluginError::InvalidOutput { detail, .. } if detail.contains("not resident"))),
        ("overfill", |e| matches!(e, PluginError::InvalidOutput { .. })),
    ];
    for (what, expected) in cases {
        let mut evictor = Evictor::new(hostile_evictor(&host), &behave(what), Some(fifo.clone()), 3).unwrap();
        let started = Instant::now();
        let hits = access(&mut evictor).unwrap_or_else(|e| panic!("{what}: the fallback should have answered: {e}"));
        assert!(started.elapsed() < Duration::from_secs(5), "{what} took {:?}", started.elapsed());
        assert_eq!(hits, FIFO_HITS, "{what}: the fallback's answer");
        let status = evictor.status();
        let error = status.recent.last().unwrap_or_else(|| panic!("{what}: no failure recorded"));
        assert!(expected(error), "{what}: unexpected error {error}");
        assert_eq!(error.to_string().lines().count(), 1, "{what}: one-line error: {error}");
        assert_eq!((status.failures, status.fallback_calls), (1, 1), "{what}");
        assert_eq!(evictor.len(), 3, "{what}: the resident set followed the fallback");
    }
    // Without a fallback the failure is the caller's error, and the host is still fine.
    let mut alone = Evictor::new(hostile_evictor(&host), &behave("trap"), None, 3).unwrap();
    assert!(matches!(access(&mut alone), Err(Error::Plugin(PluginError::Trap { .. }))));
    let mut lru = Evictor::new(host.load("lru").unwrap(), &[], None, 3).unwrap();
    assert_eq!(access(&mut lru).unwrap(), [false, false, false, true, false, false, false, false]);
}

#[test]
fn plugins_that_reach_for_files_or_sockets_are_refused_at_load() {
    let host = host();
    match host.load_file(&built_plugin_path("hostile_io")) {
        Err(Error::Plugin(PluginError::Load { detail, .. })) => {
            assert!(detail.contains("wasi:filesystem") || detail.contains("wasi:sockets"), "{detail}");
            assert!(detail.contains("which the sandbox refuses: policy plugins get no capabilities"), "{detail}");
            assert!(!detail.contains("matching implementation"), "not the linker's text: {detail}");
        }
        other => panic!("expected a refusal at load, got {other:?}"),
    }
    let err = common::granary_err(
        std::path::Path::new("/nonexistent"),
        &["plugin", "check", built_plugin_path("hostile_io").to_str().unwrap()],
    );
    assert!(err.contains("refused at load"), "{err}");
    assert!(matches!(host.load_bytes("junk", b"not wasm"), Err(Error::Plugin(PluginError::Load { .. }))));
    // A name that is neither a file nor a built-in: not found, with the built-ins listed.
    match host.load("no-such-plugin") {
        Err(Error::NotFound { what }) => assert!(what.contains("built in: elastic, lru"), "{what}"),
        other => panic!("expected not found, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_plugin_that_keeps_failing_is_quarantined() {
    let host = PolicyHost::new(Limits { backoff_base: Duration::ZERO, quarantine_after: 3, ..Limits::default() }, None)
        .unwrap();
    let plugin = hostile_evictor(&host);
    let name = plugin.name().to_owned();
    // The process's metrics count per plugin name, across the tests running beside this one.
    let metric = |metric: &str, kind: Option<&str>| {
        let mut labels = vec![("plugin", name.as_str())];
        labels.extend(kind.map(|kind| ("kind", kind)));
        granary::metrics::global().gather().value(metric, &labels).unwrap_or(0.0)
    };
    let before = [
        metric("granary_plugin_failures", Some("trap")),
        metric("granary_plugin_quarantines", None),
        metric("granary_plugin_fallback_calls", None),
    ];
    let mut evictor = Evictor::new(plugin, &behave("trap"), Some(host.load("fifo").unwrap()), 3).unwrap();
    for round in 0..6 {
        let mut evictor_round = || evictor.access(&[round, round + 100], &[1, 1], &[u64::MAX; 2]);
        assert!(evictor_round().is_ok(), "round {round}: the fallback answers");
    }
    let status = evictor.status();
    assert!(status.quarantined);
    assert_eq!(status.failures, 3, "no call reaches a quarantined plugin");
    assert_eq!(status.fallback_calls, 6);
    assert!(metric("granary_plugin_failures", Some("trap")) >= before[0] + 3.0);
    assert!(metric("granary_plugin_quarantines", None) >= before[1] + 1.0);
    assert!(metric("granary_plugin_fallback_calls", None) >= before[2] + 6.0);
    let text = granary::metrics::global().encode(granary::metrics::Format::Prometheus);
    assert!(text.contains(&format!("granary_plugin_call_seconds_count{{plugin=\"{name}\"}}")), "{text}");
}

#[test]
fn a_failed_plugin_is_rebuilt_after_its_backoff_and_recovers() {
    let host = host();
    let mut evictor =
        Evictor::new(hostile_evictor(&host), &behave("trap-on-key=666"), Some(host.load("lru").unwrap()), 4).unwrap();
    evictor.access(&[1, 2, 3], &[1; 3], &[u64::MAX; 3]).unwrap();
    evictor.access(&[666, 1], &[1; 2], &[u64::MAX; 2]).unwrap();
    assert_eq!(evictor.status().failures, 1);
    std::thread::sleep(Duration::from_millis(5));
    // The rebuilt instance is restored from the host's resident set and answers again.
    let outcome = evictor.access(&[1, 2, 3], &[1; 3], &[u64::MAX; 3]).unwrap();
    assert_eq!(outcome.hits, [true, true, true]);
    let status = evictor.status();
    assert_eq!((status.failures, status.consecutive_failures, status.fallback_calls), (1, 0, 1));
}

#[test]
fn a_hot_swap_keeps_the_cache_and_happens_between_batches() {
    let host = host();
    let mut evictor = Evictor::new(host.load("lru").unwrap(), &[], None, 100).unwrap();
    let keys: Vec<u64> = (0..300).map(|i| i * 7 % 150).collect();
    evictor.access(&keys, &vec![1; 300], &vec![u64::MAX; 300]).unwrap();
    let resident: Vec<u64> = (0..150).filter(|k| evictor.contains(*k)).collect();
    assert_eq!(resident.len(), 100);
    let handle = evictor.swap_handle();
    let sieve = host.load("sieve").unwrap();
    std::thread::spawn(move || handle.swap(sieve, &[])).join().unwrap();
    // The swap applies before this batch: every resident key still hits.
    let outcome = evictor.access(&resident, &vec![1; 100], &vec![u64::MAX; 100]).unwrap();
    assert!(outcome.hits.iter().all(|&hit| hit));
    let status = evictor.status();
    assert_eq!((status.active.as_str(), status.fallback.as_deref()), ("sieve", Some("lru")));
    // A swap to a plugin of another kind is refused and changes nothing.
    assert!(evictor.swap(host.load("elastic").unwrap(), &[]).is_err());
    assert_eq!(evictor.status().active, "sieve");
}

fn shards(records: &[u64]) -> Vec<granary::policy::ShardInfo> {
    records
        .iter()
        .enumerate()
        .map(|(i, &n)| granary::policy::ShardInfo {
            id: *blake3::hash(&(i as u64).to_le_bytes()).as_bytes(),
            bytes: n * 4096,
            records: n,
            replicas: vec![(i % 4) as u32],
        })
        .collect()
}

fn ranks(n: u32) -> Vec<RankInfo> {
    (0..n).map(|id| RankInfo { id, node: id % 4, weight: 1, up: true }).collect()
}

fn nodes() -> Vec<NodeInfo> {
    (0..4).map(|id| NodeInfo { id, weight: 1, failure_domain: id, up: true }).collect()
}

/// Reads the ranks' plans in lock step, a step at a time, as the ranks of a job would.
fn interleave(plans: &[RankPlan], world: u64, batch: u64, total: u64, start: u64) -> Vec<u64> {
    let mut iters: Vec<_> = plans.iter().map(|p| p.records()).collect();
    let mut out = Vec::new();
    let mut cursor = start;
    while cursor < total {
        let step = (world * batch).min(total - cursor);
        let (base, extra) = if step == world * batch { (batch, 0) } else { (step / world, step % world) };
        for (r, iter) in iters.iter_mut().enumerate() {
            let len = base + u64::from((r as u64) < extra);
            out.extend(iter.by_ref().take(len as usize));
        }
        cursor += step;
    }
    out
}

#[test]
fn the_elastic_plan_is_one_global_order_for_any_world_and_resumes_exactly() {
    let host = host();
    let dataset = shards(&[37, 0, 120, 64, 9, 200]);
    let total = 430;
    for (chunk, window) in [("1", "0"), ("16", "0"), ("1", "2"), ("16", "3")] {
        let options =
            vec![("chunk-records".to_owned(), chunk.to_owned()), ("window-shards".to_owned(), window.to_owned())];
        let mut partitioner = Partitioner::new(host.load("elastic").unwrap(), &options, None).unwrap();
        let epoch = |start| EpochSpec { seed: 11, epoch: 2, batch_size: 8, start };
        let global =
            partitioner.plan(&dataset, &ranks(1), &nodes(), epoch(0)).unwrap()[0].records().collect::<Vec<_>>();
        let mut sorted = global.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..total).collect::<Vec<_>>(), "a permutation");
        for world in [2u32, 3, 7] {
            let plans = partitioner.plan(&dataset, &ranks(world), &nodes(), epoch(0)).unwrap();
            let interleaved = interleave(&plans, u64::from(world), 8, total, 0);
            assert_eq!(interleaved, global, "chunk {chunk}, window {window}, world {world}");
        }
        // Resume at a step boundary of a 3-rank run on 5 ranks: exactly the rest, in order.
        let resumed = partitioner.plan(&dataset, &ranks(5), &nodes(), epoch(3 * 8 * 4)).unwrap();
        assert_eq!(interleave(&resumed, 5, 8, total, 96), global[96..], "chunk {chunk}");
        let other_epoch = partitioner.plan(&dataset, &ranks(1), &nodes(), EpochSpec { epoch: 3, ..epoch(0) }).unwrap();
        assert_ne!(other_epoch[0].records().collect::<Vec<_>>(), global, "epochs differ");
    }
}

/// The most shards begun and not finished at any point of `order`, for shards of `sizes`.
fn most_shards_open(order: &[u64], sizes: &[u64]) -> usize {
    let starts: Vec<u64> = sizes.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
    let shard_of = |record: u64| starts.partition_point(|&start| start <= record) - 1;
    let mut left: Vec<u64> = sizes.to_vec();
    let (mut open, mut most) = (0usize, 0usize);
    for &record in order {
        let shard = shard_of(record);
        if left[shard] == sizes[shard] {
            open += 1;
        }
        left[shard] -= 1;
        if left[shard] == 0 {
            most = most.max(open);
            open -= 1;
        }
        most = most.max(open);
    }
    most
}

#[test]
fn a_windowed_plan_keeps_few_shards_open_and_a_full_shuffle_keeps_them_all() {
    let host = host();
    let sizes: Vec<u64> = (0..40u64).map(|i| 50 + (i * 37) % 90).collect();
    let dataset = shards(&sizes);
    let total: u64 = sizes.iter().sum();
    let plan = |options: &[(&str, &str)]| {
        let options: Vec<(String, String)> = options.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
        let mut partitioner = Partitioner::new(host.load("elastic").unwrap(), &options, None).unwrap();
        let epoch = EpochSpec { seed: 5, epoch: 1, batch_size: 16, start: 0 };
        partitioner.plan(&dataset, &ranks(1), &nodes(), epoch).unwrap()[0].records().collect::<Vec<_>>()
    };
    let full = plan(&[]);
    assert!(most_shards_open(&full, &sizes) >= 35, "a full shuffle opens nearly every shard at once");
    for window in [1u64, 2, 4] {
        let text = window.to_string();
        let order = plan(&[("window-shards", &text)]);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..total).collect::<Vec<_>>(), "window {window}: a permutation");
        let open = most_shards_open(&order, &sizes);
        assert!(open <= window as usize + 1, "window {window}: {open} shards open at once");
        // Mixed within the window: not the shards one after another in record order.
        let in_order = order.windows(2).filter(|pair| pair[1] == pair[0] + 1).count();
        assert!(
            in_order < order.len() / 4,
            "window {window}: {in_order} of {} records follow their predecessor",
            order.len()
        );
    }
    let refused = vec![("mode".to_owned(), "affinity".to_owned()), ("window-shards".to_owned(), "2".to_owned())];
    let mut affinity = Partitioner::new(host.load("elastic").unwrap(), &refused, None).unwrap();
    let epoch = EpochSpec { seed: 5, epoch: 1, batch_size: 16, start: 0 };
    assert!(affinity.plan(&dataset, &ranks(2), &nodes(), epoch).is_err(), "window-shards is for mode=global");
}

#[test]
fn the_partition_sim_reports_how_well_a_plan_mixes() {
    let host = host();
    let plugin = host.load("elastic").unwrap();
    let dataset = sim::synthetic_shards(100, 200).unwrap();
    let mixing = |options: &[(&str, &str)]| {
        let options: Vec<(String, String)> = options.iter().map(|&(k, v)| (k.to_owned(), v.to_owned())).collect();
        let (results, _) = sim::partition(&plugin, &options, &dataset, &[4], &[], 64).unwrap();
        results[0].mixing
    };
    let full = mixing(&[]);
    assert!((0.9..1.1).contains(&full.spread) && full.shards_per_batch > 40.0, "full shuffle: {full:?}");
    let window = mixing(&[("window-shards", "4")]);
    // Few shards per batch, any of the dataset's (the shard order is shuffled), mixed.
    assert!(window.shards_per_batch <= 5.0 && window.shards_per_batch > 1.5, "a window of 4 of 100 shards: {window:?}");
    assert!(window.spread > 0.5, "a window of 4 of 100 shards: {window:?}");
    let blocks = mixing(&[("chunk-records", "64")]);
    // Runs of consecutive records: neighbours in a batch are neighbours in the dataset.
    assert!(blocks.spread < 0.1 && blocks.shards_per_batch < 2.5, "chunks of one batch: {blocks:?}");
}

#[test]
fn invalid_plans_are_refused_and_the_fallback_plans() {
    let host = host();
    let hostile = host.load_file(&built_plugin_path("hostile_partitioner")).unwrap();
    let dataset = shards(&[10, 20]);
    let mut members = ranks(3);
    members[2].up = false;
    for what in ["overlap", "out-of-range", "missing", "down-rank", "unknown-rank", "empty-range", "loop"] {
        let limits = Limits { deadline_plan: Duration::from_millis(50), ..host.limits().clone() };
        let quick = PolicyHost::new(limits, None).unwrap();
        let hostile = if what == "loop" {
            quick.load_file(&built_plugin_path("hostile_partitioner")).unwrap()
        } else {
            hostile.clone()
        };
        let fallback = Some(quick.load("elastic").unwrap());
        let mut partitioner = Partitioner::new(hostile, &behave(what), fallback).unwrap();
        let plans = partitioner
            .plan(&dataset, &members, &nodes(), EpochSpec { seed: 1, epoch: 0, batch_size: 4, start: 0 })
            .unwrap();
        let mut all: Vec<u64> = plans.iter().flat_map(|p| p.records()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..30).collect::<Vec<_>>(), "{what}: the fallback's plan");
        assert!(plans.iter().all(|p| p.rank != 2), "{what}: nothing for the rank that is down");
        let error = partitioner.status().recent.last().cloned().unwrap();
        let expected = if what == "loop" {
            matches!(error, PluginError::Deadline { .. })
        } else {
            matches!(error, PluginError::InvalidOutput { .. })
        };
        assert!(expected, "{what}: {error}");
    }
    let mut valid = Partitioner::new(hostile, &behave("valid"), None).unwrap();
    assert!(valid.plan(&dataset, &members, &nodes(), EpochSpec { seed: 1, epoch: 0, batch_size: 4, start: 0 }).is_ok());
}

#[test]
fn affinity_partitioning_moves_only_the_changed_ranks_records_and_follows_weights() {
    let host = host();
    let plugin = host.load("elastic").unwrap();
    let options = vec![("mode".to_owned(), "affinity".to_owned()), ("chunk-records".to_owned(), "10".to_owned())];
    // 20000 chunks: rendezvous shares deviate by about 2% (one standard deviation) per rank.
    let dataset = sim::synthetic_shards(2000, 100).unwrap();
    let (results, movements) = sim::partition(&plugin, &options, &dataset, &[8, 9, 8], &[], 64).unwrap();
    for (movement, n) in movements.iter().zip([9.0, 9.0]) {
        assert!(movement.moved <= 1.1 / n, "moved {}", movement.moved);
        assert!(movement.moved > 0.5 / n, "moved {}", movement.moved);
        assert!(movement.only_changed_members);
    }
    assert!(results.iter().all(|r| r.balance_error < 0.09), "{results:?}");
    let (weighted, _) = sim::partition(&plugin, &options, &dataset, &[4], &[1, 2, 3, 2], 64).unwrap();
    assert!(weighted[0].balance_error < 0.09, "{:?}", weighted[0]);
}

#[test]
fn rendezvous_replication_moves_little_spreads_domains_and_repairs() {
    let host = host();
    let plugin = host.load("rendezvous").unwrap();
    let (results, movements) = sim::replicate(&plugin, &[], 10, 3, &[], 5).unwrap();
    for movement in &movements {
        assert!(movement.moved <= 1.1 / 10.0, "moved {}", movement.moved);
        assert!(movement.only_changed_members, "{movement:?}");
    }
    assert!(results[0].balance_error < 0.08, "{:?}", results[0]);

    let mut replicator = Replicator::new(plugin, &[], None).unwrap();
    let cluster: Vec<NodeInfo> =
        (0..6).map(|id| NodeInfo { id, weight: 1, failure_domain: id % 3, up: true }).collect();
    let placement = replicator.place(&cluster, 2).unwrap();
    for bucket in &placement.buckets {
        assert_ne!(bucket[0] % 3, bucket[1] % 3, "copies in distinct failure domains");
    }
    // Node 5 is lost: every shard it held is copied from its other holder to a new target.
    let mut after = cluster.clone();
    after[5].up = false;
    let holdings: Vec<Holding> = (0..200u64)
        .map(|i| {
            let key = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            Holding { key, nodes: placement.nodes(key).to_vec() }
        })
        .collect();
    let transfers = replicator.repair(&after, 2, &holdings).unwrap();
    let lost = holdings.iter().filter(|h| h.nodes.contains(&5)).count();
    assert!(lost > 0);
    assert_eq!(transfers.len(), lost, "one copy per shard that lost one");
    assert!(transfers.iter().all(|t| t.source != 5 && t.target != 5));
}

#[test]
fn compiled_plugins_come_back_from_the_disk_cache() {
    let dir = common::tempdir();
    let first = PolicyHost::new(Limits::default(), Some(dir.path().to_owned())).unwrap();
    assert_eq!(first.load("sieve").unwrap().compiled_from(), CompiledFrom::Compiler);
    assert_eq!(first.load("sieve").unwrap().compiled_from(), CompiledFrom::Memory);
    let second = PolicyHost::new(Limits::default(), Some(dir.path().to_owned())).unwrap();
    let loaded = second.load("sieve").unwrap();
    assert_eq!(loaded.compiled_from(), CompiledFrom::Disk);
    // A damaged cache file is recompiled over, not trusted.
    for entry in std::fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[100] ^= 1;
        std::fs::write(&path, bytes).unwrap();
    }
    let third = PolicyHost::new(Limits::default(), Some(dir.path().to_owned())).unwrap();
    let reloaded = third.load("sieve").unwrap();
    assert_eq!(reloaded.compiled_from(), CompiledFrom::Compiler);
    let mut evictor = Evictor::new(reloaded, &[], None, 3).unwrap();
    assert!(access(&mut evictor).is_ok());
}

#[test]
fn every_default_plugin_passes_conformance_and_hostile_ones_fail_it() {
    let host = host();
    for name in granary::policy::builtin::NAMES {
        let report = conformance::check(&host.load(name).unwrap(), 12, 3);
        assert!(report.passed(), "{name}: {report:?}");
    }
    let template = host.load_file(&built_plugin_path("evictor_template")).unwrap();
    assert!(conformance::check(&template, 12, 3).passed());
    for hostile in ["hostile_evictor", "hostile_partitioner"] {
        let report = conformance::check(&host.load_file(&built_plugin_path(hostile)).unwrap(), 12, 3);
        assert!(!report.passed(), "{hostile} should fail");
        assert!(
            report.checks.iter().any(|c| c.failure.as_deref().is_some_and(|f| f.contains("invalid output"))),
            "{report:?}"
        );
    }
    // The calls a run makes only now and then (snapshot every 64 batches, restore after a
    // trap) are made by the check too, and a failing one is named.
    let hostile = host.load_file(&built_plugin_path("hostile_evictor")).unwrap();
    let snapshot_check = |behave: &str| {
        let options = [("behave".to_owned(), behave.to_owned())];
        let report = conformance::check_with(&hostile, &options, 12, 3);
        report.checks.into_iter().find(|c| c.name.starts_with("snapshot lists")).expect("the snapshot check").failure
    };
    assert_eq!(snapshot_check("fifo"), None);
    assert!(conformance::check_with(&hostile, &[("behave".to_owned(), "fifo".to_owned())], 12, 3).passed());
    for (behave, call) in [("bad-snapshot", "snapshot lists 0 objects"), ("trap-restore", "restore")] {
        let failure = snapshot_check(behave).unwrap_or_default();
        assert!(failure.contains(call), "{behave}: {failure}");
    }
    let path = built_plugin_path("hostile_evictor");
    let out = common::granary(
        std::path::Path::new("/nonexistent"),
        &["plugin", "check", path.to_str().unwrap(), "--cases", "8", "--options", "behave=bad-snapshot"],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && stdout.contains("FAIL") && stdout.contains("snapshot"), "{stdout}");
    let out = common::granary(std::path::Path::new("/nonexistent"), &["plugin", "check", "lru", "--cases", "8"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("conformance: passed"));
    let out = common::granary(
        std::path::Path::new("/nonexistent"),
        &["plugin", "check", built_plugin_path("hostile_evictor").to_str().unwrap(), "--cases", "8"],
    );
    assert_eq!(out.status.code(), Some(1));
}

#[test]
fn the_defaults_are_plugins_with_a_fallback_and_fuel_measures_work() {
    let host = PolicyHost::new(Limits { fuel: true, ..Limits::default() }, None).unwrap();
    let mut evictor = host.evictor(None, &[], 100).unwrap();
    let status = evictor.status();
    assert_eq!((status.active.as_str(), status.fallback.as_deref()), ("lru", Some("lru")));
    let keys: Vec<u64> = (0..1024).map(|i| i * 13 % 300).collect();
    evictor.access(&keys, &[1; 1024], &[u64::MAX; 1024]).unwrap();
    let fuel = evictor.stats().fuel;
    // Fuel counts the plugin's instructions: a batch of 1024 LRU updates is millions, not billions.
    assert!(fuel > 10_000 && fuel < 100_000_000, "fuel {fuel}");
    let mut partitioner = host.partitioner(None, &[]).unwrap();
    assert_eq!(partitioner.status().active, "elastic");
    let plans = partitioner.plan(
        &shards(&[5, 5]),
        &ranks(2),
        &nodes(),
        EpochSpec { seed: 0, epoch: 0, batch_size: 2, start: 0 },
    );
    assert_eq!(plans.unwrap().iter().map(RankPlan::n_records).sum::<u64>(), 10);
    assert_eq!(host.replicator(None, &[]).unwrap().status().active, "rendezvous");
    let user = host.evictor(Some(built_plugin_path("evictor_template").to_str().unwrap()), &[], 10).unwrap();
    assert_eq!(user.status().fallback.as_deref(), Some("lru"));
}
