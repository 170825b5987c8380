//! The GPU path, from the trainer's side: batches copied to the device come back identical for
//! several dtypes, shapes and batch sizes; a trainer that reads batches with work queued on its
//! own stream and drops them before that work has run gets every byte, and no device buffer is
//! reused under it.
//!
//! Runs only where asked: `cargo test --test gpu -- --ignored` on a machine with CUDA, and
//! `make gpu-fake` everywhere else, against `tests/fake-cuda` (a strict stand-in for the driver
//! that runs each stream's work late and out of order with the others, and aborts on the misuse
//! a GPU would turn into silently wrong bytes). With the fake, one test also checks that the
//! fake catches each misuse it claims to, in child processes.
#![allow(
    unsafe_code,
    reason = "the trainer's side of the GPU path: raw driver calls through cudarc, as a CUDA consumer makes them"
)]

mod common;

use std::sync::Arc;

use common::*;
use cudarc::driver::{result, sys};
use granary::io::AlignedBuf;
use granary::loader::{Loader, LoaderConfig, PlanSource, Target};
use granary::staging::cuda::Cuda;
use granary::{Granary, Order, Position, VersionSpec};

/// The fake driver's live objects and counters, when it is the driver loaded (`None` with a real
/// one): allocations, allocated bytes, host registrations, streams, events, queued ops, async
/// copies, async copies from memory that was not page-locked.
fn fake_cuda_stats() -> Option<[u64; 8]> {
    // SAFETY: looks a symbol up in a library already loaded (RTLD_NOLOAD loads nothing); the
    // fake's function fills exactly eight u64 counters.
    unsafe {
        let mut lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            lib = libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        }
        if lib.is_null() {
            return None;
        }
        let symbol = libc::dlsym(lib, c"granary_fake_cuda_stats".as_ptr());
        libc::dlclose(lib);
        if symbol.is_null() {
            return None;
        }
        let stats: extern "C" fn(*mut [u64; 8]) -> i32 = std::mem::transmute(symbol);
        let mut out = [0u64; 8];
        stats(&mut out);
        Some(out)
    }
}

/// `make gpu-fake` sets this: the fake must then be the driver loaded.
fn fake_required() -> bool {
    std::env::var_os("GRANARY_FAKE_CUDA").is_some_and(|v| v == "1")
}

/// Tests here count the driver's objects process-wide: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn cuda() -> &'static Cuda {
    let cuda = Cuda::get().unwrap_or_else(|| panic!("no CUDA: {:?}", Cuda::unavailable_reason()));
    // Touch the driver so that the library is loaded before the fake is looked for.
    assert!(!fake_required() || fake_cuda_stats().is_some(), "GRANARY_FAKE_CUDA=1 but the fake driver is not loaded");
    cuda
}

/// Makes device `ordinal`'s primary context current on this thread, as a trainer's framework
/// does, and returns it.
fn make_current(ordinal: i32) -> sys::CUcontext {
    let device = result::device::get(ordinal).unwrap();
    // SAFETY: a valid device handle; the context is retained for the rest of the process.
    let ctx = unsafe { result::primary_ctx::retain(device) }.unwrap();
    // SAFETY: a retained context.
    unsafe { result::ctx::set_current(ctx) }.unwrap();
    ctx
}

/// A store of `n` records of 50 u16 tokens, in shards of about 16 KiB, and its dataset.
fn tokens(n: u64) -> (tempfile::TempDir, Arc<granary::Dataset>, Vec<Vec<u8>>) {
    let dir = tempdir();
    let mut granary = Granary::create(dir.path().join("store")).unwrap();
    let records: Vec<Vec<u8>> = (0..n).map(|i| bytes(i, 100)).collect();
    ingest(&mut granary, "tokens", tokens_layout(50), small_shards(16 << 10), &records);
    let dataset = granary.open_dataset(&VersionSpec::parse("tokens").unwrap()).unwrap();
    (dir, dataset, records)
}

fn gpu_config(batch_size: u64) -> LoaderConfig {
    LoaderConfig {
        batch_size,
        seed: 7,
        plan: PlanSource::Native(Order::Shuffled),
        epochs: Some(1),
        target: Target::Gpu,
        ..LoaderConfig::default()
    }
}

#[test]
#[ignore = "needs CUDA and a GPU, or the fake driver (make gpu-fake)"]
fn batches_copied_to_the_gpu_come_back_identical() {
    let _serial = serial();
    cuda();
    for (dtype, shape) in [
        (granary::Dtype::U8, vec![4096u64]),
        (granary::Dtype::U16, vec![2048]),
        (granary::Dtype::F32, vec![3, 33]),
        (granary::Dtype::Bf16, vec![7, 5]),
    ] {
        let dir = tempdir();
        let mut granary = Granary::create(dir.path().join("store")).unwrap();
        let layout = granary::Layout::Fixed(granary::FixedLayout::new(dtype, &shape).unwrap());
        let record_bytes = layout.record_bytes().unwrap() as usize;
        let records: Vec<Vec<u8>> = (0..700).map(|i| bytes(i, record_bytes)).collect();
        ingest(&mut granary, "gpu", layout, small_shards(256 << 10), &records);
        let dataset = granary.open_dataset(&VersionSpec::parse("gpu").unwrap()).unwrap();
        for batch_size in [1, 64, 256] {
            let mut loader = Loader::new(Arc::clone(&dataset), gpu_config(batch_size), Position::default()).unwrap();
            let mut seen = 0;
            while let Some(batch) = loader.next() {
                let batch = batch.unwrap();
                assert!(batch.pinned(), "staging is page-locked with CUDA");
                let device = batch.device().expect("copied to the GPU");
                let mut back = vec![0u8; device.len()];
                device.download(&mut back).unwrap();
                let wanted: Vec<u8> = batch.indices().iter().flat_map(|&i| records[i as usize].clone()).collect();
                assert_eq!(back, wanted, "{dtype:?} {shape:?} batch {batch_size}");
                seen += batch.len();
            }
            assert_eq!(seen, records.len(), "{dtype:?} {shape:?} batch {batch_size}: one epoch");
        }
    }
}

#[test]
#[ignore = "needs CUDA and a GPU, or the fake driver (make gpu-fake)"]
fn batches_dropped_at_a_rebalance_point_give_their_device_buffers_back() {
    // The fast rank's reader reads past the first point before the slow rank has measured; the
    // point moves the weights, so what it read there is dropped, and those batches' device
    // buffers must go back to the device stage (kept, the loader would run out of them and
    // stall). Every byte that arrives on the GPU is the record's, and the epoch is read once.
    let _serial = serial();
    cuda();
    let (_dir, dataset, records) = tokens(32 * 40);
    let exchange: Arc<dyn granary::loader::MeasureExchange> =
        granary::loader::LocalExchange::new(2, std::time::Duration::from_secs(60));
    let ranks: Vec<_> = (0..2u32)
        .map(|rank| {
            let (dataset, exchange, records) = (Arc::clone(&dataset), Arc::clone(&exchange), records.clone());
            std::thread::spawn(move || {
                let mut rebalance = granary::loader::RebalanceConfig::every(10, Some(exchange));
                rebalance.lead = 2;
                let config = LoaderConfig {
                    plan: PlanSource::default(),
                    world: granary::World::new(rank, 2).unwrap(),
                    rebalance: Some(rebalance),
                    ..gpu_config(16)
                };
                let mut loader = Loader::new(dataset, config, Position::default()).unwrap();
                let mut read = Vec::new();
                while let Some(batch) = loader.next() {
                    let batch = batch.unwrap();
                    let device = batch.device().expect("copied to the GPU");
                    let mut back = vec![0u8; device.len()];
                    device.download(&mut back).unwrap();
                    let wanted: Vec<u8> = batch.indices().iter().flat_map(|&i| records[i as usize].clone()).collect();
                    assert_eq!(back, wanted, "rank {rank}");
                    read.extend_from_slice(batch.indices());
                    let per_record = if rank == 1 { 2000 } else { 40 };
                    std::thread::sleep(std::time::Duration::from_micros(per_record * batch.len() as u64));
                }
                (read, loader.stats().recut)
            })
        })
        .collect();
    let runs: Vec<(Vec<u64>, u64)> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    let mut all: Vec<u64> = runs.iter().flat_map(|(read, _)| read.clone()).collect();
    all.sort_unstable();
    assert_eq!(all, (0..32 * 40).collect::<Vec<u64>>(), "the epoch, once");
    assert!(runs[0].1 >= 1, "the fast rank read past the first point and dropped it: {:?}", runs[0].1);
}

/// Reads `loader` to its end as a trainer does: each batch ordered before `stream` (unnamed:
/// waited for), copied back on that stream into page-locked memory (into pageable memory the
/// driver would return only once the copy has run), released after that copy (unnamed: after
/// all the device's work), and dropped before the copy has run. Once the stream has finished,
/// checks every batch's bytes against `records`; returns the batches read and the loader's
/// first error.
fn read_back(loader: &mut Loader, stream: u64, named: bool, records: &[Vec<u8>]) -> (usize, Option<String>) {
    let mut back = AlignedBuf::new(records.iter().map(Vec::len).sum()).unwrap();
    // SAFETY: `back` is a live mapping of its length, unregistered below before it is freed.
    unsafe { sys::cuMemHostRegister_v2(back.base_ptr().cast(), back.len(), 0) }.result().unwrap();
    let (mut copies, mut offset, mut failure) = (Vec::new(), 0, None);
    while let Some(batch) = loader.next() {
        let mut batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                failure.get_or_insert(e.to_string());
                continue;
            }
        };
        let device = batch.device().expect("copied to the GPU");
        if named {
            device.order_before(stream).unwrap();
        } else {
            device.wait().unwrap();
        }
        let len = device.len();
        let into = &mut back.as_mut_slice()[offset..offset + len];
        // SAFETY: `into` stays allocated and untouched until the stream is synchronised below;
        // the source is the batch's device bytes, which the release below keeps from reuse
        // until this copy has run.
        unsafe { result::memcpy_dtoh_async(into, device.ptr(), stream as sys::CUstream) }.unwrap();
        if named {
            batch.release_after(stream).unwrap();
        } else {
            batch.release_after_all_device_work();
        }
        copies.push((batch.indices().to_vec(), offset..offset + len));
        offset += len;
    }
    // SAFETY: a live stream of the current context, or the legacy default stream; then the
    // registration made above, with no copy left to use it.
    unsafe {
        result::stream::synchronize(stream as sys::CUstream).unwrap();
        sys::cuMemHostUnregister(back.base_ptr().cast()).result().unwrap();
    }
    for (indices, range) in &copies {
        let wanted: Vec<u8> = indices.iter().flat_map(|&i| records[i as usize].clone()).collect();
        assert_eq!(&back.as_slice()[range.clone()], &wanted[..], "stream {stream}, named: {named}");
    }
    (copies.len(), failure)
}

/// A trainer that reads each device batch with work queued on its own stream (here an
/// asynchronous copy back to the host) and drops the batch before that work has run, as a
/// training step does: every byte arrives, and no device buffer is reused before the work on it
/// has run (the fake aborts on such a reuse; on a GPU the bytes would differ). With the fake,
/// the loader leaves nothing behind, and every copy it made was from page-locked memory.
#[test]
#[ignore = "needs CUDA and a GPU, or the fake driver (make gpu-fake)"]
fn device_batches_released_before_the_trainers_work_has_run_stay_intact() {
    let _serial = serial();
    let cuda = cuda();
    let (_dir, dataset, records) = tokens(3000);
    let before = fake_cuda_stats();
    make_current(cuda.ordinal() as i32);
    let trainer = cuda.stream().unwrap();
    let mut trainer_copies = 0u64;
    // The trainer's own stream, the legacy default stream (1, as in DLPack), and the trainer's
    // stream again, unnamed: the loader is told only that it cannot know the streams.
    for (stream, named) in [(trainer.raw() as u64, true), (1, true), (trainer.raw() as u64, false)] {
        let config = LoaderConfig { hold_max: 1, prefetch: 2, ..gpu_config(16) };
        let mut loader = Loader::new(Arc::clone(&dataset), config, Position::default()).unwrap();
        let (copies, failure) = read_back(&mut loader, stream, named, &records);
        assert!(failure.is_none(), "{failure:?}");
        assert_eq!(copies, records.len() / 16 + 1, "one epoch in batches of 16");
        trainer_copies += copies as u64;
    }
    drop(trainer);
    if let (Some(before), Some(after)) = (before, fake_cuda_stats()) {
        assert_eq!(after[..6], before[..6], "allocations, bytes, registrations, streams, events, queued ops");
        assert_eq!(after[7], before[7], "every copy was between device and page-locked memory");
        assert!(after[6] - before[6] >= 2 * trainer_copies, "the loader's copies were counted");
    }
}

/// A loader used from a trainer's thread leaves the thread's current context as it found it:
/// none (a framework that has not started CUDA yet would otherwise adopt the loader's device as
/// its current one), the loader's own, or another device's.
#[test]
#[ignore = "needs CUDA and a GPU, or the fake driver (make gpu-fake)"]
fn the_loader_leaves_the_trainers_current_context_alone() {
    let _serial = serial();
    let cuda = cuda();
    let (_dir, dataset, _) = tokens(200);
    let count = result::device::get_count().unwrap();
    let other = (0..count).find(|&d| d != cuda.ordinal() as i32);
    // None current, the loader's device's context, another device's (where there is one).
    for current in [None, Some(cuda.ordinal() as i32), other]
        .into_iter()
        .enumerate()
        .filter_map(|(i, d)| (i == 0 || d.is_some()).then_some(d))
    {
        let dataset = Arc::clone(&dataset);
        std::thread::spawn(move || {
            let ctx = current.map(make_current);
            let mut loader = Loader::new(dataset, gpu_config(16), Position::default()).unwrap();
            let mut batch = loader.next().unwrap().unwrap();
            batch.device().unwrap().wait().unwrap();
            let mut ordinal = -1i32;
            // SAFETY: a device pointer of a live batch; the attribute is an int.
            unsafe {
                sys::cuPointerGetAttribute(
                    (&raw mut ordinal).cast(),
                    sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                    batch.device().unwrap().ptr(),
                )
            }
            .result()
            .unwrap();
            assert_eq!(ordinal, cuda.ordinal() as i32, "the batch is on the loader's device");
            batch.release_after(1).unwrap();
            let mut back = vec![0u8; batch.data().len()];
            batch.device().unwrap().download(&mut back).unwrap();
            drop((batch, loader));
            assert_eq!(result::ctx::get_current().unwrap(), ctx, "current context before: device {current:?}");
        })
        .join()
        .unwrap();
    }
}

/// Asserts that the fake driver is the one loaded: the `fake_*` tests check the fake itself
/// (what it catches), which a real driver cannot show. On a GPU machine, run the rest with
/// `cargo test --test gpu -- --ignored --skip fake_` (README.md); run here, they fail rather
/// than pass having checked nothing.
fn assert_fake_loaded() {
    cuda();
    assert!(
        fake_cuda_stats().is_some(),
        "a real driver is loaded: this test checks the fake driver (make gpu-fake); on a GPU, pass --skip fake_"
    );
}

/// Runs test `name` of this binary in a child process with `env`; a child still running after
/// a minute (a hang) is killed and fails the test.
fn child(name: &str, env: &[(&str, &str)]) -> std::process::Output {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", name, "--nocapture", "--test-threads", "1"])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{name} {env:?}: still running after a minute");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// An upload that fails (the fake fails the 40th host-to-device copy) while the trainer's work
/// on the buffer it was to overwrite is still queued: the loader reports the error, frees no
/// device memory under that work (the fake would abort), and stops without hanging.
#[test]
#[ignore = "needs the fake driver (make gpu-fake)"]
fn fake_driver_sees_a_failed_upload_free_nothing_under_the_trainers_work() {
    let _serial = serial();
    assert_fake_loaded();
    let out = child(
        "fake_cuda_failed_upload",
        &[
            ("GRANARY_FAKE_CASE", "failed-upload"),
            ("FAKE_CUDA_FAIL", "cuMemcpyHtoDAsync_v2:40"),
            ("FAKE_CUDA_DELAY_US", "5000"),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("failed as injected: CUDA cuMemcpyHtoDAsync"), "{stdout}");
}

/// The child of the test above.
#[test]
#[ignore = "a child process of fake_driver_sees_a_failed_upload_free_nothing_under_the_trainers_work"]
fn fake_cuda_failed_upload() {
    if std::env::var("GRANARY_FAKE_CASE").as_deref() != Ok("failed-upload") {
        return;
    }
    let _serial = serial();
    let cuda = cuda();
    let (_dir, dataset, records) = tokens(3000);
    make_current(cuda.ordinal() as i32);
    let trainer = cuda.stream().unwrap();
    let config = LoaderConfig { hold_max: 1, prefetch: 2, ..gpu_config(16) };
    let mut loader = Loader::new(dataset, config, Position::default()).unwrap();
    let (copies, failure) = read_back(&mut loader, trainer.raw() as u64, true, &records);
    assert!(copies >= 30, "batches before the failure: {copies}");
    println!("failed as injected: {}", failure.expect("the injected failure was reported"));
}

/// The misuses the fake driver claims to catch, each provoked in a child process (this test
/// binary, running `fake_cuda_case`), with the message it must abort with; the first is the
/// same work correctly ordered, which must pass.
const FAKE_CASES: [(&str, Option<&str>); 6] = [
    ("ordered", None),
    ("source-changed", Some("page-locked host memory changed before the asynchronous copy from it ran")),
    ("write-before-read", Some("a copy to device memory ran before an earlier read of it on another stream")),
    ("read-before-write", Some("a copy from device memory ran before an earlier write to it on another stream")),
    ("freed-in-use", Some("device memory freed while a copy queued on a stream still uses it")),
    ("unregistered-in-use", Some("host memory unregistered while a copy queued on a stream still uses it")),
];

#[test]
#[ignore = "needs the fake driver (make gpu-fake)"]
fn fake_driver_catches_what_a_gpu_would_get_silently_wrong() {
    let _serial = serial();
    assert_fake_loaded();
    for (case, message) in FAKE_CASES {
        let out = child("fake_cuda_case", &[("GRANARY_FAKE_CASE", case), ("FAKE_CUDA_DELAY_US", "100000")]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        match message {
            None => assert!(out.status.success(), "{case}: {stderr}"),
            Some(message) => {
                assert!(!out.status.success(), "{case}: not caught");
                assert!(stderr.contains(&format!("fake CUDA: {message}")), "{case}: {stderr}");
            }
        }
    }
    // Without a current context, a call fails as the driver's does.
    let refused = std::thread::spawn(|| {
        // SAFETY: an allocation the driver must refuse (no context is current on a new thread).
        unsafe { result::malloc_sync(4096) }
    })
    .join()
    .unwrap();
    assert_eq!(refused.unwrap_err().0, sys::CUresult::CUDA_ERROR_INVALID_CONTEXT);
}

/// One case of the test above, when run as its child.
#[test]
#[ignore = "a child process of fake_driver_catches_what_a_gpu_would_get_silently_wrong"]
fn fake_cuda_case() {
    let Ok(case) = std::env::var("GRANARY_FAKE_CASE") else { return };
    let _serial = serial();
    let cuda = cuda();
    make_current(cuda.ordinal() as i32);
    let (a, b, c) = (cuda.stream().unwrap(), cuda.stream().unwrap(), cuda.stream().unwrap());
    let (a, b, c) = (a.raw(), b.raw(), c.raw());
    let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
    let wait = sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
    let mut host = vec![7u8; 1 << 16];
    let mut back = vec![0u8; 1 << 16];
    let slow = vec![0u8; 1 << 16];
    // SAFETY: every buffer outlives the work queued on it (the streams are synchronised before
    // the function returns) except where a case breaks that rule on purpose, which the fake
    // catches before any memory is misused.
    unsafe {
        // Page-locked, so that every copy is asynchronous (copies from pageable memory are
        // staged before they return, copies into it return once they have run).
        for buffer in [host.as_mut_ptr(), back.as_mut_ptr(), slow.as_ptr().cast_mut()] {
            sys::cuMemHostRegister_v2(buffer.cast(), 1 << 16, 0).result().unwrap();
        }
        let device = result::malloc_sync(host.len()).unwrap();
        let other = result::malloc_sync(slow.len()).unwrap();
        // An event that passes only after four copies on stream `c` (at least twice as long as
        // any one copy takes): work on `b` behind it runs after any single copy on `a`.
        let late = result::event::create(flags).unwrap();
        for _ in 0..4 {
            result::memcpy_htod_async(other, &slow, c).unwrap();
        }
        result::event::record(late, c).unwrap();
        match case.as_str() {
            "ordered" => {
                let written = result::event::create(flags).unwrap();
                result::memcpy_htod_async(device, &host, a).unwrap();
                result::event::record(written, a).unwrap();
                result::stream::wait_event(b, written, wait).unwrap();
                result::memcpy_dtoh_async(&mut back, device, b).unwrap();
                let read = result::event::create(flags).unwrap();
                result::event::record(read, b).unwrap();
                result::stream::wait_event(a, read, wait).unwrap();
                result::memcpy_htod_async(device, &slow, a).unwrap();
                result::stream::synchronize(a).unwrap();
                result::stream::synchronize(b).unwrap();
                assert_eq!(back, host);
            }
            "source-changed" => {
                result::memcpy_htod_async(device, &host, a).unwrap();
                host[100] ^= 1;
            }
            "write-before-read" => {
                result::stream::wait_event(b, late, wait).unwrap();
                result::memcpy_dtoh_async(&mut back, device, b).unwrap();
                result::memcpy_htod_async(device, &host, a).unwrap();
            }
            "read-before-write" => {
                result::stream::wait_event(a, late, wait).unwrap();
                result::memcpy_htod_async(device, &host, a).unwrap();
                result::memcpy_dtoh_async(&mut back, device, b).unwrap();
            }
            "freed-in-use" => {
                result::memcpy_htod_async(device, &host, a).unwrap();
                result::free_sync(device).unwrap();
            }
            "unregistered-in-use" => {
                result::memcpy_htod_async(device, &host, a).unwrap();
                sys::cuMemHostUnregister(host.as_mut_ptr().cast()).result().unwrap();
            }
            other => panic!("no case {other}"),
        }
        for stream in [a, b, c] {
            result::stream::synchronize(stream).unwrap();
        }
    }
}
