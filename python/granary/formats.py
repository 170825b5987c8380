"""Samples ingested from other formats (Parquet's, MDS's and LitData's several columns), decoded to Python
values by the extension of each part's name, as webdataset's decoders do:

  COLUMN.npy    a NumPy array (dtype and shape kept)      COLUMN.cls    an int
  COLUMN.float  a float                                   COLUMN.txt    a str
  COLUMN.json   the JSON value                            COLUMN.bin    bytes
  COLUMN.decimal   a decimal.Decimal                      (a 0-d .npy: a NumPy scalar)
  COLUMN.datetime  a datetime.datetime (with its zone, when the column had one; nanoseconds
                   as a pandas.Timestamp, as pyarrow gives them, or numpy.datetime64 without pandas)
  COLUMN.date      a datetime.date                        COLUMN.time   a datetime.time
  COLUMN.timedelta a datetime.timedelta (nanoseconds: a pandas.Timedelta, or numpy.timedelta64)
  COLUMN.jpg, .png, .gif, .webp, .bmp, .tiff   the image file's bytes, or a PIL image with images=True
  COLUMN.wav, .flac, .mp3, .ogg                   the audio file's bytes
  COLUMN.jpg.list, .png.list, .npy.list   a list of such parts, each decoded as above

    for batch in store.loader("mds", batch_size=32):
        samples = [granary.formats.decode(s) for s in batch]
"""

from __future__ import annotations

import datetime
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
        if ext == "list":
            column, _, inner = column.rpartition(".")
            out[column] = [_decode_part(inner, element, images) for element in _list_elements(data)]
            continue
        out[column] = _decode_part(ext, data, images)
    return out


def _list_elements(data: bytes) -> list:
    """A list part: a `u32` count, each element's `u32` length, the elements back to back."""
    count = int.from_bytes(data[:4], "little")
    at = 4 + 4 * count
    elements = []
    for i in range(count):
        length = int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "little")
        elements.append(data[at : at + length])
        at += length
    return elements


def _decode_part(ext: str, data: bytes, images: bool) -> Any:
    """One part's bytes as the value its extension names."""
    if ext == "npy":
        import numpy as np

        decoded: Any = np.load(io.BytesIO(data), allow_pickle=False)
        if decoded.shape == ():
            decoded = decoded[()]  # a NumPy scalar (np.uint8, ...), as it was written
    elif ext == "decimal":
        from decimal import Decimal

        decoded = Decimal(data.decode("ascii"))
    elif ext == "datetime":
        decoded = _datetime(data.decode("ascii"))
    elif ext == "date":
        decoded = datetime.date.fromisoformat(data.decode("ascii"))
    elif ext == "time":
        decoded = datetime.time.fromisoformat(data.decode("ascii"))
    elif ext == "timedelta":
        decoded = _timedelta(data.decode("ascii"))
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
    return decoded


def _zone(name: str) -> datetime.tzinfo:
    """Arrow's zone: a fixed offset (`+05:30`) or a name of the tz database."""
    if name[:1] in ("+", "-"):
        hours, _, minutes = name[1:].partition(":")
        offset = datetime.timedelta(hours=int(hours), minutes=int(minutes or 0))
        return datetime.timezone(offset if name[0] == "+" else -offset)
    import zoneinfo

    return zoneinfo.ZoneInfo(name)


def _datetime(text: str) -> Any:
    """`YYYY-MM-DDTHH:MM:SS.fraction`, then `+00:00[ZONE]` for an instant of a zone."""
    zone = None
    if text.endswith("]"):
        text, _, zone = text[:-1].partition("[")
    nanoseconds = len(text.split(".", 1)[1].split("+", 1)[0]) == 9
    if nanoseconds:
        try:
            import pandas
        except ImportError:
            import numpy as np

            return np.datetime64(text.split("+", 1)[0], "ns")
        stamp = pandas.Timestamp(text)
        return stamp.tz_convert(_zone(zone)) if zone else stamp
    value = datetime.datetime.fromisoformat(text)
    return value.astimezone(_zone(zone)) if zone else value


def _timedelta(text: str) -> Any:
    """`COUNT UNIT`, the unit `s`, `ms`, `us` or `ns`."""
    count, unit = text.split()
    if unit == "ns":
        try:
            import pandas
        except ImportError:
            import numpy as np

            return np.timedelta64(int(count), "ns")
        return pandas.Timedelta(int(count), unit="ns")
    name = {"s": "seconds", "ms": "milliseconds", "us": "microseconds"}[unit]
    return datetime.timedelta(**{name: int(count)})
