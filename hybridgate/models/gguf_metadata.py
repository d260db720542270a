"""The metadata of a GGUF file alone, read in one pass: for vocabulary-only files and tokenizers.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (little-endian
versions 2 and 3): magic `GGUF`, uint32 version, uint64 tensor count, uint64
key-value count, then each key (uint64 length + UTF-8) with its uint32 value
type and value; an array is a uint32 element type, a uint64 count and the
elements. Why not `gguf.GGUFReader`: it builds numpy views for every string
of every array (and its tensor table), 10-70 s on these machines for the
vocabularies of llama.cpp's test data (128,000-256,000 tokens plus merges) where
this walk takes about a second. `read_header` adds the tensor table (each
tensor's name, uint32 dimension count, uint64 dimensions innermost first, uint32
type, uint64 offset from the data section, which starts at the next multiple of
`general.alignment`, default 32): `load_gguf` reads a file's header with it the
first time (before, with GGUFReader: 24 s of CPU for Gemma 3 270M's header), then
from its cache. Values come out as `GGUFReader`'s `field.contents()` gives them:
Python scalars, `str`, lists.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType


class ModelLoadError(ValueError):
    """A model file is missing, malformed, or uses something this project does not support (also
    `hybridgate.models.ModelLoadError`)."""


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


# One tensor of the table: (name, GGML type, shape row-major (outermost first), file offset, bytes).
TensorInfo = tuple[str, int, list[int], int, int]


def read_metadata(path: str | Path) -> dict[str, Any]:
    """Every metadata key of the GGUF file at `path` and its value, unvalidated.

    Raises:
        ModelLoadError: the file is missing, is not GGUF (named), is a version
            other than 2 or 3, or is cut short or malformed (the key named).
    """
    return read_header(path, tensors=False)[0]


def read_header(path: str | Path, tensors: bool = True) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensor table) of the GGUF file at `path` (the table empty unless `tensors`); each
    tensor's offset is from the file's start, its bytes from its type's block size (gguf's
    GGML_QUANT_SIZES). Unvalidated beyond what reading needs: `load_gguf` checks types and shapes.

    Raises:
        ModelLoadError: the file is missing, is not GGUF (named), is a version
            other than 2 or 3, or is cut short or malformed (the key or tensor named), or a
            tensor's type is unknown (named).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"model file {str(path)!r} does not exist")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, count = struct.unpack_from("<IQQ", buf, 4)
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
            raise ModelLoadError(f"{path}: truncated or malformed GGUF metadata at key {key!r} ({exc})") from exc
        infos = _tensor_table(buf, pos, n_tensors, int(out.get("general.alignment", 32)), path) if tensors else []
    return out, infos


def _tensor_table(buf, pos: int, count: int, alignment: int, path: Path) -> list[TensorInfo]:
    rows, name = [], "(table)"
    try:
        for _ in range(count):
            name, pos = _string(buf, pos)
            (dims,) = struct.unpack_from("<I", buf, pos)
            shape = list(struct.unpack_from(f"<{dims}Q", buf, pos + 4))[::-1]
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            rows.append((name, kind, shape, offset))
    except (struct.error, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: truncated or malformed GGUF tensor table at tensor {name!r} ({exc})") from exc
    start = -(-pos // alignment) * alignment
    out = []
    for name, kind, shape, offset in rows:
        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"tensor {name!r}: unknown GGUF tensor type {kind}") from None
        out.append((name, kind, shape, start + offset, int(np.prod(shape, dtype=np.int64)) // block * size))
    return out
