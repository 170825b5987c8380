//! The general promise behind issue 25, as a property: damage one random file of a random store
//! (a ref, a history, a manifest, a shard, the catalog, or add stray entries), in a random way
//! (truncate, flip a byte, delete). Then whole-store `verify` fails whenever some live record
//! cannot be read, and after `repair` and `gc --prune-now` every version whose own files
//! (manifest, shards, and its ref or history) are still sound reads back every byte.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use granary::engine::{self, GcOptions};
use granary::{Batch, Granary, IngestMode, IngestOptions, Layout, Reader, StorePaths, VersionSpec};
use proptest::prelude::*;

const RECORD: usize = 512;

/// Every dataset version made, with its records.
type Truth = BTreeMap<(String, u64), Vec<Vec<u8>>>;

/// A store of `datasets` datasets, each of one to three versions (appends and a replace), in
/// shards of 8 KiB.
fn build(root: &Path, datasets: &[Vec<usize>], seed: u64) -> Truth {
    let mut granary = Granary::create(root).unwrap();
    let mut truth = Truth::new();
    let mut n = seed;
    for (d, versions) in datasets.iter().enumerate() {
        let name = format!("d{d}");
        let mut current: Vec<Vec<u8>> = Vec::new();
        for (v, &count) in versions.iter().enumerate() {
            let records: Vec<Vec<u8>> = (0..count)
                .map(|_| {
                    n += 1;
                    bytes(n, RECORD)
                })
                .collect();
            let mode = if v == 2 { IngestMode::Replace } else { IngestMode::Append };
            let options = IngestOptions { mode, shard_bytes_target: 8 << 10, ..IngestOptions::default() };
            let layout = Layout::Fixed(granary::FixedLayout::new(granary::Dtype::U8, &[RECORD as u64]).unwrap());
            let number = ingest(&mut granary, &name, layout, options, &records);
            if mode == IngestMode::Replace {
                current.clear();
            }
            current.extend(records);
            truth.insert((name.clone(), number), current.clone());
        }
    }
    truth
}

/// Whether `name@number` reads back exactly `records` through the files alone.
fn reads_back(root: &Path, name: &str, number: u64, records: &[Vec<u8>]) -> bool {
    let spec = VersionSpec::parse(&format!("{name}@{number}")).unwrap();
    let Ok(dataset) = granary::Dataset::open(&StorePaths::new(root), &spec) else { return false };
    if dataset.n_records() != records.len() as u64 {
        return false;
    }
    let Ok(io) = granary::IoConfig::default().build() else { return false };
    let mut reader = Reader::new(Arc::clone(&dataset), io);
    let indices: Vec<u64> = (0..records.len() as u64).collect();
    let mut batch = Batch::default();
    reader.read_batch(&indices, &mut batch).is_ok() && batch.records().zip(records).all(|(got, want)| got == &want[..])
}

/// The files a damage may hit, and what each one's loss costs: the versions that need it.
fn targets(root: &Path, truth: &Truth) -> Vec<(PathBuf, Vec<(String, u64)>)> {
    let paths = StorePaths::new(root);
    let mut out = Vec::new();
    for (name, number) in truth.keys() {
        let spec = VersionSpec::parse(&format!("{name}@{number}")).unwrap();
        let Ok((manifest, _)) = paths.resolve(&spec) else { continue };
        let needs = |_: &PathBuf| vec![(name.clone(), *number)];
        let manifest_path = paths.manifest(manifest);
        out.push((manifest_path.clone(), needs(&manifest_path)));
        for entry in paths.read_manifest(manifest).unwrap().entries() {
            let shard = paths.shard(entry.shard);
            out.push((shard.clone(), needs(&shard)));
        }
    }
    // A ref or a history alone costs nothing: each is rebuilt from the other.
    for name in paths.list_refs().unwrap() {
        out.push((paths.ref_file(&name), Vec::new()));
        out.push((root.join("history").join(name.as_str()), Vec::new()));
    }
    for entry in std::fs::read_dir(root.join("catalog")).unwrap().flatten() {
        if entry.path().is_file() {
            out.push((entry.path(), Vec::new()));
        }
    }
    // Merge: a file shared by versions costs all of them.
    let mut merged: BTreeMap<PathBuf, Vec<(String, u64)>> = BTreeMap::new();
    for (path, cost) in out {
        merged.entry(path).or_default().extend(cost);
    }
    merged.into_iter().collect()
}

#[derive(Clone, Debug)]
enum Damage {
    Truncate(u64),
    Flip(u64),
    Delete,
    Strays,
}

fn apply(root: &Path, path: &Path, damage: &Damage) {
    match damage {
        Damage::Strays => {
            std::fs::create_dir_all(root.join("tmp/junk")).unwrap();
            std::fs::create_dir_all(root.join("refs/not-a-ref")).unwrap();
            let _ = std::os::unix::fs::symlink("loop", root.join("refs/loop"));
        }
        Damage::Delete => {
            let _ = std::fs::remove_file(path);
        }
        Damage::Truncate(at) => {
            let len = std::fs::metadata(path).unwrap().len();
            if len > 0 {
                std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(at % len).unwrap();
            }
        }
        Damage::Flip(at) => {
            let mut data = std::fs::read(path).unwrap();
            if !data.is_empty() {
                let i = (*at % data.len() as u64) as usize;
                data[i] ^= 0x20;
                std::fs::write(path, data).unwrap();
            }
        }
    }
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        any::<u64>().prop_map(Damage::Truncate),
        any::<u64>().prop_map(Damage::Flip),
        Just(Damage::Delete),
        Just(Damage::Strays),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn one_damaged_file_costs_only_the_versions_that_need_it(
        datasets in prop::collection::vec(prop::collection::vec(1usize..40, 1..4), 1..4),
        seed in any::<u64>(),
        pick in any::<prop::sample::Index>(),
        harm in damage(),
    ) {
        let dir = tempdir();
        let root = dir.path().join("store");
        let truth = build(&root, &datasets, seed);
        // Only versions live in a ref count (a replace keeps the older ones live: every
        // version stays until removed).
        let targets = targets(&root, &truth);
        let (path, cost) = targets[pick.index(targets.len())].clone();
        apply(&root, &path, &harm);
        let lost: Vec<(String, u64)> = if matches!(harm, Damage::Strays) { Vec::new() } else { cost };

        // Whole-store verify fails whenever a live record cannot be read.
        let unreadable: Vec<&(String, u64)> =
            truth.iter().filter(|((n, v), records)| !reads_back(&root, n, *v, records)).map(|(k, _)| k).collect();
        let report = engine::verify(&StorePaths::new(&root), None);
        if !unreadable.is_empty() {
            prop_assert!(report.as_ref().map_or(true, |r| !r.is_clean()), "verify passed with {unreadable:?} unreadable ({harm:?} {path:?})");
        }

        // Repair, then the harshest gc: nothing that is still sound is lost.
        let repaired = Granary::open_and_repair(&root, Duration::from_secs(5));
        prop_assert!(repaired.is_ok(), "repair failed: {:?}", repaired.err());
        let (mut granary, _) = repaired.unwrap();
        let _ = granary.gc(GcOptions { grace: Duration::ZERO });
        drop(granary);
        for ((name, number), records) in &truth {
            if lost.contains(&(name.clone(), *number)) {
                continue;
            }
            prop_assert!(reads_back(&root, name, *number, records), "{name}@{number} lost to {harm:?} of {path:?}");
        }
        // What is lost is named by verify, never passed over.
        if lost.iter().any(|(n, v)| !reads_back(&root, n, *v, &truth[&(n.clone(), *v)])) {
            let report = engine::verify(&StorePaths::new(&root), None);
            prop_assert!(report.as_ref().map_or(true, |r| !r.is_clean()), "verify passed after {harm:?} of {path:?} lost data");
        }
    }
}
