//! Damaged bytes, on disk or in flight, come back as structured errors and never as data.

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use granary::io::{Fault, FaultIo};
use granary::{
    Backend, Batch, Dataset, Error, FormatError, Granary, IoConfig, Loader, LoaderConfig, Position, Reader, StorePaths,
    TierSetting, VersionSpec,
};

/// A store with dataset "d": 40 records of 4 KiB in 8 KiB shards (2 records, 2 blocks each).
fn store() -> (tempfile::TempDir, std::path::PathBuf, Vec<Vec<u8>>) {
    let dir = tempdir();
    let root = dir.path().join("store");
    let records: Vec<Vec<u8>> = (0..40).map(|i| bytes(i, 4096)).collect();
    let mut granary = Granary::create(&root).unwrap();
    ingest(&mut granary, "d", tokens_layout(2048), small_shards(8192), &records);
    (dir, root, records)
}

fn dataset(root: &std::path::Path) -> std::sync::Arc<Dataset> {
    Dataset::open(&StorePaths::new(root), &VersionSpec::parse("d").unwrap()).unwrap()
}

#[test]
fn a_flipped_bit_on_disk_is_a_checksum_error_naming_shard_and_block() {
    let (_dir, root, records) = store();
    let dataset = dataset(&root);
    // Record 5 is the second record of shard 2: data block 1 of that shard.
    let (shard, local) = dataset.locate(5).unwrap();
    assert_eq!((shard, local), (2, 1));
    let path = dataset.shard_path(shard);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let offset = granary::shard::DATA_OFFSET + 4096 + 100;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, offset).unwrap();
    file.write_all_at(&[byte[0] ^ 0x10], offset).unwrap();
    file.sync_all().unwrap();

    for backend in [Backend::Pread, Backend::Uring] {
        let mut reader = Reader::new(dataset.clone(), IoConfig { backend, ..IoConfig::default() }.build().unwrap());
        let mut batch = Batch::default();
        reader.read_batch(&[0, 1], &mut batch).unwrap();
        let error = reader.read_batch(&[4, 5, 6], &mut batch).unwrap_err();
        match error {
            Error::ChecksumMismatch { shard, block, expected, actual } => {
                assert_eq!(shard, dataset.shard_id(2));
                assert_eq!(block, 1);
                assert_ne!(expected, actual);
            }
            other => panic!("{backend:?}: expected a checksum mismatch, got {other}"),
        }
        assert!(batch.is_empty() && batch.data().is_empty(), "no byte of a failed batch is visible");
        // The records around it still read.
        reader.read_batch(&[4, 6], &mut batch).unwrap();
        assert_eq!(batch.record(0), &records[4][..]);
    }

    let report = granary::engine::verify(&StorePaths::new(&root), None).unwrap();
    assert_eq!(report.failures.len(), 1);
    assert_eq!(report.failures[0].path, path);
    assert!(report.failures[0].error.is_corruption());
    let out = granary(&root, &["verify"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("block 1 checksum mismatch"), "{stderr}");
    let err = granary_err(&root, &["get", "d", "5"]);
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(granary(&root, &["get", "d", "4"]).status.success());
}

#[test]
fn a_truncated_shard_fails_when_opened_and_a_swapped_one_fails_its_manifest() {
    let (_dir, root, _) = store();
    let dataset = dataset(&root);
    let path = dataset.shard_path(3);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 4096).unwrap();
    let mut reader = Reader::new(dataset.clone(), IoConfig::default().build().unwrap());
    match reader.get(6) {
        Err(Error::Format { path: reported, source: FormatError::Truncated { .. } | FormatError::BadMagic { .. } }) => {
            assert_eq!(reported, path)
        }
        other => panic!("expected a format error, got {other:?}"),
    }
    let err = granary_err(&root, &["get", "d", "6"]);
    assert!(err.contains(path.to_str().unwrap()), "{err}");

    // A complete, valid shard in the wrong place: its own checks pass, the manifest's do not.
    std::fs::copy(dataset.shard_path(0), &path).unwrap();
    let fresh = self::dataset(&root);
    let error = Reader::new(fresh, IoConfig::default().build().unwrap()).get(6).unwrap_err();
    assert!(
        matches!(error, Error::Format { source: FormatError::Inconsistent { field: "metadata digest", .. }, .. }),
        "{error}"
    );
    let report = granary::engine::verify(&StorePaths::new(&root), None).unwrap();
    assert!(report.failures.iter().any(|f| matches!(f.error, Error::HashMismatch { .. })), "{:?}", report.failures);
}

#[test]
fn a_shard_from_a_newer_format_version_is_named_as_such() {
    let (_dir, root, _) = store();
    let dataset = dataset(&root);
    let path = dataset.shard_path(0);
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut header = vec![0u8; 4096];
    file.read_exact_at(&mut header, 0).unwrap();
    header[8..12].copy_from_slice(&7u32.to_le_bytes());
    let crc = crc32c::crc32c(&header[..4092]);
    header[4092..].copy_from_slice(&crc.to_le_bytes());
    file.write_all_at(&header, 0).unwrap();
    let err = granary_err(&root, &["get", "d", "0"]);
    assert!(err.contains("unsupported shard header format version 7 (this build reads version 1)"), "{err}");
}

#[test]
fn faults_in_flight_are_caught_and_reported() {
    let (_dir, root, records) = store();
    let dataset = dataset(&root);
    for backend in [Backend::Pread, Backend::Uring] {
        let inner = IoConfig { backend, ..IoConfig::default() }.build().unwrap();
        let faults = vec![Fault::FlipBit { op: 1, bit: 77_777 }, Fault::FailRead { op: 3, errno: libc::EIO }];
        let mut reader = Reader::new(dataset.clone(), Box::new(FaultIo::new(inner, faults)));
        let mut batch = Batch::default();
        // Op 0: record 0 alone.
        reader.read_batch(&[0], &mut batch).unwrap();
        assert_eq!(batch.record(0), &records[0][..]);
        // Op 1 carries a flipped bit: caught, not returned.
        let error = reader.read_batch(&[2], &mut batch).unwrap_err();
        assert!(matches!(error, Error::ChecksumMismatch { block: 0, .. }), "{backend:?}: {error}");
        assert!(batch.is_empty());
        // Op 2 is clean again.
        reader.read_batch(&[2], &mut batch).unwrap();
        assert_eq!(batch.record(0), &records[2][..]);
        // Op 3 fails with EIO: an I/O error, not corruption.
        let error = reader.read_batch(&[9], &mut batch).unwrap_err();
        match &error {
            Error::Io { source, .. } => assert_eq!(source.raw_os_error(), Some(libc::EIO)),
            other => panic!("{backend:?}: expected EIO, got {other}"),
        }
        assert!(!error.is_corruption());
        reader.read_batch(&[9], &mut batch).unwrap();
        assert_eq!(batch.record(0), &records[9][..]);
    }
}

#[test]
fn damaged_refs_and_manifests_are_format_errors() {
    let (_dir, root, _) = store();
    let paths = StorePaths::new(&root);
    let name = granary::DatasetName::new("d").unwrap();
    let manifest = paths.read_ref(&name).unwrap().latest().manifest;
    let manifest_path = paths.manifest(manifest);
    let mut bytes = std::fs::read(&manifest_path).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&manifest_path, &bytes).unwrap();
    assert!(matches!(paths.read_manifest(manifest), Err(Error::HashMismatch { .. })));
    let err = granary_err(&root, &["get", "d", "0"]);
    assert!(err.contains("does not match its id"), "{err}");

    let ref_path = paths.ref_file(&name);
    let mut text = std::fs::read(&ref_path).unwrap();
    text[20] ^= 1;
    std::fs::write(&ref_path, &text).unwrap();
    assert!(matches!(paths.read_ref(&name), Err(Error::Format { .. })));
}

/// A bit flipped in an op read straight into the batch, while a verify worker checks it and the
/// reading thread goes on with the next ops: the read fails with the block named, no batch with
/// the damaged record is delivered, and the batches before it are whole.
#[test]
fn a_bit_flipped_under_a_verify_worker_is_caught_and_nothing_damaged_is_delivered() {
    let dir = tempdir();
    let records: Vec<Vec<u8>> = (0..512).map(|i| bytes(i + 11, 4096)).collect();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    // One shard: op b is batch b.
    ingest(&mut granary, "w", tokens_layout(2048), small_shards(8 << 20), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("w").unwrap()).unwrap();
    // 64 KiB ops (16 records): batch b is op b; op 5 gets bit 3 of its block 7 flipped.
    let batches: Vec<Vec<u64>> = (0..32).map(|b| (b * 16..b * 16 + 16).collect()).collect();
    for backend in [Backend::Pread, Backend::Uring] {
        let inner = IoConfig { backend, queue_depth: 8, op_bytes_max: 64 << 10, direct: true }.build().unwrap();
        let faults = vec![Fault::FlipBit { op: 5, bit: 7 * 4096 * 8 + 3 }];
        let mut reader = Reader::new(dataset.clone(), Box::new(FaultIo::new(inner, faults)));
        reader.set_verify_threads(1);
        let mut delivered = Vec::new();
        let error = reader
            .read_batches(&batches, 4, &mut |batch| {
                delivered.push((batch.indices().to_vec(), batch.data().to_vec()));
                Ok(())
            })
            .unwrap_err();
        let (shard, block) = match &error {
            Error::ChecksumMismatch { shard, block, .. } => (*shard, *block),
            other => panic!("{backend:?}: expected a checksum mismatch, got {other}"),
        };
        let (damaged_shard, local) = dataset.locate(5 * 16 + 7).unwrap();
        assert_eq!(shard, dataset.shard_id(damaged_shard), "{backend:?}");
        assert_eq!(block, local, "{backend:?}: records are one block each");
        assert!(delivered.len() <= 5, "{backend:?}: {} batches delivered past the damage", delivered.len());
        for (indices, data) in &delivered {
            let expected: Vec<u8> = indices.iter().flat_map(|&i| records[i as usize].clone()).collect();
            assert!(data == &expected, "{backend:?}: a delivered batch is not the input");
        }
        let stats = reader.stats();
        assert!(stats.ops_offloaded >= 1, "{backend:?}: no check ran on a worker: {stats:?}");
        assert_eq!(stats.verify_failures, 1, "{backend:?}");
        // The damage was in flight only: read again, everything is whole.
        read_as_the_model(&mut reader, &batches, 4, &records, &format!("{backend:?}"));
    }
}

/// The same for records that are not whole blocks: a long op is read into the reader's scratch
/// memory, and a worker checks it and copies its records into the batch. A bit flipped there is
/// caught before anything is copied, and no batch holding a byte of the op is delivered.
#[test]
fn a_bit_flipped_in_an_op_a_worker_copies_from_is_caught_and_nothing_damaged_is_delivered() {
    let dir = tempdir();
    let records: Vec<Vec<u8>> = (0..1000).map(|i| bytes(i + 13, 1000)).collect();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    ingest(&mut granary, "v", granary::Layout::Bytes, small_shards(8 << 20), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("v").unwrap()).unwrap();
    // Batches of 131 records (about 32 blocks): two 64 KiB ops each, and a short one where a
    // batch ends inside a block the next one starts in.
    let batches: Vec<Vec<u64>> = (0..7).map(|b| (b * 131..b * 131 + 131).collect()).collect();
    for backend in [Backend::Pread, Backend::Uring] {
        let inner = IoConfig { backend, queue_depth: 8, op_bytes_max: 64 << 10, direct: true }.build().unwrap();
        // Op 12 is batch 4's or 5's, block 3 of the op: damaged in flight. With three batches in
        // flight, batch 1 or 2 was delivered before it was read; a batch's ops are counted when
        // it is delivered.
        let faults = vec![Fault::FlipBit { op: 12, bit: 3 * 4096 * 8 + 5 }];
        let mut reader = Reader::new(dataset.clone(), Box::new(FaultIo::new(inner, faults)));
        reader.set_verify_threads(1);
        let mut delivered = Vec::new();
        let error = reader
            .read_batches(&batches, 3, &mut |batch| {
                delivered.push((batch.indices().to_vec(), batch.data().to_vec()));
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(error, Error::ChecksumMismatch { .. }), "{backend:?}: {error}");
        assert!((1..=5).contains(&delivered.len()), "{backend:?}: {} batches delivered", delivered.len());
        for (indices, data) in &delivered {
            let expected: Vec<u8> = indices.iter().flat_map(|&i| records[i as usize].clone()).collect();
            assert!(data == &expected, "{backend:?}: a delivered batch is not the input");
        }
        let stats = reader.stats();
        // Batch 0's first op happens to be its first 64 KiB, read straight into it; the others
        // went through the scratch memory.
        assert!(stats.ops_offloaded > stats.ops_direct, "{backend:?}: no copy was made by a worker: {stats:?}");
        // The damage was in flight only: read again, everything is whole.
        read_as_the_model(&mut reader, &batches, 3, &records, &format!("{backend:?}"));
    }
}

/// A loop device holding an ext4 file system mounted at a temporary directory, taken down when
/// dropped.
struct LoopMount {
    device: String,
    mount: std::path::PathBuf,
}

impl LoopMount {
    fn new(dir: &std::path::Path) -> Self {
        let run = |program: &str, args: &[&str]| {
            let out = std::process::Command::new(program).args(args).output().unwrap();
            assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap().trim().to_owned()
        };
        let image = dir.join("disk.img");
        std::fs::File::create(&image).unwrap().set_len(64 << 20).unwrap();
        run("mkfs.ext4", &["-q", "-F", "-b", "4096", image.to_str().unwrap()]);
        let device = run("losetup", &["-f", "--show", image.to_str().unwrap()]);
        let mount = dir.join("mnt");
        std::fs::create_dir(&mount).unwrap();
        let mounted = LoopMount { device, mount };
        run("mount", &[mounted.device.as_str(), mounted.mount.to_str().unwrap()]);
        mounted
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        // A file system a reader just used can stay busy a moment (an io_uring ring's files are
        // let go by the kernel after the ring closes): tried again, then detached lazily.
        let unmounted = (0..40).any(|_| {
            let done = std::process::Command::new("umount")
                .arg(&self.mount)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !done {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            done
        });
        if !unmounted {
            let _ = std::process::Command::new("umount").arg("-l").arg(&self.mount).status();
        }
        let _ = std::process::Command::new("losetup").args(["-d", &self.device]).status();
    }
}

/// The device offset of byte `offset` of `path`, by `filefrag` (FIEMAP) in 4096-byte blocks.
fn device_offset(path: &std::path::Path, offset: u64) -> u64 {
    let out = std::process::Command::new("filefrag").args(["-v", "-b4096"]).arg(path).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    // Extent lines: "   0:        0..       3:      34816..     34819:      4:  ..."
    for line in text.lines().filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit())) {
        let fields: Vec<&str> = line.split(':').map(str::trim).collect();
        let logical: Vec<u64> = fields[1].split("..").map(|v| v.trim().parse().unwrap()).collect();
        let physical: u64 = fields[2].split("..").next().unwrap().trim().parse().unwrap();
        let block = offset / 4096;
        if (logical[0]..=logical[1]).contains(&block) {
            return (physical + block - logical[0]) * 4096 + offset % 4096;
        }
    }
    panic!("no extent of {} holds byte {offset}: {text}", path.display());
}

#[test]
fn verify_reads_the_device_not_the_page_cache() {
    // Issue 53: with a shard's pages cached, a byte flipped on the device under them passed
    // `granary verify` (it read the cache); the loader's cold read and `get` refused it.
    let is_root =
        std::fs::metadata("/proc/self").map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0).unwrap_or(false);
    let tools = ["mkfs.ext4", "losetup", "filefrag", "mount"].iter().all(|tool| {
        std::process::Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !machine_has(
        is_root && tools && std::path::Path::new("/dev/loop-control").exists(),
        "root, loop devices, mkfs.ext4 and filefrag",
    ) {
        return;
    }
    let dir = tempdir();
    let mounted = LoopMount::new(dir.path());
    let root = mounted.mount.join("store");
    let records: Vec<Vec<u8>> = (0..40).map(|i| bytes(i, 4096)).collect();
    let mut writer = Granary::create(&root).unwrap();
    ingest(&mut writer, "d", tokens_layout(2048), small_shards(8192), &records);
    drop(writer);
    granary_ok(&root, &["verify"]);

    let shard = shard_files(&root).into_iter().next().unwrap();
    // Its pages in the page cache, as a loader leaves them.
    let cached = std::fs::read(&shard).unwrap();
    // One byte of data block 0 flipped on the device, beneath the cache (O_DIRECT on the device).
    let target = device_offset(&shard, granary::shard::DATA_OFFSET + 100);
    use std::os::unix::fs::OpenOptionsExt;
    let device =
        std::fs::OpenOptions::new().read(true).write(true).custom_flags(libc::O_DIRECT).open(&mounted.device).unwrap();
    let mut block = granary::io::AlignedBuf::new(4096).unwrap();
    let at = target / 4096 * 4096;
    device.read_exact_at(block.as_mut_slice(), at).unwrap();
    block.as_mut_slice()[(target - at) as usize] ^= 0x20;
    device.write_all_at(block.as_slice(), at).unwrap();
    device.sync_all().unwrap();
    // The cache still holds the bytes as they were: what a scrub of memory would check.
    assert_eq!(std::fs::read(&shard).unwrap(), cached);

    let out = granary(&root, &["verify"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stderr.contains("block 0 checksum mismatch"), "{stderr}");
    assert!(stdout.contains("1 unreadable: 2 failures") && !stdout.contains("page cache"), "{stdout}");

    // The loader's next cold read (the file's pages let go, tier off) refuses the block: no
    // damaged byte reaches the trainer.
    let file = std::fs::File::open(&shard).unwrap();
    granary::io::advise(&file, 0, 0, granary::io::Advice::DontNeed).unwrap();
    let dataset = dataset(&root);
    let config = || LoaderConfig {
        batch_size: 4,
        epochs: Some(1),
        target: granary::Target::Host,
        tier: TierSetting::Off,
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(std::sync::Arc::clone(&dataset), config(), Position::default()).unwrap();
    let failed = loop {
        match loader.next().expect("the damaged block ends the stream with an error") {
            Ok(batch) => {
                for (i, &index) in batch.indices().iter().enumerate() {
                    assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
                }
            }
            Err(error) => break error,
        }
    };
    assert!(matches!(failed, Error::ChecksumMismatch { block: 0, .. }), "{failed}");
    drop(loader);

    // With a repair (here the bytes as they were, put back as a peer's copy is), the same read
    // refuses the block, repairs the shard and delivers every record right; the scrub then passes.
    let hook = std::sync::Arc::new(PutBack { path: shard.clone(), good: cached, repairs: 0.into() });
    let config = LoaderConfig { repair: Some(hook.clone() as std::sync::Arc<dyn granary::ShardSource>), ..config() };
    let mut loader = Loader::new(dataset, config, Position::default()).unwrap();
    assert_eq!(drain_checked(&mut loader, &records), records.len());
    assert_eq!(hook.repairs.load(std::sync::atomic::Ordering::Relaxed), 1);
    assert!(loader.stats().read.verify_failures >= 1, "{:?}", loader.stats().read);
    granary_ok(&root, &["verify"]);
}
