//! What goes wrong at or on the way to an origin: a damaged object, transient failures and
//! flipped bits, a fetch or a push killed mid-way, a store mounted read-only.

use super::*;

#[test]
fn a_damaged_shard_at_the_origin_is_named_and_never_delivered() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    store_with(&source, 64, 1);
    let url = format!("s3://{BUCKET}/damaged");
    moto.ok(&source, &["push", "tok", &url]);
    moto.ok(&here, &["attach", "tok", &url]);
    // The origin's copy of the first shard gets one data byte flipped (metadata intact, so the
    // attach's check passed; only the shard's BLAKE3 can tell).
    let shard = shard_files(&source).into_iter().min().unwrap();
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[4096 + 100] ^= 0x01;
    let name = shard.file_name().unwrap().to_str().unwrap().to_owned();
    let id = name.trim_end_matches(".shard");
    let damaged = dir.path().join("damaged.shard");
    std::fs::write(&damaged, &bytes).unwrap();
    moto.origin("damaged").upload(ObjectKind::Shard, ObjectId::parse_hex(id).unwrap(), &damaged, &|_| {}).unwrap();
    // Whichever records that shard holds: ask for each shard's first record until one fails.
    let mut failed = None;
    for index in (0..64).step_by(8) {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        if !out.status.success() {
            assert!(out.stdout.is_empty(), "bytes delivered from a damaged shard");
            failed = Some(String::from_utf8_lossy(&out.stderr).into_owned());
            break;
        }
    }
    let failed = failed.expect("a record of the damaged shard failed");
    assert!(failed.contains(id) && failed.contains("did not hash to its id"), "{failed}");
    assert!(
        !shard_files(&here).iter().any(|f| f.file_name().unwrap() == name.as_str()),
        "the damaged shard was published here"
    );
    assert!(std::fs::read_dir(here.join("origin/incoming")).unwrap().next().is_none(), "partial files left");
}

#[test]
fn transient_failures_are_retried_and_flipped_bits_refetched_never_delivered() {
    use granary::loader::{Loader, LoaderConfig, PlanSource, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 256, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let faulty = Arc::new(Faulty::default());
    let origin = Arc::new(
        Origin::with_store(
            Arc::clone(&faulty) as Arc<dyn object_store::ObjectStore>,
            object_store::path::Path::from("faulty"),
            "memory://faulty".to_owned(),
        )
        .unwrap(),
    );
    let spec = VersionSpec::parse("tok").unwrap();
    // Every upload's first try and the ref's reply fail: the push still lands, whole.
    let pushed = granary::origin::push(&StorePaths::new(&source), &spec, &origin, &|_| {}).unwrap();
    assert_eq!((pushed.shards_uploaded, pushed.ref_written), (4, true), "{pushed:?}");
    let after_push = origin.retries();
    assert!(after_push >= 5, "{after_push} retries: each shard's, the manifest's and the ref's first put failed");

    let bound = dataset_bytes / 2;
    {
        let mut granary = granary::Granary::create(&here).unwrap();
        // Every metadata read fails once, then comes back damaged once: read again until sound.
        granary::origin::attach(&mut granary, &origin, &spec, Some(bound), None).unwrap();
    }
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    let dataset = granary::Dataset::open(&paths, &spec).unwrap();
    let config = LoaderConfig {
        batch_size: 16,
        seed: 3,
        plan: PlanSource::Partitioner { plugin: None, options: Vec::new() },
        epochs: Some(2),
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(dataset, config, granary::Position::default()).unwrap();
    let mut seen = 0;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        for (i, &index) in batch.indices().iter().enumerate() {
            let index = usize::try_from(index).unwrap();
            assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            seen += 1;
        }
    }
    assert_eq!(seen, 2 * 256, "two epochs, every record");
    let stats = cache.stats();
    assert!(stats.refetches > 0, "flipped shards were refetched: {stats:?}");
    let seen_by_loader = loader.stats().cache.expect("the loader reports its cache's counters");
    assert_eq!(seen_by_loader.refetches, stats.refetches);
    assert!(seen_by_loader.waited > 0 && seen_by_loader.hit_ratio() < 1.0, "{seen_by_loader:?}");
    assert!(origin.retries() > after_push, "fetches retried");
    assert!(Faulty::count(&faulty.flipped) > 0 && Faulty::count(&faulty.failed) > 0);
    assert!(shard_bytes_here(&here) <= bound, "over the bound: {} of {bound}, {stats:?}", shard_bytes_here(&here));
    // Nothing damaged was kept.
    assert_shards_whole(&here);
}

#[test]
fn a_fetch_or_a_push_killed_mid_way_leaves_nothing_partial_and_the_next_run_finishes() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 2048, 1);
    let url = format!("s3://{BUCKET}/killed");
    let ids: Vec<(ObjectId, u64)> = shard_files(&source)
        .iter()
        .map(|f| {
            let name = f.file_name().unwrap().to_str().unwrap().trim_end_matches(".shard");
            (ObjectId::parse_hex(name).unwrap(), std::fs::metadata(f).unwrap().len())
        })
        .collect();

    // Pushes killed after a while, each longer: the origin holds whole shards or none, and no
    // ref before every shard and the manifest are there.
    let origin = moto.origin("killed");
    let name = granary::DatasetName::new("tok").unwrap();
    for wait_ms in [100, 250] {
        let mut push = moto.spawn(&source, &["push", "tok", &url]);
        std::thread::sleep(Duration::from_millis(wait_ms));
        push.kill().unwrap();
        push.wait().unwrap();
        let sizes = origin.sizes_of(ObjectKind::Shard, &ids.iter().map(|&(id, _)| id).collect::<Vec<_>>()).unwrap();
        for (&(id, bytes), size) in ids.iter().zip(&sizes) {
            assert!(size.is_none() || *size == Some(bytes), "shard {id}: {size:?} of {bytes} bytes at the origin");
        }
        if origin.read_ref(&name).unwrap().is_some() {
            assert!(sizes.iter().all(Option::is_some), "a ref before all its shards");
        }
    }
    let pushed = moto.ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("pushed tok@1"), "{pushed}");

    // Reads killed mid-fetch: nothing unverified is ever published, and the next read finishes.
    let bound = shard_bytes_here(&source) / 4;
    moto.ok(&here, &["attach", "tok", &url, "--cache-bytes", &bound.to_string()]);
    for wait_ms in [100, 250, 450] {
        let mut verify = moto.spawn(&here, &["verify", "tok"]);
        std::thread::sleep(Duration::from_millis(wait_ms));
        verify.kill().unwrap();
        verify.wait().unwrap();
        assert_shards_whole(&here);
    }
    let verified = moto.ok(&here, &["verify", "tok"]);
    assert!(verified.contains(": 0 failures"), "{verified}");
    assert_shards_whole(&here);
    let left: Vec<_> = std::fs::read_dir(here.join("origin/incoming")).unwrap().collect();
    assert!(left.is_empty(), "parts of killed fetches left behind: {left:?}");
    for index in [0usize, 777, 2047] {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        assert_eq!(out.stdout, input[index * RECORD..(index + 1) * RECORD], "record {index}");
    }
}

#[test]
fn a_store_mounted_read_only_serves_its_cached_shards_and_names_the_rest() {
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let (input, url) = pushed_to_file(dir.path(), &source, 256, 9);
    granary_ok(&here, &["attach", "tok", &url]);
    // Record 1's shard is cached; record 200's is not.
    assert_eq!(granary(&here, &["get", "tok", "1"]).stdout, input[RECORD..2 * RECORD]);
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    // The store bind-mounted read-only over itself, in a mount namespace of this test's own.
    let script = format!(
        "mount --bind {here} {here} && mount -o remount,ro,bind {here} && \
         {granary} --root {here} get tok 1 -o {out}/1; echo \"rc=$?\"; \
         {granary} --root {here} get tok 200 -o {out}/200; echo \"rc=$?\"",
        here = here.display(),
        granary = env!("CARGO_BIN_EXE_granary"),
        out = out.display(),
    );
    let run = Command::new("unshare").args(["--mount", "sh", "-c", &script]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "unshare: {stdout}{stderr}");
    assert_eq!(stdout.lines().collect::<Vec<_>>(), ["rc=0", "rc=1"], "{stdout}{stderr}");
    assert_eq!(std::fs::read(out.join("1")).unwrap(), &input[RECORD..2 * RECORD]);
    assert!(!out.join("200").exists() || std::fs::read(out.join("200")).unwrap().is_empty());
    assert!(stderr.contains("cannot be written here") && stderr.contains("cannot be fetched from"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}
