//! The loader on the CPU path: batches come in plan order with the right bytes, a position
//! resumes exactly, a flipped bit is caught, memory stays bounded with a slow trainer, and a
//! trainer that holds too many batches gets an error rather than a hang; rebalancing and its
//! points. The GPU path's tests are in `gpu.rs`, `granary bench loader`'s in `bench_smoke.rs`.

mod common;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use common::*;
use granary::io::{AlignedBuf, Fault};
use granary::loader::{LoadedBatch, Loader, LoaderConfig, PlanSource, RebalanceState, Target};
use granary::{Backend, Dataset, EpochPlan, Granary, IoConfig, Order, Position, RankCursor, VersionSpec, World};

/// Tests here count memory mappings process-wide: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

const TOKENS: u64 = 50;

/// `n` records of 50 u16 tokens in shards of about 16 KiB.
fn fixture(n: usize) -> TokenStore {
    token_store(n, TOKENS, 16 << 10)
}

fn config(plan: PlanSource, world: World) -> LoaderConfig {
    LoaderConfig {
        batch_size: 16,
        world,
        seed: 7,
        plan,
        epochs: Some(2),
        io: IoConfig { backend: Backend::Auto, queue_depth: 8, op_bytes_max: 16 << 10, direct: true },
        target: Target::Host,
        ..LoaderConfig::default()
    }
}

fn drain(loader: &mut Loader, records: &[Vec<u8>]) -> Vec<(Vec<u64>, Position)> {
    let mut out = Vec::new();
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        check_bytes(&batch, records);
        out.push((batch.indices().to_vec(), batch.position()));
    }
    out
}

fn check_bytes(batch: &LoadedBatch, records: &[Vec<u8>]) {
    assert_eq!(batch.data().len(), batch.len() * TOKENS as usize * 2, "one dense array");
    for (i, &index) in batch.indices().iter().enumerate() {
        assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
    }
}

fn sources() -> Vec<PlanSource> {
    vec![
        PlanSource::Native(Order::Shuffled),
        PlanSource::Native(Order::Sequential),
        PlanSource::Partitioner { plugin: None, options: Vec::new() },
        PlanSource::Partitioner { plugin: None, options: vec![("chunk-records".into(), "8".into())] },
    ]
}

#[test]
fn batches_follow_the_plan_with_the_right_bytes() {
    let _serial = serial();
    let fx = fixture(500);
    let n = fx.records.len() as u64;
    for world in [World::single(), World::new(1, 3).unwrap()] {
        // The native plan, rank by rank, is the model.
        let mut loader = Loader::new(
            Arc::clone(&fx.dataset),
            config(PlanSource::Native(Order::Shuffled), world),
            Position::default(),
        )
        .unwrap();
        let got: Vec<Vec<u64>> = drain(&mut loader, &fx.records).into_iter().map(|(indices, _)| indices).collect();
        let mut wanted = Vec::new();
        for epoch in 0..2 {
            let mut cursor = RankCursor::new(EpochPlan::new(n, 7, epoch, Order::Shuffled), world, 16, 0);
            let mut records = Vec::new();
            while cursor.next_batch(&mut records) {
                if !records.is_empty() {
                    wanted.push(records.clone());
                }
            }
        }
        assert_eq!(got, wanted, "world {world:?}");
        assert_eq!(loader.position(), Position { epoch: 2, cursor: 0 });
    }
    // With the partitioner plugin: every rank's batches together read each record once per epoch.
    for plan in sources() {
        let mut seen = vec![0u32; fx.records.len()];
        for rank in 0..3 {
            let mut loader = Loader::new(
                Arc::clone(&fx.dataset),
                config(plan.clone(), World::new(rank, 3).unwrap()),
                Position::default(),
            )
            .unwrap();
            for (indices, _) in drain(&mut loader, &fx.records) {
                assert!(indices.len() <= 16);
                for index in indices {
                    seen[index as usize] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&count| count == 2), "{plan:?}: each record once per epoch, two epochs");
    }
}

#[test]
fn the_start_is_reported_stage_by_stage() {
    use granary::loader::StartStage;
    let _serial = serial();
    let f = fixture(300);
    // With the page cache tier, whose schedule wants the next epoch's plan too.
    let tier = granary::TierConfig {
        kind: granary::TierKind::PageCache,
        budget_bytes: Some(64 << 20),
        ..granary::TierConfig::default()
    };
    let config =
        LoaderConfig { tier: granary::TierSetting::Config(tier), ..config(PlanSource::default(), World::single()) };
    let mut loader = Loader::new(Arc::clone(&f.dataset), config, Position::default()).unwrap();
    let first = loader.next().unwrap().unwrap();
    check_bytes(&first, &f.records);
    let marks = loader.start_stages();
    let at = |stage: StartStage| marks.iter().find(|&&(s, _)| s == stage).map(|&(_, at)| at);
    let ends = |stages: &[StartStage]| {
        let ends: Vec<_> =
            stages.iter().map(|&s| at(s).unwrap_or_else(|| panic!("{s:?} not marked: {marks:?}"))).collect();
        assert!(ends.windows(2).all(|w| w[0] <= w[1]), "{stages:?} out of order: {marks:?}");
    };
    // The loader's own construction, then the reader's way to the first batch, then the trainer.
    ends(&[StartStage::TierOpened, StartStage::StagingReady, StartStage::Built]);
    ends(&[
        StartStage::PlannerReady,
        StartStage::EpochPlanned,
        StartStage::FirstBatchRead,
        StartStage::FirstBatchTaken,
    ]);
    assert_eq!(marks.last().map(|&(s, _)| s), Some(StartStage::FirstBatchTaken), "{marks:?}");
    // The next epoch is planned off the path to the first batch (by the schedule's thread).
    assert!(at(StartStage::NextEpochPlanned).is_none(), "{marks:?}");
    assert!(loader.tier().is_some());
    // Marks are the start's: later batches do not move them.
    let taken = at(StartStage::FirstBatchTaken);
    drop(first);
    drop(loader.next().unwrap().unwrap());
    let later = loader.start_stages();
    assert_eq!(later.iter().find(|&&(s, _)| s == StartStage::FirstBatchTaken).map(|&(_, at)| at), taken);
}

#[test]
fn a_position_resumes_exactly() {
    let _serial = serial();
    let fx = fixture(300);
    for plan in sources() {
        for world in [World::single(), World::new(2, 4).unwrap()] {
            let full = drain(
                &mut Loader::new(Arc::clone(&fx.dataset), config(plan.clone(), world), Position::default()).unwrap(),
                &fx.records,
            );
            assert!(full.len() > 4);
            for cut in [0, 1, full.len() / 2, full.len() - 2] {
                let from = full[cut].1;
                let mut config = config(plan.clone(), world);
                // The resumed run ends where the full one does: at the end of epoch 1.
                config.epochs = Some(2 - from.epoch);
                let rest = drain(&mut Loader::new(Arc::clone(&fx.dataset), config, from).unwrap(), &fx.records);
                assert_eq!(rest, full[cut + 1..].to_vec(), "{plan:?}, {world:?}, resumed after batch {cut}");
            }
        }
    }
}

#[test]
fn a_bit_flipped_after_the_read_is_caught_before_any_batch_holds_it() {
    let _serial = serial();
    let fx = fixture(300);
    for backend in [Backend::Uring, Backend::Pread] {
        let mut config = config(PlanSource::Native(Order::Sequential), World::single());
        config.io.backend = backend;
        config.faults = vec![Fault::FlipBit { op: 3, bit: 12_345 }];
        let mut loader = Loader::new(Arc::clone(&fx.dataset), config, Position::default()).unwrap();
        let mut delivered = 0;
        let error = loop {
            match loader.next().expect("an error comes before the end") {
                Ok(batch) => {
                    check_bytes(&batch, &fx.records);
                    delivered += 1;
                }
                Err(error) => break error,
            }
        };
        assert!(error.is_corruption(), "{backend:?}: {error}");
        assert!(delivered < 19, "the corrupt op's batch was never handed out");
        assert!(loader.next().is_none(), "nothing after the error");
    }
}

#[test]
fn a_slow_trainer_makes_the_loader_wait_not_allocate() {
    let _serial = serial();
    let fx = fixture(400);
    let mut config = config(PlanSource::Native(Order::Shuffled), World::single());
    config.prefetch = 2;
    let mut loader = Loader::new(Arc::clone(&fx.dataset), config, Position::default()).unwrap();
    let first = loader.next().unwrap().unwrap();
    drop(first);
    std::thread::sleep(Duration::from_millis(50));
    let mappings = AlignedBuf::mappings_made();
    let bound = loader.stats().pool.buffers;
    let mut batches = 1;
    while let Some(batch) = loader.next() {
        let batch = batch.unwrap();
        check_bytes(&batch, &fx.records);
        std::thread::sleep(Duration::from_millis(3));
        batches += 1;
    }
    let stats = loader.stats();
    assert_eq!(batches, 50);
    assert_eq!(AlignedBuf::mappings_made(), mappings, "no buffer was allocated after the start");
    assert_eq!(stats.pool.buffers, bound);
    assert!(stats.pool.leased_max <= bound);
    assert!(stats.stall <= stats.elapsed);
}

#[test]
fn variable_length_records_keep_the_queue_full_not_two_batches_in_flight() {
    let _serial = serial();
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    // Documents of 1-2000 bytes: a batch of 64 is about 64 KiB, so a queue of 32 ops of 1 MiB
    // wants all 64 batches in flight; the buffers stay 64 MiB each, the largest batch allowed.
    let records: Vec<Vec<u8>> = (0..2000).map(|i| bytes(i, 1 + (i as usize * 7919) % 2000)).collect();
    ingest(&mut granary, "docs", granary::Layout::Bytes, small_shards(256 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("docs").unwrap()).unwrap();
    let mut config = config(PlanSource::Native(Order::Sequential), World::single());
    config.batch_size = 64;
    // Read from disk: a loader served from the memory tier copies from memory at the depth asked.
    config.tier = granary::TierSetting::Off;
    config.io = IoConfig { backend: Backend::Auto, queue_depth: 32, op_bytes_max: 1 << 20, direct: true };
    let in_flight = |config: LoaderConfig| {
        let extra = config.prefetch + config.hold_max + 1;
        let mut loader = Loader::new(Arc::clone(&dataset), config, Position::default()).unwrap();
        let mut seen = Vec::new();
        while let Some(batch) = loader.next() {
            let batch = batch.unwrap();
            for (i, &index) in batch.indices().iter().enumerate() {
                assert_eq!(batch.record(i), &records[index as usize][..], "record {index}");
            }
            seen.extend_from_slice(batch.indices());
        }
        assert_eq!(seen, (0..2000).chain(0..2000).collect::<Vec<u64>>(), "two epochs in order");
        let pool = loader.stats().pool;
        (pool.buffers - extra, pool.buffer_bytes)
    };
    assert_eq!(in_flight(config.clone()), (64, 64 << 20));
    // Batches of about 1 MiB: as many in flight as fill the queue's 32 MiB, no more.
    config.batch_size = 1024;
    let mean_batch = dataset.manifest().file_bytes() as f64 / 2000.0 * 1024.0;
    let (depth, _) = in_flight(config.clone());
    assert!(depth as f64 * mean_batch >= f64::from(32 << 20), "{depth} batches of {mean_batch} bytes");
    assert!((depth - 1) as f64 * mean_batch < f64::from(32 << 20), "{depth} batches of {mean_batch} bytes");
    // The largest batch given: buffers of that size, the depth unchanged.
    config.batch_bytes_max = Some(2 << 20);
    assert_eq!(in_flight(config), (depth, 2 << 20));
}

#[test]
fn a_trainer_holding_too_many_batches_gets_an_error_not_a_hang() {
    let _serial = serial();
    let fx = fixture(200);
    let mut loader = Loader::new(
        Arc::clone(&fx.dataset),
        config(PlanSource::Native(Order::Shuffled), World::single()),
        Position::default(),
    )
    .unwrap();
    let a = loader.next().unwrap().unwrap();
    let b = loader.next().unwrap().unwrap();
    let error = loader.next().unwrap().err().expect("hold_max is 2");
    assert!(error.to_string().contains("hold"), "{error}");
    drop(a);
    let c = loader.next().unwrap().unwrap();
    assert_ne!(b.indices(), c.indices());
    // And dropping the loader with batches held and queued ends its threads.
    drop(loader);
    check_bytes(&c, &fx.records);
}

#[test]
fn bad_configurations_are_errors() {
    let _serial = serial();
    let fx = fixture(100);
    let mut bad = config(PlanSource::Native(Order::Shuffled), World::single());
    bad.batch_size = 0;
    assert!(Loader::new(Arc::clone(&fx.dataset), bad, Position::default()).is_err());
    let mut small = config(PlanSource::Native(Order::Shuffled), World::single());
    // Buffers are whole pages: 64 records of 100 bytes do not fit one.
    small.batch_size = 64;
    small.batch_bytes_max = Some(100);
    let mut loader = Loader::new(Arc::clone(&fx.dataset), small, Position::default()).unwrap();
    let error = loader.next().unwrap().err().expect("a batch larger than the staging buffer");
    assert!(error.to_string().contains("staging buffer"), "{error}");
    // Rebalancing needs a plugin's plan, an exchange for more than one rank, and a plugin that
    // can rebalance (built against granary:policy@0.2.0).
    let every = |exchange| Some(granary::loader::RebalanceConfig::every(10, exchange));
    let native =
        LoaderConfig { rebalance: every(None), ..config(PlanSource::Native(Order::Shuffled), World::single()) };
    let elastic = || PlanSource::Partitioner { plugin: None, options: Vec::new() };
    let alone = LoaderConfig { rebalance: every(None), ..config(elastic(), World::new(0, 2).unwrap()) };
    let old_plugin =
        env!("CARGO_MANIFEST_DIR").to_owned() + "/../tests/fixtures/plugins-0.1.0/partitioner_elastic.wasm";
    let old = LoaderConfig {
        rebalance: every(None),
        ..config(PlanSource::Partitioner { plugin: Some(old_plugin), options: Vec::new() }, World::single())
    };
    for (config, expected) in [(native, "native order"), (alone, "exchange"), (old, "0.1.0")] {
        // A refusal at construction or as the stream's first item.
        let error = match Loader::new(Arc::clone(&fx.dataset), config, Position::default()) {
            Err(error) => error,
            Ok(mut loader) => loader.next().unwrap().err().expect("refused"),
        };
        assert!(error.to_string().contains(expected), "{error}");
    }
}

/// A job of `world` ranks rebalanced every `every` steps, rank `slow` taking `slow_us` per record
/// and the others `fast_us`, for `epochs` epochs.
#[derive(Clone, Copy)]
struct Job {
    world: u32,
    every: u64,
    slow: u32,
    slow_us: u64,
    /// What every other rank takes per record.
    fast_us: u64,
    epochs: u64,
    /// Whether the ranks meet at a barrier after each step's compute, as DDP's all-reduce makes
    /// them, and whether each reports its compute time (`report_busy`).
    sync: Sync,
    /// What rank 1 spends in each exchange after every rank's measure is in (as one side of a
    /// transport slower to return: under a barrier, which rank waits there longer is jitter).
    exchange_lag_ms: u64,
}

/// An exchange whose rank `rank` returns `lag` after the others.
struct Lagging {
    inner: Arc<dyn granary::loader::MeasureExchange>,
    rank: u32,
    lag: Duration,
}

impl granary::loader::MeasureExchange for Lagging {
    fn all_gather(
        &self,
        epoch: u64,
        step: u64,
        mine: granary::policy::RankMeasure,
    ) -> granary::Result<Vec<granary::policy::RankMeasure>> {
        let rank = mine.rank;
        let all = self.inner.all_gather(epoch, step, mine)?;
        if rank == self.rank {
            std::thread::sleep(self.lag);
        }
        Ok(all)
    }
}

/// Two free-running ranks, rank 1 computing 2 ms a record and rank 0 40 us, rebalanced every 10
/// steps, one epoch.
const FREE_RUNNING_PAIR: Job = Job {
    world: 2,
    every: 10,
    slow: 1,
    slow_us: 2000,
    fast_us: 40,
    epochs: 1,
    sync: Sync::FreeRunning,
    exchange_lag_ms: 0,
};

#[derive(Clone, Copy, PartialEq)]
enum Sync {
    FreeRunning,
    Barrier,
    BarrierReportingBusy,
}

/// One rank's batches (indices, the position after, the weights) and its last state.
type RankRun = (Vec<(Vec<u64>, Position, Vec<u32>)>, Option<RebalanceState>);

/// Runs `world` ranks of a rebalancing loader as threads, rank `slow` sleeping `slow_us` per
/// record of a batch (the others `fast_us`), each from `starts[rank]`; returns each rank's batches (indices, the
/// position after, the weights it was cut with) and its loader's state after `stop_after`
/// batches when given (the run stops there).
fn run_ranks(
    dataset: &Arc<Dataset>,
    job: Job,
    starts: &[(Position, Option<RebalanceState>)],
    stop_after: Option<usize>,
    registry: &granary::metrics::Registry,
) -> Vec<RankRun> {
    run_ranks_of(
        dataset,
        PlanSource::Partitioner { plugin: None, options: Vec::new() },
        job,
        starts,
        stop_after,
        registry,
    )
}

/// `run_ranks` of `plan`.
fn run_ranks_of(
    dataset: &Arc<Dataset>,
    plan: PlanSource,
    job: Job,
    starts: &[(Position, Option<RebalanceState>)],
    stop_after: Option<usize>,
    registry: &granary::metrics::Registry,
) -> Vec<RankRun> {
    let Job { world, every, slow, slow_us, fast_us, epochs, sync, exchange_lag_ms } = job;
    let exchange: Arc<dyn granary::loader::MeasureExchange> = Arc::new(Lagging {
        inner: granary::loader::LocalExchange::new(world, Duration::from_secs(30)),
        rank: 1,
        lag: Duration::from_millis(exchange_lag_ms),
    });
    let barrier = Arc::new(std::sync::Barrier::new(world as usize));
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let dataset = Arc::clone(dataset);
            let exchange = Arc::clone(&exchange);
            let (start, resume) = starts[rank as usize].clone();
            let registry = registry.clone();
            let barrier = Arc::clone(&barrier);
            let plan = plan.clone();
            std::thread::spawn(move || {
                let mut rebalance = granary::loader::RebalanceConfig::every(every, Some(exchange));
                rebalance.lead = 2;
                rebalance.resume = resume;
                let config = LoaderConfig {
                    epochs: Some(epochs),
                    rebalance: Some(rebalance),
                    metrics: granary::metrics::Setting::Registry(registry),
                    ..config(plan, World::new(rank, world).unwrap())
                };
                let mut loader = Loader::new(dataset, config, start).unwrap();
                let mut batches = Vec::new();
                while let Some(batch) = loader.next() {
                    let batch = batch.unwrap();
                    let weights = batch.weights().map(|w| w.weights.clone()).unwrap_or_default();
                    let per_record = if rank == slow { slow_us } else { fast_us };
                    batches.push((batch.indices().to_vec(), batch.position(), weights));
                    let compute = Duration::from_micros(per_record * batch.len() as u64);
                    std::thread::sleep(compute);
                    drop(batch);
                    if sync != Sync::FreeRunning {
                        barrier.wait();
                    }
                    if sync == Sync::BarrierReportingBusy {
                        loader.report_busy(compute);
                    }
                    if stop_after == Some(batches.len()) {
                        return (batches, loader.rebalance_state());
                    }
                }
                (batches, loader.rebalance_state())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

#[test]
fn a_mixture_rebalances_and_its_global_order_stays_the_blends() {
    // The slow rank's compute (2 ms a record, 32 ms a step) is far above what reading a batch of
    // the mixture takes on a loaded machine: at 400 us (6.4 ms a step) both ranks' steps were
    // bound by the reads once in CI, the ranks measured alike and the shares were kept.
    const TWO: Job = FREE_RUNNING_PAIR;
    let _serial = serial();
    let fixture = fixture(32 * 48);
    let mut granary = Granary::open(fixture.dir.path().join("store")).unwrap();
    let more: Vec<Vec<u8>> = (0..300).map(|i| bytes(1_000_000 + i, TOKENS as usize * 2)).collect();
    ingest(&mut granary, "more", tokens_layout(TOKENS), small_shards(16 << 10), &more);
    let more = granary.open_dataset(&VersionSpec::parse("more").unwrap()).unwrap();
    drop(granary);
    let mixture = granary::Mixture::of(
        &[Arc::clone(&fixture.dataset), more],
        &[0.75, 0.25],
        granary::EpochLength::Samples(32 * 48),
    )
    .unwrap();
    let start = (Position::default(), None);
    let registry = granary::metrics::Registry::default();
    let plan = PlanSource::Mixture(Arc::clone(mixture.blend()));
    let runs = run_ranks_of(mixture.dataset(), plan, TWO, &[start.clone(), start], None, &registry);
    let (fast, slow) = (&runs[0].0, &runs[1].0);
    assert_eq!((fast.len(), slow.len()), (48, 48));
    assert!(slow[10].0.len() < 16 && fast[10].0.len() > 16, "step 10: {} and {}", fast[10].0.len(), slow[10].0.len());
    // Step by step, the fast rank's share then the slow one's is the blend's order.
    let order: Vec<u64> = mixture.blend().epoch(7, 0).unwrap().records_from(0).map(|(_, r)| r).collect();
    let read: Vec<u64> = (0..48).flat_map(|s| fast[s].0.iter().chain(&slow[s].0).copied()).collect();
    assert_eq!(read, order);
}

#[test]
fn a_slow_rank_gets_a_smaller_share_at_the_next_point_and_the_epoch_is_read_exactly_once() {
    // The slow rank's compute (2 ms a record) is far above a batch's read, as in the mixture
    // test: at 400 us a record CI once measured the fast rank the slower (step 10: 14 and 18).
    const TWO: Job = Job { epochs: 2, ..FREE_RUNNING_PAIR };
    let _serial = serial();
    // 2 ranks x 16 records a step: 48 steps an epoch, points at 10, 20, 30, 40; two epochs.
    let fixture = fixture(32 * 48);
    let start = (Position::default(), None);
    let registry = granary::metrics::Registry::default();
    let runs = run_ranks(&fixture.dataset, TWO, &[start.clone(), start.clone()], None, &registry);
    let (fast, slow) = (&runs[0].0, &runs[1].0);
    assert_eq!(fast.len(), 96);
    assert_eq!(slow.len(), 96, "every rank reads in every step");
    for epoch in 0..2 {
        let steps = epoch * 48..(epoch + 1) * 48;
        let mut all: Vec<u64> = steps.clone().flat_map(|s| fast[s].0.iter().chain(&slow[s].0).copied()).collect();
        all.sort_unstable();
        assert_eq!(all, (0..32 * 48).collect::<Vec<u64>>(), "epoch {epoch}: the union is the epoch, once");
    }
    // Before the first point both take 16; from it on the slow rank takes less.
    assert!(fast[..10].iter().chain(&slow[..10]).all(|b| b.0.len() == 16));
    assert!(slow[10].0.len() < 16 && fast[10].0.len() > 16, "step 10: {} and {}", fast[10].0.len(), slow[10].0.len());
    let lens: Vec<(usize, Vec<u32>)> = slow.iter().map(|b| (b.0.len(), b.2.clone())).collect();
    assert!(slow[47].0.len() < 10, "the slow rank ends with a small share: {lens:?}");
    // The second epoch starts with the weights the first ended with (not the ones its plan was
    // first made with), and every batch is its rank's share of the step under its weights.
    assert_eq!(slow[48].2, slow[47].2);
    assert!(slow[48].0.len() < 10, "{lens:?}");
    for step in 0..96 {
        // The ranks agree on the weights and the positions of every step.
        assert_eq!(fast[step].2, slow[step].2, "step {step}");
        assert_eq!(fast[step].1, slow[step].1, "step {step}");
        let shares = granary::plan::step_shares(32, &fast[step].2);
        assert_eq!((fast[step].0.len() as u64, slow[step].0.len() as u64), (shares[0], shares[1]), "step {step}");
    }
    // The metrics count the points passed and the records of a step they moved (the loaders
    // are dropped: their counters are kept, their gauges, such as the weight, are not).
    let samples = registry.gather();
    let of_rank = |name: &str| -> Vec<f64> {
        samples
            .values(name)
            .filter(|(labels, _)| labels.iter().any(|(k, v)| *k == "rank" && v == "1"))
            .map(|(_, v)| v)
            .collect()
    };
    assert!(of_rank("granary_loader_rebalances").contains(&8.0), "{:?}", of_rank("granary_loader_rebalances"));
    assert!(of_rank("granary_loader_rebalance_moved_records").iter().any(|&n| n >= 8.0));
    // The fast rank's reader read on past the first point before the slow rank had measured
    // (no point before it had told the ranks apart); what it read there was dropped and read
    // again with the point's weights, and every step above still split as the weights say.
    let recut: Vec<f64> = samples
        .values("granary_loader_rebalance_recut_batches")
        .filter(|(labels, _)| labels.iter().any(|(k, v)| *k == "rank" && v == "0"))
        .map(|(_, v)| v)
        .collect();
    assert!(recut.iter().any(|&n| n >= 1.0), "{recut:?}");
    // Steps concatenated in rank order are the global order the default plan has for any world.
    let global: Vec<u64> = (0..96).flat_map(|s| fast[s].0.iter().chain(&slow[s].0).copied()).collect();
    let one = Job { world: 1, slow_us: 0, ..TWO };
    let single = run_ranks(&fixture.dataset, one, &[(Position::default(), None)], None, &registry);
    let single: Vec<u64> = single[0].0.iter().flat_map(|b| b.0.clone()).collect();
    assert_eq!(global, single);

    // Saved after step 8 (the ranks have exchanged their measures for point 10, at step
    // 10 - lead) and resumed: the same batches through step 19, from the recorded weights and
    // measures.
    let stopped = run_ranks(&fixture.dataset, TWO, &[start.clone(), start.clone()], Some(9), &registry);
    let starts: Vec<_> = stopped
        .iter()
        .map(|(batches, state)| {
            let state = state.clone().unwrap();
            assert!(state.pending.as_ref().is_some_and(|(step, _)| *step == 10), "{state:?}");
            (batches.last().unwrap().1, Some(state))
        })
        .collect();
    let resumed = run_ranks(&fixture.dataset, TWO, &starts, Some(11), &registry);
    for rank in 0..2 {
        let stopped_weights = &stopped[rank].0[8].2;
        let resumed = &resumed[rank].0;
        assert_eq!(&resumed[0].2, stopped_weights, "rank {rank}: resumed with the saved weights");
        // Steps 9..20 of the resumed run equal each other across ranks and split 32 records.
        assert_eq!(resumed.len(), 11);
        assert!(resumed[1].0.len() != 16, "rank {rank}: step 10 is rebalanced from the saved measures");
    }
    let resumed_global: Vec<u64> =
        (0..11).flat_map(|s| resumed[0].0[s].0.iter().chain(&resumed[1].0[s].0).copied()).collect();
    assert_eq!(resumed_global, single[9 * 32..20 * 32], "the resumed run reads the same global order");

    // Saved after step 6 of the two-rank run and resumed on three ranks: its steps of 48
    // records start between the saving run's (cursor 224), its points follow its own steps,
    // and the rest of the epoch is read once, in the same global order.
    let stopped = run_ranks(&fixture.dataset, TWO, &[start.clone(), start], Some(7), &registry);
    let saved: Vec<_> = stopped.iter().map(|(b, state)| (b.last().unwrap().1, state.clone())).collect();
    assert_eq!(saved[0].0, Position { epoch: 0, cursor: 224 });
    let three = Job { world: 3, epochs: 1, every: 4, ..TWO };
    let resumed =
        run_ranks(&fixture.dataset, three, &[saved[0].clone(), saved[0].clone(), saved[0].clone()], None, &registry);
    let steps = resumed[0].0.len();
    assert!(resumed.iter().all(|(b, _)| b.len() == steps));
    let by_rank = &resumed;
    let rest: Vec<u64> = (0..steps).flat_map(|s| (0..3).flat_map(move |r| by_rank[r].0[s].0.clone())).collect();
    assert_eq!(rest, single[224..32 * 48], "resumed on 3 ranks: the rest of the epoch, once, in order");
    assert!(resumed[1].0.last().unwrap().0.len() < 16, "the slow rank is rebalanced on 3 ranks too");
}

/// The samples of `name` for `rank` in `registry`.
fn of_rank(registry: &granary::metrics::Registry, name: &str, rank: &str) -> Vec<f64> {
    registry
        .gather()
        .values(name)
        .filter(|(labels, _)| labels.iter().any(|(k, v)| *k == "rank" && v == rank))
        .map(|(_, v)| v)
        .collect()
}

#[test]
fn under_a_per_step_barrier_without_report_busy_the_shares_stay_equal_and_the_points_say_why() {
    // A synchronous trainer: each rank computes, then waits for the others (DDP's all-reduce).
    // Every rank's time between batches is then the slowest's; before issue 40 the rank holding
    // more records looked faster and was given still more (identical ranks drifted to 21/11).
    let _serial = serial();
    let fixture = fixture(32 * 48);
    let start = (Position::default(), None);
    // Steps of 6.4 ms (and 25.6 ms for the slow rank): a window of ten is long against a
    // scheduler's jitter on a loaded 2-core machine.
    // The third case: rank 1 returns from each exchange 10 ms after rank 0 (a step takes 6.4 ms).
    // When a step's time left out the whole wait there, rank 1's window was 10 ms shorter than
    // rank 0's (16 %) and the point moved records to it; now only what passes a step is left out.
    for (slow_us, exchange_lag_ms) in [(400, 0), (1600, 0), (400, 10)] {
        let job = Job {
            world: 2,
            every: 10,
            slow: 1,
            slow_us,
            fast_us: 400,
            epochs: 1,
            sync: Sync::Barrier,
            exchange_lag_ms,
        };
        let registry = granary::metrics::Registry::default();
        let runs = run_ranks(&fixture.dataset, job, &[start.clone(), start.clone()], None, &registry);
        for (rank, (batches, _)) in runs.iter().enumerate() {
            let lens: Vec<usize> = batches.iter().map(|b| b.0.len()).collect();
            assert!(lens.iter().all(|&n| n == 16), "slow_us {slow_us}, lag {exchange_lag_ms}, rank {rank}: {lens:?}");
            assert!(batches.iter().all(|b| b.2 == [16, 16]), "slow_us {slow_us}, rank {rank}: weights moved");
        }
        // Four points in the epoch, each passed with the weights in force, each counted as held.
        for rank in ["0", "1"] {
            assert_eq!(of_rank(&registry, "granary_loader_rebalances_held", rank), [4.0], "rank {rank}");
            assert_eq!(of_rank(&registry, "granary_loader_rebalance_moved_records", rank), [0.0], "rank {rank}");
        }
    }
    // The same barrier with each rank's own compute reported: the slow rank is seen and gets less,
    // and the moves stop once the ranks' compute is balanced (no drift back and forth).
    let job = Job {
        world: 2,
        every: 10,
        slow: 1,
        slow_us: 1600,
        fast_us: 400,
        epochs: 1,
        sync: Sync::BarrierReportingBusy,
        exchange_lag_ms: 0,
    };
    let registry = granary::metrics::Registry::default();
    let runs = run_ranks(&fixture.dataset, job, &[start.clone(), start], None, &registry);
    let slow: Vec<usize> = runs[1].0.iter().map(|b| b.0.len()).collect();
    assert!(slow[10] < 16 && slow[47] < 16, "the reported slow rank reads less: {slow:?}");
    assert!(slow[47] >= 3, "a 4 x slow rank keeps about a fifth of a 32-record step: {slow:?}");
}

#[test]
fn the_reader_reads_on_past_a_point_before_its_measures_come() {
    // Issue 53: at each rebalance point the reader waited for the point's measures, which come
    // when the trainer takes the batch `lead` steps before it: the steps past the point were
    // read only then, and a trainer at a per-step barrier waited for them. Now it reads on
    // with the weights in force (one rank: every point keeps them).
    let fixture = fixture(32 * 48);
    let mut rebalance = granary::loader::RebalanceConfig::every(8, None);
    rebalance.lead = 2;
    let config = LoaderConfig {
        epochs: Some(1),
        prefetch: 4,
        rebalance: Some(rebalance),
        ..config(PlanSource::default(), World::single())
    };
    let mut loader = Loader::new(Arc::clone(&fixture.dataset), config, Position::default()).unwrap();
    let mut seen = Vec::new();
    for _ in 0..6 {
        seen.push(loader.next().unwrap().unwrap().indices().to_vec());
    }
    // The trainer at step 6 (point 8 less the lead): the reader has time to fill its queue.
    std::thread::sleep(Duration::from_millis(500));
    let ready = loader.stats().ready;
    // Steps 6 to 9 were queued, past the point: taken at once, none waited for.
    for _ in 6..10 {
        seen.push(loader.next().unwrap().unwrap().indices().to_vec());
    }
    assert_eq!(loader.stats().ready - ready, 4, "the reader stopped at the point");
    while let Some(batch) = loader.next() {
        seen.push(batch.unwrap().indices().to_vec());
    }
    let mut all: Vec<u64> = seen.into_iter().flatten().collect();
    all.sort_unstable();
    assert_eq!(all, (0..32 * 48).collect::<Vec<u64>>());
    assert_eq!(loader.stats().recut, 0);
}

#[test]
fn a_point_tells_ranks_apart_only_when_their_window_times_differ() {
    use granary::loader::tells_ranks_apart;
    use granary::policy::RankMeasure;
    let m = |rank, records, busy_nanos| RankMeasure { rank, records, busy_nanos };
    // Under a barrier the times match whatever the records: nothing to tell.
    assert!(!tells_ranks_apart(&[m(0, 21, 1_000_000), m(1, 11, 1_020_000)]));
    // A 4 x straggler running free shows it; so does a reported compute time.
    assert!(tells_ranks_apart(&[m(0, 16, 1_000_000), m(1, 16, 4_000_000)]));
    // One rank, or ranks that measured nothing, tell nothing.
    assert!(!tells_ranks_apart(&[m(0, 16, 1_000_000)]));
    assert!(!tells_ranks_apart(&[m(0, 16, 1_000_000), m(1, 0, 0), m(2, 16, 0)]));
    assert!(!tells_ranks_apart(&[]));
}

#[test]
fn a_named_partitioner_that_fails_is_replaced_by_the_default_unless_the_loader_asks_for_no_fallback() {
    // A partitioner whose plan drops a record: by default the built-in plans the epoch instead
    // (said on stderr, counted by the plugin metrics); with no fallback the stream ends with the
    // plugin's error, naming it.
    let fixture = fixture(200);
    let path = granary::policy::builtin::built_plugin_path("hostile_partitioner");
    let plan = || PlanSource::Partitioner {
        plugin: Some(path.to_string_lossy().into_owned()),
        options: vec![("behave".to_owned(), "missing".to_owned())],
    };
    let mut loader = Loader::new(
        Arc::clone(&fixture.dataset),
        LoaderConfig { epochs: Some(1), ..config(plan(), World::single()) },
        Position::default(),
    )
    .unwrap();
    let mut seen: Vec<u64> = drain(&mut loader, &fixture.records).into_iter().flat_map(|(i, _)| i).collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..200).collect::<Vec<u64>>(), "the fallback planned every record once");

    let mut strict = Loader::new(
        Arc::clone(&fixture.dataset),
        LoaderConfig { epochs: Some(1), partitioner_fallback: false, ..config(plan(), World::single()) },
        Position::default(),
    )
    .unwrap();
    let error =
        std::iter::from_fn(|| strict.next()).find_map(Result::err).expect("the plugin's failure ends the stream");
    assert!(error.to_string().contains("hostile"), "{error}");
}

#[test]
fn the_window_for_a_cache_is_about_the_shards_it_holds() {
    use granary::loader::window_for_cache;
    // A quarter-size cache of 16 shards holds 4: a window of 3 (each batch mixes about 3).
    assert_eq!(window_for_cache(4 << 20, 1 << 20), 3);
    assert_eq!(window_for_cache((4 << 20) - 1, 1 << 20), 2);
    // A cache of one or two shards still reads a window of one.
    assert_eq!(window_for_cache(1 << 20, 1 << 20), 1);
    assert_eq!(window_for_cache(2 << 20, 1 << 20), 1);
    // Larger caches keep an eighth for the prefetch: 16 shards, a window of 13.
    assert_eq!(window_for_cache(16 << 20, 1 << 20), 13);
    assert_eq!(window_for_cache(100, 0), 87);
}
