//! The memory tier shared and bounded: four ranks of a node hold one copy, plan the tier
//! together and keep one set within half a budget; the evictor plugin chooses within the plan's
//! rules; a windowed plan over twice the budget is served from memory; a cgroup limit shrinks the
//! tier instead of killing the trainer; versions that share shards share extents.

use super::*;

/// Four ranks of a node read `epochs` epochs of `f` through a tier of `budget` bytes, each
/// opening the tier as a process of its own would.
fn four_ranks(f: &TokenStore, budget: u64, epochs: u64, local_world_size: Option<u32>) -> Vec<RankRun> {
    let tier_dir = f.dir.path().to_path_buf();
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            let dataset = Arc::clone(&f.dataset);
            let records = f.records.clone();
            let tier_dir = tier_dir.clone();
            std::thread::spawn(move || {
                let tier = MemoryTier::open(&tier_config(&tier_dir, budget)).unwrap().unwrap();
                let mut config = config(World::new(rank, 4).unwrap(), epochs, TierSetting::Shared(Arc::clone(&tier)));
                config.local_world_size = local_world_size;
                let mut loader = Loader::new(dataset, config, Position::default()).unwrap();
                let seen = drain(&mut loader, &records);
                let stats = loader.stats();
                let tier_stats = stats.tier.unwrap();
                let run = RankRun {
                    records: seen.len() as u64,
                    loaded: tier_stats.extents_loaded,
                    evicted: tier_stats.extents_evicted,
                    hits: stats.read.tier_records,
                    held_after: tier_dir_bytes(&tier),
                };
                (run, tier)
            })
        })
        .collect();
    // Every tier stays open until all ranks are done, so none empties the directory early.
    let runs: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    runs.into_iter().map(|(run, _)| run).collect()
}

#[test]
fn four_ranks_of_a_node_hold_one_copy() {
    let f = fixture(2000);
    let runs = four_ranks(&f, 64 << 20, 2, None);
    assert_eq!(runs.iter().map(|r| r.records).sum::<u64>(), 2 * 2000);
    let loaded: u64 = runs.iter().map(|r| r.loaded).sum();
    assert_eq!(loaded, n_extents(&f.dataset), "each extent loaded by one rank only");
    for run in &runs {
        assert!(run.held_after <= data_bytes(&f.dataset), "one copy: {} bytes held", run.held_after);
    }
}

/// Four ranks read three epochs of a dataset twice the tier's budget; returns the extents they
/// loaded and evicted in all, and the share of records served from memory.
fn four_ranks_over_half_a_budget(local_world_size: Option<u32>) -> (u64, u64, f64) {
    let f = fixture(4000);
    let budget = data_bytes(&f.dataset) / 2;
    let runs = four_ranks(&f, budget, 3, local_world_size);
    for run in &runs {
        assert!(run.held_after <= budget, "{} bytes in the tier, over the budget of {budget}", run.held_after);
    }
    let records: u64 = runs.iter().map(|r| r.records).sum();
    assert_eq!(records, 3 * 4000, "every record of every epoch, once");
    let loaded = runs.iter().map(|r| r.loaded).sum();
    let evicted = runs.iter().map(|r| r.evicted).sum();
    let hits: u64 = runs.iter().map(|r| r.hits).sum();
    (loaded, evicted, hits as f64 / records as f64)
}

#[test]
fn the_ranks_of_a_node_plan_the_tier_together_and_keep_one_set() {
    let f = fixture(4000);
    let fit = n_extents(&f.dataset) / 2;
    drop(f);
    let (loaded, evicted, hits) = four_ranks_over_half_a_budget(Some(4));
    // Every rank computes the node's schedule: they admit the same extents, load them once
    // between them and keep them, instead of each evicting what only the others read.
    eprintln!("node plan: {loaded} extents loaded, {evicted} evicted, hit ratio {hits:.3} ({fit} fit)");
    let (alone_loaded, alone_evicted, alone_hits) = four_ranks_over_half_a_budget(Some(1));
    eprintln!("each rank alone: {alone_loaded} loaded, {alone_evicted} evicted, hit ratio {alone_hits:.3}");
    // Ranks planning alone evict each other's extents as "never read here" and load them again.
    assert!(
        loaded * 3 <= alone_loaded * 2 && evicted * 2 <= alone_evicted,
        "a node plan loaded {loaded} and evicted {evicted}; ranks alone {alone_loaded} and {alone_evicted}"
    );
    assert!(loaded >= fit && hits >= 0.4, "hit ratio {hits:.3} with half of the data in the tier");
}

/// Three epochs over half of the data in the tier, `plan` ordering them; the extents loaded and
/// the share of records served from memory.
fn half_a_budget(plan: PlanSource) -> (u64, f64) {
    let (stats, hits) = half_a_budget_evicting(plan, None, Vec::new());
    (stats.extents_loaded, hits)
}

/// `half_a_budget`, with the evictor plugin `evictor` (`None`: the default) and its options;
/// the tier's counters and the share of records served from memory. Checks that the tier never
/// held more than its budget.
fn half_a_budget_evicting(
    plan: PlanSource,
    evictor: Option<String>,
    evictor_options: Vec<(String, String)>,
) -> (granary::TierStats, f64) {
    let f = fixture(4000);
    let budget = data_bytes(&f.dataset) / 2;
    let tier = MemoryTier::open(&TierConfig { evictor, evictor_options, ..tier_config(f.dir.path(), budget) })
        .unwrap()
        .unwrap();
    // Named like a claim, but not of an extent: the fillers' listings leave it alone.
    let notes = tier.dir().unwrap().join(".fill-notes");
    std::fs::write(&notes, b"not the tier's").unwrap();
    let mut config = config(World::single(), 3, TierSetting::Shared(Arc::clone(&tier)));
    config.plan = plan;
    let mut loader = Loader::new(Arc::clone(&f.dataset), config, Position::default()).unwrap();
    let seen = drain(&mut loader, &f.records);
    assert_eq!(seen.len(), 3 * 4000);
    assert_eq!(std::fs::read(&notes).unwrap(), b"not the tier's");
    let stats = loader.stats();
    let tier_stats = stats.tier.unwrap();
    assert!(tier_stats.bytes_held <= budget && tier_dir_bytes(&tier) <= budget, "over the budget: {tier_stats:?}");
    (tier_stats, stats.read.tier_records as f64 / seen.len() as f64)
}

fn windowed() -> PlanSource {
    PlanSource::Partitioner {
        plugin: None,
        options: vec![("window-shards".into(), "4".into()), ("chunk-records".into(), "4".into())],
    }
}

#[test]
fn the_evictor_plugin_chooses_what_makes_room_within_the_plans_rules() {
    // The default (plan-aware: Belady on the plan's next uses), a recency policy, and a plugin
    // that traps at every call (its fallback, LRU, answers): each chooses the victims, the plan's
    // rules keep what it needs sooner, and the reads stay right and within the budget.
    let hostile = granary::policy::builtin::built_plugin_path("hostile_evictor").display().to_string();
    let cases = [
        ("plan-aware", None, Vec::new()),
        ("lru", Some("lru".to_owned()), Vec::new()),
        ("trapping", Some(hostile), vec![("behave".to_owned(), "trap".to_owned())]),
    ];
    for (label, evictor, options) in cases {
        let (stats, hits) = half_a_budget_evicting(windowed(), evictor, options);
        eprintln!("{label}: hit ratio {hits:.3}, {stats:?}");
        assert!(stats.evictor_chosen > 0, "{label}: the plugin chose no victim: {stats:?}");
        assert_eq!(stats.evictor_failures, 0, "{label}: {stats:?}");
        assert!(hits >= 0.9, "{label}: hit ratio {hits:.3}");
    }
    // A plugin that is not there is refused when the tier opens, not at its first eviction.
    let dir = tempdir();
    let missing = TierConfig { evictor: Some("no-such-evictor".into()), ..tier_config(dir.path(), 1 << 20) };
    let error = MemoryTier::open(&missing).expect_err("refused");
    assert!(error.to_string().contains("no-such-evictor"), "{error}");
    // So is one that refuses its options.
    let refusing = TierConfig {
        evictor: Some("lru".into()),
        evictor_options: vec![("bogus".into(), "1".into())],
        ..tier_config(dir.path(), 1 << 20)
    };
    let error = MemoryTier::open(&refusing).expect_err("refused");
    assert!(error.to_string().contains("bogus"), "{error}");
}

#[test]
fn a_windowed_plan_over_twice_the_budget_is_served_from_memory() {
    let (loaded, hits) = half_a_budget(windowed());
    let (shuffled_loaded, shuffled_hits) = half_a_budget(PlanSource::Native(Order::Shuffled));
    eprintln!("windowed: {loaded} loaded, hit ratio {hits:.3}; shuffled: {shuffled_loaded} loaded, {shuffled_hits:.3}");
    // The tier follows the window, loading each extent ahead of its reads at most once an epoch
    // (128 extents, 3 epochs); a full shuffle keeps one set of half of them.
    assert!(hits >= 0.9 && loaded <= 3 * 128, "windowed: {loaded} extents loaded, hit ratio {hits:.3}");
    assert!(shuffled_hits >= 0.4 && shuffled_loaded <= 128, "shuffled: {shuffled_loaded} loaded, {shuffled_hits:.3}");
}

#[test]
fn a_bad_local_world_size_is_refused() {
    let f = fixture(100);
    let tier = MemoryTier::open(&tier_config(f.dir.path(), 1 << 20)).unwrap().unwrap();
    let mut config = config(World::new(1, 4).unwrap(), 1, TierSetting::Shared(tier));
    config.local_world_size = Some(0);
    let error = Loader::new(Arc::clone(&f.dataset), config, Position::default()).err().expect("refused");
    assert!(error.to_string().contains("local_world_size"), "{error}");
}

/// The child of `a_cgroup_limit_shrinks_the_tier_instead_of_killing_the_trainer`, run inside a
/// memory cgroup: fills the tier, then allocates memory while it reads on, and prints what the
/// tier held before and after.
#[test]
#[ignore = "run by its parent test inside a memory cgroup"]
fn child_reading_under_a_cgroup_limit() {
    let (Ok(store), Ok(tier_dir)) =
        (std::env::var("GRANARY_TEST_PRESSURE_STORE"), std::env::var("GRANARY_TEST_PRESSURE_TIER"))
    else {
        return;
    };
    let dataset = Dataset::open(&StorePaths::new(store), &VersionSpec::parse("tokens").unwrap()).unwrap();
    let tier = MemoryTier::open(&tier_config(Path::new(&tier_dir), 1 << 30)).unwrap().unwrap();
    let n_batches = dataset.n_records() / 32 + 1;
    let mut loader = Loader::new(
        dataset,
        config(World::single(), 1000, TierSetting::Shared(Arc::clone(&tier))),
        Position::default(),
    )
    .unwrap();
    for _ in 0..2 * n_batches {
        loader.next().unwrap().unwrap();
    }
    let full = tier_dir_bytes(&tier);
    let hog = allocate_while_reading(|| drop(loader.next().unwrap().unwrap()));
    let after = tier_dir_bytes(&tier);
    println!("tier held {full} bytes, then {after} bytes with {} MiB allocated", hog.len() * 16);
}

#[test]
fn a_cgroup_limit_shrinks_the_tier_instead_of_killing_the_trainer() {
    // 96 MiB of records; the child's cgroup allows 320 MiB, and it allocates 224 MiB on top of
    // the tier it filled: unless the tier gives memory back, the kernel kills the child.
    let f = fixture(48 * 1024);
    let store = f.dir.path().join("store");
    let envs = [("GRANARY_TEST_PRESSURE_STORE", store.as_path()), ("GRANARY_TEST_PRESSURE_TIER", f.dir.path())];
    let Some(out) = run_in_memory_cgroup(320 << 20, "sharing::child_reading_under_a_cgroup_limit", &envs) else {
        return;
    };
    let numbers = child_report(&out, "tier held");
    assert!(numbers[0] >= 64 << 20, "the tier filled first: {numbers:?}");
    assert!(numbers[1] < numbers[0] / 2, "then gave memory back: {numbers:?}");
}

#[test]
fn versions_that_share_shards_share_their_extents() {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let first: Vec<Vec<u8>> = (0..1000).map(|i| bytes(i, TOKENS as usize * 2)).collect();
    ingest(&mut granary, "tokens", tokens_layout(TOKENS), small_shards(256 << 10), &first);
    let more: Vec<Vec<u8>> = (1000..1200).map(|i| bytes(i, TOKENS as usize * 2)).collect();
    ingest(&mut granary, "tokens", tokens_layout(TOKENS), small_shards(256 << 10), &more);
    let all: Vec<Vec<u8>> = first.iter().chain(&more).cloned().collect();
    let v1 = granary.open_dataset(&VersionSpec::parse("tokens@1").unwrap()).unwrap();
    let v2 = granary.open_dataset(&VersionSpec::parse("tokens@2").unwrap()).unwrap();
    let tier = MemoryTier::open(&tier_config(dir.path(), 64 << 20)).unwrap().unwrap();
    let shared = || TierSetting::Shared(Arc::clone(&tier));
    let mut loader = Loader::new(Arc::clone(&v1), config(World::single(), 1, shared()), Position::default()).unwrap();
    drain(&mut loader, &first);
    let after_v1 = tier.stats().extents_loaded;
    assert_eq!(after_v1, n_extents(&v1));
    let mut loader = Loader::new(Arc::clone(&v2), config(World::single(), 1, shared()), Position::default()).unwrap();
    drain(&mut loader, &all);
    // All but its first batches (read from disk while the fills start).
    assert!(loader.stats().read.tier_records >= 1200 - (READ_DEPTH + 1) * 32, "version 2 read from the tier too");
    // Version 2 appends: it shares version 1's shards, so only its own extents were loaded.
    assert_eq!(tier.stats().extents_loaded - after_v1, n_extents(&v2) - n_extents(&v1));
}
