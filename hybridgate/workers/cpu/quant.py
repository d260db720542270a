"""GGUF quant blocks in Numba: per-type row dequantizers and `[B, K] x W^T` matmuls.

Block layouts follow ggml (ggml/src/ggml-quants.c, ggml-common.h): each type
packs a fixed number of weights with fp16 scales. Numba has no float16, so
scales are decoded from their bits (`f16_to_f32`) or widened once at load.

`QuantMatrix` keeps a weight `[rows, cols]` in its GGUF bytes; `matmul(x, w)`
computes x @ w.T for activations x float32 `[batch, cols]`, reading each weight
row once for the whole batch (one pass over the weights per step): the row is
dequantized into a per-thread scratch of `cols` floats (L1-resident) and dotted
with every activation row. Q4_1 (the default model's linear layers) and Q8_0
(its embedding and LM head) have a fast path in `simd`, with the fp16 scales
split out and widened to float32 at load (Q4_1: 6 bits per weight).
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from hybridgate.workers.cpu.intdot import activation_format, matmul_i16  # noqa: E402
from hybridgate.workers.cpu.simd import matmul_blocks  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)

# GGML type ids (gguf.GGMLQuantizationType) and (weights per block, bytes per block).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K = 0, 1, 2, 3, 6, 7, 8, 12, 14
BLOCK = {F32: (1, 4), F16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24),
         Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}


@nb.njit(**_JIT)
def f16_to_f32(lo, hi):
    """IEEE half (little-endian bytes lo, hi) to float32, subnormals and inf/nan included."""
    h = np.uint32(lo) | (np.uint32(hi) << 8)
    sign = (h >> 15) & 1
    exp = (h >> 10) & 0x1F
    frac = h & 0x3FF
    if exp == 0:
        v = np.float32(frac) * np.float32(5.960464477539063e-08)  # 2**-24
    elif exp == 31:
        v = np.float32(np.inf) if frac == 0 else np.float32(np.nan)
    else:
        v = np.float32(1.0 + frac / 1024.0) * np.float32(2.0 ** (np.int32(exp) - 15))
    return -v if sign else v


@nb.njit(**_JIT)
def _u32(b, o):
    return np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8) | (np.uint32(b[o + 2]) << 16) | (np.uint32(b[o + 3]) << 24)


@nb.njit(**_JIT)
def dequant_row(kind, row, out):
    """Dequantize one row of GGUF blocks (uint8 bytes) into out float32 `[cols]`."""
    n = out.shape[0]
    if kind == F32:
        for i in range(n):
            out[i] = row[4 * i : 4 * i + 4].view(np.float32)[0]
    elif kind == F16:
        for i in range(n):
            out[i] = f16_to_f32(row[2 * i], row[2 * i + 1])
    elif kind == Q4_0:
        for blk in range(n // 32):
            o, y = blk * 18, blk * 32
            d = f16_to_f32(row[o], row[o + 1])
            for j in range(16):
                q = row[o + 2 + j]
                out[y + j] = d * (np.int32(q & 15) - 8)
                out[y + j + 16] = d * (np.int32(q >> 4) - 8)
    elif kind == Q4_1:
        for blk in range(n // 32):
            o, y = blk * 20, blk * 32
            d, m = f16_to_f32(row[o], row[o + 1]), f16_to_f32(row[o + 2], row[o + 3])
            for j in range(16):
                q = row[o + 4 + j]
                out[y + j] = d * np.float32(q & 15) + m
                out[y + j + 16] = d * np.float32(q >> 4) + m
    elif kind == Q5_0 or kind == Q5_1:
        size, off = (22, 2) if kind == Q5_0 else (24, 4)
        for blk in range(n // 32):
            o, y = blk * size, blk * 32
            d = f16_to_f32(row[o], row[o + 1])
            m = f16_to_f32(row[o + 2], row[o + 3]) if kind == Q5_1 else np.float32(0.0)
            qh = _u32(row, o + off)
            bias = 16 if kind == Q5_0 else 0
            for j in range(16):
                q = row[o + off + 4 + j]
                lo = np.int32(q & 15) | np.int32(((qh >> j) & 1) << 4)
                hi = np.int32(q >> 4) | np.int32(((qh >> (j + 12)) & 0x10))
                out[y + j] = d * (lo - bias) + m
                out[y + j + 16] = d * (hi - bias) + m
    elif kind == Q8_0:
        for blk in range(n // 32):
            o, y = blk * 34, blk * 32
            d = f16_to_f32(row[o], row[o + 1])
            for j in range(32):
                out[y + j] = d * np.float32(np.int8(row[o + 2 + j]))
    elif kind == Q4_K:
        for blk in range(n // 256):
            o, y = blk * 144, blk * 256
            d, dmin = f16_to_f32(row[o], row[o + 1]), f16_to_f32(row[o + 2], row[o + 3])
            sc = row[o + 4 : o + 16]
            qs = row[o + 16 : o + 144]
            for j in range(4):  # pairs of 32-weight sub-blocks share 32 bytes of nibbles
                s1, m1 = _scale_min_k4(2 * j, sc)
                s2, m2 = _scale_min_k4(2 * j + 1, sc)
                for l in range(32):
                    q = qs[32 * j + l]
                    out[y + 64 * j + l] = d * s1 * np.float32(q & 15) - dmin * m1
                    out[y + 64 * j + 32 + l] = d * s2 * np.float32(q >> 4) - dmin * m2
    elif kind == Q6_K:
        for blk in range(n // 256):
            o, y = blk * 210, blk * 256
            d = f16_to_f32(row[o + 208], row[o + 209])
            for half in range(2):
                ql = row[o + 64 * half : o + 64 * half + 64]
                qh = row[o + 128 + 32 * half : o + 128 + 32 * half + 32]
                sc = o + 192 + 8 * half
                yy = y + 128 * half
                for l in range(32):
                    i = l // 16
                    q1 = np.int32((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32
                    q2 = np.int32((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32
                    q3 = np.int32((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                    q4 = np.int32((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                    out[yy + l] = d * np.float32(np.int8(row[sc + i])) * q1
                    out[yy + l + 32] = d * np.float32(np.int8(row[sc + i + 2])) * q2
                    out[yy + l + 64] = d * np.float32(np.int8(row[sc + i + 4])) * q3
                    out[yy + l + 96] = d * np.float32(np.int8(row[sc + i + 6])) * q4


@nb.njit(**_JIT)
def _scale_min_k4(j, sc):
    if j < 4:
        return np.float32(sc[j] & 63), np.float32(sc[j + 4] & 63)
    s = (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4)
    m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
    return np.float32(s), np.float32(m)


_CHUNKS = 16  # row chunks per call: each thread allocates its scratch once per chunk, not per row


@nb.njit(parallel=True, **_JIT)
def matmul_rows(kind, x, w, out):
    """out float32 `[batch, rows]` = x `[batch, cols]` @ dequant(w `[rows, row_bytes]`).T."""
    rows, batch, cols = w.shape[0], x.shape[0], x.shape[1]
    per = (rows + _CHUNKS - 1) // _CHUNKS
    for c in prange(_CHUNKS):
        scratch = np.empty(cols, dtype=np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            dequant_row(kind, w[r], scratch)
            for b in range(batch):
                s = np.float32(0.0)
                for i in range(cols):
                    s += scratch[i] * x[b, i]
                out[b, r] = s


_KERNELS = {"f32": matmul_blocks, "i16": matmul_i16}


class QuantMatrix:
    """A weight `[rows, cols]` in its GGUF blocks; `matmul(x)` → x @ W.T (float32)."""

    activations = "f32"  # the row-dequantizing kernel multiplies float32 activations

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        if kind not in BLOCK:
            raise ValueError(f"tensor {name!r}: GGUF type {kind} has no CPU kernel")
        self.name, self.kind, self.data, self.shape = name, kind, np.ascontiguousarray(data), shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def matmul(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        matmul_rows(self.kind, x, self.data, out)
        return out

    def row(self, index: int) -> np.ndarray:
        out = np.empty(self.shape[1], dtype=np.float32)
        dequant_row(self.kind, self.data[index], out)
        return out


class Q41Matrix(QuantMatrix):
    """Q4_1 split: ggml's nibbles `[rows, cols / 2]` (16 bytes per block, byte j: columns j and
    j + 16) plus float32 scales and mins `[rows, cols / 32]`: 6 bits per weight; the GGUF bytes
    are not kept. Multiplied by `simd.matmul_blocks` (float32 activations) or
    `intdot.matmul_i16` (int16 activations), as `activations` resolves for this path."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)
        self.activations = activation_format(activations, "q4_1")
        self._kernel = _KERNELS[self.activations]
        rows, cols = shape
        blocks = np.ascontiguousarray(data).reshape(rows, cols // 32, 20)
        self.scale = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        self.minimum = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
        self.qs = np.ascontiguousarray(blocks[:, :, 4:]).reshape(rows, cols // 2)
        self.data = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes + self.minimum.nbytes

    def matmul(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        self._kernel(x, self.qs, self.scale, self.minimum, out)
        return out

    def row(self, index: int) -> np.ndarray:
        q = self.qs[index].reshape(-1, 16)
        codes = np.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)
        return (codes * self.scale[index][:, None] + self.minimum[index][:, None]).ravel()


class Q80Matrix(QuantMatrix):
    """Q8_0 split: int8 codes `[rows, cols]` and float32 scales `[rows, cols / 32]` (9 bits per weight).
    Multiplied by `simd.matmul_blocks` or `intdot.matmul_i16`, as for `Q41Matrix`."""

    def __init__(self, name: str, kind: int, data: np.ndarray, shape: tuple[int, int], activations: str = "auto"):
        super().__init__(name, kind, data, shape)
        self.activations = activation_format(activations, "q8_0")
        self._kernel = _KERNELS[self.activations]
        blocks = np.ascontiguousarray(data).reshape(shape[0], shape[1] // 32, 34)
        self.scale = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        self.qs = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(shape[0], shape[1])
        self.data = None

    @property
    def nbytes(self) -> int:
        return self.qs.nbytes + self.scale.nbytes

    def matmul(self, x: np.ndarray) -> np.ndarray:
        out = np.empty((x.shape[0], self.shape[0]), dtype=np.float32)
        self._kernel(x, self.qs, self.scale, self.scale, out)
        return out

    def row(self, index: int) -> np.ndarray:
        return self.rows(np.array([index]))[0]

    def rows(self, index: np.ndarray) -> np.ndarray:
        """Dequantized rows float32 `[len(index), cols]` (the embedding lookup)."""
        q = self.qs[index].astype(np.float32).reshape(len(index), -1, 32)
        return (q * self.scale[index][:, :, None]).reshape(len(index), -1)


_FAST = {Q4_1: Q41Matrix, Q8_0: Q80Matrix}


def quant_matrix(name: str, kind: int, data: np.ndarray, shape: tuple[int, int],
                 activations: str = "auto") -> QuantMatrix:
    """The matrix class for `kind`: repacked fast paths for Q4_1 and Q8_0 (their activation format
    from `activations`, see `intdot.activation_format`), row dequantization otherwise."""
    return _FAST.get(kind, QuantMatrix)(name, kind, data, shape, activations)


def concat_rows(name: str, parts: list[tuple[int, np.ndarray, tuple[int, int]]],
                activations: str = "auto") -> QuantMatrix | None:
    """One matrix of several weights with the same type and columns, rows stacked (fused Q/K/V, gate/up)."""
    kinds = {k for k, _, _ in parts}
    cols = {s[1] for _, _, s in parts}
    if len(kinds) != 1 or len(cols) != 1:
        return None
    data = np.concatenate([np.ascontiguousarray(d) for _, d, _ in parts], axis=0)
    return quant_matrix(name, kinds.pop(), data, (sum(s[0] for _, _, s in parts), cols.pop()), activations)
