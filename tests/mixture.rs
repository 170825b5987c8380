//! Mixtures: weighted datasets read as one stream. The proportions hold at every prefix of an
//! epoch's order, any world size reads the same global order, a position saved on N ranks
//! resumes on M with the weights' changes in force, and every record comes with its bytes.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use granary::blend::{Blend, BlendSource};
use granary::loader::{Loader, LoaderConfig, PlanSource, Reads, Session, SessionConfig, Target};
use granary::{EpochLength, Granary, Mixture, Position, VersionSpec, World};
use proptest::prelude::*;

const TOKENS: u64 = 24;

/// A store with three sources of different sizes ("web" 300, "code" 70, "math" 9 records), each
/// record's bytes unique in the store.
struct Sources {
    _dir: tempfile::TempDir,
    granary: Granary,
    /// The records of the sources, one after the other (the mixture's dataset's order).
    records: Vec<Vec<u8>>,
    sizes: Vec<u64>,
}

fn sources() -> Sources {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).expect("a store");
    let mut records = Vec::new();
    let sizes = vec![300, 70, 9];
    for (s, (name, &n)) in ["web", "code", "math"].iter().zip(&sizes).enumerate() {
        let part: Vec<Vec<u8>> = (0..n).map(|i| bytes(s as u64 * 1_000_000 + i, TOKENS as usize * 2)).collect();
        ingest(&mut granary, name, tokens_layout(TOKENS), small_shards(4 << 10), &part);
        records.extend(part);
    }
    Sources { _dir: dir, granary, records, sizes }
}

fn mixture(s: &Sources, weights: &[f64], epoch: EpochLength) -> Mixture {
    let parts: Vec<(VersionSpec, f64)> = ["web", "code", "math"]
        .iter()
        .zip(weights)
        .map(|(name, &w)| (VersionSpec::parse(name).expect("spec"), w))
        .collect();
    Mixture::open(s.granary.paths(), &parts, epoch).expect("the mixture opens")
}

fn config(mixture: &Mixture, world: World, epochs: u64) -> LoaderConfig {
    LoaderConfig {
        batch_size: 4,
        world,
        seed: 11,
        plan: PlanSource::Mixture(Arc::clone(mixture.blend())),
        epochs: Some(epochs),
        target: Target::Host,
        ..LoaderConfig::default()
    }
}

/// Each rank's batch of one step.
type RankBatches = Vec<(u32, Vec<u64>)>;

/// Every rank of `size` read from `from` for `epochs` epochs, put back in global order: steps by
/// the position after them, ranks in order within a step. Checks every record's bytes.
fn global_order(s: &Sources, mixture: &Mixture, size: u32, from: Position, epochs: u64) -> Vec<(u64, Position)> {
    let mut steps: BTreeMap<(u64, u64), RankBatches> = BTreeMap::new();
    for rank in 0..size {
        let world = World::new(rank, size).expect("a world");
        let mut loader =
            Loader::new(Arc::clone(mixture.dataset()), config(mixture, world, epochs), from).expect("a loader");
        while let Some(batch) = loader.next() {
            let batch = batch.expect("a batch");
            for (i, &index) in batch.indices().iter().enumerate() {
                assert_eq!(batch.record(i), &s.records[index as usize][..], "record {index}");
            }
            let at = batch.position();
            steps.entry((at.epoch, at.cursor)).or_default().push((rank, batch.indices().to_vec()));
        }
    }
    let mut out = Vec::new();
    for ((epoch, cursor), mut ranks) in steps {
        ranks.sort_unstable();
        for (_, records) in ranks {
            out.extend(records.into_iter().map(|r| (r, Position { epoch, cursor })));
        }
    }
    out
}

fn source_of(sizes: &[u64], record: u64) -> usize {
    let mut start = 0;
    for (s, &n) in sizes.iter().enumerate() {
        if record < start + n {
            return s;
        }
        start += n;
    }
    panic!("record {record} is in no source")
}

#[test]
fn every_world_size_reads_the_same_global_order() {
    let s = sources();
    let m = mixture(&s, &[0.6, 0.3, 0.1], EpochLength::Samples(250));
    let one: Vec<u64> = global_order(&s, &m, 1, Position::default(), 2).into_iter().map(|(r, _)| r).collect();
    assert_eq!(one.len(), 500, "two epochs of 250 samples");
    for size in [3, 8] {
        let many: Vec<u64> = global_order(&s, &m, size, Position::default(), 2).into_iter().map(|(r, _)| r).collect();
        assert_eq!(many, one, "{size} ranks");
    }
    // The small source is repeated (9 records, ~25 draws an epoch), each pass a permutation.
    let math: Vec<u64> = one.iter().copied().filter(|&r| source_of(&s.sizes, r) == 2).collect();
    for pass in math.chunks(9).filter(|pass| pass.len() == 9) {
        let mut pass = pass.to_vec();
        pass.sort_unstable();
        assert_eq!(pass, (370..379).collect::<Vec<_>>());
    }
    // The web source is read partly, and the second epoch goes on with records not yet read.
    let web: Vec<u64> = one.iter().copied().filter(|&r| source_of(&s.sizes, r) == 0).collect();
    let mut distinct = web.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), web.len(), "300 web records cover two epochs' 300 draws once each");
}

#[test]
fn a_position_saved_on_three_ranks_resumes_on_two_with_the_weight_change_in_force() {
    let s = sources();
    // A curriculum: math goes up at position 100 of epoch 0.
    let m = mixture(&s, &[0.6, 0.3, 0.1], EpochLength::Samples(200))
        .with_change(Position { epoch: 0, cursor: 100 }, &[0.3, 0.3, 0.4])
        .expect("a change");
    let whole = global_order(&s, &m, 1, Position::default(), 2);
    // Three ranks save after step 12 (batch 4: 144 positions), past the change.
    let three = global_order(&s, &m, 3, Position::default(), 2);
    assert_eq!(three.iter().map(|(r, _)| *r).collect::<Vec<_>>(), whole.iter().map(|(r, _)| *r).collect::<Vec<_>>());
    let saved = Position { epoch: 0, cursor: 144 };
    assert!(three.iter().any(|(_, at)| *at == saved), "a step ends at {saved:?}");
    // The mixture is rebuilt from what a state records (sources, weights, changes) and read on 2.
    let again = mixture(&s, &[0.6, 0.3, 0.1], EpochLength::Samples(200))
        .with_change(Position { epoch: 0, cursor: 100 }, &[0.3, 0.3, 0.4])
        .expect("a change");
    assert_eq!(again.id(), m.id(), "the identity is the content");
    let rest: Vec<u64> = global_order(&s, &again, 2, saved, 2).into_iter().map(|(r, _)| r).collect();
    assert_eq!(rest, whole[144..].iter().map(|(r, _)| *r).collect::<Vec<_>>());
    // The change shows: math's share after it is about 0.4.
    let math_after = whole[100..200].iter().filter(|(r, _)| source_of(&s.sizes, *r) == 2).count();
    assert!((39..=41).contains(&math_after), "{math_after} of 100");
    // Another weight is another mixture.
    let other = mixture(&s, &[0.6, 0.3, 0.1], EpochLength::Samples(200));
    assert_ne!(other.id(), m.id());
}

#[test]
fn an_epoch_is_the_sources_records_or_one_sources_pass() {
    let s = sources();
    let m = mixture(&s, &[1.0, 1.0, 1.0], EpochLength::Records);
    assert_eq!(m.blend().epoch_samples(), 379);
    let m = mixture(&s, &[0.5, 0.4, 0.1], EpochLength::PassOf(1));
    assert_eq!(m.blend().epoch_samples(), 175, "70 code records at 0.4");
    assert_eq!(m.drawn(1).unwrap()[1], 70);
}

#[test]
fn sources_of_different_layouts_are_refused_by_name() {
    let mut s = sources();
    ingest(&mut s.granary, "wide", tokens_layout(TOKENS * 2), small_shards(4 << 10), &[bytes(1, TOKENS as usize * 4)]);
    let parts = [(VersionSpec::parse("web").unwrap(), 1.0), (VersionSpec::parse("wide").unwrap(), 1.0)];
    let error = Mixture::open(s.granary.paths(), &parts, EpochLength::Records).unwrap_err().to_string();
    assert!(error.contains("wide@1") && error.contains("web@1") && error.contains("layout"), "{error}");
    let parts = [(VersionSpec::parse("web").unwrap(), -1.0)];
    assert!(Mixture::open(s.granary.paths(), &parts, EpochLength::Records).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Each source's count stays within 1 of the sum of its weights over the positions so far,
    /// at every prefix of an epoch, also across a change of weights.
    #[test]
    fn proportions_are_exact_at_every_prefix(
        weights in prop::collection::vec(0.0f64..10.0, 1..9),
        sizes in prop::collection::vec(1u64..50, 9),
        samples in 1u64..600,
        change in prop::option::of((0u64..600, prop::collection::vec(0.0f64..10.0, 9))),
        epoch in 0u64..3,
    ) {
        prop_assume!(weights.iter().sum::<f64>() > 1e-3);
        let n = weights.len();
        let mut start = 0;
        let sources: Vec<BlendSource> = sizes[..n].iter().enumerate().map(|(s, &size)| {
            let source = BlendSource { start, n_records: size, key: s as u64 };
            start += size;
            source
        }).collect();
        let mut blend = Blend::new(sources, &weights, samples).unwrap();
        if let Some((at, w)) = change && w[..n].iter().sum::<f64>() > 1e-3 && at < samples {
            blend = blend.with_change(Position { epoch, cursor: at }, &w[..n]).unwrap();
        }
        let mut counts = vec![0u64; n];
        let mut targets = vec![0f64; n];
        let first = blend.units_at(Position { epoch, cursor: 0 }).to_vec();
        let changed_by = |p: u64| (0..=p).any(|q| blend.units_at(Position { epoch, cursor: q }) != first.as_slice());
        for (p, (s, record)) in blend.epoch(5, epoch).unwrap().records_from(0).enumerate() {
            let units = blend.units_at(Position { epoch, cursor: p as u64 });
            for (t, &u) in targets.iter_mut().zip(units) {
                *t += u as f64 / granary::blend::WEIGHT_UNIT as f64;
            }
            counts[s] += 1;
            prop_assert!(record >= blend.sources()[s].start && record < blend.sources()[s].start + sizes[s]);
            // Within one draw of its share under one set of weights; a change can push two
            // sources nearly a draw behind both past it at once: within two after it.
            let off_max = if changed_by(p as u64) { 2.0 } else { 1.0 };
            for i in 0..n {
                prop_assert!((counts[i] as f64 - targets[i]).abs() < off_max + 1e-9,
                    "source {i} at prefix {}: {} draws, target {}", p + 1, counts[i], targets[i]);
            }
        }
        prop_assert_eq!(counts.iter().sum::<u64>(), samples);
    }
}

#[test]
fn granary_mix_counts_each_sources_draws_and_passes() {
    let s = sources();
    let root = s.granary.paths().root().to_path_buf();
    drop(s.granary);
    let out = granary_ok(&root, &["mix", "web=0.6", "code=0.3", "math=0.1", "--samples", "250", "--epochs", "2"]);
    let m = {
        let parts: Vec<(VersionSpec, f64)> = [("web", 0.6), ("code", 0.3), ("math", 0.1)]
            .iter()
            .map(|(n, w)| (VersionSpec::parse(n).unwrap(), *w))
            .collect();
        Mixture::open(&granary::StorePaths::new(&root), &parts, EpochLength::Samples(250)).unwrap()
    };
    assert!(out.contains(&format!("mixture {}", m.id())), "{out}");
    // 500 draws in two epochs: 300, 150 and 50, so math (9 records) is read 5.556 times.
    for line in ["web@1", "code@1", "math@1"] {
        assert!(out.lines().any(|l| l.starts_with(line)), "{out}");
    }
    let math = out.lines().find(|l| l.starts_with("math@1")).unwrap();
    let fields: Vec<&str> = math.split_whitespace().collect();
    assert_eq!(fields[1..], ["9", "0.1000", "50", "5.556"], "{out}");
    let error = granary(&root, &["mix", "web=0.6", "nope=1"]);
    assert!(!error.status.success());
    assert!(String::from_utf8_lossy(&error.stderr).contains("nope"));
    let error = granary(&root, &["mix", "web"]);
    assert!(String::from_utf8_lossy(&error.stderr).contains("NAME=WEIGHT"));
    // Counts a user can type: 2**32 - 1 epochs took a row of counts each (a 103 GB allocation,
    // aborted); epochs of one set of weights are counted once now, and a total past a u64 is
    // refused.
    let started = std::time::Instant::now();
    let out =
        granary_ok(&root, &["mix", "web=0.6", "code=0.3", "math=0.1", "--samples", "250", "--epochs", "4294967295"]);
    let math = out.lines().find(|l| l.starts_with("math@1")).unwrap();
    assert_eq!(math.split_whitespace().nth(3), Some((25u64 * 4294967295).to_string().as_str()), "{out}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "{:?}", started.elapsed());
    let error = granary(&root, &["mix", "web=0.6", "code=0.3", "--samples", "250", "--epochs", "18446744073709551615"]);
    assert_eq!(error.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&error.stderr).contains("pass what a u64 counts"), "{error:?}");
    // An epoch of 2^64 - 1 samples under 1:1 weights: whole periods of the draws are counted at
    // once (it spun a core for minutes); a pass over a source drawn less than 1 / 2^32 of the
    // time is refused (it spun).
    let out = granary_ok(&root, &["mix", "web=1", "code=1", "--samples", "18446744073709551615"]);
    let code = out.lines().find(|l| l.starts_with("code@1")).unwrap();
    assert_eq!(code.split_whitespace().nth(3), Some("9223372036854775807"), "{out}");
    let error = granary(&root, &["mix", "web=1", "code=1e-12", "--pass-of", "code"]);
    assert_eq!(error.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&error.stderr).contains("never drawn"), "{error:?}");
}

/// A session of the sources' mixture (60/30/10, 50 samples an epoch) as rank `rank` of two,
/// 4 records a batch, `drop_last`.
fn session(s: &Sources, rank: u32) -> Session {
    let parts = [("web", 0.6), ("code", 0.3), ("math", 0.1)]
        .iter()
        .map(|(name, w)| (VersionSpec::parse(name).expect("spec"), *w))
        .collect();
    let loader = LoaderConfig {
        batch_size: 4,
        world: World::new(rank, 2).expect("a world"),
        seed: 11,
        target: Target::Host,
        ..LoaderConfig::default()
    };
    let config = SessionConfig {
        reads: Reads::Mixture { parts, epoch: EpochLength::Samples(50), changes: Vec::new() },
        plan: None,
        pack: None,
        drop_last: true,
        device: None,
        epoch: 0,
        loader,
    };
    Session::new(s.granary.paths().root(), config).expect("a session")
}

/// The rest of the epoch being iterated: each batch's indices.
fn rest_of_epoch(session: &mut Session, s: &Sources) -> Vec<Vec<u64>> {
    let mut out = Vec::new();
    while let Some(batch) = session.next_records().expect("a batch") {
        for (i, &index) in batch.indices().iter().enumerate() {
            assert_eq!(batch.record(i), &s.records[index as usize][..], "record {index}");
        }
        out.push(batch.indices().to_vec());
    }
    out
}

#[test]
fn a_session_drops_the_short_step_changes_weights_resumes_and_refuses_an_altered_state() {
    let s = sources();
    let math = s.sizes[0] + s.sizes[1];
    let mut a = session(&s, 0);
    // Steps of 8 samples: 6 whole steps of an epoch of 50, the short seventh dropped.
    assert_eq!(a.batches_per_epoch().expect("batches"), 6);
    assert_eq!(a.begin_epoch(), 0);
    let first = rest_of_epoch(&mut a, &s);
    assert_eq!(first.len(), 6);
    assert!(first.iter().all(|batch| batch.len() == 4));
    assert_eq!(a.position(), Position { epoch: 1, cursor: 0 }, "the short step is skipped, not read");
    // Halfway through epoch 1 the weights become math's alone.
    assert_eq!(a.begin_epoch(), 1);
    for _ in 0..3 {
        a.next_records().expect("a batch").expect("one more");
    }
    a.change_weights(vec![0.0, 0.0, 1.0]).expect("a change");
    let saved = a.save().expect("a state");
    assert_eq!(saved.digest, Some(saved.digest()));
    let after_change = rest_of_epoch(&mut a, &s);
    assert_eq!(after_change.len(), 3);
    assert!(after_change.iter().flatten().all(|&index| index >= math), "only math after the change");
    // A new session resumes from the saved state: the same batches.
    let mut b = session(&s, 0);
    b.resume(&saved).expect("the saved state");
    b.begin_epoch();
    assert_eq!(rest_of_epoch(&mut b, &s), after_change);
    // A state altered after its save is refused, the session unchanged: with its digest (any
    // field), and without one (a state of before digests: its changes no longer give its id).
    let mut c = session(&s, 0);
    let mut altered = saved.clone();
    altered.mixture.as_mut().expect("a mixture").changes.last_mut().expect("a change").1 = vec![1.0, 0.0, 0.0];
    for digest in [saved.digest.clone(), None] {
        altered.digest = digest;
        let error = c.resume(&altered).expect_err("an altered state").to_string();
        assert!(error.contains("altered after it was saved"), "{error}");
        assert_eq!(c.changes(), Some(&[][..]));
        assert_eq!(c.position(), Position::default());
    }
    let mut past = saved.clone();
    (past.position.cursor, past.digest) = (51, None);
    let error = c.resume(&past).expect_err("a cursor past the epoch").to_string();
    assert!(error.contains("past the end"), "{error}");
    assert_eq!(c.changes(), Some(&[][..]), "refused whole");
    // Another seed reads other samples at the same position: refused, naming both.
    let mut other = session(&s, 1);
    other.resume(&saved).expect("another rank of the same order");
    let mut reseeded = saved.clone();
    reseeded.seed = 12;
    reseeded.digest = Some(reseeded.digest());
    let error = c.resume(&reseeded).expect_err("another seed").to_string();
    assert!(error.contains("with seed 12, this loader has seed 11"), "{error}");
    // An epoch whose plan would not fit in this process's memory is refused when opened.
    let parts = vec![(VersionSpec::parse("web").unwrap(), 1.0), (VersionSpec::parse("code").unwrap(), 1.0)];
    let config = SessionConfig {
        reads: Reads::Mixture { parts, epoch: EpochLength::Samples(1 << 62), changes: Vec::new() },
        plan: None,
        pack: None,
        drop_last: false,
        device: None,
        epoch: 0,
        loader: LoaderConfig { batch_size: 8, target: Target::Host, ..LoaderConfig::default() },
    };
    let mut huge = Session::new(s.granary.paths().root(), config).expect("checked when opened");
    let Err(error) = huge.dataset() else { panic!("a plan past memory was opened") };
    let error = error.to_string();
    assert!(error.contains("held whole"), "{error}");
}
