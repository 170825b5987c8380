//! Erasure coding per core: `granary::erasure` against `reed-solomon-simd` alone, same k, m and
//! size, in one run (BENCHMARKS.md, issue 19).
//!
//! `engine` rows are what a node pays: encode builds the fragment files (the shard's BLAKE3, the
//! coder, a CRC32C per 4 KiB block); reconstruct rebuilds from `k` checked fragments with two
//! data fragments lost (the coder, then the shard's BLAKE3 against its id). `crate` rows are
//! the coder alone on the same payloads: the reference.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use granary::erasure::{Coding, Fragment, encode, reconstruct};

mod common;

use common::data;

fn erasure(c: &mut Criterion) {
    let shard = data(64 << 20);
    for (k, m) in [(4u8, 2u8), (10, 4)] {
        let coding = Coding::new(k, m).expect("a coding");
        let (k, m) = (usize::from(k), usize::from(m));
        let files = encode(&shard, coding).expect("encode");
        let fragments: Vec<Fragment> = files.iter().map(|f| Fragment::decode(f.clone()).expect("checks")).collect();
        let payload = usize::try_from(coding.fragment_bytes(shard.len() as u64)).expect("in memory");
        let originals: Vec<Vec<u8>> = (0..k)
            .map(|i| {
                let mut p = vec![0u8; payload];
                let start = (i * payload).min(shard.len());
                let end = (start + payload).min(shard.len());
                p[..end - start].copy_from_slice(&shard[start..end]);
                p
            })
            .collect();
        let recovery = reed_solomon_simd::encode(k, m, &originals).expect("the crate encodes");

        let mut group = c.benchmark_group(format!("erasure_{k}+{m}_64MiB"));
        group.sample_size(10);
        group.throughput(Throughput::Bytes(shard.len() as u64));
        group.bench_function("encode/engine", |b| b.iter(|| encode(&shard, coding).expect("encode")));
        group.bench_function("encode/crate", |b| {
            b.iter(|| reed_solomon_simd::encode(k, m, &originals).expect("the crate encodes"))
        });
        // Data fragments 0 and 1 lost: rebuilt from the other data fragments and parity.
        let kept: Vec<Fragment> = fragments[2..2 + k].to_vec();
        let id = kept[0].header().shard;
        group.bench_function("reconstruct/engine", |b| b.iter(|| reconstruct(id, &kept).expect("rebuilt")));
        group.bench_function("reconstruct/crate", |b| {
            b.iter(|| {
                reed_solomon_simd::decode(k, m, (2..k).map(|i| (i, &originals[i])), (0..2).map(|i| (i, &recovery[i])))
                    .expect("the crate decodes")
            })
        });
        group.bench_function("check_fragments/engine", |b| {
            b.iter(|| {
                for file in &files {
                    Fragment::check(file).expect("checks");
                }
            })
        });
        group.finish();
    }
}

criterion_group!(benches, erasure);
criterion_main!(benches);
