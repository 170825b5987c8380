"""Samples ingested from other formats (Parquet's, MDS's and LitData's several columns), decoded to Python
values by the extension of each part's name, as webdataset's decoders do:

  COLUMN.npy    a NumPy array (dtype and shape kept)      COLUMN.cls    an int
  COLUMN.float  a float                                   COLUMN.txt    a str
  COLUMN.json   the JSON value                            COLUMN.bin    bytes
  COLUMN.jpg, COLUMN.png   the image file's bytes, or a PIL image with images=True

    for batch in store.loader("mds", batch_size=32):
        samples = [granary.formats.decode(s) for s in batch]
"""

from __future__ import annotations

import io
import json
from typing import Any, Dict

__all__ = ["decode"]


def decode(sample: Dict[str, Any], *, images: bool = False) -> Dict[str, Any]:
    """`sample` with each `COLUMN.EXT` part decoded and named `COLUMN`; `__key__` (and any
    part without an extension) kept as it is."""
    out: Dict[str, Any] = {}
    for name, value in sample.items():
        column, dot, ext = name.rpartition(".")
        if name.startswith("__") or not dot or not column:
            out[name] = value
            continue
        data = bytes(value)
        if ext == "npy":
            import numpy as np

            decoded: Any = np.load(io.BytesIO(data), allow_pickle=False)
        elif ext == "cls":
            decoded = int(data)
        elif ext == "float":
            decoded = float(data)
        elif ext == "txt":
            decoded = data.decode("utf-8")
        elif ext == "json":
            decoded = json.loads(data)
        elif ext in ("jpg", "png") and images:
            from PIL import Image

            decoded = Image.open(io.BytesIO(data))
        else:
            decoded = data
        out[column] = decoded
    return out
