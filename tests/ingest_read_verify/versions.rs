//! Versions around an ingest: a dropped ingest removes only what it wrote, appends make
//! versions and old ones stay readable while gc keeps what is live, readers share a store while
//! a writer holds it, and a ref from elsewhere is adopted only when it extends this history.

use super::*;

#[test]
fn an_ingest_dropped_without_commit_removes_only_what_it_wrote() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let kept: Vec<Vec<u8>> = (0..40).map(|i| bytes(i, 512)).collect();
    let mut granary = Granary::create(&root).unwrap();
    let layout = tokens_layout(256);
    ingest(&mut granary, "kept", layout.clone(), small_shards(4096), &kept);
    let before = shard_files(&root);
    assert!(before.len() > 1);

    // The same records again (their shards are found already stored), then new ones (new
    // shards, and a partial one still open), and the session is dropped.
    let mut session = granary.ingest(DatasetName::new("dropped").unwrap(), layout, small_shards(4096)).unwrap();
    for record in kept.iter().chain(&(100..150).map(|i| bytes(i, 512)).collect::<Vec<_>>()) {
        session.push(record).unwrap();
    }
    assert!(session.stats().shards_published > 0 && session.stats().shards_deduplicated > 0);
    assert!(shard_files(&root).len() > before.len());
    drop(session);

    assert_eq!(shard_files(&root), before, "exactly the new shards are gone");
    let tmp = root.join("tmp");
    assert!(!tmp.exists() || std::fs::read_dir(&tmp).unwrap().next().is_none(), "the partial shard is gone");
    assert_eq!(granary.catalog().shards().unwrap().len(), before.len(), "and their catalog entries");
    assert_eq!(read_all(&open(&root, "kept"), IoConfig::default()), kept);
    assert_eq!(granary.gc(granary::engine::GcOptions::prune_now()).unwrap().shards, 0, "nothing was left for gc");
}

#[test]
fn appends_make_versions_old_versions_stay_readable_and_gc_keeps_what_is_live() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let first: Vec<Vec<u8>> = (0..50).map(|i| bytes(i, 512)).collect();
    let second: Vec<Vec<u8>> = (50..80).map(|i| bytes(i, 512)).collect();
    let mut granary = Granary::create(&root).unwrap();
    let layout = tokens_layout(256);
    assert_eq!(ingest(&mut granary, "d", layout.clone(), small_shards(4096), &first), 1);
    assert_eq!(ingest(&mut granary, "d", layout.clone(), small_shards(4096), &second), 2);

    let v1 = granary.open_dataset(&VersionSpec::parse("d@1").unwrap()).unwrap();
    let v2 = granary.open_dataset(&VersionSpec::parse("d").unwrap()).unwrap();
    assert_eq!(read_all(&v1, IoConfig::default()), first);
    assert_eq!(read_all(&v2, IoConfig::default()), [first.clone(), second.clone()].concat());
    assert_eq!(v2.version().unwrap().1, 2);

    // The same content under another name is stored once.
    let name = granary::DatasetName::new("copy").unwrap();
    let mut session = granary.ingest(name, layout.clone(), small_shards(4096)).unwrap();
    for record in &first {
        session.push(record).unwrap();
    }
    let committed = session.commit().unwrap();
    assert_eq!(committed.stats.shards_published, 0);
    assert_eq!(committed.stats.shards_deduplicated, committed.n_shards as u64);
    assert_eq!(committed.manifest, v1.manifest_id(), "identical versions are one manifest");

    // An append of nothing is no new version.
    let name = granary::DatasetName::new("d").unwrap();
    assert_eq!(granary.ingest(name.clone(), layout.clone(), small_shards(4096)).unwrap().commit().unwrap().version, 2);

    // Replace: version 3 holds only the new records; a layout mismatch on append is refused.
    let options = granary::IngestOptions { mode: IngestMode::Replace, ..small_shards(4096) };
    let mut session = granary.ingest(name.clone(), layout.clone(), options).unwrap();
    session.push(&second[0]).unwrap();
    assert_eq!(session.commit().unwrap().version, 3);
    let appending_bytes = granary.ingest(name.clone(), Layout::Bytes, small_shards(4096)).err();
    assert!(matches!(appending_bytes, Some(granary::Error::InvalidInput { .. })));

    // Removing versions 2 and 3 leaves version 1 (shared with "copy"); gc frees what only they used.
    let shards_before = shard_files(&root).len();
    granary.remove(&name, Some(2)).unwrap();
    granary.remove(&name, Some(3)).unwrap();
    let report = granary.gc(granary::engine::GcOptions::prune_now()).unwrap();
    assert_eq!(report.manifests, 2);
    assert!(report.shards > 0 && (report.shards as usize) < shards_before);
    assert_eq!(
        read_all(&granary.open_dataset(&VersionSpec::parse("d@1").unwrap()).unwrap(), IoConfig::default()),
        first
    );
    assert!(matches!(granary.open_dataset(&VersionSpec::parse("d@2").unwrap()), Err(granary::Error::NotFound { .. })));
    granary.remove(&name, None).unwrap();
    granary.remove(&granary::DatasetName::new("copy").unwrap(), None).unwrap();
    granary.gc(granary::engine::GcOptions::prune_now()).unwrap();
    assert!(shard_files(&root).is_empty());
    assert!(granary.datasets().unwrap().is_empty());
}

#[test]
fn readers_share_a_store_while_a_writer_holds_it() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let records: Vec<Vec<u8>> = (0..10).map(|i| bytes(i, 64)).collect();
    let mut granary = Granary::create(&root).unwrap();
    ingest(&mut granary, "d", Layout::Bytes, small_shards(4096), &records);
    assert!(matches!(Granary::open(&root), Err(granary::Error::StoreLocked { .. })));
    // Readers need no lock, and `ls` falls back to the files.
    assert_eq!(read_all(&open(&root, "d"), IoConfig::default()), records);
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("d ") && ls.contains("bytes"), "{ls}");
    drop(granary);
    assert!(Granary::open(&root).is_ok());
}

#[test]
fn a_ref_from_elsewhere_is_adopted_only_when_it_extends_this_history() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let records: Vec<Vec<u8>> = (0..8).map(|i| bytes(i, 64)).collect();
    ingest(&mut granary, "d", tokens_layout(32), small_shards(1 << 20), &records[..4]);
    ingest(&mut granary, "d", tokens_layout(32), small_shards(1 << 20), &records[4..]);
    ingest(&mut granary, "e", tokens_layout(32), small_shards(1 << 20), &records[..2]);
    let name = granary::DatasetName::new("d").unwrap();
    let local = granary.paths().read_ref(&name).unwrap();
    let other = granary.paths().read_ref(&granary::DatasetName::new("e").unwrap()).unwrap().latest().manifest;
    // Not ahead: kept as it is.
    assert!(!granary.adopt_ref(&name, &local).unwrap());
    // Newer, but without this node's latest version: not an extension of this history.
    let skipping = local.with_next(other).unwrap().without(2).unwrap();
    let error = granary.adopt_ref(&name, &skipping).unwrap_err().to_string();
    assert!(error.contains("two histories"), "{error}");
    assert_eq!(granary.paths().read_ref(&name).unwrap(), local);
    // Ahead, with version 1 removed where it comes from: adopted, and version 1 goes.
    let ahead = local.with_next(other).unwrap().without(1).unwrap();
    assert!(granary.adopt_ref(&name, &ahead).unwrap());
    let now = granary.paths().read_ref(&name).unwrap();
    assert_eq!(now, ahead);
    assert!(now.version(1).is_none());
    // Another history under the same name (version 1 names another manifest): refused.
    let diverged = granary::store::RefLog::first(other)
        .with_next(other)
        .unwrap()
        .with_next(other)
        .unwrap()
        .with_next(other)
        .unwrap();
    let error = granary.adopt_ref(&name, &diverged).unwrap_err().to_string();
    assert!(error.contains("two histories"), "{error}");
    assert_eq!(granary.paths().read_ref(&name).unwrap(), ahead);
}
