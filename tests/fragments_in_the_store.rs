//! Fragments (erasure coding) as store objects: published only when they check out whole
//! against their id, kept by gc as their shard is, checked by verify, quarantined by repair.

mod common;

use std::path::Path;

use common::*;
use granary::engine::GcOptions;
use granary::erasure::{Coding, encode, fragment_id};
use granary::store::ObjectKind;
use granary::{DatasetName, Granary, ObjectId, ShardId, StorePaths, VersionSpec};

/// Ingests 64 records of 4 KiB as `name` in 64 KiB shards; returns the shards with their bytes.
fn dataset(granary: &mut Granary, name: &str, seed: u64) -> Vec<(ShardId, Vec<u8>)> {
    let records: Vec<Vec<u8>> = (0..64).map(|i| bytes(seed * 1000 + i, 4096)).collect();
    ingest(granary, name, tokens_layout(2048), small_shards(64 << 10), &records);
    let paths = StorePaths::new(granary.paths().root());
    let dataset = granary.open_dataset(&VersionSpec::parse(name).unwrap()).unwrap();
    (0..dataset.n_shards())
        .map(|s| (dataset.shard_id(s), std::fs::read(paths.shard(dataset.shard_id(s))).unwrap()))
        .collect()
}

/// Adopts every fragment of `shard` (coded 2+1) from a file in `dir`.
fn adopt_fragments(granary: &mut Granary, dir: &Path, shard: ShardId, data: &[u8]) -> Vec<ObjectId> {
    let coding = Coding::new(2, 1).unwrap();
    let mut ids = Vec::new();
    for (i, file) in encode(data, coding).unwrap().into_iter().enumerate() {
        let id = fragment_id(shard, coding, i as u8);
        let path = dir.join(format!("{id}.in"));
        std::fs::write(&path, &file).unwrap();
        assert!(granary.adopt_object(ObjectKind::Fragment, id, &path).unwrap());
        ids.push(id);
    }
    ids
}

#[test]
fn a_fragment_is_published_only_whole_and_under_its_own_id() {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let shards = dataset(&mut granary, "tokens", 1);
    let (shard, data) = &shards[0];
    let coding = Coding::new(2, 1).unwrap();
    let files = encode(data, coding).unwrap();
    let incoming = dir.path().join("in");
    std::fs::write(&incoming, &files[1]).unwrap();
    // Under another fragment's id: refused, nothing published.
    let wrong = fragment_id(*shard, coding, 0);
    let error = granary.adopt_object(ObjectKind::Fragment, wrong, &incoming).unwrap_err();
    assert!(error.is_corruption() && error.to_string().contains("names fragment 1"), "{error}");
    // A flipped bit: refused.
    let mut damaged = files[1].clone();
    damaged[4096 + 100] ^= 1;
    std::fs::write(&incoming, &damaged).unwrap();
    let right = fragment_id(*shard, coding, 1);
    let error = granary.adopt_object(ObjectKind::Fragment, right, &incoming).unwrap_err();
    assert!(error.is_corruption(), "{error}");
    assert!(StorePaths::new(dir.path().join("store")).list_objects(ObjectKind::Fragment).unwrap().is_empty());
    // Whole, under its id: published; a second copy finds the first intact and keeps it.
    std::fs::write(&incoming, &files[1]).unwrap();
    assert!(granary.adopt_object(ObjectKind::Fragment, right, &incoming).unwrap());
    std::fs::write(&incoming, &files[1]).unwrap();
    assert!(!granary.adopt_object(ObjectKind::Fragment, right, &incoming).unwrap());
    let listed = StorePaths::new(dir.path().join("store")).list_objects(ObjectKind::Fragment).unwrap();
    assert_eq!(listed.iter().map(|(id, _)| *id).collect::<Vec<_>>(), vec![right]);
}

#[test]
fn gc_keeps_fragments_as_it_keeps_their_shards_and_verify_and_repair_check_them() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let kept = dataset(&mut granary, "kept", 1);
    let gone = dataset(&mut granary, "gone", 2);
    let kept_ids = adopt_fragments(&mut granary, dir.path(), kept[0].0, &kept[0].1);
    let gone_ids = adopt_fragments(&mut granary, dir.path(), gone[0].0, &gone[0].1);
    let report = granary.verify(None).unwrap();
    assert_eq!(report.fragments_ok, 6);
    assert!(report.is_clean(), "{report:?}");
    // The dataset goes: gc with no grace takes its shards and their fragments, not the others.
    granary.remove(&DatasetName::new("gone").unwrap(), None).unwrap();
    let report = granary.gc(GcOptions::prune_now()).unwrap();
    assert_eq!(report.fragments, 3, "{report:?}");
    let paths = StorePaths::new(&root);
    let left: Vec<ObjectId> = paths.list_objects(ObjectKind::Fragment).unwrap().into_iter().map(|(id, _)| id).collect();
    let mut want = kept_ids.clone();
    want.sort();
    assert_eq!(left, want);
    assert!(gone_ids.iter().all(|id| !left.contains(id)));
    // A damaged fragment: verify names it, gc keeps a file it cannot read the header of, and
    // repair quarantines it.
    let victim = paths.object(ObjectKind::Fragment, kept_ids[2]);
    let mut file = std::fs::read(&victim).unwrap();
    file[4096 + 5] ^= 0x80;
    std::fs::write(&victim, &file).unwrap();
    let report = granary.verify(None).unwrap();
    assert_eq!(report.fragments_ok, 2);
    assert_eq!(report.failures.len(), 1);
    assert_eq!(report.failures[0].path, victim);
    let header = paths.object(ObjectKind::Fragment, kept_ids[1]);
    let mut file = std::fs::read(&header).unwrap();
    file[20] ^= 0x01;
    std::fs::write(&header, &file).unwrap();
    granary.remove(&DatasetName::new("kept").unwrap(), None).unwrap();
    let report = granary.gc(GcOptions::prune_now()).unwrap();
    assert_eq!((report.fragments, report.kept_damaged), (2, 1), "{report:?}");
    drop(granary);
    let (_, repaired) = Granary::open_and_repair(&root, std::time::Duration::ZERO).unwrap();
    assert_eq!(repaired.quarantined.len(), 1, "{repaired:?}");
    assert!(paths.list_objects(ObjectKind::Fragment).unwrap().is_empty());
}

#[test]
fn a_node_that_holds_only_fragments_verifies_and_repairs_clean_saying_so() {
    // A node of a coded dataset: its ref and manifest, and one fragment of each shard (the others
    // on other nodes), no whole shard. verify said "0 live versions readable, 1 unreadable" and
    // exited 1, repair "N referenced objects are missing" (issue 40, item 3).
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut store = Granary::create(&root).unwrap();
    let shards = dataset(&mut store, "tokens", 3);
    for (shard, data) in &shards {
        let ids = adopt_fragments(&mut store, dir.path(), *shard, data);
        // One fragment stays: the node's share.
        for id in &ids[1..] {
            store.forget_object(ObjectKind::Fragment, *id).unwrap();
        }
        store.forget_object(ObjectKind::Shard, shard.0).unwrap();
    }
    drop(store);
    let verify = granary_ok(&root, &["verify"]);
    assert!(verify.contains("1 live versions readable"), "{verify}");
    assert!(
        verify.contains(&format!("({} of their shards held here as erasure-coded fragments", shards.len())),
        "{verify}"
    );
    assert!(verify.contains(": 0 failures"), "{verify}");
    let repair = granary_ok(&root, &["repair"]);
    assert!(repair.contains(", 0 missing,"), "{repair}");
    assert!(
        repair.contains(&format!("{} listed shards are held here as erasure-coded fragments", shards.len())),
        "{repair}"
    );
    // A shard with neither its file nor a fragment here is still missing, and says so.
    let paths = StorePaths::new(&root);
    let (fragment, _) = paths.list_objects(ObjectKind::Fragment).unwrap().remove(0);
    std::fs::remove_file(paths.object(ObjectKind::Fragment, fragment)).unwrap();
    let out = granary(&root, &["verify"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is missing"), "{}", String::from_utf8_lossy(&out.stderr));
}
