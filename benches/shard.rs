//! Shard-format costs per core: the block checksum, the content hash and encoding.
//!
//! Back of the envelope: the read path checks a CRC32C per 4 KiB block and the writer hashes
//! every byte with BLAKE3; both must stay far above the disk (2 GB/s sequential here) so that
//! verification is never the bottleneck.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use granary::shard::{ShardWriter, block_crc, blocks_match};
use granary::{Dtype, FixedLayout, Layout};

mod common;

use common::data;

/// `shard_block_crc32c`: CRC32C of 4 KiB blocks, seeded with the block index, over 64 MiB.
/// Budget: over 10 GB/s per core (SSE4.2 three-way interleaved), 5x the disk. `64MiB` computes
/// every block's checksum, as the writer does; `check_runs` checks the blocks against their
/// stored checksums as the reader does (`blocks_match`: one pass per run of 48 blocks); `one_pass`
/// is the crate's speed on one long buffer, the reference `check_runs` is held to.
fn shard_block_crc32c(c: &mut Criterion) {
    let buf = data(64 << 20);
    let expected: Vec<u32> = buf.chunks_exact(4096).enumerate().map(|(i, block)| block_crc(i as u64, block)).collect();
    let mut group = c.benchmark_group("shard_block_crc32c");
    group.throughput(Throughput::Bytes(buf.len() as u64));
    group.bench_function("64MiB", |b| {
        b.iter(|| buf.chunks_exact(4096).enumerate().fold(0u32, |acc, (i, block)| acc ^ block_crc(i as u64, block)))
    });
    group.bench_function("check_runs", |b| b.iter(|| assert!(blocks_match(0, &buf, &expected))));
    group.bench_function("one_pass", |b| b.iter(|| crc32c::crc32c(&buf)));
    group.finish();
}

/// `shard_blake3`: BLAKE3 of a 64 MiB shard on one core, as ingest and verify compute it.
/// Budget: over 3 GB/s per core (AVX-512 here), above the disk's sequential bandwidth.
fn shard_blake3(c: &mut Criterion) {
    let buf = data(64 << 20);
    let mut group = c.benchmark_group("shard_blake3");
    group.throughput(Throughput::Bytes(buf.len() as u64));
    group.bench_function("64MiB", |b| b.iter(|| blake3::hash(&buf)));
    group.finish();
}

/// `shard_encode`: writing records into a shard in memory (checksums, hash, index, footer),
/// without the disk. Budget: about BLAKE3's speed, which dominates; a 4 KiB record costs ~1 us.
fn shard_encode(c: &mut Criterion) {
    let buf = data(16 << 20);
    let mut group = c.benchmark_group("shard_encode");
    group.throughput(Throughput::Bytes(buf.len() as u64));
    for record_bytes in [256usize, 4096, 1 << 20] {
        let layout = Layout::Fixed(FixedLayout::new(Dtype::U8, &[record_bytes as u64]).expect("a valid shape"));
        group.bench_with_input(BenchmarkId::from_parameter(record_bytes), &record_bytes, |b, &record_bytes| {
            b.iter(|| {
                let out = Vec::with_capacity(buf.len() + (1 << 20));
                let mut writer = ShardWriter::new(out, "memory".into(), layout.clone()).expect("in memory");
                for record in buf.chunks_exact(record_bytes) {
                    writer.push(record).expect("in memory");
                }
                writer.finish().expect("in memory").1
            })
        });
    }
    group.finish();
}

criterion_group!(benches, shard_block_crc32c, shard_blake3, shard_encode);
criterion_main!(benches);
