//! What a user gets from the command line when they ingest the same data again, ingest
//! Megatron-LM's token files, or point it at a store it cannot write or one with stray entries
//! (issues 23 and 25): the same ingest twice changes nothing, a different one says what it
//! needs; a read-only store lists, inspects, reads and verifies; what the store did not write
//! is left alone and reported by repair.

mod common;

use std::path::Path;

use common::*;

#[test]
fn the_same_ingest_twice_is_unchanged_and_a_different_one_asks_for_append_or_replace() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
    std::fs::write(&a, bytes(1, 100 * 64)).unwrap();
    std::fs::write(&b, bytes(2, 10 * 64)).unwrap();
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let ingest = |extra: &[&str], input: &str| {
        let mut args = vec!["ingest", "records", "--name", "t", "--record-bytes", "64"];
        args.extend_from_slice(extra);
        args.push(input);
        granary(&root, &args)
    };
    assert!(ingest(&[], a).status.success());
    let again = ingest(&[], a);
    let out = String::from_utf8_lossy(&again.stdout);
    assert!(
        again.status.success() && out.starts_with("unchanged: t@1 already holds exactly these 100 records"),
        "{out}"
    );
    let differs = ingest(&[], b);
    let err = String::from_utf8_lossy(&differs.stderr);
    assert!(!differs.status.success(), "a different input needs --append or --replace");
    assert!(err.contains("t@1: 100 records") && err.contains("--append") && err.contains("--replace"), "{err}");
    assert_eq!(shard_files(&root).len(), 1, "the refused ingest left no shard");
    let err = granary_err(&root, &["get", "t@2", "0"]);
    assert!(err.contains("version 2 of dataset t"), "no version was added: {err}");
    let out = String::from_utf8_lossy(&ingest(&["--append"], b).stdout).into_owned();
    assert!(out.starts_with("t@2: 110 records"), "{out}");
    let out = String::from_utf8_lossy(&ingest(&["--replace"], b).stdout).into_owned();
    assert!(out.starts_with("t@3: 10 records"), "{out}");
    let both = ingest(&["--append", "--replace"], b);
    assert!(!both.status.success());
}

/// Writes `PREFIX.bin` and `PREFIX.idx` in Megatron-LM's published layout (version 1, u16
/// tokens, one document per sequence).
fn write_megatron(prefix: &Path, sequences: &[Vec<u16>]) {
    let mut bin = Vec::new();
    let mut idx = b"MMIDIDX\x00\x00".to_vec();
    idx.extend_from_slice(&1u64.to_le_bytes());
    idx.push(8);
    idx.extend_from_slice(&(sequences.len() as u64).to_le_bytes());
    idx.extend_from_slice(&(sequences.len() as u64 + 1).to_le_bytes());
    for s in sequences {
        idx.extend_from_slice(&(s.len() as i32).to_le_bytes());
    }
    for s in sequences {
        idx.extend_from_slice(&(bin.len() as i64).to_le_bytes());
        bin.extend(s.iter().flat_map(|t| t.to_le_bytes()));
    }
    for d in 0..=sequences.len() {
        idx.extend_from_slice(&(d as i64).to_le_bytes());
    }
    std::fs::write(prefix.with_extension("bin"), bin).unwrap();
    std::fs::write(prefix.with_extension("idx"), idx).unwrap();
}

#[test]
fn a_megatron_dataset_ingests_one_record_per_sequence() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let sequences: Vec<Vec<u16>> =
        (0..40u16).map(|i| (0..(i * 37 % 500)).map(|t| t.wrapping_mul(31).wrapping_add(i)).collect()).collect();
    let prefix = dir.path().join("corpus_text_document");
    write_megatron(&prefix, &sequences);
    let out = granary_ok(&root, &["ingest", "megatron", "--name", "m", prefix.to_str().unwrap()]);
    assert!(out.starts_with("m@1: 40 records"), "{out}");
    assert!(granary_ok(&root, &["ls"]).contains("arrays u16"));
    for i in [0usize, 1, 17, 39] {
        let got = granary(&root, &["get", "m", &i.to_string()]);
        let expected: Vec<u8> = sequences[i].iter().flat_map(|t| t.to_le_bytes()).collect();
        assert!(got.status.success() && got.stdout == expected, "sequence {i}");
    }
    // A damaged index is refused before the store is touched.
    let idx = prefix.with_extension("idx");
    let len = std::fs::metadata(&idx).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&idx).unwrap().set_len(len - 3).unwrap();
    let err = granary_err(&root, &["ingest", "megatron", "--name", "broken", prefix.to_str().unwrap()]);
    assert!(err.contains("is not a Megatron index"), "{err}");
}

#[test]
fn entries_the_store_did_not_write_are_left_alone_and_reported_by_repair() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("a.bin");
    std::fs::write(&input, bytes(3, 64 * 64)).unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "t", "--record-bytes", "64", input.to_str().unwrap()]);
    std::fs::create_dir_all(root.join("tmp/junk")).unwrap();
    std::fs::write(root.join("tmp/notes.txt"), b"mine").unwrap();
    std::fs::create_dir(root.join("refs/adir")).unwrap();
    std::os::unix::fs::symlink("loop", root.join("refs/loop")).unwrap();
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.lines().any(|l| l.starts_with("t ") && l.contains(" 64 ")), "{ls}");
    let input2 = dir.path().join("b.bin");
    std::fs::write(&input2, bytes(4, 64 * 8)).unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "u", "--record-bytes", "64", input2.to_str().unwrap()]);
    let repair = granary(&root, &["repair"]);
    let err = String::from_utf8_lossy(&repair.stderr);
    assert!(repair.status.success(), "{err}");
    for stray in ["tmp/junk", "tmp/notes.txt", "refs/adir", "refs/loop"] {
        assert!(err.contains(&format!("left alone {}", root.join(stray).display())), "{stray}: {err}");
    }
    granary_ok(&root, &["gc", "--prune-now"]);
    assert_eq!(std::fs::read(root.join("tmp/notes.txt")).unwrap(), b"mine", "not the store's to remove");
    granary_ok(&root, &["verify"]);
}

/// Unmounts the read-only view when the test ends, also when it fails.
#[test]
fn a_store_on_a_read_only_mount_is_read_and_writers_say_why_they_cannot() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("a.bin");
    let data = bytes(5, 64 * 64);
    std::fs::write(&input, &data).unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "t", "--record-bytes", "64", input.to_str().unwrap()]);
    let view = dir.path().join("ro");
    std::fs::create_dir(&view).unwrap();
    let bind = std::process::Command::new("mount").arg("--bind").arg(&root).arg(&view).status();
    if !machine_has(bind.is_ok_and(|s| s.success()), "a bind mount (root)") {
        return;
    }
    let _mounted = Mounted(view.clone());
    let remount = std::process::Command::new("mount").args(["-o", "remount,bind,ro"]).arg(&view).status().unwrap();
    assert!(remount.success());
    let ls = granary_ok(&view, &["ls"]);
    assert!(ls.contains('t') && ls.contains("64"), "{ls}");
    granary_ok(&view, &["inspect", "t"]);
    let got = granary(&view, &["get", "t", "5"]);
    assert!(got.status.success() && got.stdout == data[5 * 64..6 * 64]);
    assert!(granary(&view, &["verify"]).status.success());
    let err =
        granary_err(&view, &["ingest", "records", "--name", "u", "--record-bytes", "64", input.to_str().unwrap()]);
    assert!(err.contains("read-only") && err.contains("read-only file system"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn a_writer_that_finds_the_store_locked_says_on_whom_at_once() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("a.bin");
    std::fs::write(&input, bytes(6, 64 * 4)).unwrap();
    let input = input.to_str().unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "t", "--record-bytes", "64", input]);
    // This test process holds the write lock.
    let held = granary::Granary::open(&root).unwrap();
    let me = format!("locked by process {} (", std::process::id());
    let started = std::time::Instant::now();
    let err = granary_err(&root, &["--no-wait", "ingest", "records", "--name", "u", "--record-bytes", "64", input]);
    assert!(err.contains(&me), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "--no-wait does not wait");
    let out = granary(&root, &["--wait", "1", "rm", "t"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let first = err.lines().next().unwrap_or_default();
    assert!(first.contains(&me) && first.contains("waiting up to 1 s"), "{err}");
    assert!(err.lines().last().unwrap_or_default().starts_with("granary: error:"), "{err}");
    drop(held);
    granary_ok(&root, &["--no-wait", "rm", "t"]);
}

#[test]
fn ids_are_taken_by_a_unique_prefix_and_ls_columns_fit_their_content() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("a.bin");
    std::fs::write(&input, bytes(7, 64 * 64)).unwrap();
    let long_name = "a-dataset-name-longer-than-twenty-four-characters";
    granary_ok(&root, &["ingest", "records", "--name", long_name, "--record-bytes", "64", input.to_str().unwrap()]);
    granary_ok(&root, &["ingest", "records", "--name", "b", "--record-bytes", "64", input.to_str().unwrap()]);
    let ls = granary_ok(&root, &["ls"]);
    let lines: Vec<&str> = ls.lines().collect();
    // The header and both rows put VERSION's column in the same place, whatever the name's length.
    let at = |line: &str, what: &str| line.find(what).unwrap_or_else(|| panic!("{what} in {line:?}"));
    let manifest_col = at(lines[0], "MANIFEST");
    let row = lines.iter().find(|l| l.starts_with(long_name)).expect("the long name's row");
    let manifest = row[manifest_col..].split_whitespace().next().unwrap().to_owned();
    assert_eq!(manifest.len(), 12, "{ls}");
    let other = lines.iter().find(|l| l.starts_with("b ")).expect("b's row");
    assert_eq!(&other[manifest_col..manifest_col + 12], manifest, "columns line up: {ls}");

    // The 12 digits ls shows name the version; so do 8; fewer are a name.
    let out = granary_ok(&root, &["inspect", &manifest]);
    assert!(out.contains("records:  64"), "{out}");
    let out = granary_ok(&root, &["inspect", &manifest[..8]]);
    assert!(out.contains(&format!("manifest: {manifest}")), "{out}");
    let got = granary(&root, &["get", &manifest[..10], "3"]);
    assert!(got.status.success() && got.stdout.len() == 64);
    let err = granary_err(&root, &["inspect", &manifest[..7]]);
    assert!(err.contains("not found") && err.contains("at least 8 hex digits"), "{err}");
    let err = granary_err(&root, &["get", &manifest[..4], "3"]);
    assert!(err.contains("not found") && err.contains("at least 8 hex digits"), "{err}");
    // A shard by prefix too.
    let shard = shard_files(&root)[0].file_stem().unwrap().to_str().unwrap().to_owned();
    let out = granary_ok(&root, &["inspect", &shard[..9]]);
    assert!(out.contains(&format!("shard:    {shard}")), "{out}");
    // Two objects sharing a prefix: named, not guessed. Make a second manifest whose id
    // begins as the first's by planting a file under such a name (inspect only lists names).
    let fan = root.join("manifests").join(&manifest[..2]);
    let twin = format!("{}{}", &manifest[..8], "0".repeat(56));
    std::fs::write(fan.join(format!("{twin}.manifest")), b"x").unwrap();
    let err = granary_err(&root, &["inspect", &manifest[..8]]);
    assert!(err.contains("ambiguous") && err.contains("give more digits"), "{err}");
}
