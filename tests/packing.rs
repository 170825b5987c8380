//! Packed sequences through the loader: every window `seq_len + 1` tokens, every token of an
//! epoch in one window (but the one-token overlaps), `cu_seqlens` and position ids at the
//! documents' boundaries, the same windows on 1, 3 and 8 ranks, and a resume from 3 ranks to 2.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use granary::loader::{LoaderConfig, Reads, Session, SessionConfig, Target, pack_plan};
use granary::pack::{PackConfig, PackPlan};
use granary::{Dataset, Dtype, Granary, Layout, Position, VersionSpec, World};

const EOD: u32 = u32::MAX;
const SEQ: u64 = 16;

/// Token `t` of document `d` is `d * 100_000 + t`: a token names its document and place.
fn documents(n: u64) -> Vec<Vec<u32>> {
    (0..n).map(|d| (0..(d * 37 % 53) + 1).map(|t| (d * 100_000 + t) as u32).collect()).collect()
}

struct Corpus {
    dir: tempfile::TempDir,
    dataset: Arc<Dataset>,
    documents: Vec<Vec<u32>>,
}

fn corpus(n: u64) -> Corpus {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).expect("a store");
    let documents = documents(n);
    let records: Vec<Vec<u8>> =
        documents.iter().map(|doc| doc.iter().flat_map(|t| t.to_le_bytes()).collect()).collect();
    ingest(&mut granary, "docs", Layout::Arrays(Dtype::U32), small_shards(4 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("docs").expect("spec")).expect("open");
    Corpus { dir, dataset, documents }
}

fn plan(c: &Corpus, cross: bool) -> Arc<PackPlan> {
    let config = PackConfig { seq_len: SEQ, eod: cross.then_some(u64::from(EOD)), cross_documents: cross, pad: 0 };
    Arc::new(pack_plan(&c.dataset, config).expect("a pack"))
}

fn config(world: World) -> LoaderConfig {
    LoaderConfig { batch_size: 4, world, seed: 5, target: Target::Host, ..LoaderConfig::default() }
}

/// (window index, its tokens, its cu_seqlens within it, its position ids) of every window the
/// ranks of `size` read from `from`, by (epoch, window).
type Windows = BTreeMap<(u64, u64), (Vec<u32>, Vec<i32>, Vec<i32>)>;

/// Adds `batch`'s windows to `out` (each seq_len + 1 tokens; none read twice).
fn collect(out: &mut Windows, batch: &granary::loader::PackedBatch) {
    let p = &batch.packed;
    let width = SEQ as usize + 1;
    assert_eq!(p.tokens.len(), p.windows * width * 4, "every window is seq_len + 1 tokens");
    assert_eq!(p.windows as u64, batch.windows.end - batch.windows.start);
    let tokens: Vec<u32> = p.tokens.chunks(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    for (i, w) in batch.windows.clone().enumerate() {
        let (lo, hi) = (i * width, (i + 1) * width);
        let cu: Vec<i32> =
            p.cu_seqlens.iter().filter(|&&c| c as usize >= lo && c as usize <= hi).map(|&c| c - lo as i32).collect();
        let previous = out.insert((batch.epoch, w), (tokens[lo..hi].to_vec(), cu, p.position_ids[lo..hi].to_vec()));
        assert!(previous.is_none(), "window {w} of epoch {} read twice", batch.epoch);
    }
}

/// The windows of epochs before `end` a session of `reads` packed by `pack` hands out from
/// `from`, on each rank of `size`.
fn read_packed(
    root: &std::path::Path,
    reads: Reads,
    pack: &PackConfig,
    size: u32,
    from: Position,
    end: u64,
) -> Windows {
    let mut out = Windows::new();
    for rank in 0..size {
        let world = World::new(rank, size).expect("world");
        let config = SessionConfig {
            reads: reads.clone(),
            plan: None,
            pack: Some(pack.clone()),
            drop_last: false,
            device: None,
            epoch: 0,
            loader: config(world),
        };
        let mut session = Session::new(root, config).expect("a session");
        session.seek(from).expect("seek");
        while session.begin_epoch() < end {
            while let Some(step) = session.next_packed().expect("a batch") {
                collect(&mut out, &step.pack().expect("packed"));
            }
        }
    }
    out
}

fn read(c: &Corpus, pack: &Arc<PackPlan>, size: u32, from: Position, epochs: u64) -> Windows {
    let reads = Reads::One(VersionSpec::parse("docs").expect("spec"));
    read_packed(&c.dir.path().join("store"), reads, pack.config(), size, from, epochs)
}

#[test]
fn across_documents_every_token_is_read_once_and_segments_are_the_documents() {
    let c = corpus(300);
    let pack = plan(&c, true);
    let windows = read(&c, &pack, 1, Position::default(), 2);
    for epoch in 0..2 {
        let mine: Vec<_> = windows.range((epoch, 0)..(epoch + 1, 0)).collect();
        assert_eq!(mine.len() as u64, pack.n_windows());
        // The stream: each window without its last token, then the last window's last.
        let mut stream: Vec<u32> = Vec::new();
        for (i, (_, (tokens, cu, ids))) in mine.iter().enumerate() {
            stream.extend_from_slice(&tokens[..tokens.len() - usize::from(i + 1 < mine.len())]);
            // Segments: each is one document's consecutive tokens (its end token last), and
            // position ids restart at each.
            assert_eq!(cu.first(), Some(&0));
            assert_eq!(cu.last(), Some(&(SEQ as i32 + 1)));
            for seg in cu.windows(2) {
                let run = &tokens[seg[0] as usize..seg[1] as usize];
                let doc = run.iter().find(|&&t| t != EOD).map(|t| t / 100_000);
                for (k, pair) in run.windows(2).enumerate() {
                    if pair[1] == EOD {
                        assert_eq!(k + 2, run.len(), "the end token closes a segment");
                    } else {
                        assert_eq!(pair[1], pair[0] + 1, "consecutive tokens of document {doc:?}");
                    }
                }
                assert_eq!(ids[seg[0] as usize..seg[1] as usize], (0..seg[1] - seg[0]).collect::<Vec<_>>());
            }
        }
        // Split at the end tokens: every document whole and once, but the cut tail's.
        let mut seen = vec![false; c.documents.len()];
        let parts: Vec<&[u32]> = stream.split(|&t| t == EOD).collect();
        let (whole, tail) = parts.split_at(parts.len() - 1);
        for part in whole {
            let d = (part[0] / 100_000) as usize;
            assert_eq!(*part, &c.documents[d][..], "document {d} whole");
            assert!(!std::mem::replace(&mut seen[d], true), "document {d} twice in epoch {epoch}");
        }
        let left: usize = seen.iter().filter(|s| !**s).count();
        assert!(left <= 1 + SEQ as usize, "{left} documents not read");
        let read_tokens: usize = whole.iter().map(|p| p.len() + 1).sum::<usize>() + tail[0].len();
        let total: usize = c.documents.iter().map(|d| d.len() + 1).sum();
        assert!(total - read_tokens < SEQ as usize, "only the tail shorter than a window is left out");
    }
    // Each epoch has its own order.
    assert_ne!(windows[&(0, 0)].0, windows[&(1, 0)].0);
}

#[test]
fn every_world_size_reads_the_same_windows_and_a_resume_goes_on_from_three_ranks_to_two() {
    let c = corpus(200);
    let pack = plan(&c, true);
    let one = read(&c, &pack, 1, Position::default(), 1);
    for size in [3, 8] {
        assert_eq!(read(&c, &pack, size, Position::default(), 1), one, "{size} ranks");
    }
    // Three ranks stop after 5 steps of 12 windows; two go on from there.
    let saved = Position { epoch: 0, cursor: 60 };
    let rest = read(&c, &pack, 2, saved, 1);
    let expected: Windows = one.range((0, 60)..).map(|(k, v)| (*k, v.clone())).collect();
    assert_eq!(rest, expected);
}

#[test]
fn within_documents_each_window_is_one_documents_padded() {
    let c = corpus(120);
    let pack = plan(&c, false);
    let windows = read(&c, &pack, 2, Position::default(), 1);
    assert_eq!(windows.len() as u64, pack.n_windows());
    let mut covered: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (tokens, cu, _) in windows.values() {
        let real = cu[1] as usize;
        let doc = tokens[0] / 100_000;
        assert!(tokens[..real].iter().all(|t| t / 100_000 == doc), "one document a window");
        assert!(tokens[real..].iter().all(|&t| t == 0), "then padding");
        covered.entry(doc).or_default().extend_from_slice(&tokens[..real]);
    }
    for (d, doc) in c.documents.iter().enumerate() {
        let Some(tokens) = covered.get(&(d as u32)) else {
            assert_eq!(doc.len(), 1, "only a one-token document has no window");
            continue;
        };
        let mut tokens = tokens.clone();
        tokens.sort_unstable();
        tokens.dedup();
        assert_eq!(tokens, *doc, "document {d}'s every token");
    }
}

#[test]
fn records_that_are_not_tokens_are_refused() {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).expect("a store");
    let layout = Layout::Fixed(granary::FixedLayout::new(Dtype::U16, &[2, 2]).expect("a layout"));
    ingest(&mut granary, "wide", layout, small_shards(4 << 10), &[vec![0; 8]]);
    let dataset = granary.open_dataset(&VersionSpec::parse("wide").unwrap()).unwrap();
    let config = PackConfig { seq_len: 4, eod: None, cross_documents: true, pad: 0 };
    let error = pack_plan(&dataset, config).unwrap_err().to_string();
    assert!(error.contains("packing"), "{error}");
}

/// A store with two corpora, "a" (documents 0..) and "b" (documents 1000..): a token names its
/// source, document and place.
fn two_corpora() -> (tempfile::TempDir, granary::Mixture) {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).expect("a store");
    for (name, first, n) in [("a", 0u64, 150u64), ("b", 1000, 40)] {
        let records: Vec<Vec<u8>> = (first..first + n)
            .map(|d| (0..(d * 37 % 53) + 2).flat_map(|t| ((d * 100_000 + t) as u32).to_le_bytes()).collect())
            .collect();
        ingest(&mut granary, name, Layout::Arrays(Dtype::U32), small_shards(4 << 10), &records);
    }
    let parts = [(VersionSpec::parse("a").unwrap(), 0.7), (VersionSpec::parse("b").unwrap(), 0.3)];
    let mixture = granary::Mixture::open(granary.paths(), &parts, granary::EpochLength::Samples(120)).expect("mixture");
    (dir, mixture)
}

fn read_mixture(dir: &tempfile::TempDir, size: u32, from: Position) -> Windows {
    let parts = vec![(VersionSpec::parse("a").unwrap(), 0.7), (VersionSpec::parse("b").unwrap(), 0.3)];
    let reads = Reads::Mixture { parts, epoch: granary::EpochLength::Samples(120), changes: Vec::new() };
    let pack = PackConfig { seq_len: SEQ, eod: Some(u64::from(EOD)), cross_documents: true, pad: 0 };
    read_packed(&dir.path().join("store"), reads, &pack, size, from, 2)
}

#[test]
fn a_mixture_of_packed_sources_packs_each_source_and_blends_windows_exactly() {
    let (dir, mixture) = two_corpora();
    let config = PackConfig { seq_len: SEQ, eod: Some(u64::from(EOD)), cross_documents: true, pad: 0 };
    let packed = Arc::new(granary::loader::pack_mixture(&mixture, config).expect("packed"));
    assert_eq!(packed.blend.epoch_samples(), 120);
    let one = read_mixture(&dir, 1, Position::default());
    assert_eq!(one.len(), 240, "two epochs of 120 windows");
    let mut counts = [0f64; 2];
    for (p, ((epoch, _), (tokens, cu, _))) in one.iter().enumerate() {
        // Each window is one source's: its documents are all of "a" or all of "b".
        let sources: std::collections::BTreeSet<bool> =
            tokens.iter().filter(|&&t| t != EOD).map(|t| t / 100_000 >= 1000).collect();
        assert_eq!(sources.len(), 1, "window {p} mixes sources");
        assert_eq!(cu.last(), Some(&(SEQ as i32 + 1)));
        if *epoch == 0 {
            counts[usize::from(*sources.iter().next().unwrap())] += 1.0;
            let position = (p + 1) as f64;
            assert!(
                (counts[0] - 0.7 * position).abs() < 1.0 && (counts[1] - 0.3 * position).abs() < 1.0,
                "{counts:?} at {p}"
            );
        }
    }
    for size in [3, 8] {
        assert_eq!(read_mixture(&dir, size, Position::default()), one, "{size} ranks");
    }
    let saved = Position { epoch: 0, cursor: 48 };
    let rest = read_mixture(&dir, 2, saved);
    let expected: Windows = one.range((0, 48)..).map(|(k, v)| (*k, v.clone())).collect();
    assert_eq!(rest, expected);
}

/// Two ranks of a session of `reads` packed by `pack`, rebalanced every 5 steps, rank 1 taking
/// 3 ms a window and rank 0 40 us, for `epochs` epochs: each rank's windows, their count, and
/// its weights at the end.
fn rebalanced(
    root: &std::path::Path,
    reads: &Reads,
    pack: &PackConfig,
    epochs: u64,
) -> Vec<(Windows, usize, Vec<u32>)> {
    let exchange: Arc<dyn granary::loader::MeasureExchange> =
        granary::loader::LocalExchange::new(2, std::time::Duration::from_secs(30));
    let threads: Vec<_> = (0..2u32)
        .map(|rank| {
            let (root, reads, pack) = (root.to_path_buf(), reads.clone(), pack.clone());
            let exchange = Arc::clone(&exchange);
            std::thread::spawn(move || {
                let mut rebalance = granary::loader::RebalanceConfig::every(5, Some(exchange));
                rebalance.lead = 2;
                let loader = LoaderConfig { rebalance: Some(rebalance), ..config(World::new(rank, 2).unwrap()) };
                let config = SessionConfig {
                    reads,
                    plan: None,
                    pack: Some(pack),
                    drop_last: false,
                    device: None,
                    epoch: 0,
                    loader,
                };
                let mut session = Session::new(root, config).expect("a session");
                let (mut out, mut windows) = (Windows::new(), 0);
                while session.begin_epoch() < epochs {
                    while let Some(step) = session.next_packed().expect("a batch") {
                        let batch = step.pack().expect("packed");
                        windows += batch.packed.windows;
                        collect(&mut out, &batch);
                        let per_window = if rank == 1 { 3000 } else { 40 };
                        std::thread::sleep(std::time::Duration::from_micros(per_window * batch.packed.windows as u64));
                    }
                }
                let weights = session.rebalance_state().expect("a rebalancing state").weights.weights;
                (out, windows, weights)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().expect("a rank")).collect()
}

/// The ranks' windows put together, each once.
fn both(runs: &[(Windows, usize, Vec<u32>)]) -> Windows {
    let mut both = Windows::new();
    for (out, _, _) in runs {
        for (key, window) in out {
            assert!(both.insert(*key, window.clone()).is_none(), "window {key:?} read by both ranks");
        }
    }
    let (fast, slow) = (runs[0].1, runs[1].1);
    assert!(slow < fast, "the slow rank read {slow} windows, the fast one {fast}");
    assert!(runs[1].2[1] < runs[1].2[0], "the weights moved toward the fast rank: {:?}", runs[1].2);
    both
}

#[test]
fn rebalanced_ranks_read_every_window_once_and_the_slow_rank_gets_fewer() {
    let c = corpus(300);
    let pack = plan(&c, true);
    let root = c.dir.path().join("store");
    let reads = Reads::One(VersionSpec::parse("docs").expect("spec"));
    let alone = read_packed(&root, reads.clone(), pack.config(), 1, Position::default(), 1);
    assert_eq!(both(&rebalanced(&root, &reads, pack.config(), 1)), alone, "the windows one rank reads");
    // A packed mixture likewise (an epoch of 60 steps: a point's window of measures is a few
    // steps long, so that the ranks' speeds show through a start or a step read again).
    let (dir, _) = two_corpora();
    let parts = vec![(VersionSpec::parse("a").unwrap(), 0.7), (VersionSpec::parse("b").unwrap(), 0.3)];
    let reads = Reads::Mixture { parts, epoch: granary::EpochLength::Samples(480), changes: Vec::new() };
    let pack = PackConfig { seq_len: SEQ, eod: Some(u64::from(EOD)), cross_documents: true, pad: 0 };
    let root = dir.path().join("store");
    let alone = read_packed(&root, reads.clone(), &pack, 1, Position::default(), 1);
    assert_eq!(both(&rebalanced(&root, &reads, &pack, 1)), alone, "the windows one rank reads");
}
