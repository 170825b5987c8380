"""`Loader`: one rank's batches of a dataset, a mixture or packed windows, and what turns the
engine's batches into tensors."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from . import _native
from ._common import _canonical_dtype, _dtype_name, _torch, world_from_env

if TYPE_CHECKING:
    from . import Store

PathLike = Union[str, "os.PathLike[str]"]


# Shards a batch should mix at least: below this a cache-forced window warns.
_MIXED_SHARDS_MIN = 4


class Loader:
    """One rank's batches of a dataset, verified, prefetched, one epoch per iteration.

    `dataset`: a name (its version current when the loader is made: a missing one is
    `NotFoundError` here), `name@version`, or a manifest id; or a mixture, a list of `(dataset,
    weight)` pairs (`[("web", 0.7), ("code", 0.2), ("math", 0.1)]`, datasets of one layout) read
    as one stream: at every prefix of an epoch each source's count is within 1 of its weight
    times the position, each source shuffled pass by pass (a small one repeated with a fresh
    shuffle, a large one read partly and continued next epoch), the same global order on any
    world size. A mixture's epoch is `mixture_samples` samples (default: as many as its sources
    hold together) or one pass over source `mixture_pass_of` (its index); `change_weights`
    changes the weights from the current position on (a curriculum), `mixture_changes` (a list
    of `(epoch, cursor, weights)`) gives such changes ahead; both are recorded in `state_dict`. On a replicated store (a `granary
    serve` serving it, `GRANARY_CLUSTER_KEY` set in the environment), a damaged or missing shard
    is fetched from a peer through that node, or rebuilt from fragments, in the same order. `rank` and `world_size` default to
    torchrun's `RANK` and `WORLD_SIZE`; one without the other is refused unless the launcher set
    both. Every count is checked here, naming the argument (`ValueError`). `device`: `"cuda"` (torch's current device once torch
    has initialised CUDA, else `LOCAL_RANK` when that device exists, else 0), `"cuda:N"`,
    `"cpu"` (host memory), or `None` (`"cuda"` when torch sees a GPU, `"cpu"` otherwise).
    `prefetch`: batches read ahead; `hold`: batches the trainer may keep at once (a batch is
    held while any tensor made from it lives; asking for one more raises instead of waiting
    forever); `read_depth`: batches read from disk at once, at least (more when batches are
    small: enough to keep the read queue's 32 MiB in flight, sized for variable-length records
    from their mean). `order`: `"shuffled"` or `"sequential"` (the native plan; default shuffled, and for
    an attached dataset that its store's cache cannot hold, the default partitioner's plan
    windowed to the cache, recorded in the saved state); `partitioner`: a
    partitioner plugin by name (`"default"`, the built-in elastic one) or `.wasm` path instead,
    with `partitioner_options` (given alone: the default partitioner's, as `window-shards`).
    A named partitioner that fails to plan an epoch is replaced by the built-in default for it
    (said once on stderr, counted in `granary_plugin_fallback_calls`);
    `partitioner_fallback=False` makes that failure an error instead.
    `drop_last=True` ends each epoch before its short last step,
    so that every rank reads the same number of batches (DDP needs that; without it the last
    step gives some ranks one batch fewer when it holds fewer records than there are ranks).
    `seq_len` packs a dataset of token documents (Megatron ingest, arrays or byte records) into
    windows of `seq_len + 1` tokens cut over the documents in the plan's order (`order`:
    shuffled by default), each document followed by the token `eod` when given, a window's last
    token the next one's first; `within_documents=True` keeps each window inside one document,
    padded with `pad`. A batch is then `batch_size` windows, a dict of `tokens` (`(windows,
    seq_len + 1)`), `cu_seqlens` (int32 boundaries of the documents' runs over the flattened
    windows, padding its own run, as variable-length attention takes them), `position_ids`
    (restarting at 0 at each run) and `real_tokens` (each window's tokens that are not padding);
    with `with_indices`, the windows' indices first. Every token of an epoch is in one window
    but the overlaps and the tail shorter than a window; windows resume like records, on any
    world size. Windows are built in host memory and copied to `device`. A mixture with
    `seq_len` packs each source on its own and draws windows by the weights (a window is one
    source's; `mixture_samples` then counts windows).
    `output`: `"torch"` or `"numpy"` (default: torch when importable). `with_indices=True`
    yields `(indices, batch)`. `dtype`: `"int64"` or `"int32"` widens fixed-size integer
    records (u16 token ids, say, for `nn.Embedding`) in the same pass that hands the batch over,
    into memory of the batch's own (host batches; on a GPU, widen there with `batch.long()`);
    a dtype that cannot hold every value of the records' is refused here. `tier`: where the
    node's tier of data in memory is, filled ahead of the reader in plan order and shared by
    every process of the node reading the store, every block checked as it is copied out:
    `"page-cache"` (the default, or `GRANARY_TIER`: the shard files' pages in the kernel's page
    cache, kept across loaders, processes and restarts, taken back by the kernel as it needs) or
    `"memory"` (extent files in `/dev/shm`, emptied when the last loader using it closes).
    `tier_bytes`: its budget in bytes, `0` to read every record from disk, `None` for the
    default (`GRANARY_TIER_BYTES`, else half of the memory available when it opens).
    `tier_evictor`: the evictor plugin (a built-in name or a `.wasm` file) that chooses which
    extents make room when the tier is full, among those the plan does not need sooner (default
    `GRANARY_TIER_EVICTOR`, else `plan-aware`), with `tier_evictor_options`.
    `local_world_size`: ranks per node, numbered node by node as torchrun numbers them (default:
    `LOCAL_WORLD_SIZE`, which torchrun sets); the tier then plans for all of the node's ranks,
    so they fill it together and keep the same extents when it cannot hold the whole dataset.
    `verify_threads`: threads that check the CRC32C of long reads (64 KiB or more) and copy their
    records into the batch, so the reading thread only reaps the disk (default `GRANARY_VERIFY_THREADS`, else one per 8
    cores, at most 8, none below 8 cores; `0` checks on the reading thread).
    `rebalance_every`: every this many steps the ranks exchange their measured speed and a slow
    rank gets a smaller share of each step from then on (the partitioner's `rebalance`; with
    neither `order` nor `partitioner` given, the default partitioner plans (a mixture keeps its
    order, the default partitioner deciding the shares); its
    `partitioner_options` `max-change` and `min-share` bound the moves). The global order is the
    same and every record is read once per epoch; a rank's batches then vary in size around
    `batch_size`. The ranks exchange through `rebalance_exchange`, a callable
    `(epoch, step, (rank, records, busy_nanos)) -> [(rank, records, busy_nanos), ...]` for every
    rank, by default `torch.distributed.all_gather_object` (initialise the process group first).
    Under DDP report the trainer's own time per batch with `report_busy`: without it the
    barrier makes every rank's step as long as the slowest's, and a point at which every rank
    took the same time keeps the weights in force (counted as held, said once on stderr).

    Batches are the loader's own memory, read-only (NumPy's `writeable` is False; torch warns
    that the tensor is not writable): copy one (`batch.copy()`, `batch.clone()`) to change it.
    Each batch is a tensor of shape `(records, *record_shape)` for fixed-size records, a pair
    `(data, offsets)` for byte records (record `i` is `data[offsets[i]:offsets[i+1]]`) and for
    arrays (`ingest_megatron`: `data` of the arrays' dtype, offsets in elements), or for
    WebDataset samples (`ingest_tars`) a list of dicts, one per sample, like WebDataset's:
    `"__key__"` and one `bytes` value per part, named as in the tar (`"jpg"`, `"seg.png"`; not
    lowercased, no `"__url__"`); samples load to host memory.

    A GPU batch is ready on the torch stream current when it was converted; the loader reuses
    its memory once the tensor is freed and the work queued on that stream by then has run. A
    tensor used on other streams must be kept alive until that work is done (torch's
    `record_stream` does not apply to memory torch did not allocate).
    """

    def __init__(
        self,
        store: Union["Store", PathLike],
        dataset: Union[str, Sequence[Tuple[str, float]]],
        batch_size: int,
        *,
        mixture_samples: Optional[int] = None,
        mixture_pass_of: Optional[int] = None,
        mixture_changes: Optional[Sequence[Tuple[int, int, Sequence[float]]]] = None,
        seq_len: Optional[int] = None,
        eod: Optional[int] = None,
        pad: int = 0,
        within_documents: bool = False,
        seed: int = 0,
        epoch: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        device: Optional[str] = None,
        prefetch: int = 4,
        read_depth: int = 2,
        hold: int = 4,
        order: Optional[str] = None,
        partitioner: Optional[str] = None,
        partitioner_options: Optional[Dict[str, Any]] = None,
        io: Optional[str] = None,
        drop_last: bool = False,
        output: Optional[str] = None,
        with_indices: bool = False,
        tier: Optional[str] = None,
        tier_bytes: Optional[int] = None,
        tier_evictor: Optional[str] = None,
        tier_evictor_options: Optional[Dict[str, Any]] = None,
        dtype: Optional[Any] = None,
        local_world_size: Optional[int] = None,
        verify_threads: Optional[int] = None,
        rebalance_every: Optional[int] = None,
        rebalance_exchange: Optional[Callable[..., Any]] = None,
        partitioner_fallback: bool = True,
    ) -> None:
        env_rank, env_world = world_from_env()
        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        if (rank is None) != (world_size is None) and not launched:
            given, missing = ("rank", "world_size") if world_size is None else ("world_size", "rank")
            raise ValueError(
                f"{given} given without {missing}, and no launcher set RANK and WORLD_SIZE: pass both "
                "(reading as rank 0 of the wrong world would duplicate or drop records)"
            )
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
        for name, value, least in (
            ("batch_size", batch_size, 1),
            ("prefetch", prefetch, 1),
            ("read_depth", read_depth, 1),
            ("hold", hold, 1),
            ("seed", seed, 0),
            ("epoch", epoch, 0),
            ("rank", rank, 0),
            ("world_size", world_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, not {value!r}")
        if tier_bytes is not None and (not isinstance(tier_bytes, int) or tier_bytes < 0):
            raise ValueError(f"tier_bytes must be a number of bytes (0 turns the tier off), not {tier_bytes!r}")
        if local_world_size is not None and (
            isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1
        ):
            raise ValueError(f"local_world_size must be an integer of at least 1, not {local_world_size!r}")
        if verify_threads is not None and (
            isinstance(verify_threads, bool) or not isinstance(verify_threads, int) or not 0 <= verify_threads <= 64
        ):
            raise ValueError(f"verify_threads must be an integer from 0 to 64, not {verify_threads!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if rebalance_every is not None:
            if isinstance(rebalance_every, bool) or not isinstance(rebalance_every, int) or rebalance_every < 2:
                raise ValueError(f"rebalance_every must be an integer of at least 2 steps, not {rebalance_every!r}")
            if order is None and partitioner is None and isinstance(dataset, str) and seq_len is None:
                # (A mixture and packed windows rebalance by the default partitioner's decisions
                # without one.)
                partitioner = "default"
            if rebalance_exchange is None and world_size > 1:
                # Said now, not at the first rebalance point an epoch into the run.
                if _process_group() is None:
                    raise ValueError(_NO_PROCESS_GROUP)
                rebalance_exchange = _torch_exchange
        elif rebalance_exchange is not None:
            raise ValueError("rebalance_exchange is for rebalancing: give rebalance_every too")
        if output is None:
            output = "torch" if _torch() is not None else "numpy"
        if output not in ("torch", "numpy"):
            raise ValueError(f"output {output!r}: expected 'torch' or 'numpy'")
        if output == "torch" and _torch() is None:
            raise ImportError("output='torch' needs torch, which cannot be imported here: install it, or use output='numpy'")
        device_chosen = device is not None
        if device is None:
            torch = _torch() if output == "torch" else None
            device = "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
        device = _device_name(str(device))
        widen = None if dtype is None else _canonical_dtype(_dtype_name(dtype) or "")
        if widen is not None and widen not in ("int64", "int32"):
            raise ValueError(f"dtype={dtype!r}: expected 'int64' or 'int32' (or None, the records' own)")
        if widen is not None and device != "cpu":
            raise ValueError(f"dtype={dtype!r} widens host batches: with device={device!r}, widen on the GPU (batch.long())")
        self._widen = widen
        self._output = output
        self._with_indices = with_indices
        if not isinstance(dataset, str):
            dataset = [(str(name), float(weight)) for name, weight in dataset]
        options = dict(
            seed=seed,
            epoch=epoch,
            rank=rank,
            world_size=world_size,
            prefetch=prefetch,
            read_depth=read_depth,
            hold=hold,
            order=order,
            partitioner=partitioner,
            partitioner_options=None
            if partitioner_options is None
            else [(str(k), str(v)) for k, v in partitioner_options.items()],
            io=io,
            drop_last=drop_last,
            tier=tier,
            tier_bytes=tier_bytes,
            tier_evictor=None if tier_evictor is None else os.fspath(tier_evictor),
            tier_evictor_options=None
            if tier_evictor_options is None
            else [(str(k), str(v)) for k, v in tier_evictor_options.items()],
            local_world_size=local_world_size,
            verify_threads=verify_threads,
            rebalance_every=rebalance_every,
            rebalance_exchange=rebalance_exchange,
            partitioner_fallback=partitioner_fallback,
        )
        self._pack_device = None
        if seq_len is not None:
            for name, value in (("seq_len", seq_len), ("pad", pad)) + ((("eod", eod),) if eod is not None else ()):
                if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "seq_len" else 0):
                    raise ValueError(f"{name} must be an integer of at least {1 if name == 'seq_len' else 0}, not {value!r}")
            # Windows are cut in host memory; a GPU gets them by a copy.
            self._pack_device = None if device == "cpu" else device
            device = "cpu"
        # What goes with a mixture or with packing is the engine's to check.
        options.update(
            seq_len=seq_len,
            eod=eod,
            pad=pad,
            within_documents=bool(within_documents),
            mixture_samples=mixture_samples,
            mixture_pass_of=mixture_pass_of,
            mixture_changes=None
            if mixture_changes is None
            else [(int(e), int(c), [float(w) for w in ws]) for e, c, ws in mixture_changes],
        )
        native = getattr(store, "_native", None)
        source = native if isinstance(native, _native.Store) else os.fspath(store)
        self._native = _native.Loader(source, dataset, batch_size, device=device, **options)
        self._packed = seq_len is not None
        window_given = "window-shards" in {str(k) for k in (partitioner_options or {})}
        # The options it reads with (the engine's: for an attached dataset the cache cannot hold,
        # the default shuffle is the default partitioner's plan windowed to the cache).
        window = dict(self._native.plan_options or []).get("window-shards")
        if window is not None and not window_given and int(window) < _MIXED_SHARDS_MIN:
            # The cache chose a window that thins the shuffle: say so once, with the fix.
            import warnings

            shard_bytes = self._native.shard_bytes_max
            warnings.warn(
                f"the cache of this store reads {dataset!r} through a window of {window} shard(s), so each batch "
                f"mixes at most {window}; a cache of at least {(_MIXED_SHARDS_MIN + 1) * shard_bytes} bytes "
                f"(attach with cache_bytes=...) mixes {_MIXED_SHARDS_MIN}. loader.metrics()['shards_per_batch'] "
                "says how many it drew from",
                stacklevel=2,
            )
        if self._native.layout == "samples" and device != "cpu":
            if device_chosen:
                raise ValueError(
                    f"{dataset} holds WebDataset samples, which are decoded in host memory: load it with device='cpu'"
                )
            # Samples are decoded on the host; the GPU chosen by default does not apply.
            self._native.load_to_host()
        if widen is not None:
            self._native.check_dtype(widen)
        # A GPU this process cannot use is a DeviceError now, not at the first batch.
        self._native.check_device()
        self.rank = rank
        self.world_size = world_size
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[Any]:
        self._native.begin_epoch()
        return self

    def __next__(self) -> Any:
        if self._packed:
            packed = self._native.next_packed()
            if packed is None:
                raise StopIteration
            return self._convert_packed(packed)
        batch = self._native.next_batch()
        if batch is None:
            raise StopIteration
        return self._convert(batch)

    def __len__(self) -> int:
        """Batches this iteration yields (the next one's, between two): a whole epoch, or after
        `load_state_dict` mid-epoch what is left of it, as torchdata's StatefulDataLoader counts.
        `batches_per_epoch()` is the whole epoch's."""
        return self._native.batches_in_iteration()

    def batches_per_epoch(self) -> int:
        """Batches this rank reads in a whole epoch."""
        return self._native.batches_per_epoch()

    def _convert(self, batch: Any) -> Any:
        to = _to_torch if self._output == "torch" else _to_numpy
        layout = batch.layout
        if layout == "samples":
            out = batch.samples()
        elif layout == "fixed":
            out = to(batch.data() if self._widen is None else batch.data_as(self._widen))
        elif layout == "arrays":
            out = (to(batch.data() if self._widen is None else batch.data_as(self._widen)), to(batch.offsets()))
        else:
            out = (to(batch.data()), to(batch.offsets()))
        if self._with_indices:
            return to(batch.indices()), out
        return out

    def _convert_packed(self, packed: Dict[str, Any]) -> Any:
        import numpy as np

        n, width = packed["windows"], packed["width"]
        tokens = np.frombuffer(packed["tokens"], dtype=packed["dtype"]).reshape(n, width)
        if self._widen is not None:
            tokens = tokens.astype(self._widen)
        out = {
            "tokens": tokens,
            "cu_seqlens": np.frombuffer(packed["cu_seqlens"], dtype="<i4"),
            "position_ids": np.frombuffer(packed["position_ids"], dtype="<i4").reshape(n, width),
            "real_tokens": np.asarray(packed["real_tokens"], dtype=np.int32),
        }
        if self._output == "torch":
            torch = _torch()
            out = {k: torch.from_numpy(v.copy()) for k, v in out.items()}
            if self._pack_device is not None:
                out = {k: v.to(self._pack_device, non_blocking=True) for k, v in out.items()}
        if self._with_indices:
            first = packed["first_window"]
            return np.arange(first, first + n, dtype=np.int64), out
        return out

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._native.position[0]

    @property
    def position(self) -> Tuple[int, int]:
        """`(epoch, cursor)` after the last batch handed out; the cursor counts the epoch's
        records consumed by all ranks together."""
        return self._native.position

    @property
    def device(self) -> Optional[str]:
        return self._native.device

    def set_epoch(self, epoch: int) -> None:
        """Makes `epoch` the one the next iteration reads: from its start, or, when the loader
        is already inside it (resumed by `load_state_dict`), from where it is."""
        self._native.set_epoch(epoch)

    def seek(self, epoch: int, cursor: int = 0) -> None:
        """Moves to `(epoch, cursor)` (`cursor` records of the epoch consumed by all ranks)."""
        self._native.seek(epoch, cursor)

    def report_busy(self, seconds: float) -> None:
        """The trainer's own time on the last batch (its forward and backward, without the
        all-reduce's wait for the other ranks), for rebalancing; without it the loader takes the
        time from one batch to the next, which a synchronous step makes equal on every rank (and
        rebalancing then keeps the shares in force)."""
        self._native.report_busy(float(seconds))

    def change_weights(self, weights: Sequence[float]) -> None:
        """A mixture's new weights (one per source, normalized) from the current position on: a
        curriculum's step. Recorded in `state_dict`, so a resume repeats it; the batches already
        read ahead are read again under the new weights."""
        self._native.change_weights([float(w) for w in weights])

    @property
    def mixture(self) -> Optional[Dict[str, Any]]:
        """The mixture read (`None` for one dataset): its `id` (a digest of the versions,
        weights, changes and epoch length), `sources` (`label`, `manifest`, `records`,
        `weight` each), `epoch_samples` and `changes`."""
        return self._native.mixture

    def state_dict(self) -> Dict[str, Any]:
        """The exact position, to resume from (on any world size), with what decides the order
        (seed, plan, version, a mixture's weights and changes) and their `digest`; with
        rebalancing also the rank weights in force and the measures already exchanged for the
        next point, so that a resumed run on the same world size repeats the same decisions."""
        return self._native.saved_state()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes at `state`'s position: the next batches are exactly the samples not yet read,
        split over this loader's world (which may differ from the one that saved it). A state
        altered after it was saved (its digest no longer that of its fields), saved under
        another seed, plan, version or mixture, or whose cursor is past the epoch is refused
        with a `ValueError` naming what differs; the loader is then unchanged."""
        self._native.resume(state)

    def metrics(self) -> Dict[str, Any]:
        """Counters since the loader was made: `batches`, `records`, `bytes`, `stall_seconds`
        (time the trainer waited for data), `stall_max_seconds`, `stall_fraction`,
        `cache_hit_ratio` (batches already prefetched when asked for), `bytes_read`,
        `blocks_verified`, `verify_failures`, `shards_repaired`, `pinned`, `shards_per_batch` (how
        many shards a batch drew from, on average: how well the plan mixes); the memory tier's
        `tier_records`, `tier_bytes` and `tier_hit_ratio` (records served from memory; like
        `bytes_read`, these count what the reader read, the batches it read ahead of the trainer
        included, so `tier_records` can pass `records`) and, when
        the tier is on, `tier_bytes_held` (node-wide), `tier_budget_bytes`, `tier_extents_loaded`,
        `tier_extents_evicted`, and of those evictions `tier_evictor_chosen` (the evictor plugin's
        choices taken), `tier_evictor_refused` (its choices kept because the plan needs them) and
        `tier_evictor_failures`; reading an attached dataset, its origin cache's
        `origin_bytes` (fetched from the origin), `origin_peer_bytes` (sent by a peer of the job
        instead, through the `granary serve` beside the store; `origin_peer_failures` counts asks of
        it that failed other than by no peer holding the shard), `origin_shards_fetched` (from
        either), `origin_prefetched`
        (fetched ahead of the reader), `origin_refetches` (fetches that failed their hash check),
        `origin_cache_hit_ratio` (shard accesses that found their shard here),
        `origin_wait_seconds` (time reads waited for a shard) and `origin_evictions`; `start`: the
        running engine loader's start, stage by stage (`tier_opened`, `staging_ready`, `io_ready`,
        `built`, `planner_ready`, `epoch_planned`, `next_epoch_planned`, `first_batch_read`,
        `first_batch_taken`: the seconds from its construction to each stage's end, for the
        stages passed)."""
        return self._native.metrics()

    def close(self) -> None:
        """Stops the I/O threads now (iterating again restarts them where it stopped). Close
        before forking a child that makes loaders of its own: a fork that catches one of these
        threads inside a lock's slow path copies the lock held, and the child may wait on it."""
        self._native.close()

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _torch_exchange(epoch: int, step: int, mine: Tuple[int, int, int]) -> List[Tuple[int, int, int]]:
    """Every rank's measure for a rebalance point, through `torch.distributed`."""
    dist = _process_group()
    if dist is None:
        raise RuntimeError(_NO_PROCESS_GROUP)
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (int(epoch), int(step), tuple(int(v) for v in mine)))
    points = {(e, s) for e, s, _ in gathered}
    if points != {(int(epoch), int(step))}:
        raise RuntimeError(f"the ranks are at different rebalance points: {sorted(points)}")
    return sorted(m for _, _, m in gathered)


_NO_PROCESS_GROUP = (
    "rebalance_every over more than one rank exchanges the ranks' measures through torch.distributed: "
    "initialise the process group first (init_process_group), or pass rebalance_exchange"
)


def _process_group() -> Any:
    """`torch.distributed` when its process group is initialised here, else None."""
    torch = _torch()
    dist = None if torch is None else torch.distributed
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _to_torch(exported: Any) -> Any:
    import torch

    return torch.from_dlpack(exported)


def _to_numpy(exported: Any) -> Any:
    import numpy

    if exported.__dlpack_device__()[0] != 1:
        raise ValueError("NumPy holds host arrays only: load with device='cpu', or use output='torch'")
    return numpy.from_dlpack(exported)


def _device_name(device: str) -> str:
    if device != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch = _torch()
    if torch is not None and torch.cuda.is_available():
        if torch.cuda.is_initialized():
            return f"cuda:{torch.cuda.current_device()}"
        # A launcher that gives each process one visible device leaves LOCAL_RANK past it.
        return f"cuda:{local if local < torch.cuda.device_count() else 0}"
    return f"cuda:{local}"
