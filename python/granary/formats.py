"""Samples ingested from other formats (Parquet's, MDS's and LitData's several columns), decoded to Python
values by the extension of each part's name, as webdataset's decoders do:

  COLUMN.npy    a NumPy array (dtype and shape kept)      COLUMN.cls    an int
  COLUMN.float  a float                                   COLUMN.txt    a str
  COLUMN.json   the JSON value                            COLUMN.bin    bytes
  COLUMN.decimal   a decimal.Decimal                      (a 0-d .npy: a NumPy scalar)
  COLUMN.jpg, .png, .gif, .webp, .bmp, .tiff   the image file's bytes, or a PIL image with images=True
  COLUMN.wav, .flac, .mp3, .ogg                   the audio file's bytes

    for batch in store.loader("mds", batch_size=32):
        samples = [granary.formats.decode(s) for s in batch]
"""

from __future__ import annotations

import io
import json
from typing import Any, Dict

__all__ = ["decode"]

# What webdataset names a sample's own fields; an ingest refuses a column of these names.
_RESERVED = frozenset(("__key__", "__url__", "__local_path__"))


def decode(sample: Dict[str, Any], *, images: bool = False) -> Dict[str, Any]:
    """`sample` with each `COLUMN.EXT` part decoded and named `COLUMN`; `__key__`, `__url__`
    and `__local_path__` (and any part without an extension) kept as they are."""
    out: Dict[str, Any] = {}
    for name, value in sample.items():
        column, dot, ext = name.rpartition(".")
        if name in _RESERVED or not dot or not column:
            out[name] = value
            continue
        data = bytes(value)
        if ext == "npy":
            import numpy as np

            decoded: Any = np.load(io.BytesIO(data), allow_pickle=False)
            if decoded.shape == ():
                decoded = decoded[()]  # a NumPy scalar (np.uint8, ...), as it was written
        elif ext == "decimal":
            from decimal import Decimal

            decoded = Decimal(data.decode("ascii"))
        elif ext == "cls":
            decoded = int(data)
        elif ext == "float":
            decoded = float(data)
        elif ext == "txt":
            decoded = data.decode("utf-8")
        elif ext == "json":
            decoded = json.loads(data)
        elif ext in ("jpg", "png", "gif", "webp", "bmp", "tiff") and images:
            from PIL import Image

            decoded = Image.open(io.BytesIO(data))
        else:
            decoded = data
        out[column] = decoded
    return out
