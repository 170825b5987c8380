//! A reader's open files: used a record at a time it opens each shard once, and it lets go of
//! a file whose shard was replaced or removed.

use super::*;

/// A store of 300 records of 256 bytes in 8 KiB shards; its root.
fn small_store(dir: &std::path::Path) -> (std::path::PathBuf, Vec<Vec<u8>>) {
    let root = dir.join("store");
    let records: Vec<Vec<u8>> = (0..300).map(|i| bytes(i, 256)).collect();
    let mut granary = Granary::create(&root).unwrap();
    ingest(&mut granary, "tokens", tokens_layout(128), small_shards(8 << 10), &records);
    (root, records)
}

/// The child of `a_reader_used_a_record_at_a_time_opens_each_shard_once`, run under strace:
/// reads every record of the store one at a time, three times over.
#[test]
#[ignore = "run by its parent test under strace"]
fn child_getting_records_one_at_a_time() {
    let Ok(root) = std::env::var("GRANARY_TEST_GET_STORE") else { return };
    let dataset = open(std::path::Path::new(&root), "tokens");
    for config in [IoConfig::default(), IoConfig { backend: Backend::Pread, ..IoConfig::default() }] {
        let mut reader = Reader::new(dataset.clone(), config.build().unwrap());
        for _ in 0..3 {
            for index in 0..dataset.n_records() {
                assert_eq!(reader.get(index).unwrap().len(), 256);
            }
        }
    }
}

#[test]
fn a_reader_used_a_record_at_a_time_opens_each_shard_once() {
    let dir = tempdir();
    let (root, _) = small_store(dir.path());
    let shards = open(&root, "tokens").n_shards();
    let trace = dir.path().join("trace");
    let out = std::process::Command::new("strace")
        .args(["-f", "-e", "trace=open,openat,openat2", "-o"])
        .arg(&trace)
        .arg(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "open_files::child_getting_records_one_at_a_time", "--test-threads=1"])
        .env("GRANARY_TEST_GET_STORE", &root)
        .output()
        .expect("strace runs (make test installs it)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"), "the child ran");
    let trace = std::fs::read_to_string(&trace).unwrap();
    // Opens that succeeded (an O_DIRECT open a file system refuses is tried again without).
    let shard_opens = trace.lines().filter(|line| line.contains("/shards/") && !line.contains("= -1 ")).count();
    // Each shard's metadata is read once (the dataset keeps it) and its file opened once per
    // reader (two readers), where 1800 reads used to open one each.
    assert!(shard_opens <= 3 * shards, "{shard_opens} opens of {shards} shards' files for 1800 reads");
    assert!(shard_opens >= shards, "the trace saw the reads: {shard_opens}");
}

#[test]
fn a_file_kept_open_is_let_go_when_its_shard_is_replaced_or_removed() {
    let dir = tempdir();
    let (root, records) = small_store(dir.path());
    let dataset = open(&root, "tokens");
    let path = dataset.shard_path(0);
    let good = std::fs::read(&path).unwrap();
    let mut reader = Reader::new(dataset.clone(), IoConfig::default().build().unwrap());
    assert_eq!(reader.get(0).unwrap(), records[0]);
    // Damaged in place, the file the reader holds open: the read says so.
    let mut damaged = good.clone();
    damaged[4096 + 10] ^= 1;
    std::fs::write(&path, &damaged).unwrap();
    assert!(reader.get(0).unwrap_err().is_corruption());
    // Replaced by a good copy under its name (as a repair does): read afresh at once.
    let fresh = dir.path().join("fresh");
    std::fs::write(&fresh, &good).unwrap();
    std::fs::rename(&fresh, &path).unwrap();
    assert_eq!(reader.get(0).unwrap(), records[0]);
    // The open file damaged again, then replaced while it stays open: the failed read is read
    // again from the new file, within the same call.
    assert_eq!(reader.get(1).unwrap(), records[1]);
    std::fs::write(&path, &damaged).unwrap();
    std::fs::write(&fresh, &good).unwrap();
    std::fs::rename(&fresh, &path).unwrap();
    assert_eq!(reader.get(0).unwrap(), records[0]);
    // Removed: the watch on its directory tells the reader, which lets the file go at its next
    // read (a millisecond later at most: it reads its notifications that often) and reports
    // the shard missing; the process holds no descriptor of the removed file after that read.
    assert_eq!(reader.get(0).unwrap(), records[0]);
    std::fs::remove_file(&path).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    assert!(matches!(reader.get(0), Err(granary::Error::MissingShard { .. })));
    assert!(!holds_removed(&path), "a descriptor of the removed shard is still open");
    // Another shard, read and then removed while another's records are read: let go too.
    let other = dataset.shard_path(1);
    let first_of_other = (0..records.len() as u64).find(|&i| dataset.locate(i).unwrap().0 == 1).unwrap();
    reader.get(first_of_other).unwrap();
    std::fs::remove_file(&other).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(5));
    let last_shard = dataset.n_shards() - 1;
    let in_last = (0..records.len() as u64).rev().find(|&i| dataset.locate(i).unwrap().0 == last_shard).unwrap();
    assert_eq!(reader.get(in_last).unwrap(), records[in_last as usize]);
    assert!(!holds_removed(&other), "a descriptor of the removed shard is still open");
}

/// Whether this process holds a descriptor of `path`, removed.
fn holds_removed(path: &std::path::Path) -> bool {
    let wanted = format!("{} (deleted)", path.display());
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .any(|target| target.to_string_lossy() == wanted)
}
