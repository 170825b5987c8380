"""Grain integration: a granary dataset as a Grain data source, and granary's loader as a Grain
iterator with Grain's checkpoint protocol, so a JAX (or torchtitan) trainer keeps its loop.

  DataSource      a `grain.sources.RandomAccessDataSource` (`__len__`, `__getitem__`): record
                  `i` of one pinned version, every byte verified, for Grain's own samplers,
                  transformations and workers (it pickles as its store path and version).
  LoaderDataset   a `grain.IterDataset` whose iterator hands out granary's planned batches (its
                  order, tier, prefetch and ranks), `get_state`/`set_state` being the loader's
                  exact position; its epochs run on (`num_epochs`, default one).

    source = granary.grain.DataSource("/data/store", "tokens")
    ds = grain.MapDataset.source(source).shuffle(seed=0).batch(32)

    ds = granary.grain.LoaderDataset(store, "tokens", batch_size=32, seed=0, output="numpy")
    it = iter(ds)
    batch = next(it)
    state = it.get_state()      # a dict of plain values (JSON-safe)
    it.set_state(state)         # resumes at exactly the next batch
"""

from __future__ import annotations

import operator

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from . import _native

__all__ = ["DataSource", "LoaderDataset"]

_NUMPY = {
    "u8": np.uint8,
    "i8": np.int8,
    "u16": np.uint16,
    "i16": np.int16,
    "u32": np.uint32,
    "i32": np.int32,
    "u64": np.uint64,
    "i64": np.int64,
    "f16": np.float16,
    "f32": np.float32,
    "f64": np.float64,
}


class DataSource:
    """Record `i` of a dataset version, verified, by index: a Grain `RandomAccessDataSource`.

    `store` is a `granary.Store` or a store's path; `dataset` a name (pinned to its current
    version now) or `name@N`. A record comes as the loader would give it: a NumPy array for
    fixed records (their shape) and arrays (their dtype), `bytes` for byte records, a dict for
    samples; `decode`, when given, is applied to each. An index out of range is an
    `IndexError`; a damaged record a `granary.CorruptionError`. It pickles as its path and
    version: each worker process opens its own reader."""

    def __init__(self, store: Any, dataset: str, *, decode: Optional[Callable[[Any], Any]] = None) -> None:
        root = store.path if hasattr(store, "path") else os.fspath(store)
        self._root = root
        self._decode = decode
        self._native = _native.RecordReader(root, dataset)
        self._spec = self._native.spec
        self._layout = self._native.layout
        self._dtype = _NUMPY.get(self._native.dtype) if self._native.dtype else None
        self._shape = tuple(self._native.shape) if self._native.shape else None

    @property
    def spec(self) -> str:
        """The version read, `name@N`."""
        return self._spec

    def __len__(self) -> int:
        return len(self._native)

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        # An index is an integer (operator.index: ints and NumPy's integers); 1.9 and "5" are
        # refused with TypeError, as a list refuses them, rather than read as records 1 and 5.
        index = operator.index(index)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"record {index} of {self._spec} ({n} records)")
        return self._convert(self._native.read([index])[0])

    def __getitems__(self, indices: Sequence[int]) -> List[Any]:
        """Several records in one read (Grain batches its lookups through this)."""
        n = len(self)
        whole = [operator.index(i) for i in indices]
        wanted = [i + n if i < 0 else i for i in whole]
        return [self._convert(r) for r in self._native.read(wanted)]

    def _convert(self, record: Any) -> Any:
        if self._layout == "fixed":
            record = np.frombuffer(record, dtype=self._dtype).reshape(self._shape)
        elif self._layout == "arrays":
            record = np.frombuffer(record, dtype=self._dtype)
        return self._decode(record) if self._decode is not None else record

    def __repr__(self) -> str:
        # Grain's checkpoints name the source by this: the path and the pinned version.
        return f"granary.grain.DataSource({self._root!r}, {self._spec!r})"

    def __getstate__(self) -> Dict[str, Any]:
        return {"root": self._root, "spec": self._spec, "decode": self._decode}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__init__(state["root"], state["spec"], decode=state["decode"])


def _grain():
    try:
        import grain
    except ImportError as error:  # pragma: no cover - the message is the point
        raise ImportError("granary.grain.LoaderDataset needs grain: pip install grain") from error
    return grain


class LoaderDataset:
    """granary's loader as a `grain.IterDataset`: `iter()` gives a `grain.DatasetIterator` of
    the loader's batches, epoch after epoch (`num_epochs`, None for ever), whose state is the
    loader's position. Arguments are `store.loader`'s (`dataset`, `batch_size`, `**options`)."""

    def __new__(cls, store: Any, dataset: Any, batch_size: int, *, num_epochs: Optional[int] = 1, **options: Any) -> Any:
        grain = _grain()

        class _Iterator(grain.DatasetIterator):
            def __init__(self) -> None:
                super().__init__()
                self._loader = store.loader(dataset, batch_size, **options)
                # Epochs are counted by the loader's position: after an epoch's last batch it
                # stands at the next epoch's start, and a resumed iterator counts on from there.
                self._first_epoch = self._loader.state_dict()["epoch"]
                self._current: Any = None

            def __next__(self) -> Any:
                while True:
                    if self._current is None:
                        epoch = self._loader.state_dict()["epoch"]
                        if num_epochs is not None and epoch >= self._first_epoch + num_epochs:
                            raise StopIteration
                        self._current = iter(self._loader)
                    try:
                        return next(self._current)
                    except StopIteration:
                        self._current = None

            def get_state(self) -> Dict[str, Any]:
                return {"loader": self._loader.state_dict(), "first_epoch": self._first_epoch}

            def set_state(self, state: Dict[str, Any]) -> None:
                self._loader.load_state_dict(state["loader"])
                self._first_epoch = int(state["first_epoch"])
                self._current = None

            def close(self) -> None:
                self._loader.close()

        class _Dataset(grain.IterDataset):
            def __iter__(self) -> Any:
                return _Iterator()

            def __str__(self) -> str:
                return f"granary.grain.LoaderDataset({dataset!r}, batch_size={batch_size})"

        return _Dataset()
