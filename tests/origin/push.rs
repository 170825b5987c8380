//! Publishing and attaching: a second history under one name, versions through a file origin,
//! credentials in a URL, a missing bucket, a large upload retried, no credentials at all.

use super::*;

#[test]
fn a_second_history_under_one_name_is_refused_and_the_origin_keeps_the_first() {
    let moto = Moto::start();
    let dir = tempdir();
    let (first, second, here) = (dir.path().join("first"), dir.path().join("second"), dir.path().join("here"));
    let input = store_with(&first, 64, 1);
    store_with(&second, 64, 1000);
    let url = format!("s3://{BUCKET}/shared");
    moto.ok(&first, &["push", "tok", &url]);
    let refused = moto.err(&second, &["push", "tok", &url]);
    assert!(refused.contains("two histories"), "{refused}");
    moto.ok(&here, &["attach", "tok", &url]);
    let out = moto.granary(&here, &["get", "tok", "5"]);
    assert_eq!(out.stdout, input[5 * RECORD..6 * RECORD], "the first push's record");
}

#[test]
fn credentials_in_an_origin_url_are_refused_without_being_repeated() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 8, 1);
    for url in ["s3://AKIAEXAMPLE:do-not-print@bucket/x", "s3://bucket/x?X-Amz-Signature=do-not-print"] {
        let refused = moto.err(&source, &["push", "tok", url]);
        assert!(refused.contains("carries no credentials"), "{refused}");
    }
    assert!(moto.err(&source, &["push", "tok", "memory://x"]).contains("memory://"));
    assert!(moto.err(&source, &["push", "tok", "ftp://host/x"]).contains("unknown scheme"));
}

#[test]
fn a_file_origin_takes_a_second_version_and_refuses_a_stale_ref() {
    let dir = tempdir();
    let (source, here) = (dir.path().join("source"), dir.path().join("here"));
    let (input, url) = pushed_to_file(dir.path(), &source, 16, 1);
    // A pusher that read the ref before another pusher changed it is refused.
    let origin = Origin::open(&url).unwrap();
    let name = granary::DatasetName::new("tok").unwrap();
    let (first, stale) = origin.read_ref(&name).unwrap().unwrap();
    // A second version: the first's records and 16 more.
    let more = dir.path().join("more.bin");
    std::fs::write(&more, (16..32).flat_map(|i| bytes(1 + i as u64, RECORD)).collect::<Vec<u8>>()).unwrap();
    granary_ok(
        &source,
        &["ingest", "records", "--name", "tok", "--append", "--record-bytes", "4096", more.to_str().unwrap()],
    );
    let pushed = granary_ok(&source, &["push", "tok", &url]);
    assert!(pushed.contains("pushed tok@2") && pushed.contains("ref written"), "{pushed}");
    let refused = origin.write_ref(&name, &first, Some(stale)).unwrap_err().to_string();
    assert!(refused.contains("another push changed it"), "{refused}");
    assert_eq!(origin.read_ref(&name).unwrap().unwrap().0.latest().number, 2, "the newer ref stands");
    let attached = granary_ok(&here, &["attach", "tok@1", &url]);
    assert!(attached.contains("attached tok@1"), "{attached}");
    assert_eq!(granary(&here, &["get", "tok@1", "3"]).stdout, input[3 * RECORD..4 * RECORD]);
    let moved = granary_ok(&here, &["attach", "tok", &url]);
    assert!(moved.contains("attached tok@2"), "{moved}");
    assert_eq!(granary(&here, &["get", "tok@2", "20"]).stdout, bytes(21, RECORD));
}

#[test]
fn a_large_upload_tried_again_reports_its_bytes_once() {
    let dir = tempdir();
    let file = dir.path().join("large.shard");
    let data = bytes(7, 20 << 20);
    std::fs::write(&file, &data).unwrap();
    let id = ObjectId::from_bytes(*blake3::hash(&data).as_bytes());
    let faulty = Arc::new(Faulty::default());
    let origin = Origin::with_store(
        Arc::clone(&faulty) as Arc<dyn object_store::ObjectStore>,
        object_store::path::Path::from("faulty"),
        "memory://faulty".to_owned(),
    )
    .unwrap();
    let sent = std::sync::atomic::AtomicU64::new(0);
    origin
        .upload(ObjectKind::Shard, id, &file, &|n| {
            sent.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap();
    // In parts, the first upload failed at its end and the second went whole.
    assert_eq!(Faulty::count(&faulty.failed), 1);
    assert!(origin.retries() >= 1);
    assert_eq!(sent.into_inner(), data.len() as u64, "progress counts each byte once");
    assert_eq!(origin.size_of(ObjectKind::Shard, id).unwrap(), Some(data.len() as u64));
}

#[test]
fn a_push_to_a_missing_bucket_says_so_in_one_line_without_the_xml() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 16, 9);
    let err = moto.err(&source, &["push", "tok", "s3://granary-no-such-bucket/x"]);
    assert!(err.contains("NoSuchBucket") && err.contains("create the bucket first"), "{err}");
    assert!(!err.contains("<?xml") && !err.contains("<Error>") && err.lines().count() == 1, "{err}");
}

/// A reader with no S3 credentials in its environment (issue 40: a 403 from the metadata
/// address, or three minutes of retries where it drops packets) is told within seconds what to
/// set; with them set, the same command goes on to the bucket.
#[test]
fn no_credentials_and_no_metadata_service_say_what_to_set_within_seconds() {
    let moto = Moto::start();
    let dir = tempdir();
    let source = dir.path().join("source");
    store_with(&source, 16, 9);
    moto.ok(&source, &["push", "tok", &format!("s3://{BUCKET}/creds")]);
    // A "metadata service" the kernel accepts connections for and that never answers.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://127.0.0.1:{}", silent.local_addr().unwrap().port());
    let root = dir.path().join("reader");
    for profile in [false, true] {
        let mut command = moto.command(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")]);
        command
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env("AWS_METADATA_ENDPOINT", &endpoint);
        if profile {
            command.env("AWS_PROFILE", "training");
        }
        let started = Instant::now();
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
        assert!(
            stderr.contains("no S3 credentials")
                && stderr.contains("did not answer within 2 s")
                && stderr.contains("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
                && stderr.contains("AWS_SKIP_SIGNATURE=true"),
            "{stderr}"
        );
        assert_eq!(stderr.contains("AWS_PROFILE is set"), profile, "{stderr}");
        assert_eq!(stderr.lines().count(), 1, "{stderr}");
    }
    // A metadata address nothing listens on is as quick, and says so.
    drop(silent);
    let out = moto
        .command(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")])
        .env_remove("AWS_ACCESS_KEY_ID")
        .env("AWS_METADATA_ENDPOINT", &endpoint)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("could not be reached"), "{stderr}");
    // With the keys, the same attach reads the bucket.
    let attached = moto.ok(&root, &["attach", "tok", &format!("s3://{BUCKET}/creds")]);
    assert!(!attached.is_empty());
}
