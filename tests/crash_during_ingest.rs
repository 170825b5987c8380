//! A `granary ingest` killed (SIGKILL) at random points, many times over: afterwards no partial
//! shard is visible, every cataloged object is an intact file, the catalog agrees with the refs,
//! and the dataset holds exactly the ingests that committed, in order; and the next writer's open
//! never needs a person (a catalog sled cannot read is rebuilt there, issue 53).
//!
//! The kill times are fractions (from a seed printed at the start) of how long an uninterrupted
//! ingest takes on this machine; `GRANARY_CRASH_SEED=N` replays the same fractions, which hit
//! similar, not identical, points (process scheduling is not replayable).

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use common::*;
use granary::engine::verify_shard;
use granary::store::ObjectKind;
use granary::{DatasetName, Granary, IoConfig, Reader, ShardId, StorePaths, VersionSpec};

/// Issue 53's count: a hundred killed ingests in a row, every next open succeeding by itself.
const ITERATIONS: u64 = 100;
const RECORD_BYTES: usize = 1024;
const RECORDS_PER_INGEST: usize = 1536;

#[test]
fn crash_during_ingest_leaves_no_partial_shard_and_a_consistent_catalog() {
    let seed = std::env::var("GRANARY_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("crash test seed {seed} (replay with GRANARY_CRASH_SEED={seed})");
    let delays = bytes(seed, 8 * ITERATIONS as usize);

    let dir = tempdir();
    let root = dir.path().join("store");
    let name = DatasetName::new("crashy").unwrap();
    let mut committed: Vec<Vec<u8>> = Vec::new();
    let mut last_version = 0;
    let mut kills = 0;
    // How long an uninterrupted ingest takes here, to spread the kill times over all of it.
    let mut full_run = Duration::from_millis(400);

    for i in 0..ITERATIONS {
        let input = dir.path().join(format!("input-{i}.bin"));
        let records: Vec<u8> = bytes(seed ^ (i + 1), RECORD_BYTES * RECORDS_PER_INGEST);
        std::fs::write(&input, &records).unwrap();
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
            .arg("--root")
            .arg(&root)
            .args([
                "ingest",
                "records",
                "--name",
                "crashy",
                "--append",
                "--record-bytes",
                "1024",
                "--shard-bytes",
                "64K",
            ])
            .arg(&input)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = Instant::now();
        let fraction = u64::from_le_bytes(delays[8 * i as usize..8 * i as usize + 8].try_into().unwrap()) % 1000;
        // Every fifth ingest runs to completion, so the dataset keeps growing.
        let kill_after = (i % 5 != 4).then(|| full_run.mul_f64(fraction as f64 / 1000.0));
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if kill_after.is_some_and(|after| started.elapsed() >= after) {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
                break None;
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        if let Some(status) = status {
            assert!(status.success(), "iteration {i}: ingest failed: {:?}", child.wait_with_output().unwrap().stderr);
            full_run = started.elapsed();
        }

        // The store must open (the dead writer's lock is gone), clean up and be consistent.
        let granary = Granary::open(&root).unwrap_or_else(|e| panic!("iteration {i}: {e}"));
        check_consistent(&granary, i);
        let paths = StorePaths::new(&root);
        let before = last_version;
        let version = match paths.read_ref(&name) {
            Ok(log) => log.latest().number,
            Err(granary::Error::NotFound { .. }) => 0,
            Err(e) => panic!("iteration {i}: {e}"),
        };
        assert!(
            version == last_version || version == last_version + 1,
            "iteration {i}: version {last_version} -> {version}"
        );
        if version == last_version + 1 {
            committed.push(records);
            last_version = version;
        }
        assert!(status.is_none() || version == before + 1, "iteration {i}: a completed ingest committed");
        if last_version > 0 {
            let dataset = granary.open_dataset(&VersionSpec::parse("crashy").unwrap()).unwrap();
            let mut reader = Reader::new(dataset.clone(), IoConfig::default().build().unwrap());
            let all: Vec<u64> = (0..dataset.n_records()).collect();
            let mut got = Vec::new();
            reader
                .read_batches(all.chunks(500), 2, &mut |batch| {
                    got.extend_from_slice(batch.data());
                    Ok(())
                })
                .unwrap();
            assert!(got == committed.concat(), "iteration {i}: the dataset is not the committed ingests in order");
        }
    }
    println!("{kills} kills, {last_version} versions committed");
    assert!(kills >= ITERATIONS / 2, "most iterations were killed");
    assert!(last_version >= ITERATIONS / 5, "the uninterrupted ingests committed");
}

/// The consistency contract after a crash (see the `ingest` module doc).
fn check_consistent(granary: &Granary, i: u64) {
    let paths = granary.paths();
    let tmp: Vec<_> = std::fs::read_dir(paths.tmp_dir()).unwrap().collect();
    assert!(tmp.is_empty(), "iteration {i}: temp files survived the reopen");

    // No partial shard is visible: every shard file is complete and named by its hash.
    let shard_files: BTreeSet<_> =
        paths.list_objects(ObjectKind::Shard).unwrap().into_iter().map(|(id, _)| id).collect();
    for (id, path) in paths.list_objects(ObjectKind::Shard).unwrap() {
        verify_shard(&path, ShardId(id)).unwrap_or_else(|e| panic!("iteration {i}: visible shard {id} is broken: {e}"));
    }
    let manifest_files: BTreeSet<_> =
        paths.list_objects(ObjectKind::Manifest).unwrap().into_iter().map(|(id, _)| id).collect();
    for &id in &manifest_files {
        paths.read_manifest(granary::ManifestId(id)).unwrap_or_else(|e| panic!("iteration {i}: manifest {id}: {e}"));
    }

    // The catalog names nothing that is not an intact file, and its datasets are the refs.
    let catalog = granary.catalog();
    for (id, entry) in catalog.shards().unwrap() {
        assert!(shard_files.contains(&id.0), "iteration {i}: cataloged shard {id} has no file");
        assert_eq!(entry.file_bytes, std::fs::metadata(paths.shard(id)).unwrap().len());
    }
    for (id, _) in catalog.manifests().unwrap() {
        assert!(manifest_files.contains(&id.0), "iteration {i}: cataloged manifest {id} has no file");
    }
    let refs = paths.list_refs().unwrap();
    let datasets = catalog.datasets().unwrap();
    assert_eq!(datasets.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(), refs, "iteration {i}");
    for (name, log) in datasets {
        assert_eq!(paths.read_ref(&name).unwrap(), log, "iteration {i}");
        for version in log.versions() {
            let manifest = paths.read_manifest(version.manifest).unwrap();
            assert!(
                catalog.manifest(version.manifest).unwrap().is_some(),
                "iteration {i}: a live manifest is cataloged"
            );
            for entry in manifest.entries() {
                assert!(
                    shard_files.contains(&entry.shard.0),
                    "iteration {i}: a live version lost shard {}",
                    entry.shard
                );
                assert!(catalog.shard(entry.shard).unwrap().is_some(), "iteration {i}: a live shard is cataloged");
            }
        }
    }
}
