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

/// `path`'s Parquet file with its footer rewritten by `change`: the file arrow-rs's writer made,
/// its metadata then made to lie (what a hostile or damaged file's footer claims).
fn rewrite_parquet_footer(
    path: &Path,
    change: impl FnOnce(parquet::file::metadata::ParquetMetaData) -> parquet::file::metadata::ParquetMetaData,
) {
    use parquet::file::metadata::{ParquetMetaDataReader, ParquetMetaDataWriter};

    let bytes = bytes::Bytes::from(std::fs::read(path).unwrap());
    let metadata = ParquetMetaDataReader::new().parse_and_finish(&bytes).unwrap();
    let tail = &bytes[bytes.len() - 8..];
    let footer_bytes = u32::from_le_bytes(tail[..4].try_into().unwrap()) as usize;
    let mut out = bytes[..bytes.len() - 8 - footer_bytes].to_vec();
    ParquetMetaDataWriter::new(&mut out, &change(metadata)).finish().unwrap();
    std::fs::write(path, out).unwrap();
}

#[test]
fn a_parquet_footer_that_lies_is_refused_in_one_line_and_commits_nothing() {
    use parquet::file::metadata::ParquetMetaData;

    type Change = fn(ParquetMetaData) -> ParquetMetaData;
    fn chunk_change(metadata: ParquetMetaData, edit: Change2) -> ParquetMetaData {
        let groups = metadata
            .row_groups()
            .iter()
            .map(|group| {
                let columns = group.columns().iter().map(|c| edit(c.clone().into_builder()).build().unwrap()).collect();
                group.clone().into_builder().set_column_metadata(columns).build().unwrap()
            })
            .collect();
        metadata.into_builder().set_row_groups(groups).build()
    }
    type Change2 =
        fn(parquet::file::metadata::ColumnChunkMetaDataBuilder) -> parquet::file::metadata::ColumnChunkMetaDataBuilder;
    let cases: [(&str, Change, &str); 4] = [
        ("negative size", |m| chunk_change(m, |c| c.set_total_compressed_size(-5)), "claims a size of -5"),
        ("negative offset", |m| chunk_change(m, |c| c.set_data_page_offset(-100)), "claims a data page offset of -100"),
        ("past the end", |m| chunk_change(m, |c| c.set_total_compressed_size(1 << 40)), "of a file of"),
        (
            "negative rows",
            |m| {
                let groups =
                    m.row_groups().iter().map(|g| g.clone().into_builder().set_num_rows(-7).build().unwrap()).collect();
                m.into_builder().set_row_groups(groups).build()
            },
            "claims -7 rows",
        ),
    ];
    let dir = tempdir();
    let root = dir.path().join("store");
    for (what, change, expected) in cases {
        let file = dir.path().join(format!("{}.parquet", what.replace(' ', "-")));
        write_parquet(&file);
        rewrite_parquet_footer(&file, change);
        let out = granary(&root, &["ingest", "parquet", "--name", "h", "--column", "text", file.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{what}: {}", String::from_utf8_lossy(&out.stderr));
        let err = granary_err(&root, &["ingest", "parquet", "--name", "h", "--column", "text", file.to_str().unwrap()]);
        assert!(err.contains("not a readable Parquet file") && err.contains(expected), "{what}: {err}");
        assert!(!root.join("refs").join("h").exists(), "{what}");
    }
}

#[test]
fn parquet_columns_are_found_by_name_whatever_their_order() {
    use std::sync::Arc;

    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use parquet::arrow::ArrowWriter;

    let dir = tempdir();
    let root = dir.path().join("store");
    // Two files of the same columns in opposite orders, of different types.
    let write = |path: &Path, rows: std::ops::Range<i64>, text_first: bool| {
        let text: ArrayRef = Arc::new(StringArray::from(rows.clone().map(|r| format!("text {r}")).collect::<Vec<_>>()));
        let id: ArrayRef = Arc::new(Int64Array::from(rows.collect::<Vec<_>>()));
        let columns = if text_first { vec![("text", text), ("id", id)] } else { vec![("id", id), ("text", text)] };
        let batch = RecordBatch::try_from_iter(columns).unwrap();
        let mut writer = ArrowWriter::try_new(std::fs::File::create(path).unwrap(), batch.schema(), None).unwrap();
        writer.write(&batch).unwrap();
        writer.close().unwrap();
    };
    let (a, b) = (dir.path().join("a.parquet"), dir.path().join("b.parquet"));
    write(&a, 0..5, true);
    write(&b, 5..9, false);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    // Once a panic of the decoding thread (exit 101): now the columns by name, in both files.
    granary_ok(&root, &["ingest", "parquet", "--name", "s", "--column", "id", "--column", "text", a, b]);
    for row in 0..9u64 {
        let sample = granary(&root, &["get", "s", &row.to_string()]).stdout;
        let decoded = granary::shard::Sample::decode(&sample).unwrap();
        assert_eq!(decoded.part("id.cls"), Some(row.to_string().as_bytes()), "row {row}");
        assert_eq!(decoded.part("text.txt"), Some(format!("text {row}").as_bytes()), "row {row}");
    }
    granary_ok(&root, &["ingest", "parquet", "--name", "ids", "--column", "id", b, a]);
    let expected: Vec<u8> = (5..9i64).chain(0..5).flat_map(i64::to_le_bytes).collect();
    let got: Vec<u8> = (0..9).flat_map(|r| granary(&root, &["get", "ids", &r.to_string()]).stdout).collect();
    assert_eq!(got, expected);
}

/// What arrow-rs itself reads from Parquet file `path`'s `ids` column (lists of int32), as the
/// records an ingest skipping nulls makes of it: each row's elements little-endian; `None` when
/// the reader refuses (or panics on) the file.
fn arrow_reads_ids(path: &Path) -> Option<Vec<Vec<u8>>> {
    use arrow_array::Array;
    use arrow_array::cast::AsArray;
    use arrow_array::types::Int32Type;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    let read = || -> Option<Vec<Vec<u8>>> {
        let file = std::fs::File::open(path).ok()?;
        let builder = ParquetRecordBatchReaderBuilder::try_new(file).ok()?;
        let index = builder.schema().index_of("ids").ok()?;
        let mask = parquet::arrow::ProjectionMask::roots(builder.parquet_schema(), [index]);
        let mut rows = Vec::new();
        for batch in builder.with_projection(mask).build().ok()? {
            let batch = batch.ok()?;
            let lists = batch.column(0).as_list_opt::<i32>()?;
            for row in 0..lists.len() {
                if lists.is_null(row) {
                    continue;
                }
                let values = lists.value(row);
                let values = values.as_primitive_opt::<Int32Type>()?;
                if values.null_count() > 0 {
                    continue;
                }
                rows.push(values.values().iter().flat_map(|v| v.to_le_bytes()).collect());
            }
        }
        Some(rows)
    };
    std::panic::catch_unwind(read).ok().flatten()
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 48,
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// A damaged Parquet file is refused, committing nothing, or ingested exactly as arrow-rs
    /// reads it: never half, never a panic (issue 52).
    #[test]
    fn a_damaged_parquet_file_is_refused_or_ingested_as_its_reader_reads_it(
        flips in proptest::collection::vec((0.0f64..1.0, 1u8..=255), 1..4),
        cut in proptest::option::of(0.0f64..1.0),
    ) {
        let dir = tempdir();
        let file = dir.path().join("damaged.parquet");
        write_parquet(&file);
        let mut data = std::fs::read(&file).unwrap();
        for (at, mask) in &flips {
            let at = ((data.len() - 1) as f64 * at) as usize;
            data[at] ^= mask;
        }
        if let Some(cut) = cut {
            data.truncate((data.len() as f64 * cut) as usize);
        }
        std::fs::write(&file, &data).unwrap();
        let expected = arrow_reads_ids(&file);

        let root = dir.path().join("store");
        let mut granary = granary::Granary::create(&root).unwrap();
        let inputs = [file.to_str().unwrap().to_owned()];
        let outcome = granary::ingest::ParquetInput::open(&inputs, &["ids".to_owned()], granary::ingest::Nulls::Skip)
            .and_then(|input| {
                let name = granary::DatasetName::new("p").unwrap();
                let mut ingest = granary.ingest(name, input.layout(), granary::IngestOptions::default())?;
                granary::ingest::records_from_parquet(&mut ingest, &input, &())?;
                ingest.commit()
            });
        match (outcome, expected) {
            (Ok(committed), Some(rows)) => {
                let dataset = granary.open_dataset(&granary::VersionSpec::parse("p").unwrap()).unwrap();
                proptest::prop_assert_eq!(committed.n_records, rows.len() as u64);
                let mut reader = granary::Reader::new(dataset, granary::IoConfig::default().build().unwrap());
                let all: Vec<u64> = (0..rows.len() as u64).collect();
                let mut got = Vec::new();
                reader.read_batches([all.as_slice()].into_iter(), 1, &mut |batch| {
                    for i in 0..batch.len() {
                        got.push(batch.record(i).to_vec());
                    }
                    Ok(())
                }).unwrap();
                proptest::prop_assert!(got == rows, "the ingest differs from what arrow-rs reads");
            }
            (Ok(_), None) => proptest::prop_assert!(false, "ingested a file arrow-rs refuses"),
            (Err(error), expected) => {
                // Refused: nothing committed, whatever arrow-rs made of it (a footer that lies
                // is refused here even where arrow-rs reads on). A panic is never granary's own,
                // and the decoder's only on a file arrow-rs itself cannot read.
                let message = error.to_string();
                proptest::prop_assert!(!matches!(error, granary::Error::Panicked { .. }), "{}", message);
                if message.contains("the reader failed on it") {
                    proptest::prop_assert!(expected.is_none(), "{}", message);
                }
                proptest::prop_assert!(granary.datasets().unwrap().is_empty());
            }
        }
    }
}
