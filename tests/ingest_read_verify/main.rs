//! Ingest from each source and read everything back verified through every backend. This file
//! holds the sources (token records, record files through the CLI, directory trees, WebDataset
//! tars); `versions.rs` the versioning around an ingest (drops, appends, gc, shared readers,
//! adopted refs); `open_files.rs` a reader's open files (each shard opened once, let go when
//! replaced or removed).

#[path = "../common/mod.rs"]
mod common;
mod open_files;
mod versions;

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
