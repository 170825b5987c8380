//! Policy plugin costs: an eviction batch through the component boundary against the same policy
//! compiled natively, a 100k-shard plan, interrupting an infinite loop, loading from the cache.
//!
//! Back of the envelope: a component call costs ~200 ns (concurrency support off), a batch of
//! 1024 accesses moves ~20 KiB across the boundary, and LRU costs ~30-60 ns per access natively,
//! so a batch should cost at most 1.25x native per access. An infinite loop must stop within 2
//! epoch ticks of its deadline. A plan for 100k shards and 64 ranks must take under 100 ms.

use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, Throughput, criterion_group};
use granary::policy::builtin::built_plugin_path;
use granary::policy::{
    AccessOutcome, EpochSpec, Evictor, Limits, NodeInfo, Partitioner, PolicyHost, RankInfo, ResidentSet, sim, trace,
};
use granary_policy_sdk::Options;
use granary_policy_sdk::evict::Cache;

const BATCH: usize = 1024;

/// `policy_evict_batch1024`: LRU over a Zipf(1.0) trace, cache of 1000 objects, 1024 accesses per
/// iteration: through the host (one component call, outcome validated against the host's
/// resident set), and the same LRU source compiled natively with the SDK's batch driver.
fn policy_evict_batch1024(c: &mut Criterion) {
    let requests = trace::zipf(10_000, 1 << 20, 1.0, 7).expect("counts within the bounds");
    let keys: Vec<u64> = requests.iter().map(|r| r.key).collect();
    let sizes = vec![1u32; BATCH];
    let next_uses = vec![u64::MAX; BATCH];
    let host = PolicyHost::new(Limits::default(), None).expect("a host");
    let mut group = c.benchmark_group("policy_evict_batch1024");
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut evictor = Evictor::new(host.load("lru").expect("built in"), &[], None, 1000).expect("an evictor");
    let mut at = 0;
    group.bench_function("wasm/lru", |b| {
        b.iter(|| {
            let batch = &keys[at..at + BATCH];
            at = (at + BATCH) % (keys.len() - BATCH);
            evictor.access(batch, &sizes, &next_uses).expect("valid")
        })
    });
    let mut native = Cache::<evictor_lru::Lru>::new(1000, &Options::default()).expect("a cache");
    let (mut hits, mut evictions) = (Vec::with_capacity(BATCH), Vec::new());
    let mut at = 0;
    group.bench_function("native/lru", |b| {
        b.iter(|| {
            let batch = &keys[at..at + BATCH];
            at = (at + BATCH) % (keys.len() - BATCH);
            hits.clear();
            evictions.clear();
            native.access(batch, &sizes, &next_uses, &mut hits, &mut evictions).expect("valid");
            hits.len()
        })
    });
    group.finish();
}

/// `policy_plan_100k_shards_64_ranks`: the elastic partitioner's global plan (block shuffle of one
/// chunk per shard) for 100k shards of 1000 records and 64 ranks, validated by the host.
fn policy_plan_100k_shards_64_ranks(c: &mut Criterion) {
    let host = PolicyHost::new(Limits::default(), None).expect("a host");
    let options = vec![("chunk-records".to_owned(), "1000".to_owned())];
    let mut partitioner =
        Partitioner::new(host.load("elastic").expect("built in"), &options, None).expect("a partitioner");
    let shards = sim::synthetic_shards(100_000, 1000).expect("counts within the bounds");
    let ranks: Vec<RankInfo> = (0..64).map(|id| RankInfo { id, node: id / 8, weight: 1, up: true }).collect();
    let nodes: Vec<NodeInfo> = (0..8).map(|id| NodeInfo { id, weight: 1, failure_domain: id, up: true }).collect();
    let mut group = c.benchmark_group("policy_plan_100k_shards_64_ranks");
    group.sample_size(20);
    group.bench_function("elastic_global", |b| {
        b.iter(|| {
            partitioner
                .plan(&shards, &ranks, &nodes, EpochSpec { seed: 1, epoch: 0, batch_size: 256, start: 0 })
                .expect("valid")
        })
    });
    group.finish();
}

/// `policy_interrupt_loop`: a call into an infinite loop with a deadline of 2 ticks of 1 ms; the
/// time per call minus the deadline is how long the interruption took (target: within 2 ticks).
fn policy_interrupt_loop(c: &mut Criterion) {
    let limits = Limits {
        tick: Duration::from_millis(1),
        deadline_evict: Duration::from_millis(2),
        backoff_base: Duration::ZERO,
        quarantine_after: u32::MAX,
        ..Limits::default()
    };
    let host = PolicyHost::new(limits, None).expect("a host");
    let hostile = host.load_file(&built_plugin_path("hostile_evictor")).expect("built");
    let options = vec![("behave".to_owned(), "loop".to_owned())];
    let mut evictor = Evictor::new(hostile, &options, None, 10).expect("an evictor");
    let mut group = c.benchmark_group("policy_interrupt_loop");
    group.sample_size(30);
    group.bench_function("deadline_2_ticks", |b| b.iter(|| evictor.access(&[1], &[1], &[u64::MAX]).is_err()));
    group.finish();
}

/// `policy_load`: a plugin compiled from scratch, and loaded from the disk cache by a new host
/// (what a restart pays; target: well under a millisecond).
fn policy_load(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let warm = PolicyHost::new(Limits::default(), Some(dir.path().to_owned())).expect("a host");
    warm.load("lru").expect("built in");
    let mut group = c.benchmark_group("policy_load");
    group.sample_size(20);
    group.bench_function("compile", |b| {
        b.iter_batched(
            || PolicyHost::new(Limits::default(), None).expect("a host"),
            |host| host.load("lru").expect("built in"),
            BatchSize::PerIteration,
        )
    });
    group.bench_function("from_disk_cache", |b| {
        b.iter_batched(
            || PolicyHost::new(Limits::default(), Some(dir.path().to_owned())).expect("a host"),
            |host| host.load("lru").expect("built in"),
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// `policy_evict_ratio`: the eviction target as one figure. The two criterion rows above run one
/// after the other, and on a shared machine the speed drifts between them by more than the
/// difference being measured; here rounds of wasm and native batches alternate (order rotated
/// every round) and the ratio is taken per round, so drift cancels. A third side runs the native
/// policy with the host's check of every outcome (`ResidentSet::apply`, what the host does to a
/// plugin's answer): how much of the budget the check alone takes.
fn policy_evict_ratio() {
    const ROUNDS: usize = 101;
    const BATCHES: usize = 32;
    let requests = trace::zipf(10_000, 1 << 20, 1.0, 7).expect("counts within the bounds");
    let keys: Vec<u64> = requests.iter().map(|r| r.key).collect();
    let sizes = vec![1u32; BATCH];
    let next_uses = vec![u64::MAX; BATCH];
    let (keys, sizes, next_uses) = (&keys, &sizes, &next_uses);
    let host = PolicyHost::new(Limits::default(), None).expect("a host");
    let mut evictor = Evictor::new(host.load("lru").expect("built in"), &[], None, 1000).expect("an evictor");
    let mut wasm_at = 0;
    let mut wasm_round = || {
        let started = Instant::now();
        for _ in 0..BATCHES {
            let batch = &keys[wasm_at..wasm_at + BATCH];
            wasm_at = (wasm_at + BATCH) % (keys.len() - BATCH);
            std::hint::black_box(evictor.access(batch, sizes, next_uses).expect("valid"));
        }
        started.elapsed().as_secs_f64()
    };
    let native_side = |checked: bool| {
        let mut cache = Cache::<evictor_lru::Lru>::new(1000, &Options::default()).expect("a cache");
        let mut resident = ResidentSet::new(1000);
        let mut outcome = AccessOutcome { hits: Vec::with_capacity(BATCH), evictions: Vec::new() };
        let mut at = 0;
        move || {
            let started = Instant::now();
            for _ in 0..BATCHES {
                let batch = &keys[at..at + BATCH];
                at = (at + BATCH) % (keys.len() - BATCH);
                outcome.hits.clear();
                outcome.evictions.clear();
                cache.access(batch, sizes, next_uses, &mut outcome.hits, &mut outcome.evictions).expect("valid");
                if checked {
                    resident.apply(batch, sizes, &outcome).expect("valid");
                }
                std::hint::black_box(&outcome);
            }
            started.elapsed().as_secs_f64()
        }
    };
    let mut native_round = native_side(false);
    let mut checked_round = native_side(true);
    // Warm up every side (compiled code, caches, the tables at their steady size).
    for _ in 0..8 {
        wasm_round();
        native_round();
        checked_round();
    }
    let mut rounds: Vec<[f64; 3]> = (0..ROUNDS)
        .map(|round| {
            let mut times = [0.0; 3];
            for side in (0..3).map(|k| (k + round) % 3) {
                times[side] = match side {
                    0 => wasm_round(),
                    1 => native_round(),
                    _ => checked_round(),
                };
            }
            times
        })
        .collect();
    let per_batch_us = |seconds: f64| seconds / BATCHES as f64 * 1e6;
    let quantiles = |mut ratios: Vec<f64>| {
        ratios.sort_by(f64::total_cmp);
        (ratios[ROUNDS / 2], ratios[ROUNDS / 10], ratios[ROUNDS * 9 / 10])
    };
    let (wasm, wasm_p10, wasm_p90) = quantiles(rounds.iter().map(|[w, n, _]| w / n).collect());
    let (checked, checked_p10, checked_p90) = quantiles(rounds.iter().map(|[_, n, c]| c / n).collect());
    rounds.sort_by(|a, b| (a[0] / a[1]).total_cmp(&(b[0] / b[1])));
    let [w, n, c] = rounds[ROUNDS / 2];
    println!(
        "policy_evict_ratio: per access, medians of {ROUNDS} interleaved rounds of {BATCHES} batches of {BATCH}:\n  \
         wasm / native: {wasm:.2} (p10 {wasm_p10:.2}, p90 {wasm_p90:.2})\n  \
         native checked by the host / native: {checked:.2} (p10 {checked_p10:.2}, p90 {checked_p90:.2})\n  \
         median round: wasm {:.1} us, native {:.1} us, native checked {:.1} us per batch",
        per_batch_us(w),
        per_batch_us(n),
        per_batch_us(c),
    );
}

criterion_group!(benches, policy_evict_batch1024, policy_plan_100k_shards_64_ranks, policy_interrupt_loop, policy_load);

fn main() {
    // `cargo bench -- FILTER`: the ratio runs when no filter is given or the filter names it.
    // The filter is the first argument that is neither an option nor the value of one.
    const TAKES_VALUE: &[&str] = &[
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--profile-time",
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--output-format",
        "--color",
        "--plotting-backend",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
    ];
    let mut args = std::env::args().skip(1);
    let mut filter = None;
    while let Some(arg) = args.next() {
        if TAKES_VALUE.contains(&arg.as_str()) {
            args.next();
        } else if !arg.starts_with('-') {
            filter = Some(arg);
            break;
        }
    }
    if filter.as_deref().is_none_or(|filter| "policy_evict_ratio".contains(filter)) {
        policy_evict_ratio();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
