"""granary: an embedded storage engine for ML training data.

Shards on local disk are content-addressed (BLAKE3) and checksummed (CRC32C); every byte a
batch holds passed its checksum before the batch was handed over. Batches come as PyTorch
tensors (NumPy arrays where torch is absent) through DLPack, without a copy: on the GPU, ready
on the consumer's stream, or in host memory.

    import granary
    store = granary.Store("/data/store", create=True)
    store.ingest("tokens", records, dtype="uint16", shape=[2048])
    loader = store.loader("tokens", batch_size=32, seed=0, device="cuda")
    for epoch in range(3):
        for batch in loader:          # one epoch per iteration; (32, 2048) uint16 tensors
            ...
        checkpoint = loader.state_dict()

Processes: a `Loader` starts its I/O threads (and its CUDA stream) on the first batch asked
for, in the process that asks. Make loaders in the process that iterates them; one used after
a fork raises `ForkError`. `granary.torch.IterableDataset` does this for DataLoader workers.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

from . import _native, formats
from ._common import _canonical_dtype, _dtype_name, world_from_env
from ._loader import Loader
from ._native import CorruptionError, DeviceError, Error, ForkError, IngestIntentError, NotFoundError, PluginError

__all__ = [
    "Store",
    "formats",
    "Loader",
    "Error",
    "CorruptionError",
    "NotFoundError",
    "PluginError",
    "ForkError",
    "DeviceError",
    "IngestIntentError",
    "cuda_available",
    "world_from_env",
    "serve_metrics",
    "metrics_text",
]
__version__ = _native.__version__


def _kind_from_text(error: BaseException, name: str) -> Any:
    # An error re-raised by torch's DataLoader from a worker is its class made anew from the
    # worker's traceback text: `kind` is not set on it, but the text carries it (a note the
    # engine adds, Python 3.11+).
    if name == "kind":
        found = re.findall(r"granary error kind: (\w+)", str(error))
        if found:
            return found[-1]
    raise AttributeError(f"{type(error).__name__!r} object has no attribute {name!r}")


Error.__getattr__ = _kind_from_text

# A fork while another thread scrapes or registers would leave the child's metrics registry
# locked for good; and the child's registry must not hold the parent's loaders.
# Once per process, however often this module is imported or reloaded.
if hasattr(os, "register_at_fork") and not getattr(_native, "_fork_hooks_registered", False):
    _native._fork_hooks_registered = True
    os.register_at_fork(
        before=_native._metrics_before_fork,
        after_in_parent=_native._metrics_after_fork_in_parent,
        after_in_child=_native._metrics_after_fork_in_child,
    )

PathLike = Union[str, "os.PathLike[str]"]


def cuda_available() -> Tuple[bool, str]:
    """`(True, "N CUDA devices")` when this process can load to a GPU, else `(False, why not)`.
    It initialises the CUDA driver in this process (no device is chosen), which a child forked
    afterwards cannot use: ask in the process that loads, or start children with 'spawn'."""
    return _native.cuda_available()


def serve_metrics(port: int, host: str = "0.0.0.0", *, offset_by_local_rank: bool = True) -> Any:
    """Serves this process's metrics (every loader it runs, labelled by rank and dataset) for
    Prometheus at `http://HOST:PORT/metrics`, on a thread of its own, until the returned
    endpoint's `close()`. Under torchrun the ranks of a node share its address, so each listens
    on `port + LOCAL_RANK` unless `offset_by_local_rank=False` (port 0 picks a free port; the
    endpoint's `port` tells which). Call it once per process. The default host is every
    interface, so that Prometheus on another machine can scrape; the metrics carry dataset
    names, shard ids and peer addresses (never a key): `host="127.0.0.1"` keeps them on this
    machine. Loaders in DataLoader worker processes (`granary.torch.IterableDataset` with
    `num_workers > 0`) run in the workers, whose metrics this endpoint does not include: call
    `serve_metrics` in each worker (`worker_init_fn`, with its own port) to scrape them."""
    if port != 0 and offset_by_local_rank:
        port += int(os.environ.get("LOCAL_RANK", "0"))
    return _native.serve_metrics(host, port)


def metrics_text() -> str:
    """This process's metrics in the Prometheus text format, as a scrape would get them."""
    return _native.metrics_text()


class Store:
    """A granary store on local disk (opened per call: the object holds no threads or locks).
    Opening an existing one checks the store's files only (`create=True` makes a missing one),
    so it works in any process; writes (`ingest*`) open the catalog, which a child forked after
    its parent opened it (a write, or creating the store) cannot (a `ForkError`)."""

    def __init__(self, path: PathLike, *, create: bool = False) -> None:
        self._native = _native.Store(os.fspath(path), create=create)

    @property
    def path(self) -> str:
        return str(self._native.path)

    def datasets(self) -> List[Dict[str, Any]]:
        """Every dataset: `name`, `version`, `versions`, `manifest`, `records`, `shards`,
        `bytes`, `layout`."""
        return self._native.datasets()

    def attach(
        self, name: str, url: str, *, cache_bytes: Optional[int] = None, evictor: Optional[str] = None
    ) -> Dict[str, Any]:
        """Makes dataset `name` (`"NAME"` or `"NAME@N"`) of the object store at `url`
        (`s3://bucket/prefix`, `gs://`, `az://`, `file:///path`) readable here: its manifest and
        every shard's metadata are fetched and checked now, record data as loaders need it, into
        this store's cache of shards, kept within `cache_bytes` by the evictor plugin `evictor`
        (both remembered for later attaches; 0 is no bound; the default evictor, `plan-aware`,
        is told by loaders when each shard is needed next). Credentials come from the environment (`AWS_*` and the like), never from
        `url`. Returns `name`, `version`, `shards`, `bytes`, `cache_bytes`."""
        return self._native.attach(name, url, cache_bytes=cache_bytes, evictor=evictor)

    def detach(self, name: str) -> int:
        """Drops the attached dataset `name` and its cached shards (the origin keeps them);
        returns how many cached shards were removed."""
        return self._native.detach(name)

    def push(self, name: str, url: str) -> int:
        """Publishes version `name` (`"NAME"` or `"NAME@N"`) to the object store at `url`: the
        shards it lacks, then the manifest, then the ref (written only if nobody changed it
        meanwhile). Returns how many shards were uploaded."""
        return self._native.push(name, url)

    def ingest(
        self,
        name: str,
        records: Iterable[Any],
        *,
        dtype: Any = None,
        shape: Optional[Sequence[int]] = None,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """Ingests `records` (bytes, bytearray, NumPy arrays, torch tensors, or anything with
        `tobytes()`) as a new version of `name`. With `dtype` and `shape` every record is one
        fixed-size array (`"uint16"`, `"float32"`, ... or a torch dtype; an array or tensor of
        another dtype is refused) and batches are dense tensors; without them records are byte
        strings of any length. `progress=True` prints to stderr; a
        callable gets `(records, bytes)` every half second. Returns what was committed.

        Every `ingest*` takes `mode`: `"new"` (the default) makes a new dataset, and into one that
        exists accepts only exactly the records its current version holds (no version is added,
        `unchanged` is True: running the same ingest twice changes nothing), refusing anything
        else with `granary.IngestIntentError`; `"append"` adds the records to the current
        version's; `"replace"` (or `replace=True`) makes them the new version."""
        dtype = _dtype_name(dtype)
        return self._native.ingest(
            name,
            _record_sources(records, dtype),
            dtype=dtype,
            shape=_shape(shape),
            mode=_mode(mode, replace),
            shard_bytes=_shard_bytes(shard_bytes),
            progress=progress,
        )

    def ingest_files(
        self,
        name: str,
        source: Union[PathLike, Sequence[PathLike]],
        *,
        dtype: Any = None,
        shape: Optional[Sequence[int]] = None,
        drop_remainder: bool = False,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """With `dtype` and `shape`: files of back-to-back fixed-size records (nanoGPT or
        Megatron `.bin` token files). Without: every file under the directory `source` is one
        record. Runs with the GIL released."""
        return self._native.ingest_files(
            name,
            _paths(source),
            dtype=_dtype_name(dtype),
            shape=_shape(shape),
            drop_remainder=drop_remainder,
            mode=_mode(mode, replace),
            shard_bytes=_shard_bytes(shard_bytes),
            progress=progress,
        )

    def ingest_tars(
        self,
        name: str,
        tars: Union[PathLike, Sequence[PathLike]],
        *,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """WebDataset tar files: the entries sharing a key are one sample, one record. Members
        that are not files (links, devices) are not ingested: each is listed under `skipped` in
        what is returned (`source`, `member`, `reason`), and a warning says how many."""
        committed = self._native.ingest_tars(
            name, _paths(tars), mode=_mode(mode, replace), shard_bytes=_shard_bytes(shard_bytes), progress=progress
        )
        if committed["skipped"]:
            import warnings

            first = committed["skipped"][0]
            warnings.warn(
                f"{len(committed['skipped'])} tar members not ingested, as {first['member']!r} of "
                f"{first['source']}: {first['reason']} (see 'skipped' in what ingest_tars returned)",
                stacklevel=2,
            )
        return committed

    def ingest_megatron(
        self,
        name: str,
        prefix: PathLike,
        *,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """A Megatron-LM indexed dataset (`prefix.bin` + `prefix.idx`): one record per sequence,
        in order, an array of the index's dtype, as Megatron's `IndexedDataset[i]` returns it.
        Batches come as `(data, offsets)`: `data` the sequences' elements back to back,
        sequence `i` of the batch `data[offsets[i]:offsets[i+1]]`."""
        return self._native.ingest_megatron(
            name, os.fspath(prefix), mode=_mode(mode, replace), shard_bytes=_shard_bytes(shard_bytes), progress=progress
        )

    def ingest_parquet(
        self,
        name: str,
        source: Union[PathLike, Sequence[PathLike]],
        *,
        columns: Optional[Sequence[str]] = None,
        nulls: str = "refuse",
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """Parquet files (a path, a directory of `.parquet` files, a glob pattern, or a list of
        them): one record per row, in file order. With one column (`columns`, default the files'
        only one): lists of numbers (token ids) become arrays of their type, batches coming as
        `(data, offsets)`; binary and strings, byte records; numbers, records of one number.
        With several, each row is a sample (a dict): binary and strings as bytes, lists of
        numbers as `.npy` arrays, numbers as decimal text, bools, structs and nested lists as
        JSON, Hugging Face `Image()`/`Audio()` columns as their files, and `__key__` the row's
        position. Columns are found by name in every file. A null is refused (`nulls="refuse"`)
        or its row left out (`nulls="skip"`, counted in `skipped`)."""
        return self._native.ingest_parquet(
            name, _paths(source), nulls=nulls, **_column_options(columns, mode, replace, shard_bytes, progress)
        )

    def ingest_arrow(
        self,
        name: str,
        source: Any,
        *,
        columns: Optional[Sequence[str]] = None,
        nulls: str = "refuse",
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """Any Arrow stream: an object that offers `__arrow_c_stream__` (a pyarrow Table or
        RecordBatchReader, a Polars DataFrame, a DuckDB relation, a Lance dataset's
        `scanner().to_reader()`, a Hugging Face `Dataset`'s `.data.table`). One record per row,
        by `ingest_parquet`'s rules; `columns` default to every column, in the stream's order.
        Streamed batch by batch: a source larger than memory goes through."""
        return self._native.ingest_arrow(
            name, source, nulls=nulls, **_column_options(columns, mode, replace, shard_bytes, progress)
        )

    def ingest_mds(
        self,
        name: str,
        dir: PathLike,
        *,
        columns: Optional[Sequence[str]] = None,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """A Mosaic Streaming MDS directory (what `MDSWriter` writes, compressed or not): one
        record per sample, in order. With one column (`columns=["tokens"]`): 1-D arrays become
        arrays of their dtype (batches as `(data, offsets)`), bytes, strings, JSON and images
        byte records, numbers records of one number. Otherwise (default: every column, and a
        column of arrays of more dimensions or of `pil` images) each sample is a dict of parts
        named `COLUMN.EXT` (`.npy` arrays and `pil` images' raw pixels, `.cls`/`.txt` numbers as
        text, `.txt` strings, `.jpg`/`.png` images, `.bin` bytes, `.json`);
        `granary.formats.decode` turns one into Python values."""
        return self._native.ingest_mds(
            name, os.fspath(dir), **_column_options(columns, mode, replace, shard_bytes, progress)
        )

    def ingest_litdata(
        self,
        name: str,
        dir: PathLike,
        *,
        columns: Optional[Sequence[str]] = None,
        block_size: Optional[int] = None,
        mode: Optional[str] = None,
        replace: bool = False,
        shard_bytes: Optional[int] = None,
        progress: Union[bool, Callable[[int, int], None], None] = None,
    ) -> Dict[str, Any]:
        """A LitData optimized directory (what `litdata.optimize` writes with its default item
        loader or `TokensLoader`, zstd-compressed or not, with or without pyarrow's Arrow
        footer): one record per item, in order. With one leaf (`columns=["tokens"]`, a dict's
        key): 1-D arrays become arrays of their dtype, str and bytes byte records, int, float
        and bool records of one number. Otherwise (default: every leaf) each item is a dict of
        parts named `LEAF.EXT`, as `ingest_mds` names them (`granary.formats.decode` turns one
        into Python values). A `TokensLoader` directory becomes its documents (arrays), or with
        `block_size` records of that many tokens, as `TokensLoader(block_size)` yields them."""
        if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0):
            raise ValueError(f"block_size={block_size!r}: a positive number of tokens")
        return self._native.ingest_litdata(
            name, os.fspath(dir), block_size=block_size, **_column_options(columns, mode, replace, shard_bytes, progress)
        )

    def loader(self, dataset: Union[str, Sequence[Tuple[str, float]]], batch_size: int, **options: Any) -> "Loader":
        """A `Loader` of `dataset` (see `Loader` for the options)."""
        return Loader(self, dataset, batch_size, **options)

    def __repr__(self) -> str:
        return f"granary.Store({self.path!r})"


def _shape(shape: Any) -> Optional[List[int]]:
    """`shape` as the native ingest takes it: `2049` is `[2049]`; every dim a positive int."""
    if shape is None:
        return None
    dims = [shape] if isinstance(shape, int) else list(shape)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"shape must be a positive int or a sequence of them, not {shape!r}")
    return dims


def _shard_bytes(shard_bytes: Optional[int]) -> Optional[int]:
    if shard_bytes is not None and (isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 1):
        raise ValueError(f"shard_bytes must be a positive number of bytes, not {shard_bytes!r}")
    return shard_bytes


def _mode(mode: Optional[str], replace: bool) -> str:
    if replace and mode not in (None, "replace"):
        raise ValueError(f"replace=True and mode={mode!r} disagree: pass one of them")
    return "replace" if replace else (mode or "new")


def _record_sources(records: Iterable[Any], dtype: Optional[str]) -> Iterator[Any]:
    """`records` as the native ingest takes them: torch tensors become their bytes (a NumPy
    view of the tensor's memory, after a copy to the host when on a GPU), and an array whose
    dtype is not the dataset's (or whose bytes are big-endian) is refused, not ingested as
    bytes of another type."""
    expected = None if dtype is None else _canonical_dtype(dtype)
    torch = sys.modules.get("torch")
    for n, record in enumerate(records):
        if torch is not None and isinstance(record, torch.Tensor):
            got = _canonical_dtype(str(record.dtype))
            if expected is not None and got != expected:
                raise ValueError(f"record {n}: a tensor of dtype {got}, but the records are {expected}")
            try:
                record = record.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"record {n}: this tensor's bytes cannot be read ({e})") from e
            yield record
            continue
        if not isinstance(record, (bytes, bytearray, memoryview)):
            array_dtype = getattr(record, "dtype", None)
            got = getattr(array_dtype, "name", None)
            if expected is not None and isinstance(got, str) and _canonical_dtype(got) != expected:
                raise ValueError(f"record {n}: an array of dtype {got}, but the records are {expected}")
            if getattr(array_dtype, "byteorder", "=") == (">" if sys.byteorder == "little" else "<"):
                raise ValueError(
                    f"record {n}: an array of non-native byte order ({array_dtype}); records are stored as this "
                    "machine's arrays are (convert it with .astype(dtype.newbyteorder('=')))"
                )
        yield record


def _column_options(
    columns: Optional[Sequence[str]], mode: Optional[str], replace: bool, shard_bytes: Optional[int], progress: Any
) -> Dict[str, Any]:
    """The keyword arguments the native ingests of other formats share."""
    return {
        "columns": None if columns is None else [str(c) for c in columns],
        "mode": _mode(mode, replace),
        "shard_bytes": _shard_bytes(shard_bytes),
        "progress": progress,
    }


def _paths(source: Any) -> Any:
    if isinstance(source, (str, os.PathLike)):
        return os.fspath(source)
    return [os.fspath(p) for p in source]
