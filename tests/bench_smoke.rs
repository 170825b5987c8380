//! The benchmarks run end to end at a small scale: `granary bench loader` prints its table with
//! every row it was asked for, on data it makes itself; `granary bench read` its ratios against
//! a bare reader of the same blocks. (`bench cache` runs against an origin, in
//! `origin.rs`.)

mod common;

use common::*;

#[test]
fn the_loader_bench_prints_its_table_at_a_small_scale() {
    let dir = tempdir();
    let root = dir.path().join("store");
    // --keep-cache: a test must not drop the machine's page cache under the other tests.
    let args =
        ["bench", "loader", "--generate", "4MiB", "--batch", "16", "--batches", "8", "--runs", "1", "--keep-cache"];
    let out = granary_ok(&root, &[&args[..], &["--rows", "random,warm,block", "--step-us", "100"]].concat());
    let rate = |label: &str| -> f64 {
        let line = out.lines().find(|line| line.starts_with(label)).unwrap_or_else(|| panic!("no {label}: {out}"));
        line[label.len()..].split_whitespace().next().and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    for label in [
        "random: bare io_uring",
        "random: engine -> host",
        "warm: engine -> target",
        "block: engine -> host",
        "sequential: bare io_uring",
    ] {
        assert!(rate(label) > 0.0, "{label}: {out}");
    }
    assert!(!out.contains("sequential: engine") && !out.contains("training step"), "rows not asked for: {out}");
    assert!(out.contains("random, engine -> host / bare"), "{out}");
    let block =
        out.lines().find(|l| l.starts_with("block, engine -> host / sequential bare")).expect("the block ratio");
    assert!(!block.contains("n/a"), "{block}");
    // The raw files for the PyTorch baseline, beside the store, hold every record.
    let raw: u64 = std::fs::read_dir(dir.path().join("store.raw"))
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(raw, 4 << 20);
    let refused = granary(&root, &["bench", "loader", "--rows", "everything"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("possible values: random, sequential, block, warm, step"),
        "{err}"
    );
}

#[test]
fn the_read_bench_prints_its_ratios_at_a_small_scale() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("in.bin");
    write_records(&input, &(0..1024).map(|i| bytes(i, 4096)).collect::<Vec<_>>());
    granary_ok(
        &root,
        &[
            "ingest",
            "records",
            "--name",
            "d",
            "--record-bytes",
            "4096",
            "--shard-bytes",
            "1MiB",
            input.to_str().unwrap(),
        ],
    );
    let out = granary_ok(&root, &["bench", "read", "d", "--runs", "1"]);
    // Each side read the same blocks: the bare reader's ops (`bare_ops`) cover every record.
    let line = out.lines().find(|line| line.starts_with("per-run ratios:")).unwrap_or_else(|| panic!("{out}"));
    let ratios: Vec<f64> = line.split_whitespace().filter_map(|word| word.trim_end_matches(';').parse().ok()).collect();
    assert_eq!(ratios.len(), 2, "{line}");
    assert!(ratios.iter().all(|&r| r.is_finite() && r > 0.0), "{line}");
    assert!(out.contains("sequential: 4.0 MiB per run"), "{out}");
}
