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
