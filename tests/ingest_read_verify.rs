//! Ingest from each source, read everything back verified through every backend, verify, and
//! the versioning around it: append, replace, deduplication, removal and garbage collection. A
//! reader keeps its files open from read to read, and lets go of one removed or replaced.

mod common;

use std::sync::Arc;

use common::*;
use granary::ingest::{self, IngestMode};
use granary::shard::Sample;
use granary::{Backend, Batch, Dataset, DatasetName, Granary, IoConfig, Layout, Reader, StorePaths, VersionSpec};

fn backends() -> Vec<IoConfig> {
    let mut configs = vec![
        IoConfig { backend: Backend::Pread, ..IoConfig::default() },
        IoConfig { backend: Backend::Uring, ..IoConfig::default() },
        // Tiny ops and a queue of one force extent splitting and serialised completions.
        IoConfig { backend: Backend::Uring, queue_depth: 1, op_bytes_max: 8192, direct: true },
    ];
    configs.push(IoConfig { backend: Backend::Uring, queue_depth: 64, op_bytes_max: 64 << 10, direct: false });
    configs
}

fn open(root: &std::path::Path, spec: &str) -> Arc<Dataset> {
    Dataset::open(&StorePaths::new(root), &VersionSpec::parse(spec).unwrap()).unwrap()
}

fn read_all(dataset: &Arc<Dataset>, config: IoConfig) -> Vec<Vec<u8>> {
    let mut reader = Reader::new(dataset.clone(), config.build().unwrap());
    let indices: Vec<u64> = (0..dataset.n_records()).collect();
    let mut out = Vec::new();
    reader
        .read_batches(indices.chunks(7), 3, &mut |batch| {
            out.extend(batch.records().map(<[u8]>::to_vec));
            Ok(())
        })
        .unwrap();
    assert_eq!(reader.stats().records, dataset.n_records());
    out
}

#[test]
fn token_records_read_back_verified_through_every_backend() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let records: Vec<Vec<u8>> = (0..300).map(|i| bytes(i, 256)).collect();
    let mut granary = Granary::create(&root).unwrap();
    assert_eq!(ingest(&mut granary, "tokens", tokens_layout(128), small_shards(8 << 10), &records), 1);
    drop(granary);

    let dataset = open(&root, "tokens");
    assert_eq!(dataset.n_records(), 300);
    assert!(dataset.n_shards() >= 9, "8 KiB shards of 256-byte records: {} shards", dataset.n_shards());
    for config in backends() {
        assert_eq!(read_all(&dataset, config), records, "{config:?}");
    }

    // Random access with repeats: a batch of fixed records is one dense array in request order.
    let mut reader = Reader::new(dataset.clone(), IoConfig::default().build().unwrap());
    let indices = [299, 0, 17, 17, 150, 31, 32, 33];
    let mut batch = Batch::default();
    reader.read_batch(&indices, &mut batch).unwrap();
    let dense: Vec<u8> = indices.iter().flat_map(|&i| records[i as usize].clone()).collect();
    assert_eq!(batch.data(), &dense[..]);
    assert_eq!(batch.indices(), &indices);
    assert_eq!(reader.get(42).unwrap(), records[42]);
    assert!(matches!(reader.get(300), Err(granary::Error::RecordOutOfRange { index: 300, n_records: 300 })));

    let report = granary::engine::verify(&StorePaths::new(&root), None).unwrap();
    assert!(report.failures.is_empty(), "{:?}", report.failures);
    assert_eq!(report.shards_ok, dataset.n_shards() as u64);
    assert_eq!((report.manifests_ok, report.refs_ok), (1, 1));
}

#[test]
fn record_files_ingest_through_the_cli_and_get_returns_raw_bytes() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let records: Vec<Vec<u8>> = (0..64).map(|i| bytes(100 + i, 4096)).collect();
    let (a, b) = (dir.path().join("a.bin"), dir.path().join("b.bin"));
    write_records(&a, &records[..40]);
    write_records(&b, &records[40..]);
    let out = granary_ok(
        &root,
        &["ingest", "records", "--name", "tok", "--record-bytes", "4096", "--dtype", "u16", "--shard-bytes", "64K"]
            .iter()
            .copied()
            .chain([a.to_str().unwrap(), b.to_str().unwrap()])
            .collect::<Vec<_>>(),
    );
    assert!(out.contains("tok@1: 64 records in 4 shards"), "{out}");
    for i in [0usize, 39, 40, 63] {
        let out = granary(&root, &["get", "tok", &i.to_string()]);
        assert!(out.status.success());
        assert_eq!(out.stdout, records[i]);
    }
    let ls = granary_ok(&root, &["ls"]);
    assert!(ls.contains("tok") && ls.contains("fixed u16[2048] (4096 B)"), "{ls}");
    let inspect = granary_ok(&root, &["inspect", "tok"]);
    assert!(inspect.contains("records:  64") && inspect.contains("shards:   4"), "{inspect}");
    let shard = shard_files(&root)[0].file_stem().unwrap().to_str().unwrap().to_owned();
    let inspect = granary_ok(&root, &["inspect", &shard]);
    assert!(inspect.contains("records:  16, 65536 data bytes in 16 blocks"), "{inspect}");
    let verify = granary_ok(&root, &["verify", "tok"]);
    assert!(verify.contains("verified 4 shards, 1 manifests") && verify.contains(": 0 failures"), "{verify}");
}

#[test]
fn a_directory_tree_becomes_one_record_per_file_in_path_order() {
    let dir = tempdir();
    let tree = dir.path().join("tree");
    let files = [("b/2.txt", bytes(1, 10)), ("a.txt", bytes(2, 5000)), ("b/1/x", Vec::new()), ("c", bytes(3, 9000))];
    for (path, content) in &files {
        let path = tree.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, content).unwrap();
    }
    std::os::unix::fs::symlink(tree.join("c"), tree.join("link")).unwrap();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let name = granary::DatasetName::new("files").unwrap();
    let mut session = granary.ingest(name, Layout::Bytes, small_shards(4096)).unwrap();
    let order = ingest::files_from_dir(&mut session, &tree, &()).unwrap();
    session.commit().unwrap();
    let order: Vec<String> = order.iter().map(|p| p.to_str().unwrap().to_owned()).collect();
    assert_eq!(order, ["a.txt", "b/1/x", "b/2.txt", "c"], "sorted by path; the symlink is not followed");

    let dataset = granary.open_dataset(&VersionSpec::parse("files").unwrap()).unwrap();
    let expected: Vec<Vec<u8>> = order.iter().map(|p| files.iter().find(|(f, _)| f == p).unwrap().1.clone()).collect();
    for config in backends() {
        assert_eq!(read_all(&dataset, config), expected);
    }
}

/// Writes a tar of `entries` (path, bytes) at `path`.
fn write_tar(path: &std::path::Path, entries: &[(&str, Vec<u8>)]) {
    let mut builder = tar::Builder::new(std::fs::File::create(path).unwrap());
    for (name, data) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder.append_data(&mut header, name, &data[..]).unwrap();
    }
    builder.into_inner().unwrap();
}

#[test]
fn webdataset_tars_become_one_record_per_sample() {
    let dir = tempdir();
    let tar_path = dir.path().join("shard-000.tar");
    let entries: [(&str, Vec<u8>); 5] = [
        ("s/000.jpg", bytes(1, 3000)),
        ("s/000.cls", b"3".to_vec()),
        ("s/001.jpg", bytes(2, 7000)),
        ("s/001.seg.png", bytes(3, 100)),
        ("s/002.cls", b"9".to_vec()),
    ];
    write_tar(&tar_path, &entries);
    let root = dir.path().join("store");
    let out = granary_ok(&root, &["ingest", "tar", "--name", "wds", tar_path.to_str().unwrap()]);
    assert!(out.contains("wds@1: 3 records"), "{out}");

    let dataset = open(&root, "wds");
    assert_eq!(dataset.layout(), &Layout::Samples);
    let records = read_all(&dataset, IoConfig::default());
    let samples: Vec<Sample<'_>> = records.iter().map(|r| Sample::decode(r).unwrap()).collect();
    assert_eq!(samples.iter().map(|s| s.key).collect::<Vec<_>>(), ["s/000", "s/001", "s/002"]);
    assert_eq!(samples[0].part("jpg"), Some(&entries[0].1[..]));
    assert_eq!(samples[0].part("cls"), Some(&b"3"[..]));
    assert_eq!(samples[1].part("seg.png"), Some(&entries[3].1[..]));
    assert_eq!(samples[2].parts, vec![("cls", &b"9"[..])]);

    // A part name twice in one sample, or one standing for the key, is refused (as WebDataset
    // refuses it) and nothing is committed.
    for (clash, why) in [
        (["t/0.txt", "t/0.txt"], "already has a part of that name"),
        (["t/0.txt", "t/0.__key__"], "stands for the sample's key"),
    ] {
        let tar_path = dir.path().join("clash.tar");
        write_tar(&tar_path, &clash.map(|path| (path, b"x".to_vec())));
        let err = granary_err(&root, &["ingest", "tar", "--name", "clash", tar_path.to_str().unwrap()]);
        assert!(err.contains("clash.tar") && err.contains(clash[1]) && err.contains(why), "{err}");
    }
    let err = granary_err(&root, &["get", "clash", "0"]);
    assert!(err.contains("not found: dataset clash"), "{err}");
}

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
        .args(["--ignored", "--exact", "child_getting_records_one_at_a_time", "--test-threads=1"])
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
