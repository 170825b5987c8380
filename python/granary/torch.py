"""`IterableDataset`: granary batches for code that insists on `torch.utils.data.DataLoader`.

    ds = granary.torch.IterableDataset("/data/store", "tokens", batch_size=32, seed=0)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    for epoch in range(3):
        ds.set_epoch(epoch)
        for batch in dl:
            ...

Each item is a whole batch (granary batches and shuffles), so the DataLoader takes
`batch_size=None`. The granary loader is made inside `__iter__`, in the process that iterates:
in the main process with `num_workers=0`, in each worker otherwise, where worker `w` of `W`
reads as rank `rank * W + w` of `world_size * W` (together the workers read every sample of
the rank once). Workers load to host memory (CUDA does not survive a fork); the main process
loads to `device` (then leave the DataLoader's `pin_memory` off: the batches may already be on
the GPU). Each iteration reads the epoch after the last one read to its end, or the one
`set_epoch` named (as with `DistributedSampler`); the epoch lives in shared memory, so this
holds with workers, persistent (`persistent_workers=True`) or not. An iteration left before
its end starts that epoch again next time with workers (a worker's position stays in the
worker), and goes on where it stopped without. `state_dict` and `load_state_dict` work with
`num_workers=0`. For DDP, pass `drop_last=True` so every rank reads as many batches.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
from typing import Any, Dict, Iterator, Optional

import torch.utils.data

from . import Loader, Store, world_from_env


class IterableDataset(torch.utils.data.IterableDataset):
    """See the module documentation; the keyword arguments are `granary.Loader`'s."""

    def __init__(self, store: Any, dataset: str, batch_size: int, **options: Any) -> None:
        super().__init__()
        self._store = store.path if isinstance(store, Store) else os.fspath(store)
        self._dataset = dataset
        self._batch_size = batch_size
        self._options = dict(options)
        self._options.pop("output", None)  # always torch here
        # The epoch the next iteration reads, in shared memory: DataLoader workers (forked or
        # spawned, persistent or not) read it at each iteration and move it on at an epoch's end.
        self._epoch = multiprocessing.RawValue("q", int(self._options.pop("epoch", 0)))
        self._resume: Optional[Dict[str, Any]] = None
        self._loader: Optional[Loader] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_loader"] = None  # its threads stay in this process
        if multiprocessing.context.get_spawning_popen() is None:
            # A copy outside a process start (deepcopy, pickle): shared memory does not travel.
            state["_epoch"] = self._epoch.value
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if isinstance(state["_epoch"], int):
            state["_epoch"] = multiprocessing.RawValue("q", state["_epoch"])
        self.__dict__.update(state)

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (as `DistributedSampler.set_epoch`)."""
        self._epoch.value = epoch
        if self._resume is not None and self._resume["epoch"] != epoch:
            self._resume = None
        if self._loader is not None:
            self._loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        options = dict(self._options)
        rank = options.pop("rank", None)
        world_size = options.pop("world_size", None)
        env_rank, env_world = world_from_env()
        if (rank is None) != (world_size is None) and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
            raise ValueError("pass both rank and world_size, or neither (then the launcher's RANK and WORLD_SIZE)")
        rank = env_rank if rank is None else rank
        world_size = env_world if world_size is None else world_size
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            rank = rank * worker.num_workers + worker.id
            world_size = world_size * worker.num_workers
            options["device"] = "cpu"
            epoch = self._epoch.value
            # A fresh loader per iteration, made here, in the worker process.
            loader = Loader(
                self._store, self._dataset, self._batch_size, epoch=epoch, rank=rank,
                world_size=world_size, output="torch", **options,
            )
            try:
                yield from loader
            finally:
                loader.close()
            # Read to its end: every worker writes the same next epoch.
            self._epoch.value = epoch + 1
            return
        if self._loader is None:
            self._loader = Loader(
                self._store, self._dataset, self._batch_size, epoch=self._epoch.value, rank=rank,
                world_size=world_size, output="torch", **options,
            )
            if self._resume is not None:
                self._loader.load_state_dict(self._resume)
                self._resume = None
        yield from self._loader
        self._epoch.value = self._loader.epoch

    def state_dict(self) -> Dict[str, Any]:
        """The position of the main-process loader (`num_workers=0`)."""
        if self._loader is None:
            if self._resume is not None:
                return dict(self._resume)
            raise RuntimeError("nothing was read yet in this process (state_dict needs num_workers=0)")
        return self._loader.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes at `state` on the next iteration (`num_workers=0`)."""
        if self._loader is not None:
            self._loader.load_state_dict(state)
        else:
            self._resume = dict(state)

    def metrics(self) -> Dict[str, Any]:
        """The main-process loader's counters (`num_workers=0`)."""
        return {} if self._loader is None else self._loader.metrics()
