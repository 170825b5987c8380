"""The device path from Python without torch: batches exported through DLPack to a consumer's
CUDA stream, read there by work queued on that stream (a copy back to the host through the
driver API, via ctypes) and released before that work has run. Needs a CUDA driver and device:
skipped on CI's plain test run; `make gpu-fake` runs it against the fake driver
(tests/fake-cuda), which aborts the process on a buffer reused under the consumer's work or read
before the loader's copy into it, and the GPU machine runs it against the real one."""

import ctypes

import numpy as np
import pytest

import granary

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

    @staticmethod
    def check(result, call):
        assert result == 0, f"{call}: CUresult {result}"

    def stream(self):
        stream = ctypes.c_void_p()
        self.check(self.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")
        return stream.value

    def copy_back_async(self, out, device_ptr, stream):
        self.check(self.lib.cuMemcpyDtoHAsync_v2(out.ctypes.data, device_ptr, out.nbytes, stream), "cuMemcpyDtoHAsync")

    def synchronize(self, stream):
        self.check(self.lib.cuStreamSynchronize(stream), "cuStreamSynchronize")


def test_device_batches_reach_a_consumer_stream_intact(tmp_path):
    store = granary.Store(tmp_path / "store", create=True)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 65535, RECORD, dtype=np.uint16) for _ in range(2000)]
    store.ingest("tokens", data, dtype="uint16", shape=[RECORD], shard_bytes=16 << 10)
    driver = Driver()
    consumer = driver.stream()
    # The consumer's own stream, the legacy default stream (1), and None (legacy too, in DLPack).
    for stream in (consumer, 1, None):
        native = granary._native.Loader(store._native, "tokens", 16, device="cuda", hold=1, prefetch=2, seed=9)
        native.begin_epoch()
        copies = []
        while (batch := native.next_batch()) is not None:
            exported = batch.data()
            assert exported.__dlpack_device__() == (2, 0)
            assert exported.shape == [len(batch), RECORD]
            capsule = exported.__dlpack__(stream=stream)
            out = np.empty((len(batch), RECORD), dtype=np.uint16)
            driver.copy_back_async(out, exported.address, 1 if stream is None else stream)
            copies.append((np.from_dlpack(batch.indices()).copy(), out))
            # Released before the copy has run: the loader must not reuse the buffer until then.
            del capsule, exported, batch
        driver.synchronize(1 if stream is None else stream)
        assert len(copies) == 2000 // 16
        for indices, out in copies:
            assert np.array_equal(out, np.stack([data[i] for i in indices])), f"stream {stream}"
        native.close()
    driver.lib.cuStreamDestroy_v2(consumer)


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
    with pytest.raises(BufferError, match="not"):
        exported.__dlpack__(stream=1, dl_device=(1, 0))
    native.close()
    with pytest.raises(ValueError, match="device='cpu'"):
        next(iter(store.loader("tokens", batch_size=4, device="cuda", output="numpy")))
