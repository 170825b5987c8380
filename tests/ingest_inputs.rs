//! What an ingest is given is read whole or refused: concatenated tars are read to their last
//! member, every member not ingested is named with the reason, and inputs that hold no record
//! are refused before anything is committed.

mod common;

use std::path::Path;

use common::*;

/// A tar written at `path`, members appended by the helpers below.
fn tar_builder(path: &Path) -> tar::Builder<std::fs::File> {
    tar::Builder::new(std::fs::File::create(path).unwrap())
}

fn append_file(builder: &mut tar::Builder<std::fs::File>, name: &str, data: &[u8]) {
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    header.set_cksum();
    builder.append_data(&mut header, name, data).unwrap();
}

fn append_special(builder: &mut tar::Builder<std::fs::File>, name: &str, kind: tar::EntryType, target: &str) {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(kind);
    header.set_size(0);
    header.set_mode(0o755);
    if !target.is_empty() {
        header.set_link_name(target).unwrap();
    }
    header.set_cksum();
    builder.append_data(&mut header, name, &[][..]).unwrap();
}

/// `n` samples `PREFIX-i.txt` + `PREFIX-i.cls`.
fn append_samples(builder: &mut tar::Builder<std::fs::File>, prefix: &str, n: usize) {
    for i in 0..n {
        append_file(builder, &format!("{prefix}-{i:03}.txt"), format!("text of {prefix} {i}").as_bytes());
        append_file(builder, &format!("{prefix}-{i:03}.cls"), format!("{i}").as_bytes());
    }
}

#[test]
fn concatenated_tars_are_read_whole_and_every_skipped_member_is_named() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let (a, b) = (dir.path().join("a.tar"), dir.path().join("b.tar"));
    let mut builder = tar_builder(&a);
    append_samples(&mut builder, "a", 50);
    builder.into_inner().unwrap();
    let mut builder = tar_builder(&b);
    append_special(&mut builder, "b-dir", tar::EntryType::Directory, "");
    append_samples(&mut builder, "b", 30);
    append_special(&mut builder, "b-900.txt", tar::EntryType::Symlink, "b-000.txt");
    append_special(&mut builder, "b-901.txt", tar::EntryType::Link, "b-001.txt");
    append_special(&mut builder, "b-902.fifo", tar::EntryType::Fifo, "");
    builder.into_inner().unwrap();
    // `cat a.tar b.tar > ab.tar`: a's end-of-archive blocks sit between the two.
    let ab = dir.path().join("ab.tar");
    std::fs::write(&ab, [std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap()].concat()).unwrap();

    let out = granary(&root, &["ingest", "tar", "--name", "wds", ab.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("wds@1: 80 records"), "{stdout}");
    assert!(stdout.contains("3 input members skipped"), "{stdout}");
    let skipped: Vec<&str> = stderr.lines().filter(|l| l.starts_with("granary: skipped ")).collect();
    assert_eq!(skipped.len(), 3, "{stderr}");
    for (member, why) in [
        ("b-900.txt", "a symbolic link to b-000.txt"),
        ("b-901.txt", "a hard link to b-001.txt"),
        ("b-902.fifo", "a FIFO"),
    ] {
        assert!(skipped.iter().any(|l| l.contains("ab.tar") && l.contains(member) && l.contains(why)), "{stderr}");
    }
    // A directory holds no data: passed over without a word.
    assert!(!stderr.contains("b-dir"), "{stderr}");
    // The last sample of the second archive is there.
    let record = granary(&root, &["get", "wds", "79"]);
    assert!(record.status.success());
    assert!(record.stdout.windows(12).any(|w| w == b"text of b 29"));
}

#[test]
fn empty_inputs_are_refused_and_commit_nothing() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let data = dir.path().join("data.bin");
    std::fs::write(&data, bytes(5, 64 * 10)).unwrap();
    granary_ok(&root, &["ingest", "records", "--name", "kept", "--record-bytes", "64", data.to_str().unwrap()]);
    let kept = granary(&root, &["get", "kept", "3"]).stdout;

    let empty = dir.path().join("empty.bin");
    std::fs::write(&empty, b"").unwrap();
    let small = dir.path().join("small.bin");
    std::fs::write(&small, b"123").unwrap();
    let empty_tar = dir.path().join("empty.tar");
    std::fs::write(&empty_tar, b"").unwrap();
    let end_only_tar = dir.path().join("end-only.tar");
    tar_builder(&end_only_tar).into_inner().unwrap();
    let empty_dir = dir.path().join("empty-dir");
    std::fs::create_dir_all(empty_dir.join("sub")).unwrap();
    let (empty, small) = (empty.to_str().unwrap(), small.to_str().unwrap());
    for (name, args, why) in [
        ("e1", vec!["records", "--record-bytes", "64", empty], "no record of 64 bytes"),
        ("e2", vec!["records", "--record-bytes", "64", "--drop-remainder", small], "no record of 64 bytes"),
        ("e3", vec!["tar", empty_tar.to_str().unwrap()], "no sample"),
        ("e4", vec!["tar", end_only_tar.to_str().unwrap()], "no sample"),
        ("e5", vec!["files", empty_dir.to_str().unwrap()], "no regular file under it"),
        // --replace with nothing would empty a dataset that holds data.
        ("kept", vec!["records", "--replace", "--record-bytes", "64", empty], "no record of 64 bytes"),
    ] {
        let ingest = [&["ingest", args[0], "--name", name], &args[1..]].concat();
        let err = granary_err(&root, &ingest);
        assert!(err.contains(why) && err.contains("nothing to ingest"), "{ingest:?}: {err}");
        if name != "kept" {
            assert!(!root.join("refs").join(name).exists(), "{ingest:?} left a ref");
            let err = granary_err(&root, &["get", name, "0"]);
            assert!(err.contains("not found"), "{err}");
        }
    }
    // A tar of only links and directories holds no sample either: the link is named, then the
    // refusal.
    let links_tar = dir.path().join("links.tar");
    let mut builder = tar_builder(&links_tar);
    append_special(&mut builder, "d", tar::EntryType::Directory, "");
    append_special(&mut builder, "d/000.txt", tar::EntryType::Symlink, "/etc/passwd");
    builder.into_inner().unwrap();
    let out = granary(&root, &["ingest", "tar", "--name", "e6", links_tar.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("d/000.txt") && stderr.contains("no sample"), "{stderr}");
    assert!(!root.join("refs").join("e6").exists());
    // The dataset that was there is untouched: one version, the same bytes.
    assert_eq!(granary(&root, &["get", "kept", "3"]).stdout, kept);
    let err = granary_err(&root, &["get", "kept@2", "0"]);
    assert!(err.contains("version 2"), "{err}");
    granary_ok(&root, &["verify"]);
}

#[test]
fn a_fifo_or_device_input_is_refused_before_the_store_is_touched() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let fifo = dir.path().join("input.fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    for args in [
        vec!["ingest", "tar", "--name", "t", fifo.to_str().unwrap()],
        vec!["ingest", "records", "--name", "t", "--record-bytes", "8", fifo.to_str().unwrap()],
        vec!["ingest", "tar", "--name", "t", "/dev/zero"],
    ] {
        // Nobody writes to the FIFO: an ingest that opened it would block forever.
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_granary"))
            .arg("--root")
            .arg(&root)
            .args(&args)
            .env_remove("GRANARY_ROOT")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > std::time::Duration::from_secs(20) {
                let _ = child.kill();
                panic!("granary {args:?} blocked on a non-regular input");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(stderr.contains("is a FIFO") || stderr.contains("is a character device"), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
        // Refused before the store was opened: no store was made, so no lock was taken.
        assert!(!root.exists(), "{args:?} made a store before refusing its input");
    }
}

/// A Parquet file of `ids` (a list of int32, one row null) and `text` (strings), written by
/// arrow-rs's writer in row groups of 3, zstd-compressed.
fn write_parquet(path: &Path) {
    use std::sync::Arc;

    use arrow_array::builder::{Int32Builder, ListBuilder};
    use arrow_array::{ArrayRef, RecordBatch, StringArray};
    use parquet::arrow::ArrowWriter;
    use parquet::basic::{Compression, ZstdLevel};
    use parquet::file::properties::WriterProperties;

    let mut ids = ListBuilder::new(Int32Builder::new());
    for row in 0..10i32 {
        if row == 4 {
            ids.append_null();
        } else {
            ids.values().append_slice(&(0..row).map(|t| t * 1000 - 7).collect::<Vec<_>>());
            ids.append(true);
        }
    }
    let text = StringArray::from((0..10).map(|row| format!("row {row}")).collect::<Vec<_>>());
    let batch =
        RecordBatch::try_from_iter([("ids", Arc::new(ids.finish()) as ArrayRef), ("text", Arc::new(text) as ArrayRef)])
            .unwrap();
    let props = WriterProperties::builder()
        .set_compression(Compression::ZSTD(ZstdLevel::default()))
        .set_max_row_group_row_count(Some(3))
        .build();
    let mut writer = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

#[test]
fn parquet_rows_become_records_and_a_null_is_refused_unless_skipped() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let file = dir.path().join("part-0.parquet");
    write_parquet(&file);
    let file = file.to_str().unwrap();

    let err = granary_err(&root, &["ingest", "parquet", "--name", "p", file]);
    assert!(err.contains("2 columns (ids, text)") && err.contains("--column"), "{err}");
    let err = granary_err(&root, &["ingest", "parquet", "--name", "p", "--column", "ids", file]);
    assert!(err.contains("row 4 has a null in column \"ids\"") && err.contains("--skip-nulls"), "{err}");
    assert!(!root.join("refs").join("p").exists());

    let out = granary(&root, &["ingest", "parquet", "--name", "p", "--column", "ids", "--skip-nulls", file]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("p@1: 9 records"), "{stdout}");
    assert!(stderr.contains("skipped 1 rows with a null"), "{stderr}");
    // Record 4 is row 5: five int32 token ids, little-endian.
    let record = granary(&root, &["get", "p", "4"]).stdout;
    let expected: Vec<u8> = (0..5i32).flat_map(|t| (t * 1000 - 7).to_le_bytes()).collect();
    assert_eq!(record, expected);

    // The strings, as byte records.
    granary_ok(&root, &["ingest", "parquet", "--name", "t", "--column", "text", file]);
    assert_eq!(granary(&root, &["get", "t", "9"]).stdout, b"row 9");
    let err = granary_err(&root, &["ingest", "parquet", "--name", "x", "--column", "nope", file]);
    assert!(err.contains("no column \"nope\""), "{err}");
    granary_ok(&root, &["verify"]);
}
