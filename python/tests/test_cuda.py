"""The device path from Python without torch: batches exported through DLPack to a consumer's
CUDA stream, read there by work queued on that stream (a copy back to the host through the
driver API, via ctypes) and released before that work has run. Needs a CUDA driver and device:
skipped on CI's plain test run; `make gpu-fake` runs it against the fake driver
(tests/fake-cuda), which aborts the process on a buffer reused under the consumer's work or read
before the loader's copy into it, and the GPU machine runs it against the real one."""

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import granary

# `make gpu-fake` sets GRANARY_FAKE_CUDA=1: there, a missing device or another driver than the
# fake is a failure, not a skip.
if os.environ.get("GRANARY_FAKE_CUDA") == "1":
    assert granary.cuda_available()[0], f"GRANARY_FAKE_CUDA=1 but no CUDA: {granary.cuda_available()[1]}"
    assert hasattr(ctypes.CDLL("libcuda.so.1"), "granary_fake_cuda_stats"), "not the fake driver"
pytestmark = pytest.mark.skipif(not granary.cuda_available()[0], reason="no CUDA device")

RECORD = 64  # u16 tokens per record


class Driver:
    """The few driver calls a consumer needs, with the primary context of device 0 current."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check(self.lib.cuInit(0), "cuInit")
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.lib.cuMemcpyDtoHAsync_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        self.lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self.lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]

    @staticmethod
    def check(result, call):
        assert result == 0, f"{call}: CUresult {result}"

    def pinned(self, nbytes):
        """A page-locked host array (asynchronous copies into pageable memory return only once
        they have run), in a mapping of its own; `unpin` before it goes."""
        memory = mmap.mmap(-1, nbytes)
        array = np.frombuffer(memory, dtype=np.uint8)
        self.check(self.lib.cuMemHostRegister_v2(array.ctypes.data, nbytes, 0), "cuMemHostRegister")
        return array

    def unpin(self, array):
        self.check(self.lib.cuMemHostUnregister(array.ctypes.data), "cuMemHostUnregister")

    def stream(self):
        stream = ctypes.c_void_p()
        self.check(self.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
        return stream.value

    def copy_back_async(self, out, device_ptr, stream):
        self.check(self.lib.cuMemcpyDtoHAsync_v2(out.ctypes.data, device_ptr, out.nbytes, stream), "cuMemcpyDtoHAsync")

    def synchronize(self, stream):
        self.check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def synchronize_device(self):
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


def fake_stats():
    """The fake driver's counters (see tests/fake-cuda), or None with a real driver."""
    lib = ctypes.CDLL("libcuda.so.1")
    if not hasattr(lib, "granary_fake_cuda_stats"):
        return None
    out = (ctypes.c_uint64 * 8)()
    lib.granary_fake_cuda_stats(out)
    names = ("allocations", "allocated_bytes", "registrations", "streams", "events", "queued_ops")
    return dict(zip(names + ("async_copies", "unpinned_async_copies"), out))


def test_device_batches_reach_a_consumer_stream_intact(tmp_path):
    store = granary.Store(tmp_path / "store", create=True)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 65535, RECORD, dtype=np.uint16) for _ in range(2000)]
    store.ingest("tokens", data, dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    driver = Driver()
    before = fake_stats()
    consumer = driver.stream()
    on = {consumer: consumer, 1: 1, None: 1, -1: consumer}  # where the consumer's copies go
    # The consumer's own stream, the legacy default stream (1), None (legacy too, in DLPack), and
    # -1: the consumer synchronises itself and names no stream.
    for stream in (consumer, 1, None, -1):
        native = granary._native.Loader(store._native, "tokens", 16, device="cuda", hold=1, prefetch=2, seed=9)
        native.begin_epoch()
        back = driver.pinned(len(data) * RECORD * 2)
        rows = back.view(np.uint16).reshape(len(data), RECORD)
        copies, row = [], 0
        while (batch := native.next_batch()) is not None:
            exported = batch.data()
            assert exported.__dlpack_device__() == (2, 0)
            assert exported.shape == [len(batch), RECORD]
            capsule = exported.__dlpack__(stream=stream)
            if stream == -1:
                driver.synchronize_device()
            out = rows[row : row + len(batch)]
            driver.copy_back_async(out, exported.address, on[stream])
            copies.append((np.from_dlpack(batch.indices()).copy(), out))
            row += len(batch)
            # Released before the copy has run: the loader must not reuse the buffer until then.
            del capsule, exported, batch
        driver.synchronize(on[stream])
        driver.unpin(back)
        assert len(copies) == 2000 // 16
        for indices, out in copies:
            assert np.array_equal(out, np.stack([data[i] for i in indices])), f"stream {stream}"
        native.close()
    driver.lib.cuStreamDestroy_v2(consumer)
    after = fake_stats()
    if before is not None:
        # Every copy, the loader's and the consumer's, was between the device and page-locked
        # memory (from pageable memory a lease reused too early would go unnoticed).
        assert after["unpinned_async_copies"] == before["unpinned_async_copies"]
        assert after["async_copies"] - before["async_copies"] >= 2 * 4 * (2000 // 16)


def test_device_exports_refuse_what_they_cannot_order(tmp_path):
    store = granary.Store(tmp_path / "store", create=True)
    store.ingest("tokens", [np.zeros(RECORD, dtype=np.uint16)] * 4, dtype="uint16", shape=[RECORD])
    native = granary._native.Loader(store._native, "tokens", 4, device="cuda")
    native.begin_epoch()
    exported = native.next_batch().data()
    with pytest.raises(BufferError, match="per-thread default stream"):
        exported.__dlpack__(stream=2)
    with pytest.raises(ValueError, match="ambiguous"):
        exported.__dlpack__(stream=0)
    with pytest.raises(BufferError, match="without copying"):
        exported.__dlpack__(stream=1, copy=True)
    with pytest.raises(BufferError, match=r"DLPack device \(2, 0\), not \(1, 0\)"):
        exported.__dlpack__(stream=1, dl_device=(1, 0))
    native.close()
    with pytest.raises(ValueError, match="device='cpu'"):
        next(iter(store.loader("tokens", batch_size=4, device="cuda", output="numpy")))


def test_host_batches_do_not_start_cuda(tmp_path):
    """A CPU loader (a DataLoader worker's, a samples dataset's) must not create a context on
    device 0, nor tie its process to that device. Run in a fresh process."""
    store = granary.Store(tmp_path / "store", create=True)
    store.ingest("tokens", [np.zeros(RECORD, dtype=np.uint16)] * 8, dtype="uint16", shape=[RECORD])
    script = textwrap.dedent(f"""
        import ctypes, granary
        store = granary.Store({str(tmp_path / "store")!r})
        assert granary.cuda_available()[0]
        for batch in store.loader("tokens", batch_size=4, device="cpu", output="numpy"):
            assert batch.shape == (4, {RECORD})
        lib = ctypes.CDLL("libcuda.so.1")
        assert lib.cuInit(0) == 0
        count = ctypes.c_int()
        assert lib.cuDeviceGetCount(ctypes.byref(count)) == 0
        for device in range(count.value):
            flags, active = ctypes.c_uint(), ctypes.c_int()
            assert lib.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
            assert active.value == 0, f"a CPU loader made a context on device {{device}}"
        if count.value > 1:
            loader = store.loader("tokens", batch_size=4, device="cuda:1", output="numpy")
            assert loader.device == "cuda:1"
            native = granary._native.Loader(store._native, "tokens", 4, device="cuda:1")
            native.begin_epoch()
            assert native.next_batch().data().__dlpack_device__() == (2, 1)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _in_forked_child(started, root, queue):
    results = []
    try:
        started.next_batch()
        results.append("used")
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        results.append(f"{type(e).__name__}: {e}")
    store = granary.Store(root)
    try:
        next(iter(store.loader("tokens", batch_size=4, device="cuda", output="numpy")))
        results.append("loaded")
    except BaseException as e:  # noqa: BLE001
        results.append(f"{type(e).__name__}: {e}")
    results.append(sum(len(b) for b in store.loader("tokens", batch_size=4, device="cpu", output="numpy")))
    queue.put(results)


def test_cuda_after_a_fork_is_refused_with_the_remedy_and_host_loading_still_works(tmp_path):
    import multiprocessing

    store = granary.Store(tmp_path / "store", create=True)
    store.ingest("tokens", [np.zeros(RECORD, dtype=np.uint16)] * 8, dtype="uint16", shape=[RECORD])
    started = granary._native.Loader(store._native, "tokens", 4, device="cuda")
    started.begin_epoch()
    assert started.next_batch().data().__dlpack_device__()[0] == 2
    # The loader's threads read the epoch's rest meanwhile; fork once they are done. A fork while
    # one of them is inside a lock can leave the child that lock held for good (README: fork
    # before starting a loader, or use 'spawn'); once in the whole suite on the installed wheel
    # the child hung here for the join's 60 s.
    time.sleep(0.5)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_forked_child, args=(started, str(tmp_path / "store"), queue))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    used, fresh, host = queue.get(timeout=5)
    assert used.startswith("ForkError"), used
    assert "fork" in fresh and "spawn" in fresh, fresh
    assert host == 8
    # The parent's loader goes on.
    assert started.next_batch() is not None
