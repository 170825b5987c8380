//! The origin cache under readers: a quarter-size cache read through whole, the windowed
//! default plan, two processes, the node's plan, a peer's copy, the evictor's limits, the bound
//! on disk, `granary bench cache`.

use super::*;

#[test]
fn a_pushed_dataset_is_read_back_whole_through_a_cache_a_quarter_its_size() {
    let moto = Moto::start();
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 480, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let url = format!("s3://{BUCKET}/datasets");
    let pushed = moto.ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("8 shards uploaded"), "{pushed}");
    // Again: nothing to send, the ref already names the version.
    let again = moto.ok(&source, &["push", "tok", &url]);
    assert!(again.contains("0 shards uploaded") && again.contains("8 already there"), "{again}");

    let bound = dataset_bytes / 4;
    let attached = moto.ok(&here, &["attach", "tok", &url, "--cache-bytes", &bound.to_string()]);
    assert!(attached.contains("attached tok@1") && attached.contains("8 shards"), "{attached}");
    assert_eq!(shard_bytes_here(&here), 0, "attach fetches metadata only");
    let listed = moto.ok(&here, &["ls"]);
    assert!(listed.contains(&format!("tok: attached from {url}")), "{listed}");

    // Every shard fetched, checked (BLAKE3 and every block) and within the bound all along.
    let verified = moto.ok(&here, &["verify", "tok"]);
    assert!(verified.contains("verified 8 shards") && verified.contains(": 0 failures"), "{verified}");
    assert!(shard_bytes_here(&here) <= bound, "{} bytes cached, bound {bound}", shard_bytes_here(&here));

    // Records read back through the cache equal the input, shard after shard (the cache
    // fetches and evicts on the way), and the bound holds after each.
    for index in (0..480).step_by(7) {
        let out = moto.granary(&here, &["get", "tok", &index.to_string()]);
        assert!(out.status.success(), "get {index}: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.stdout, input[index * RECORD..(index + 1) * RECORD], "record {index}");
        assert!(shard_bytes_here(&here) <= bound, "over the bound after record {index}");
    }

    let detached = moto.ok(&here, &["detach", "tok"]);
    assert!(detached.contains("detached tok"), "{detached}");
    assert_eq!(shard_bytes_here(&here), 0, "detach removes the cached shards");
    assert!(moto.err(&here, &["get", "tok", "0"]).contains("tok"));
}

#[test]
fn bench_cache_runs_end_to_end_at_a_small_scale() {
    let dir = tempdir();
    let out = granary_ok(
        dir.path(),
        &[
            "bench",
            "cache",
            "--generate",
            "4MiB",
            "--shard-bytes",
            "128KiB",
            "--batch",
            "8",
            "--step-ms",
            "1",
            "--latency-ms",
            "1",
            "--bandwidth",
            "256MiB",
        ],
    );
    for evictor in ["plan-aware", "lru", "s3-fifo"] {
        let row =
            out.lines().find(|line| line.starts_with(evictor)).unwrap_or_else(|| panic!("no {evictor} row: {out}"));
        let ratio: f64 = row.split_whitespace().nth(4).and_then(|x| x.parse().ok()).unwrap_or_else(|| panic!("{row}"));
        // Near or above Belady's minimum for the trace it read (a pinned shard may hold the
        // cache over its bound for a moment, so a little below is possible).
        assert!(ratio > 0.8, "{row}");
    }
    // The baseline: LRU not told the plan fetches nothing ahead.
    let baseline = out.lines().find(|line| line.starts_with("lru no plan")).unwrap_or_else(|| panic!("{out}"));
    assert_eq!(baseline.split_whitespace().nth(12), Some("0"), "{baseline}");
}

#[test]
fn the_default_plan_is_windowed_when_the_dataset_does_not_fit_the_cache() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 1024, 1);
    let dataset_bytes = shard_bytes_here(&source);
    let spec = VersionSpec::parse("tok").unwrap();
    let bound = dataset_bytes / 4;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    // The default plan (the elastic partitioner's global shuffle), no window asked for.
    let config = LoaderConfig {
        batch_size: 16,
        seed: 5,
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let dataset = granary::Dataset::open(&paths, &spec).unwrap();
    // What the name promises: the plan the loader reads with is windowed to the cache.
    let planned = granary::loader::plan_for_store(&dataset, config.plan.clone()).unwrap();
    let granary::PlanSource::Partitioner { options, .. } = &planned else { panic!("{planned:?}") };
    let window: u64 = options.iter().find(|(k, _)| k == "window-shards").map(|(_, v)| v.parse().unwrap()).unwrap();
    // A cache of 4 shards holds a window of 3 (issue 53): 3 begun, one coming in.
    assert_eq!(window, 3, "the window a cache of 4 shards allows: {options:?}");
    let mut loader = Loader::new(dataset, config, Default::default()).unwrap();
    assert_every_record_read(&mut loader, &input);
    let mixed = loader.stats().read.shards_per_batch();
    assert!(mixed > 2.5, "{mixed} shards per batch through a window of 3");
    // And what it buys: the same loader with a window of all 16 shards (a full shuffle) fetched
    // 11.4 x the dataset through this quarter cache; windowed, each shard comes about once.
    // (Up to 2.2 x while the cache counted the plan from the batch delivered, not from the
    // batches the reader had in flight: a shard read only by those looked needed, the one
    // coming in pushed out one that was, and a reader replaying after a miss found the shards
    // it had let go of gone. Since: 1.00-1.25 x over 8 runs beside the other tests.)
    let fetched = cache.stats().bytes_from_origin;
    assert!(
        fetched as f64 <= 1.5 * dataset_bytes as f64,
        "{fetched} bytes from the origin for a dataset of {dataset_bytes}: {:?}",
        cache.stats()
    );
}

#[test]
fn two_processes_sharing_a_store_fetch_each_shard_once() {
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    store_with(&source, 512, 1);
    let n_shards = shard_files(&source).len() as u64;
    // Slow enough that the two readers' fetches overlap.
    let throttle =
        object_store::throttle::ThrottleConfig { wait_get_per_call: Duration::from_millis(30), ..Default::default() };
    let slow = object_store::throttle::ThrottledStore::new(object_store::memory::InMemory::new(), throttle);
    let origin = pushed_and_attached(Arc::new(slow), &source, &here, 0);
    let spec = VersionSpec::parse("tok").unwrap();
    let paths = StorePaths::new(&here);
    let ids: Vec<granary::ShardId> = {
        let manifest = paths.read_manifest(paths.resolve(&spec).unwrap().0).unwrap();
        manifest.entries().iter().map(|e| e.shard).collect()
    };
    // Two caches of one store, as two processes have: each its own fetches in flight, the
    // claims under origin/incoming/ between them (flock works between open files).
    let caches: Vec<_> = (0..2)
        .map(|_| granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap())
        .collect();
    std::thread::scope(|scope| {
        for cache in &caches {
            let ids = &ids;
            scope.spawn(move || {
                for &id in ids {
                    cache.fetch(id).unwrap();
                }
            });
        }
    });
    let fetched: u64 = caches.iter().map(|cache| cache.stats().shards_fetched).sum();
    assert_eq!(fetched, n_shards, "each shard fetched once between the two");
    assert_shards_whole(&here);
    assert!(std::fs::read_dir(here.join("origin/incoming")).unwrap().next().is_none(), "claims left behind");
}

impl granary::ShardSource for PlanHeard {
    fn repair(&self, shard: granary::ShardId, _: &granary::Error) -> granary::Result<()> {
        panic!("shard {shard} needed repair in a whole store")
    }

    fn wants_plan(&self) -> bool {
        true
    }

    fn plan(&self, first_step: u64, shards_by_step: &[Vec<granary::ShardId>]) {
        self.0.lock().unwrap().push((first_step, shards_by_step.to_vec()));
    }
}

#[test]
fn the_cache_hears_the_plan_of_every_rank_of_its_node() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 1024, 1);
    let spec = VersionSpec::parse("tok").unwrap();
    let dataset = granary::Dataset::open(&StorePaths::new(&source), &spec).unwrap();
    let config = |rank, local_world_size, repair| LoaderConfig {
        batch_size: 16,
        seed: 9,
        world: granary::World::new(rank, 2).unwrap(),
        local_world_size: Some(local_world_size),
        epochs: Some(1),
        target: Target::Host,
        tier: granary::TierSetting::Off,
        repair,
        ..LoaderConfig::default()
    };
    // Every step's shards, per rank.
    let steps = |rank| {
        let mut loader = Loader::new(Arc::clone(&dataset), config(rank, 1, None), Default::default()).unwrap();
        let mut steps = Vec::new();
        while let Some(batch) = loader.next() {
            let mut shards: Vec<_> =
                batch.unwrap().indices().iter().map(|&i| dataset.shard_id(dataset.locate(i).unwrap().0)).collect();
            shards.sort();
            shards.dedup();
            steps.push(shards);
        }
        steps
    };
    let (mine, neighbour) = (steps(0), steps(1));

    // Rank 0 of a node of two: its hook hears its own plan, then rank 1's (from a thread).
    let heard = Arc::new(PlanHeard::default());
    let repair = Some(Arc::clone(&heard) as Arc<dyn granary::ShardSource>);
    let mut loader = Loader::new(Arc::clone(&dataset), config(0, 2, repair), Default::default()).unwrap();
    while loader.next().is_some() {}
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard.0.lock().unwrap().len() < 2 {
        assert!(Instant::now() < deadline, "the neighbour's plan never came");
        std::thread::sleep(Duration::from_millis(10));
    }
    let heard = heard.0.lock().unwrap();
    let sorted = |plan: &Vec<Vec<granary::ShardId>>| -> Vec<Vec<granary::ShardId>> {
        plan.iter()
            .map(|shards| {
                let mut shards = shards.clone();
                shards.sort();
                shards
            })
            .collect()
    };
    assert_eq!(heard.len(), 2, "this rank's epoch, then the neighbour's");
    assert_eq!((heard[0].0, sorted(&heard[0].1)), (0, mine));
    assert_eq!((heard[1].0, sorted(&heard[1].1)), (0, neighbour));
}

/// A `granary serve` of the store at `root` on loopback, killed on drop.
struct Serve(Child);

impl Serve {
    fn start(root: &Path, key_file: &Path, listen: std::net::SocketAddr, peer: std::net::SocketAddr) -> Serve {
        let log = std::fs::File::create(root.with_extension("log")).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_granary"))
            .arg("--root")
            .arg(root)
            .args(["serve", "--listen", &listen.to_string(), "--peers", &peer.to_string(), "--cluster-key"])
            .arg(key_file)
            .args(["--heartbeat-ms", "100", "--down-after-ms", "800"])
            .env_remove("GRANARY_ROOT")
            .env_remove("GRANARY_CLUSTER_KEY")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut serve = Serve(child);
        let listen_file = root.join("replication").join("listen");
        let started = Instant::now();
        while std::fs::read_to_string(&listen_file).ok().is_none_or(|t| t.trim() != listen.to_string()) {
            assert!(serve.0.try_wait().unwrap().is_none(), "serve {} exited", root.display());
            assert!(started.elapsed() < Duration::from_secs(30), "serve {} did not start", root.display());
            std::thread::sleep(Duration::from_millis(20));
        }
        serve
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_shard_a_peer_holds_comes_from_the_peer_and_the_rest_from_the_origin_at_once() {
    use granary::replication::{ClusterKey, NodeClient};

    const KEY: &str = "a cluster secret of this test, long enough";
    let dir = tempdir();
    let source = dir.path().join("source");
    let (input, url) = pushed_to_file(dir.path(), &source, 256, 3);
    let dataset_bytes = shard_bytes_here(&source);
    let n_shards = shard_files(&source).len();
    assert!(n_shards >= 4, "{n_shards} shards");
    let key_file = dir.path().join("cluster.key");
    std::fs::write(&key_file, KEY).unwrap();
    let key = ClusterKey::from_secret(KEY.as_bytes()).unwrap();
    let roots = [dir.path().join("a"), dir.path().join("b")];
    let listen = [0, 1].map(|_| {
        std::net::SocketAddr::from((
            [127, 0, 0, 1],
            TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port(),
        ))
    });
    for root in &roots {
        granary_ok(root, &["attach", "tok", &url]);
    }
    let mut serves: Vec<Option<Serve>> =
        (0..2).map(|i| Some(Serve::start(&roots[i], &key_file, listen[i], listen[1 - i]))).collect();
    let client = |i: usize| Arc::new(NodeClient::new(listen[i], key.clone()));

    // Node a's reader finds no peer with the shards: they come from the origin.
    let first = read_all_through(&roots[0], Some(client(0)), &input);
    assert_eq!((first.bytes_from_origin, first.bytes_from_peers), (dataset_bytes, 0), "{first:?}");
    // Once node b hears node a list them (a rescan, a heartbeat), b's reader gets every shard
    // from a, checked, and nothing from the origin.
    let started = Instant::now();
    loop {
        let (a, b) = (client(0).status().unwrap(), client(1).status().unwrap());
        if a.objects > n_shards && b.peers.first().is_some_and(|p| p.up && p.objects == a.objects) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "b never heard a's shards: {a:?} {b:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let second = read_all_through(&roots[1], Some(client(1)), &input);
    assert_eq!((second.bytes_from_origin, second.bytes_from_peers), (0, dataset_bytes), "{second:?}");
    assert_eq!(second.shards_from_peers, n_shards as u64);
    assert_shards_whole(&roots[1]);

    // With node a gone and b's copies evicted, b's node holds no peer that lists them: it says
    // so at once (it does not wait for a source, as it does for a shard only peers have) and
    // every shard comes from the origin.
    serves[0] = None;
    for file in shard_files(&roots[1]) {
        std::fs::remove_file(file).unwrap();
    }
    // Until b's heartbeat finds a down, a still counts as a source; after, none is left, and a
    // node that waited for a source would wait 10 s per shard.
    let started = Instant::now();
    while client(1).status().unwrap().peers.first().is_some_and(|p| p.up) {
        assert!(started.elapsed() < Duration::from_secs(30), "b never found a down");
        std::thread::sleep(Duration::from_millis(50));
    }
    let started = Instant::now();
    let third = read_all_through(&roots[1], Some(client(1)), &input);
    assert_eq!((third.bytes_from_origin, third.bytes_from_peers), (dataset_bytes, 0), "{third:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{n_shards} shards took {:?}: the node waited for a peer per shard",
        started.elapsed()
    );
    drop(serves);
}

/// Four shards of 64 records of one size, pushed to an origin in memory and attached at
/// `here` under a cache of `bound_shards` of them with evictor `evictor`.
struct FourShards {
    /// Holds the stores.
    _dir: tempfile::TempDir,
    here: PathBuf,
    paths: granary::store::StorePaths,
    /// The records, in order (shard k holds records 64 k .. 64 k + 63).
    input: Vec<u8>,
    entries: Vec<granary::manifest::ManifestEntry>,
    cache: Arc<granary::origin::OriginCache>,
}

fn four_shards(seed: u64, bound_shards: u64, evictor: Option<&str>) -> FourShards {
    use granary::store::{StorePaths, VersionSpec};

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 256, seed);
    let spec = VersionSpec::parse("tok").unwrap();
    let entries = {
        let source_paths = StorePaths::new(&source);
        source_paths.read_manifest(source_paths.resolve(&spec).unwrap().0).unwrap().entries().to_vec()
    };
    assert!(entries.len() == 4 && entries.iter().all(|e| e.file_bytes == entries[0].file_bytes && e.n_records == 64));
    let bound = bound_shards * entries[0].file_bytes;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, evictor, &[], &[origin]).unwrap().unwrap();
    FourShards { _dir: dir, here, paths, input, entries, cache }
}

/// With a cache of two shards and LRU choosing: a is read at step 0 and again at `a_again`, b at
/// 1 and 50, c at 10. At step 2, c comes: LRU would evict a, the least recently used; as a is
/// needed no later than c, b (step 50) goes instead, and the cache stays within its bound.
fn lru_makes_room_for_c(a_again: usize, why: &str) {
    use granary::ShardSource;

    let FourShards { here, paths, entries, cache, .. } = &four_shards(4, 2, Some("lru"));
    let bound = 2 * entries[0].file_bytes;
    let (a, b, c) = (entries[0].shard, entries[1].shard, entries[2].shard);
    let mut steps = vec![Vec::new(); 51];
    steps[0].push(a);
    steps[1].push(b);
    steps[a_again].push(a);
    steps[10].push(c);
    steps[50].push(b);
    cache.add_plan(0, &steps);
    for shard in [a, b] {
        cache.fetch(shard).unwrap();
        cache.accessed(&[shard]);
    }
    cache.fetch(c).unwrap();
    assert!(paths.shard(a).exists(), "a, {why}, was evicted for c");
    assert!(!paths.shard(b).exists(), "b, needed last, was kept");
    assert!(paths.shard(c).exists());
    assert!(shard_bytes_here(here) <= bound);
}

#[test]
fn a_shard_needed_sooner_stays_whatever_the_evictor_chooses() {
    lru_makes_room_for_c(5, "needed sooner than c");
}

/// Two shards one batch reads: fetching the second never evicts the first for it (it would be
/// fetched again for the same read, and the two would push each other out in turn); a shard
/// needed later makes the room.
#[test]
fn a_shard_the_same_batch_reads_stays_whatever_the_evictor_chooses() {
    lru_makes_room_for_c(10, "read by the batch c is fetched for");
}

/// Behind an origin cache, a reader closes a fetched shard's file before it hands on the batch
/// that reads it last for a while (by the plan it told the cache), so that evicting the shard
/// while the trainer holds the reader up frees its space at once; one the plan reads again
/// within 8 steps stays open, and so does one the batch did not read. Seen from the sink, as a
/// trainer's wait would see it.
#[test]
fn a_reader_lets_go_of_a_fetched_shard_before_handing_on_its_last_batch() {
    use granary::store::{StorePaths, VersionSpec};
    use granary::{IoConfig, Reader, ShardSource};
    use std::collections::{BTreeSet, HashMap};

    // Shard k holds records 64 k .. 64 k + 63; all of them fit in the cache.
    let FourShards { here, paths, input, entries, cache, .. } = &four_shards(5, 4, None);
    let names: HashMap<PathBuf, char> = entries
        .iter()
        .zip(['a', 'b', 'c', 'd'])
        .map(|(e, name)| (StorePaths::new(here.canonicalize().unwrap()).shard(e.shard), name))
        .collect();
    let (a, b, c, d) = (entries[0].shard, entries[1].shard, entries[2].shard, entries[3].shard);
    // The batches: a and b, a and c, d, b. The plan told the cache also reads c at step 40.
    let batches: Vec<Vec<u64>> = vec![vec![0, 64], vec![1, 128], vec![192], vec![65]];
    let mut steps = vec![vec![a, b], vec![a, c], vec![d], vec![b]];
    steps.resize(41, Vec::new());
    steps[40].push(c);
    cache.add_plan(0, &steps);
    let dataset = granary::Dataset::open(paths, &VersionSpec::parse("tok").unwrap()).unwrap();
    let mut reader = Reader::new(dataset, IoConfig::default().build().unwrap());
    reader.set_repair(Arc::clone(cache) as Arc<dyn ShardSource>);
    // The shards whose files this process holds open, by name (none is removed here).
    let open = || -> BTreeSet<char> {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .filter_map(|target| names.get(&target).copied())
            .collect()
    };
    let mut seen = Vec::new();
    reader
        .read_batches(batches.iter(), 1, &mut |batch| {
            for (i, &index) in batch.indices().iter().enumerate() {
                let index = usize::try_from(index).unwrap();
                assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            }
            seen.push(open());
            Ok(())
        })
        .unwrap();
    let expected: Vec<BTreeSet<char>> = [
        // a is read next at step 1, b at step 3: both within 8 steps.
        &['a', 'b'][..],
        // a is not read again, c not before step 40; b, not read by this batch, stays.
        &['b'],
        // d is not read again.
        &['b'],
        // b is not read again.
        &[],
    ]
    .iter()
    .map(|names| names.iter().copied().collect())
    .collect();
    assert_eq!(seen, expected, "the shards held open as each batch was handed on");
}

/// Issue 40: a reader kept the shards its cache evicted open until its epoch ended, so the
/// store's file system held several times the cache's bound (60 MiB of deleted files under a
/// 16 MiB bound, and ENOSPC on a disk where the bound fit). Read as a trainer does, with the
/// default loader (tier and plan) over three epochs, after each batch: every shard file held
/// after its removal is one a batch in flight reads, or one the plan reads again within the
/// steps a reader keeps such a file open; the cached files exceed the bound only by the shards
/// of the batches in flight (pinned for their reads) and one being published.
#[test]
fn an_epoch_through_a_quarter_cache_holds_no_more_disk_than_the_bound() {
    use granary::loader::{Loader, LoaderConfig, Target};
    use granary::store::{StorePaths, VersionSpec};
    use std::collections::HashSet;

    /// `KEEP_OPEN_STEPS` of the origin cache.
    const KEEP_OPEN_STEPS: u64 = 8;
    /// What was on disk after a batch, between two looks at the reader's step.
    struct Look {
        step_before: u64,
        step_after: u64,
        present: u64,
        held: Vec<(PathBuf, u64)>,
    }

    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let input = store_with(&source, 2048, 3);
    let dataset_bytes = shard_bytes_here(&source);
    let bound = dataset_bytes / 4;
    let origin = pushed_and_attached(Arc::new(object_store::memory::InMemory::new()), &source, &here, bound);
    let paths = StorePaths::new(&here);
    let cache = granary::origin::OriginCache::open_with(&paths, None, &[], &[Arc::clone(&origin)]).unwrap().unwrap();
    let dataset = granary::Dataset::open(&paths, &VersionSpec::parse("tok").unwrap()).unwrap();
    let largest = dataset.manifest().entries().iter().map(|e| e.file_bytes).max().unwrap();
    // Each record's shard, and each shard's bytes.
    let shard_of: Vec<granary::ShardId> =
        dataset.manifest().entries().iter().flat_map(|e| (0..e.n_records).map(|_| e.shard)).collect();
    let bytes_of: std::collections::HashMap<granary::ShardId, u64> =
        dataset.manifest().entries().iter().map(|e| (e.shard, e.file_bytes)).collect();
    let config = LoaderConfig {
        batch_size: 16,
        seed: 2,
        target: Target::Host,
        epochs: Some(3),
        repair: Some(Arc::clone(&cache) as Arc<dyn granary::ShardSource>),
        ..LoaderConfig::default()
    };
    let read_depth = config.read_depth as u64;
    let mut loader = Loader::new(dataset, config, Default::default()).unwrap();
    // With a tier the reader keeps the read depth asked for (without one it reads deeper).
    assert!(loader.stats().tier.is_some(), "the default tier did not open");
    let mut looks = Vec::new();
    // Per step (one batch of this one rank), the shards its records come from: read from their
    // files or copied from the tier.
    let mut steps: Vec<HashSet<granary::ShardId>> = Vec::new();
    let mut seen = vec![0_u32; input.len() / RECORD];
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        steps.push(batch.indices().iter().map(|&i| shard_of[usize::try_from(i).unwrap()]).collect());
        for (i, &index) in batch.indices().iter().enumerate() {
            let index = usize::try_from(index).unwrap();
            assert_eq!(batch.record(i), &input[index * RECORD..(index + 1) * RECORD], "record {index}");
            seen[index] += 1;
        }
        drop(batch);
        let step_before = cache.step();
        let (present, held) = (shard_bytes_here(&here), held_files(&here));
        looks.push(Look { step_before, step_after: cache.step(), present, held });
    }
    assert!(seen.iter().all(|&n| n == 3), "every record once an epoch");
    let read_at = |from: u64, to: u64| -> HashSet<granary::ShardId> {
        let (from, to) = (from.min(steps.len() as u64), to.min(steps.len() as u64));
        steps[from as usize..to as usize].iter().flatten().copied().collect()
    };
    let canonical = StorePaths::new(here.canonicalize().unwrap());
    let (mut peak, mut peak_held, mut peak_in_flight) = (0_u64, 0_u64, 0_usize);
    for (b, look) in looks.iter().enumerate() {
        // In flight: the batch being handed on (its pins let go after it), the slots after it.
        let in_flight = read_at(look.step_before.saturating_sub(1), look.step_after + read_depth);
        let kept_open = read_at(look.step_before.saturating_sub(1), look.step_after + read_depth + KEEP_OPEN_STEPS);
        for (path, _) in &look.held {
            assert!(
                kept_open.iter().any(|&s| canonical.shard(s) == *path),
                "after batch {b} (reader at step {}), {} is held after its removal though no batch in flight \
                 reads it nor the plan soon",
                look.step_before,
                path.display()
            );
        }
        let in_flight_bytes: u64 = in_flight.iter().map(|&s| bytes_of[&s]).sum();
        assert!(
            look.present <= bound + largest + in_flight_bytes,
            "after batch {b}: {} bytes cached for a bound of {bound}, {} shards in flight",
            look.present,
            in_flight.len()
        );
        let held: u64 = look.held.iter().map(|(_, bytes)| bytes).sum();
        peak_held = peak_held.max(held);
        peak = peak.max(look.present + held);
        peak_in_flight = peak_in_flight.max(in_flight.len());
    }
    let fetched = cache.stats().bytes_from_origin;
    println!(
        "{} batches; on disk at most {peak} bytes ({peak_held} of them removed but held) for a bound of {bound} \
         and shards of {largest} (at most {peak_in_flight} read by the batches in flight); fetched {:.2} x the data",
        looks.len(),
        fetched as f64 / dataset_bytes as f64
    );
    // Each epoch fetches the dataset about once, as before.
    assert!(fetched as f64 <= 3.0 * 1.15 * dataset_bytes as f64, "{:?}", cache.stats());
}
