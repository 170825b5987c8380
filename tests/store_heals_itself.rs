//! No single damaged file costs data that is still on disk, and no check says "fine" while a
//! live record cannot be read: a damaged ref is rebuilt from its history and `gc` keeps what it
//! pointed at; whole-store `verify` checks that every live version can be read; a damaged
//! catalog is rebuilt by `repair`; an ingest re-writes whatever of its data is missing. Each
//! test drives the `granary` binary as a user would (issue 25).

mod common;

use std::path::{Path, PathBuf};

use common::*;

const RECORD_BYTES: usize = 4096;

/// A store with dataset `name`: 4 MiB of records of 4 KiB in 1 MiB shards (four shards), as in
/// the reproductions. Returns the input file's bytes.
fn store_with(root: &Path, input: &Path, name: &str) -> Vec<u8> {
    let data = bytes(25, 4 << 20);
    std::fs::write(input, &data).unwrap();
    let input = input.to_str().unwrap();
    granary_ok(root, &["ingest", "records", "--name", name, "--record-bytes", "4096", "--shard-bytes", "1M", input]);
    data
}

fn record(data: &[u8], index: usize) -> &[u8] {
    &data[index * RECORD_BYTES..(index + 1) * RECORD_BYTES]
}

/// Asserts `granary get NAME INDEX` prints exactly the record's bytes.
fn assert_reads(root: &Path, name: &str, data: &[u8], index: usize) {
    let out = granary(root, &["get", name, &index.to_string()]);
    assert!(out.status.success(), "get {name} {index}: {}", String::from_utf8_lossy(&out.stderr));
    assert!(out.stdout == record(data, index), "get {name} {index}: wrong bytes");
}

fn manifest_files(root: &Path) -> Vec<PathBuf> {
    granary::StorePaths::new(root)
        .list_objects(granary::store::ObjectKind::Manifest)
        .unwrap()
        .into_iter()
        .map(|(_, path)| path)
        .collect()
}

#[test]
fn a_damaged_ref_loses_no_data() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let data = store_with(&root, &dir.path().join("r.bin"), "A");
    let shards = shard_files(&root);
    assert_eq!(shards.len(), 4);

    // The reproduction: repair, then gc, after the ref is cut short.
    let ref_file = root.join("refs").join("A");
    std::fs::OpenOptions::new().write(true).open(&ref_file).unwrap().set_len(20).unwrap();
    let out = granary(&root, &["repair"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("rebuilt the ref of A from its history (versions 1)"), "{stderr}");
    granary_ok(&root, &["gc"]);
    assert_eq!(shard_files(&root), shards, "gc kept every shard of A");
    for index in [0, 1000, 1023] {
        assert_reads(&root, "A", &data, index);
    }
    let verify = granary_ok(&root, &["verify"]);
    assert!(verify.contains(": 0 failures"), "{verify}");

    // A ref damaged with no history to rebuild it from (a store written before histories):
    // repair says the binding is lost and fails; gc keeps the files for its grace period.
    std::fs::remove_dir_all(root.join("history")).unwrap();
    std::fs::OpenOptions::new().write(true).open(&ref_file).unwrap().set_len(20).unwrap();
    let out = granary(&root, &["repair"]);
    assert!(!out.status.success(), "a ref that could not be rebuilt is a failed repair");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("the ref of A was damaged and has no history"), "{stderr}");
    let gc = granary_ok(&root, &["gc"]);
    assert!(gc.contains("removed 0 shards and 0 manifests"), "{gc}");
    assert_eq!(shard_files(&root), shards, "the grace period kept A's shards");
    // Its manifest is still there, so the data can be read by id and re-bound to its name.
    let manifest = manifest_files(&root).pop().unwrap();
    let manifest_id = manifest.file_stem().unwrap().to_str().unwrap().to_owned();
    assert_reads(&root, &manifest_id, &data, 1000);

    // `--prune-now` keeps them too, and says why (before issue 40 it removed every shard of A
    // right after repair had promised to keep them), until the user restores the ref or
    // forgets A by name.
    let gc = granary_ok(&root, &["gc", "--prune-now"]);
    assert!(gc.contains("removed 0 shards and 0 manifests"), "{gc}");
    assert!(gc.contains("kept 5 objects of A whose ref `repair` quarantined"), "{gc}");
    assert_eq!(shard_files(&root), shards, "a quarantined ref's data outlives --prune-now");
    let forgot = granary_ok(&root, &["rm", "A"]);
    assert!(forgot.contains("forgot dataset A"), "{forgot}");
    let gc = granary_ok(&root, &["gc", "--prune-now"]);
    assert!(gc.contains("removed 4 shards and 1 manifests") && !gc.contains("quarantined"), "{gc}");
    let quarantine: Vec<String> = std::fs::read_dir(root.join("quarantine"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(quarantine.iter().any(|name| name.starts_with("forgotten-ref-A.")), "{quarantine:?}");
    // `rm` of a name with neither a ref nor a quarantined one is still "not found".
    let out = granary(&root, &["rm", "A"]);
    assert!(!out.status.success(), "nothing left to forget");
}

#[test]
fn gc_keeps_what_a_removed_version_used_for_the_grace_period() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let data = store_with(&root, &dir.path().join("r.bin"), "A");
    let shards = shard_files(&root);

    granary_ok(&root, &["rm", "A"]);
    let gc = granary_ok(&root, &["gc"]);
    assert!(gc.contains("removed 0 shards") && gc.contains("14-day grace period"), "{gc}");
    assert_eq!(shard_files(&root), shards);
    let manifest = manifest_files(&root).pop().unwrap();
    assert_reads(&root, manifest.file_stem().unwrap().to_str().unwrap(), &data, 7);

    let gc = granary_ok(&root, &["gc", "--prune-now"]);
    assert!(gc.contains("removed 4 shards and 1 manifests"), "{gc}");
    assert!(shard_files(&root).is_empty() && manifest_files(&root).is_empty());
    assert!(!root.join("history").join("A").exists(), "a removed dataset's history goes with it");
}

#[test]
fn whole_store_verify_fails_while_a_live_version_is_unreadable() {
    let dir = tempdir();
    let root = dir.path().join("store");
    store_with(&root, &dir.path().join("r.bin"), "A");
    let other = dir.path().join("other.bin");
    std::fs::write(&other, bytes(7, 64 * 1024)).unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "B", "--record-bytes", "4096", other.to_str().unwrap()]);

    // A shard of A is deleted: every remaining file is sound, A@1 is not.
    let shard_of_a = shard_files(&root).into_iter().find(|path| is_shard_of(&root, "A", path)).unwrap();
    std::fs::remove_file(&shard_of_a).unwrap();
    let out = granary(&root, &["verify"]);
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stem = shard_of_a.file_stem().unwrap().to_str().unwrap();
    assert!(stderr.contains(&format!("UNREADABLE A@1: shard {stem} is missing")), "{stderr}");
    assert!(!stderr.contains("B@"), "B is whole: {stderr}");

    // A damaged shard that repair quarantined: the same.
    let dir2 = tempdir();
    let root = dir2.path().join("store");
    store_with(&root, &dir2.path().join("r.bin"), "A");
    let victim = shard_files(&root).remove(1);
    let mut bytes_on_disk = std::fs::read(&victim).unwrap();
    bytes_on_disk[8192] ^= 0x40;
    std::fs::write(&victim, &bytes_on_disk).unwrap();
    assert!(!granary(&root, &["repair"]).status.success(), "repair reports the shard it leaves missing");
    assert!(!victim.exists());
    let out = granary(&root, &["verify"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("UNREADABLE A@1: shard") && stderr.contains("is missing"), "{stderr}");
}

fn is_shard_of(root: &Path, name: &str, shard: &Path) -> bool {
    let paths = granary::StorePaths::new(root);
    let (manifest, _) = paths.resolve(&granary::VersionSpec::parse(name).unwrap()).unwrap();
    paths.read_manifest(manifest).unwrap().entries().iter().any(|e| paths.shard(e.shard) == shard)
}

#[test]
fn a_damaged_catalog_is_rebuilt_at_the_next_open() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("r.bin");
    let data = store_with(&root, &input, "A");
    granary_ok(&root, &["repair"]);
    let db = root.join("catalog").join("db");
    std::fs::OpenOptions::new().write(true).open(&db).unwrap().set_len(100).unwrap();

    // Nothing stops for a person (issue 53): the first command that opens the store (here
    // `ls`) rebuilds the catalog from the files, as repair does, says so once, keeps the damaged
    // one in quarantine, and does its work; the writers after it find a sound catalog.
    let out = granary(&root, &["ls"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("A "));
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("could not be read") && stderr.contains("rebuilt it from the store's files"), "{stderr}");
    let kept: Vec<_> = std::fs::read_dir(root.join("quarantine")).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(kept.iter().any(|name| name.to_string_lossy().starts_with("catalog.")), "{kept:?}");
    let out = granary(&root, &["gc"]);
    assert!(out.status.success() && out.stderr.is_empty(), "{}", String::from_utf8_lossy(&out.stderr));

    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("A ") && ls.contains("1024"), "{ls}");
    let input = input.to_str().unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "B", "--record-bytes", "4096", input]);
    granary_ok(&root, &["gc"]);
    assert_reads(&root, "A", &data, 1000);
    assert_reads(&root, "B", &data, 3);
}

#[test]
fn an_ingest_rewrites_what_is_missing() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("r.bin");
    let data = store_with(&root, &input, "A");
    // The manifest and a shard are lost; the catalog still lists both.
    for path in [manifest_files(&root).remove(0), shard_files(&root).remove(2)] {
        std::fs::remove_file(path).unwrap();
    }
    let input = input.to_str().unwrap();
    let out = granary_ok(
        &root,
        &["ingest", "records", "--name", "A", "--replace", "--record-bytes", "4096", "--shard-bytes", "1M", input],
    );
    assert!(out.contains("unchanged: A@1 already holds exactly these 1024 records"), "{out}");
    assert!(out.contains("1 missing shards written again"), "{out}");
    let verify = granary_ok(&root, &["verify"]);
    assert!(verify.contains(": 0 failures"), "{verify}");
    for index in [0, 600, 1023] {
        assert_reads(&root, "A", &data, index);
    }

    // An append reuses the current version's shards: one that is gone is refused up front,
    // never committed into an unreadable version.
    std::fs::remove_file(shard_files(&root).remove(0)).unwrap();
    let err = granary_err(&root, &["ingest", "records", "--name", "A", "--append", "--record-bytes", "4096", input]);
    assert!(err.contains("not found: shard"), "{err}");
    let ls = granary_ok(&root, &["ls"]);
    assert!(!ls.contains("A@2") && ls.contains("1 versions"), "{ls}");
}
