//! No command panics on its output: into a full device (`> /dev/full`) each says so in one line
//! and exits 1; into a pipe whose reader has gone (`| head -c 1`) each ends quietly with exit 0,
//! as ripgrep and git do.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const KEY: &str = "a cluster secret for the output tests, 40 bytes";

/// Runs granary with `args` and stdout set to `stdout`; returns (exit code, stderr).
fn run(root: &Path, args: &[String], stdout: Stdio) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(root)
        .args(args)
        .env_remove("GRANARY_ROOT")
        .env_remove("GRANARY_CLUSTER_KEY")
        .stdout(stdout)
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn full() -> Stdio {
    Stdio::from(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap())
}

/// A pipe whose read end is already closed: every write to it fails with EPIPE.
fn closed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Stdio::from(writer)
}

/// Both checks for one command line; `args` is built per run (`{}` is replaced by "full" or
/// "pipe", for commands that must not repeat what the first run did).
fn check(root: &Path, args: &[&str]) {
    for (mode, stdout) in [("full", full()), ("pipe", closed_pipe())] {
        let args: Vec<String> = args.iter().map(|a| a.replace("{}", mode)).collect();
        let (code, stderr) = run(root, &args, stdout);
        assert!(!stderr.contains("panicked"), "granary {args:?} > {mode} panicked: {stderr}");
        if mode == "full" {
            assert_eq!(code, Some(1), "granary {args:?} > /dev/full: {stderr}");
            assert_eq!(stderr.lines().count(), 1, "granary {args:?} > /dev/full: {stderr}");
            assert!(stderr.starts_with("granary: error: write to stdout: "), "granary {args:?}: {stderr}");
            assert_eq!(stderr.matches("No space left on device").count(), 1, "the OS text once: {stderr}");
        } else {
            assert_eq!(code, Some(0), "granary {args:?} | (closed): {stderr}");
            assert!(stderr.is_empty(), "granary {args:?} | (closed) was not quiet: {stderr}");
        }
    }
}

struct Node(std::process::Child);

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(root: &Path, key: &Path) -> Node {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let listen = format!("127.0.0.1:{port}");
    let child = Command::new(env!("CARGO_BIN_EXE_granary"))
        .arg("--root")
        .arg(root)
        .args(["serve", "--listen", &listen, "--cluster-key"])
        .arg(key)
        .env_remove("GRANARY_ROOT")
        .env_remove("GRANARY_CLUSTER_KEY")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut node = Node(child);
    let listen_file = root.join("replication").join("listen");
    let started = Instant::now();
    while std::fs::read_to_string(&listen_file).ok().is_none_or(|t| t.trim() != listen) {
        assert!(node.0.try_wait().unwrap().is_none(), "the node exited");
        assert!(started.elapsed() < Duration::from_secs(30), "the node did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    node
}

#[test]
fn every_command_fails_in_one_line_on_a_full_stdout_and_ends_quietly_on_a_closed_pipe() {
    let dir = tempdir();
    let root = dir.path().join("store");
    let input = dir.path().join("tokens.bin");
    write_records(&input, &(0..64).map(|i| bytes(i, 4096)).collect::<Vec<_>>());
    let input = input.to_str().unwrap();
    for name in ["A", "R-full", "R-pipe"] {
        granary_ok(
            &root,
            &["ingest", "records", "--name", name, "--record-bytes", "4096", "--shard-bytes", "64K", input],
        );
    }
    let shard: PathBuf = shard_files(&root).into_iter().next().unwrap();
    let shard_id = shard.file_stem().unwrap().to_str().unwrap().to_owned();
    let key = dir.path().join("cluster.key");
    std::fs::write(&key, KEY).unwrap();
    let key = key.to_str().unwrap();
    let tier = dir.path().join("tier");
    let trace = dir.path().join("trace-{}.bin");
    let new_key = dir.path().join("new-{}.key");

    // Readers.
    check(&root, &["ls"]);
    check(&root, &["inspect", "A"]);
    check(&root, &["inspect", "A@1", "--records", "4"]);
    check(&root, &["inspect", &shard_id]);
    check(&root, &["verify"]);
    check(&root, &["verify", "A"]);
    check(&root, &["get", "A", "3"]);
    check(&root, &["tier", "status", "--dir", tier.to_str().unwrap()]);
    check(&root, &["plugin", "list"]);
    check(
        &root,
        &["plugin", "trace", "zipf", "--objects", "10", "--requests", "100", "--out", trace.to_str().unwrap()],
    );
    // Writers: the work is done, then its report meets the full disk or the closed pipe.
    check(&root, &["ingest", "records", "--name", "A", "--record-bytes", "4096", "--shard-bytes", "64K", input]);
    // Object storage, through a file:// origin (the S3 path is tests/origin/'s).
    let origin = format!("file://{}", dir.path().join("origin").display());
    let other = dir.path().join("attached");
    for name in ["A", "R-full", "R-pipe"] {
        granary_ok(&root, &["push", name, &origin]);
    }
    check(&root, &["push", "A", &origin]);
    check(&other, &["attach", "A", &origin]);
    check(&other, &["attach", "R-{}", &origin]);
    check(&other, &["ls"]);
    check(&other, &["verify", "A"]);
    check(&other, &["get", "A", "3"]);
    check(&other, &["detach", "R-{}"]);
    check(&root, &["rm", "R-{}"]);
    check(&root, &["gc"]);
    check(&root, &["repair"]);
    check(&root, &["cluster-key", "--out", new_key.to_str().unwrap()]);
    // A node, and the commands that talk to it.
    let _node = serve(&root, Path::new(key));
    check(&root, &["status", "--cluster-key", key]);
    check(&root, &["status", "--json", "--cluster-key", key]);
    check(&root, &["replicate", "A", "--replicas", "1", "--cluster-key", key]);
}
