//! Every refusal of the command line is one clear line on stderr and a non-zero exit.

mod common;

use common::*;

#[test]
fn usage_errors_are_one_line_each() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("tokens.bin");
    std::fs::write(&input, bytes(1, 1000)).unwrap();
    let input = input.to_str().unwrap();

    let err = granary_err(
        &root,
        &["ingest", "records", "--name", "t", "--record-bytes", "64", dir.path().join("missing.bin").to_str().unwrap()],
    );
    assert!(err.contains("missing.bin") && err.contains("No such file"), "{err}");

    let err = granary_err(&root, &["ingest", "records", "--name", "t", "--record-bytes", "64", input]);
    assert!(err.contains("1000 bytes is not a multiple of the record size 64"), "{err}");

    let err = granary_err(&root, &["ingest", "records", "--name", "../escape", "--record-bytes", "8", input]);
    assert!(err.contains("would escape the store root"), "{err}");

    let err = granary_err(&root, &["ingest", "records", "--name", "t", "--record-bytes", "8", "--dtype", "f8", input]);
    assert!(err.contains("unknown dtype \"f8\""), "{err}");

    let err = granary_err(
        &root,
        &["ingest", "records", "--name", "t", "--record-bytes", "8", "--dtype", "u16", "--shape", "3", input],
    );
    assert!(err.contains("does not match"), "{err}");

    let err = granary_err(&root, &["ingest", "files", "--name", "t", dir.path().join("nodir").to_str().unwrap()]);
    assert!(err.contains("nodir"), "{err}");

    // The refusals above left no shard and no temp file behind.
    assert!(shard_files(&root).is_empty());
    let tmp = root.join("tmp");
    assert!(!tmp.exists() || std::fs::read_dir(&tmp).unwrap().next().is_none());
    let out =
        granary_ok(&root, &["ingest", "records", "--name", "t", "--record-bytes", "8", "--drop-remainder", input]);
    assert!(out.contains("t@1: 125 records"), "{out}");

    let err = granary_err(&root, &["get", "t", "125"]);
    assert!(err.contains("record 125 is out of range (the dataset has 125 records)"), "{err}");
    let err = granary_err(&root, &["get", "nope", "0"]);
    assert!(err.contains("not found: dataset nope"), "{err}");
    let err = granary_err(&root, &["get", "t@9", "0"]);
    assert!(err.contains("version 9 of dataset t"), "{err}");
    let err = granary_err(&root, &["inspect", "a/b"]);
    assert!(err.contains("would escape the store root"), "{err}");

    let elsewhere = dir.path().join("not-a-store");
    std::fs::create_dir(&elsewhere).unwrap();
    let err = granary_err(&elsewhere, &["ls"]);
    assert!(err.contains("is not a granary store"), "{err}");
    let err = granary_err(&dir.path().join("nothing-here"), &["verify"]);
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn a_missing_root_is_explained() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("ls")
        .env_remove("GRANARY_ROOT")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("--root DIR or set GRANARY_ROOT"), "{stderr}");
}

#[test]
fn sizes_take_suffixes_dtypes_take_numpy_names_and_a_new_store_is_announced() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("r.bin");
    let records: Vec<Vec<u8>> = (0..8).map(|i| bytes(i, 4096)).collect();
    write_records(&input, &records);
    let args = ["ingest", "records", "--name", "t", "--record-bytes", "4KiB", "--dtype", "uint16"];
    let first = granary(&root, &[&args[..], &[input.to_str().unwrap()]].concat());
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    let said = String::from_utf8_lossy(&first.stderr);
    assert!(said.contains(&format!("created a new store at {}", root.display())), "{said}");
    let second = granary(&root, &[&args[..], &["--replace", input.to_str().unwrap()]].concat());
    assert!(second.status.success());
    assert!(!String::from_utf8_lossy(&second.stderr).contains("created a new store"), "only when it is new");
    // get -o FILE writes the record there.
    let out = dir.path().join("record.bin");
    granary_ok(&root, &["get", "t", "3", "-o", out.to_str().unwrap()]);
    assert_eq!(std::fs::read(&out).unwrap(), records[3]);
}

#[test]
fn the_plugin_kits_numbers_are_checked_before_anything_is_allocated() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let out = dir.path().join("trace.bin");
    let out = out.to_str().unwrap();
    for (args, why) in [
        (vec!["trace", "zipf", "--objects", "18446744073709551615", "--requests", "10"], "number of objects"),
        (vec!["trace", "zipf", "--objects", "0", "--requests", "1000"], "number of objects must be in 1..="),
        (vec!["trace", "zipf", "--objects", "10", "--requests", "0"], "number of requests"),
        (vec!["trace", "zipf", "--objects", "10", "--requests", "18446744073709551615"], "number of requests"),
        (vec!["trace", "zipf", "--objects", "10", "--requests", "10", "--alpha", "NaN"], "skew"),
        (vec!["trace", "shuffled", "--objects", "0", "--epochs", "3"], "number of objects"),
        (vec!["trace", "shuffled", "--objects", "10", "--epochs", "0"], "number of epochs"),
        (vec!["trace", "shuffled", "--objects", "65536", "--epochs", "65536"], "is more than"),
    ] {
        let args = [&["plugin"], &args[..], &["--out", out]].concat();
        let err = granary_err(&root, &args);
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(!std::path::Path::new(out).exists(), "{args:?} wrote a trace");
    }
    for (args, why) in [
        (vec!["partition", "--plugin", "elastic", "--shards", "4", "--ranks", "4294967295"], "world size"),
        (vec!["partition", "--plugin", "elastic", "--shards", "4", "--ranks", "8,0"], "world size"),
        (vec!["partition", "--plugin", "elastic", "--shards", "0", "--ranks", "8"], "number of shards"),
        (vec!["partition", "--plugin", "elastic", "--shards", "18446744073709551615", "--ranks", "8"], "shards"),
        (
            vec![
                "partition",
                "--plugin",
                "elastic",
                "--shards",
                "4",
                "--ranks",
                "8",
                "--records-per-shard",
                "18446744073709551615",
            ],
            "records per shard",
        ),
        (vec!["partition", "--plugin", "elastic", "--shards", "4", "--ranks", "8", "--batch", "0"], "batch size"),
        (vec!["partition", "--plugin", "elastic", "--shards", "4", "--ranks", "8", "--weights", "0,0"], "weight"),
        (vec!["replicate", "--plugin", "rendezvous", "--nodes", "4294967295", "--replicas", "3"], "number of nodes"),
        (vec!["replicate", "--plugin", "rendezvous", "--nodes", "0", "--replicas", "3"], "number of nodes"),
        (vec!["replicate", "--plugin", "rendezvous", "--nodes", "4", "--replicas", "0"], "number of replicas"),
        (
            vec!["replicate", "--plugin", "rendezvous", "--nodes", "4", "--replicas", "2", "--domains", "0"],
            "failure domains",
        ),
    ] {
        let args = [&["plugin", "sim"], &args[..]].concat();
        let err = granary_err(&root, &args);
        assert!(err.contains(why), "{args:?}: {err}");
    }
    // In bounds, the same commands work.
    let done = granary_ok(&root, &["plugin", "trace", "zipf", "--objects", "10", "--requests", "100", "--out", out]);
    assert!(done.contains("wrote 100 requests to 10 objects"), "{done}");
}

#[test]
fn a_plugin_name_that_is_neither_a_file_nor_a_built_in_lists_the_built_ins() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let trace = dir.path().join("trace.bin");
    std::fs::write(&trace, []).unwrap();
    let trace = trace.to_str().unwrap();
    let err = granary_err(&root, &["plugin", "sim", "evict", "--plugin", "s3fifo", "--trace", trace]);
    assert!(err.contains("plugin \"s3fifo\": no such file, and no built-in of that name"), "{err}");
    assert!(err.contains("built in: elastic, lru, fifo, sieve, s3-fifo, plan-aware, rendezvous"), "{err}");
    assert!(err.contains("did you mean \"s3-fifo\"?"), "{err}");
    assert_eq!(err.matches("no such file").count(), 1, "the cause once: {err}");
    let err = granary_err(&root, &["plugin", "sim", "evict", "--plugin", "nothing-like-it", "--trace", trace]);
    assert!(err.contains("built in:") && !err.contains("did you mean"), "{err}");
}
