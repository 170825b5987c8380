//! The conformance suite every plugin must pass (`granary plugin check`): it loads, it answers
//! every valid random input (totality), the same input always gives the same answer
//! (determinism), and every answer passes the host's validation. proptest generates the inputs
//! from a fixed seed and shrinks a failure to a minimal case. Plugins run here without a
//! fallback, so every failure shows.
//!
//! Owns: `check` and `check_with`, their `Report` and `Check`s, and the inputs generated for each
//! kind (access traces, worlds of ranks, clusters). Never: answers a call through a fallback, or
//! draws a case from anything but the seed.

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use crate::error::{Error, PluginError};

use super::{
    EpochSpec, Evictor, Holding, NodeInfo, Partitioner, Plugin, PolicyKind, RankInfo, RankPlan, Replicator, ShardInfo,
};

/// One property and how it went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// What was checked.
    pub name: &'static str,
    /// `None` when it held on every case; the (shrunk) failure otherwise.
    pub failure: Option<String>,
}

/// The outcome of the suite for one plugin.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// The plugin.
    pub plugin: String,
    /// Its kind.
    pub kind: PolicyKind,
    /// Random cases per property.
    pub cases: u32,
    /// The properties.
    pub checks: Vec<Check>,
}

impl Report {
    /// Whether every property held.
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|check| check.failure.is_none())
    }
}

/// Runs the suite on `plugin` with `cases` random cases per property, from `seed`.
pub fn check(plugin: &Plugin, cases: u32, seed: u64) -> Report {
    check_with(plugin, &[], cases, seed)
}

/// `check`, with the plugin configured by `options` in every case.
pub fn check_with(plugin: &Plugin, options: &[(String, String)], cases: u32, seed: u64) -> Report {
    let checks = match plugin.kind() {
        PolicyKind::Evictor => evictor_checks(plugin, options, cases, seed),
        PolicyKind::Partitioner => partitioner_checks(plugin, options, cases, seed),
        PolicyKind::Replicator => replicator_checks(plugin, options, cases, seed),
    };
    Report { plugin: plugin.name().to_owned(), kind: plugin.kind(), cases, checks }
}

fn runner(cases: u32, seed: u64) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config { cases, failure_persistence: None, max_shrink_iters: 256, ..Config::default() };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

fn run<S: Strategy>(
    name: &'static str,
    cases: u32,
    seed: u64,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Check
where
    S::Value: std::fmt::Debug,
{
    let failure = runner(cases, seed).run(&strategy, test).err().map(|e| e.to_string().replace('\n', " "));
    Check { name, failure }
}

fn fail(error: impl std::fmt::Display) -> TestCaseError {
    TestCaseError::fail(error.to_string())
}

/// A trace: capacity, then batches of (key, size, next use).
type Trace = (u64, Vec<Vec<(u64, u32, u64)>>);

fn traces() -> impl Strategy<Value = Trace> {
    let access = (0u64..48, 1u32..4, prop_oneof![Just(u64::MAX), 0u64..10_000]);
    (1u64..40, prop::collection::vec(prop::collection::vec(access, 0..64), 1..6))
}

fn replay(
    plugin: &Plugin,
    options: &[(String, String)],
    trace: &Trace,
) -> Result<Vec<super::AccessOutcome>, TestCaseError> {
    let (capacity, batches) = trace;
    let mut evictor = Evictor::new(plugin.clone(), options, None, *capacity).map_err(fail)?;
    let mut outcomes = Vec::new();
    for batch in batches {
        let keys: Vec<u64> = batch.iter().map(|a| a.0).collect();
        let sizes: Vec<u32> = batch.iter().map(|a| a.1).collect();
        let next_uses: Vec<u64> = batch.iter().map(|a| a.2).collect();
        outcomes.push(evictor.access(&keys, &sizes, &next_uses).map_err(fail)?);
        prop_assert!(evictor.used() <= *capacity);
    }
    Ok(outcomes)
}

fn evictor_checks(plugin: &Plugin, options: &[(String, String)], cases: u32, seed: u64) -> Vec<Check> {
    vec![
        run("answers every batch with a valid outcome", cases, seed, traces(), |trace| {
            replay(plugin, options, &trace).map(drop)
        }),
        run("the same batches give the same outcomes", cases, seed ^ 1, traces(), |trace| {
            prop_assert_eq!(replay(plugin, options, &trace)?, replay(plugin, options, &trace)?);
            Ok(())
        }),
        run(
            "evict frees what is asked, remove forgets, a swap keeps the contents",
            cases,
            seed ^ 2,
            traces(),
            |trace| {
                let (capacity, batches) = &trace;
                let mut evictor = Evictor::new(plugin.clone(), options, None, *capacity).map_err(fail)?;
                for batch in batches {
                    let keys: Vec<u64> = batch.iter().map(|a| a.0).collect();
                    let sizes: Vec<u32> = batch.iter().map(|a| a.1).collect();
                    evictor.access(&keys, &sizes, &vec![u64::MAX; keys.len()]).map_err(fail)?;
                }
                let (before, used) = (evictor.len(), evictor.used());
                evictor.swap(plugin.clone(), options).map_err(fail)?;
                prop_assert_eq!((evictor.len(), evictor.used()), (before, used));
                let victims = evictor.evict(2).map_err(fail)?;
                prop_assert!(used < 2 || used - evictor.used() >= 2, "evict(2) freed {} bytes", used - evictor.used());
                prop_assert!(victims.iter().all(|key| !evictor.contains(*key)));
                let keys: Vec<u64> = (0..48).collect();
                evictor.remove(&keys).map_err(fail)?;
                prop_assert!(evictor.is_empty() && evictor.used() == 0);
                evictor.access(&[1, 2, 1], &[1, 1, 1], &[u64::MAX; 3]).map_err(fail)?;
                Ok(())
            },
        ),
        // The engine snapshots an evictor every 64 batches and restores a new instance from it
        // after a trap: both calls are made here, on every case, so that a plugin whose
        // `snapshot` or `restore` fails is caught now, not in the middle of a run.
        run(
            "snapshot lists what is resident, and an instance restored from it decides as the original",
            cases,
            seed ^ 3,
            traces(),
            |trace| {
                let (capacity, batches) = &trace;
                let split = batches.len().div_ceil(2);
                let mut original = Evictor::new(plugin.clone(), options, None, *capacity).map_err(fail)?;
                let mut restored = Evictor::new(plugin.clone(), options, None, *capacity).map_err(fail)?;
                let access = |evictor: &mut Evictor, batch: &Vec<(u64, u32, u64)>| {
                    let keys: Vec<u64> = batch.iter().map(|a| a.0).collect();
                    let sizes: Vec<u32> = batch.iter().map(|a| a.1).collect();
                    let next_uses: Vec<u64> = batch.iter().map(|a| a.2).collect();
                    evictor.access(&keys, &sizes, &next_uses).map_err(fail)
                };
                for batch in &batches[..split] {
                    access(&mut original, batch)?;
                    access(&mut restored, batch)?;
                }
                restored.snapshot_now().map_err(fail)?;
                // A new instance, restored from that snapshot at its next call.
                restored.swap(plugin.clone(), options).map_err(fail)?;
                for batch in &batches[split..] {
                    prop_assert_eq!(access(&mut original, batch)?, access(&mut restored, batch)?);
                }
                Ok(())
            },
        ),
    ]
}

/// Shards (records each), ranks (up), batch size, seed, epoch.
type World = (Vec<u64>, Vec<bool>, u64, u64, u64, u64);

fn worlds() -> impl Strategy<Value = World> {
    (
        prop::collection::vec(0u64..300, 0..24),
        prop::collection::vec(any::<bool>(), 1..9),
        1u64..40,
        any::<u64>(),
        0u64..5,
        any::<u64>(),
    )
}

fn plan(plugin: &Plugin, options: &[(String, String)], world: &World) -> Result<Vec<RankPlan>, TestCaseError> {
    let (shards, up, batch_size, seed, epoch, start) = world;
    let shards: Vec<ShardInfo> = shards
        .iter()
        .enumerate()
        .map(|(i, &records)| {
            let mut id = [0u8; 32];
            id[..8].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            ShardInfo { id, bytes: records * 4096, records, replicas: vec![(i % 3) as u32] }
        })
        .collect();
    let mut ranks: Vec<RankInfo> =
        up.iter().enumerate().map(|(i, &up)| RankInfo { id: i as u32, node: (i % 3) as u32, weight: 1, up }).collect();
    ranks[0].up = true;
    let nodes: Vec<NodeInfo> = (0..3).map(|id| NodeInfo { id, weight: 1, failure_domain: id, up: true }).collect();
    let total: u64 = shards.iter().map(|s| s.records).sum();
    let epoch = EpochSpec { seed: *seed, epoch: *epoch, batch_size: *batch_size, start: start % (total + 1) };
    let mut partitioner = Partitioner::new(plugin.clone(), options, None).map_err(fail)?;
    match partitioner.plan(&shards, &ranks, &nodes, epoch) {
        Ok(plans) => Ok(plans),
        // A partitioner may plan only whole epochs; it must say so rather than fail.
        Err(Error::Plugin(PluginError::Rejected { detail, .. }))
            if epoch.start > 0 && detail.starts_with("unsupported") =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(fail(e)),
    }
}

fn partitioner_checks(plugin: &Plugin, options: &[(String, String)], cases: u32, seed: u64) -> Vec<Check> {
    vec![
        run("plans every epoch as a permutation of the records left", cases, seed, worlds(), |world| {
            plan(plugin, options, &world).map(drop)
        }),
        run("the same epoch gives the same plan", cases, seed ^ 1, worlds(), |world| {
            prop_assert_eq!(plan(plugin, options, &world)?, plan(plugin, options, &world)?);
            Ok(())
        }),
    ]
}

/// Nodes (weight, domain, up), replicas, and which nodes hold each of some shards.
type Cluster = (Vec<(u32, u32, bool)>, u32, Vec<Vec<bool>>);

fn clusters() -> impl Strategy<Value = Cluster> {
    (
        prop::collection::vec((1u32..5, 0u32..4, any::<bool>()), 1..16),
        1u32..5,
        prop::collection::vec(prop::collection::vec(any::<bool>(), 16), 0..20),
    )
}

fn nodes_of(cluster: &Cluster) -> Vec<NodeInfo> {
    let mut nodes: Vec<NodeInfo> = cluster
        .0
        .iter()
        .enumerate()
        .map(|(i, &(weight, failure_domain, up))| NodeInfo { id: 100 + i as u32, weight, failure_domain, up })
        .collect();
    nodes[0].up = true;
    nodes
}

fn replicator_checks(plugin: &Plugin, options: &[(String, String)], cases: u32, seed: u64) -> Vec<Check> {
    vec![
        run("places every bucket on distinct nodes that are up", cases, seed, clusters(), |cluster| {
            let mut replicator = Replicator::new(plugin.clone(), options, None).map_err(fail)?;
            replicator.place(&nodes_of(&cluster), cluster.1).map_err(fail)?;
            Ok(())
        }),
        run("the same topology gives the same placement and repair", cases, seed ^ 1, clusters(), |cluster| {
            let nodes = nodes_of(&cluster);
            let holdings: Vec<Holding> = cluster
                .2
                .iter()
                .enumerate()
                .map(|(i, held)| Holding {
                    key: (i as u64).wrapping_mul(0x2545_f491_4f6c_dd1d),
                    nodes: nodes.iter().zip(held).filter(|(_, h)| **h).map(|(n, _)| n.id).collect(),
                })
                .collect();
            let mut first = Replicator::new(plugin.clone(), options, None).map_err(fail)?;
            let mut second = Replicator::new(plugin.clone(), options, None).map_err(fail)?;
            prop_assert_eq!(
                first.place(&nodes, cluster.1).map_err(fail)?,
                second.place(&nodes, cluster.1).map_err(fail)?
            );
            prop_assert_eq!(
                first.repair(&nodes, cluster.1, &holdings).map_err(fail)?,
                second.repair(&nodes, cluster.1, &holdings).map_err(fail)?
            );
            Ok(())
        }),
    ]
}
