//! The catalog is a cache: deleted, it is rebuilt from the files; damaged files are quarantined,
//! never deleted, and what they leave missing is reported.

mod common;

use common::*;
use granary::{Granary, Layout};

#[test]
fn a_deleted_catalog_is_rebuilt_by_repair() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let a: Vec<Vec<u8>> = (0..100).map(|i| bytes(i, 300)).collect();
    ingest(&mut granary, "a", Layout::Bytes, small_shards(4096), &a);
    ingest(&mut granary, "a", Layout::Bytes, small_shards(4096), &a[..10]);
    ingest(
        &mut granary,
        "b",
        tokens_layout(64),
        small_shards(4096),
        &(0..20).map(|i| bytes(i, 128)).collect::<Vec<_>>(),
    );
    let before = granary.datasets().unwrap();
    let shards_before = granary.catalog().shards().unwrap();
    assert_eq!(before.len(), 2);
    drop(granary);

    std::fs::remove_dir_all(root.join("catalog")).unwrap();
    std::fs::write(root.join("tmp").join("123-4.tmp"), b"a dead writer's partial file").unwrap();
    let out = granary_ok(&root, &["repair"]);
    assert!(
        out.contains("catalog rebuilt") && out.contains("2 datasets; 0 quarantined, 0 missing, 1 temp files removed"),
        "{out}"
    );

    let granary = Granary::open(&root).unwrap();
    assert_eq!(granary.datasets().unwrap(), before);
    assert_eq!(granary.catalog().shards().unwrap(), shards_before);
    drop(granary);
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("a ") && ls.contains("b "), "{ls}");
}

#[test]
fn repair_quarantines_a_corrupt_shard_and_reports_what_it_leaves_missing() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let records: Vec<Vec<u8>> = (0..40).map(|i| bytes(i, 1000)).collect();
    ingest(&mut granary, "d", Layout::Bytes, small_shards(4096), &records);
    drop(granary);

    let dataset =
        granary::Dataset::open(&granary::StorePaths::new(&root), &granary::VersionSpec::parse("d").unwrap()).unwrap();
    let victim = dataset.shard_path(dataset.locate(39).unwrap().0);
    let mut bytes_on_disk = std::fs::read(&victim).unwrap();
    bytes_on_disk[5000] ^= 0x80;
    std::fs::write(&victim, &bytes_on_disk).unwrap();

    let out = common::granary(&root, &["repair"]);
    assert!(!out.status.success(), "a missing shard of a live version is an error");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("quarantined") && stderr.contains("checksum mismatch"), "{stderr}");
    assert!(stderr.contains("missing shard"), "{stderr}");
    assert!(!victim.exists(), "the corrupt file left shards/");
    let quarantined: Vec<_> = std::fs::read_dir(root.join("quarantine")).unwrap().collect();
    assert_eq!(quarantined.len(), 1, "and was kept for a person to look at");

    let granary = Granary::open(&root).unwrap();
    let victim_id = victim.file_stem().unwrap().to_str().unwrap();
    assert!(granary.catalog().shards().unwrap().iter().all(|(id, _)| id.to_string() != victim_id));
    let err = granary_err(&root, &["get", "d", "39"]);
    assert!(err.contains(&format!("not found: shard {victim_id}")), "{err}");
}

#[test]
fn a_damaged_ref_is_quarantined_and_rebuilt_by_repair_and_does_not_lock_the_store() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let records: Vec<Vec<u8>> = (0..5).map(|i| bytes(i, 100)).collect();
    ingest(&mut granary, "good", Layout::Bytes, small_shards(4096), &records);
    ingest(&mut granary, "bad", Layout::Bytes, small_shards(4096), &records[..2]);
    drop(granary);
    let ref_path = root.join("refs").join("bad");
    let good_text = std::fs::read(&ref_path).unwrap();
    let mut text = good_text.clone();
    text[16] ^= 0x02;
    std::fs::write(&ref_path, &text).unwrap();

    let verify = common::granary(&root, &["verify"]);
    assert_eq!(verify.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&verify.stderr).contains("refs/bad"));
    let out = common::granary(&root, &["repair"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("quarantined") && stderr.contains("refs/bad"), "{stderr}");
    assert!(stderr.contains("rebuilt the ref of bad from its history"), "{stderr}");
    assert_eq!(std::fs::read(&ref_path).unwrap(), good_text, "the ref's history holds what it said");
    let granary = Granary::open(&root).unwrap();
    let names: Vec<String> = granary.datasets().unwrap().into_iter().map(|d| d.name.to_string()).collect();
    assert_eq!(names, ["bad", "good"]);
}

/// A user who cannot read one shard (another owner's file, mode 0600) repairs the rest: the
/// catalog is not left empty halfway, the file is named and left in place, and every dataset
/// still lists. Run as root, the repair runs as `nobody` (through `setpriv`) on a store that
/// user owns, with the one shard root's; run as anyone else, that shard is made mode 0000.
#[test]
fn a_shard_the_user_cannot_read_is_named_and_the_rest_is_repaired() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempdir();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = dir.path().join("store");
    let mut granary = Granary::create(&root).unwrap();
    let a: Vec<Vec<u8>> = (0..60).map(|i| bytes(i, 1000)).collect();
    ingest(&mut granary, "a", Layout::Bytes, small_shards(4096), &a);
    ingest(
        &mut granary,
        "b",
        Layout::Bytes,
        small_shards(4096),
        &a[..20].iter().map(|r| r[..500].to_vec()).collect::<Vec<_>>(),
    );
    let shards_before = granary.catalog().shards().unwrap().len();
    drop(granary);
    let dataset =
        granary::Dataset::open(&granary::StorePaths::new(&root), &granary::VersionSpec::parse("a").unwrap()).unwrap();
    let victim = dataset.shard_path(dataset.locate(59).unwrap().0);

    let as_root = std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap();
    let out = if as_root {
        const NOBODY: u32 = 65534;
        for entry in walk(&root) {
            std::os::unix::fs::lchown(&entry, Some(NOBODY), Some(NOBODY)).unwrap();
        }
        std::os::unix::fs::lchown(&victim, Some(0), Some(0)).unwrap();
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o600)).unwrap();
        // The binary where `nobody` can run it, whatever the target directory's modes.
        let binary = dir.path().join("granary");
        std::fs::copy(env!("CARGO_BIN_EXE_granary"), &binary).unwrap();
        std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::process::Command::new("setpriv")
            .args(["--reuid", "65534", "--regid", "65534", "--clear-groups"])
            .arg(&binary)
            .arg("--root")
            .arg(&root)
            .arg("repair")
            .env_remove("GRANARY_ROOT")
            .output()
            .expect("setpriv runs (util-linux)")
    } else {
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o000)).unwrap();
        common::granary(&root, &["repair"])
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a file left unread is not a whole repair: {stdout}");
    assert!(
        stderr.contains(&format!("could not read {}", victim.display())) && stderr.contains("ermission denied"),
        "{stderr}"
    );
    assert!(stderr.contains("run `granary repair` again as a user who can read them"), "{stderr}");
    assert!(
        stdout.contains(&format!("catalog rebuilt: {} shards", shards_before - 1))
            && stdout.contains("2 datasets; 0 quarantined, 0 missing, 1 unreadable"),
        "{stdout}"
    );
    assert!(victim.exists(), "the file it could not read is where it was");
    assert!(!root.join("quarantine").exists() || std::fs::read_dir(root.join("quarantine")).unwrap().next().is_none());

    std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).unwrap();
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("a ") && ls.contains("b ") && !ls.contains("manifest missing"), "{ls}");
    let b = common::granary(&root, &["get", "b", "19"]);
    assert!(b.status.success() && b.stdout == a[19][..500], "{}", String::from_utf8_lossy(&b.stderr));
}

/// Every path under `root`, `root` included.
fn walk(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = vec![root.to_path_buf()];
    if root.is_dir() {
        for entry in std::fs::read_dir(root).unwrap() {
            out.extend(walk(&entry.unwrap().path()));
        }
    }
    out
}

#[test]
fn a_catalog_sled_cannot_read_is_rebuilt_at_open_without_a_person() {
    // Issue 53: after a killed ingest, a writer's open found sled's catalog unreadable and asked
    // for `granary repair`; the catalog is a cache of the files, so the open rebuilds it.
    let dir = tempdir();
    let root = dir.path().join("store");
    let mut writer = Granary::create(&root).unwrap();
    let a: Vec<Vec<u8>> = (0..100).map(|i| bytes(i, 300)).collect();
    ingest(&mut writer, "a", Layout::Bytes, small_shards(4096), &a);
    let before = writer.datasets().unwrap();
    let shards_before = writer.catalog().shards().unwrap();
    drop(writer);
    // Every file of sled's directory overwritten with what no sled wrote.
    for entry in walk(&root.join("catalog")) {
        if entry.is_file() {
            let len = std::fs::metadata(&entry).unwrap().len().max(4096) as usize;
            std::fs::write(&entry, bytes(7, len)).unwrap();
        }
    }
    let reopened = Granary::open(&root).unwrap();
    assert_eq!(reopened.datasets().unwrap(), before);
    assert_eq!(reopened.catalog().shards().unwrap(), shards_before);
    drop(reopened);
    // The command line says so, once, and goes on with its work.
    for entry in walk(&root.join("catalog")) {
        if entry.is_file() {
            std::fs::write(&entry, bytes(8, 8192)).unwrap();
        }
    }
    let records = dir.path().join("records.bin");
    std::fs::write(&records, bytes(9, 4096)).unwrap();
    let out = granary(&root, &["ingest", "records", "--name", "b", "--record-bytes", "64", records.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stderr.matches("rebuilt it from the store's files").count(), 1, "{stderr}");
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("a ") && ls.contains("b "), "{ls}");
    granary_ok(&root, &["verify"]);
}
