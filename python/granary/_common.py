"""What the package's modules share: the launcher's world, torch when importable, dtype names."""

from __future__ import annotations

import os
from typing import Any, Optional, Tuple


def world_from_env() -> Tuple[int, int]:
    """`(rank, world_size)` from torchrun's environment (`RANK`, `WORLD_SIZE`); `(0, 1)` alone."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, world_size


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def _dtype_name(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)  # a numpy dtype
    if isinstance(name, str):
        return name
    if isinstance(dtype, type):  # a numpy scalar type such as numpy.uint16
        try:
            import numpy

            return numpy.dtype(dtype).name
        except (ImportError, TypeError):
            pass
    return str(dtype)  # a torch dtype prints as "torch.uint16"


# Every name the engine takes for a dtype (its own short ones, NumPy's, torch's) to NumPy's.
_DTYPE_ALIASES = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "u8": "uint8",
    "i8": "int8",
    "u16": "uint16",
    "i16": "int16",
    "u32": "uint32",
    "i32": "int32",
    "u64": "uint64",
    "i64": "int64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
}


def _canonical_dtype(name: str) -> str:
    name = name[len("torch.") :] if name.startswith("torch.") else name
    return _DTYPE_ALIASES.get(name, name)
