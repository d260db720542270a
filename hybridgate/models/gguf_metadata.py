"""The metadata of a GGUF file alone, read in one pass: for vocabulary-only files and tokenizers.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian
versions 2 and 3): magic `GGUF`, uint32 version, uint64 tensor count, uint64
key-value count, then each key (uint64 length + UTF-8) with its uint32 value
type and value; an array is a uint32 element type, a uint64 count and the
elements. Why not `gguf.GGUFReader`: it builds numpy views for every string
of every array (and its tensor table), 10-70 s on these machines for the
vocabularies of llama.cpp's test data (128,000-256,000 tokens plus merges) where
this walk takes about a second; `load_gguf` keeps GGUFReader, behind its cache.
Values come out as `GGUFReader`'s `field.contents()` gives them: Python
scalars, `str`, lists.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from hybridgate.models.gguf_file import ModelLoadError

# Value type -> (struct format, numpy dtype) of the fixed-width types.
_SCALARS = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    return buf[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _array(buf: bytes, pos: int, key: str) -> tuple[list, int]:
    kind, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if kind == GGUFValueType.STRING:
        out = []
        for _ in range(count):
            s, pos = _string(buf, pos)
            out.append(s)
        return out, pos
    if kind not in _SCALARS:
        raise ModelLoadError(f"GGUF metadata {key!r}: arrays of value type {kind} are not readable here")
    dtype = np.dtype(_SCALARS[GGUFValueType(kind)][1]).newbyteorder("<")
    end = pos + count * dtype.itemsize
    return np.frombuffer(buf[pos:end], dtype=dtype).tolist(), end


def _value(buf: bytes, pos: int, kind: int, key: str) -> tuple[Any, int]:
    if kind == GGUFValueType.STRING:
        return _string(buf, pos)
    if kind == GGUFValueType.ARRAY:
        return _array(buf, pos, key)
    if kind not in _SCALARS:
        raise ModelLoadError(f"GGUF metadata {key!r}: unknown value type {kind}")
    fmt = _SCALARS[GGUFValueType(kind)][0]
    return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF file at `path` and its value, unvalidated.

    Raises:
        ModelLoadError: the file is missing, is not GGUF (named), is a version
            other than 2 or 3, or is cut short or malformed (the key named).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, _, count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported (supported: 2, 3, little-endian)")
        out: dict[str, Any] = {}
        pos, key = 24, "(header)"
        try:
            for _ in range(count):
                key, pos = _string(buf, pos)
                (kind,) = struct.unpack_from("<I", buf, pos)
                out[key], pos = _value(buf, pos + 4, kind, key)
        except ModelLoadError:
            raise
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: malformed GGUF metadata at key {key!r} ({exc})") from exc
    return out
