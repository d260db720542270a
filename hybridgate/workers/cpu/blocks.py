"""GGUF block layouts as data, their scales widened once at load, and per-type row dequantizers.

Every quantized type here stores a weight as `w = s · c + m` or `w = s · (c - bias)`,
with an integer code c packed in the block and a float scale s (and min m) per
sub-block of 16 or 32 weights, itself stored in fp16 or, for the K-quants, as 6- or
8-bit sub-scales of fp16 super-block scales. `unpack_scales` turns those into float32
`[rows, cols / sub]` arrays once, when a matrix is built (numpy), so the per-row
kernels (`dequant_row`, Numba) only extract codes: no fp16 decode and no sub-scale
unpacking per row read.

Layouts (ggml's ggml-common.h; dequantizers in ggml-quants.c `dequantize_row_*`):

    type  weights bytes  layout of one block                               w
    Q4_0     32    18    d f16, qs[16] (byte j: col j low, j+16 high)       d·(c-8)
    Q4_1     32    20    d, m f16, qs[16]                                   d·c + m
    Q5_0     32    22    d, qh u32 (bit j: col j's 5th bit), qs[16]         d·(c-16)
    Q5_1     32    24    d, m, qh u32, qs[16]                               d·c + m
    Q8_0     32    34    d, qs[32] int8                                     d·c
    Q4_K    256   144    d, dmin f16, scales[12] (8 × 6-bit sc, 6-bit m),   d·sc·c - dmin·m
                         qs[128] (32 bytes per 64 cols: sub-block 2i low, 2i+1 high)
    Q5_K    256   176    as Q4_K, then qh[32] (bit 2i / 2i+1 of byte l: 5th bit of
                         col l of sub-block 2i / 2i+1), then qs[128]
    Q6_K    256   210    ql[128], qh[64], scales[16] int8, d f16            d·sc·(c-32)
                         (per 128 cols: ql low nibbles, then high; qh 2 bits each)
    MXFP4    32    17    e u8 (E8M0), qs[16] (byte j: col j low, j+16 high)  2^(e-127)·E2M1(c)
    F32/F16/BF16   one value per element (bf16: a float32's top 16 bits)

MXFP4 is the OCP Microscaling format (OCP MX v1.0, 2023): 4-bit E2M1 codes (sign, 2 exponent
bits, 1 mantissa bit: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6) sharing one E8M0 scale 2^(e-127) per
32. ggml (ggml-common.h `block_mxfp4`, ggml-quants.c `dequantize_row_mxfp4`) multiplies its doubled
table `kvalues_mxfp4` {0, 1, 2, 3, 4, 6, 8, 12, ...} by half the scale (`GGML_E8M0_TO_FP32_HALF`),
the same values; so do `unpack_scales` (scale = 2^(e-128), e = 0 and 1 as float32 subnormals) and
`_mxfp4_row`. The spec makes e = 255 a NaN scale; ggml gives it no special meaning (2^128), nor here.

The reference in the tests is gguf's own dequantizer (`gguf.quants.dequantize`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)

# GGML type ids (gguf.GGMLQuantizationType).
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16, MXFP4 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30, 39
# ggml's `kvalues_mxfp4`: E2M1 code c (bit 3 the sign) → twice its value, an integer.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)


@dataclass(frozen=True)
class Layout:
    """One GGUF type: weights and bytes per block, weights per sub-block scale (0: no scales), where
    its fp16 scale d (and min) sit in a block (-1: none), and whether it has a per-sub-block min."""

    name: str
    weights: int
    nbytes: int
    sub: int
    d_at: int
    has_min: bool


LAYOUTS = {k: Layout(*v) for k, v in {
    F32: ("F32", 1, 4, 0, -1, False), F16: ("F16", 1, 2, 0, -1, False), BF16: ("BF16", 1, 2, 0, -1, False),
    Q4_0: ("Q4_0", 32, 18, 32, 0, False), Q4_1: ("Q4_1", 32, 20, 32, 0, True),
    Q5_0: ("Q5_0", 32, 22, 32, 0, False), Q5_1: ("Q5_1", 32, 24, 32, 0, True),
    Q8_0: ("Q8_0", 32, 34, 32, 0, False), Q4_K: ("Q4_K", 256, 144, 32, 0, True),
    Q5_K: ("Q5_K", 256, 176, 32, 0, True), Q6_K: ("Q6_K", 256, 210, 16, 208, False),
    MXFP4: ("MXFP4", 32, 17, 32, -1, False),
}.items()}
BLOCK = {k: (v.weights, v.nbytes) for k, v in LAYOUTS.items()}  # (weights, bytes) per block


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of every block, float32 `[rows, blocks]`."""
    return blocks[:, :, at : at + 2].copy().view(np.float16)[:, :, 0].astype(np.float32)


def _k4_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of sub-scales → (sc, m) uint8 `[..., 8]` (ggml-quants.c get_scale_min_k4)."""
    lo = np.concatenate([sc[..., 0:4] & 63, (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)], axis=-1)
    hi = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], axis=-1)
    return lo, hi


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """Half the E8M0 scale of each uint8 exponent byte, 2^(e - 128) as float32 (exact; e = 0 and 1 subnormal), as
    ggml's doubled codes take it (`GGML_E8M0_TO_FP32_HALF`)."""
    return np.ldexp(np.float32(1.0), e.astype(np.int32) - 128).astype(np.float32)


def unpack_scales(kind: int, data: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(scale, minimum) float32 `[rows, cols / sub]` of a `[rows, row_bytes]` uint8 weight of type
    `kind` (`LAYOUTS`); minimum is `[rows, 1]` of zeros for a type without one, and both are
    `[rows, 1]` for F32/F16/BF16. Raises ValueError when cols is not a whole number of blocks."""
    lay = LAYOUTS[kind]
    rows, cols = shape
    if cols % lay.weights:
        raise ValueError(f"{lay.name} weight of {cols} columns: not a multiple of its block, {lay.weights}")
    if lay.sub == 0:
        return np.zeros((rows, 1), np.float32), np.zeros((rows, 1), np.float32)
    blocks = np.ascontiguousarray(data).reshape(rows, cols // lay.weights, lay.nbytes)
    if kind == MXFP4:
        return e8m0_half(blocks[:, :, 0]), np.zeros((rows, 1), np.float32)
    d = _f16(blocks, lay.d_at)
    if kind in (Q4_K, Q5_K):
        sc, m = _k4_scales(blocks[:, :, 4:16])
        scale = (d[:, :, None] * sc).reshape(rows, -1)
        minimum = -(_f16(blocks, 2)[:, :, None] * m).reshape(rows, -1)
        return scale.astype(np.float32), minimum.astype(np.float32)
    if kind == Q6_K:
        sc = blocks[:, :, 192:208].view(np.int8).astype(np.float32)
        return (d[:, :, None] * sc).reshape(rows, -1).astype(np.float32), np.zeros((rows, 1), np.float32)
    minimum = _f16(blocks, 2) if lay.has_min else np.zeros((rows, 1), np.float32)
    return d, minimum


@nb.njit(**_JIT)
def _u32(b, o):
    return np.uint32(b[o]) | (np.uint32(b[o + 1]) << 8) | (np.uint32(b[o + 2]) << 16) | (np.uint32(b[o + 3]) << 24)


@nb.njit(**_JIT)
def _float_row(kind, row, out):
    """F32, F16 (exact for every value, subnormals, inf and NaN included) and BF16 into out."""
    n = out.shape[0]
    if kind == F32:
        out[:] = row[: 4 * n].view(np.float32)
        return
    half = row[: 2 * n].view(np.uint16)
    bits = out.view(np.uint32)
    if kind == BF16:
        for i in range(n):
            bits[i] = np.uint32(half[i]) << 16
        return
    for i in range(n):  # binary16's exponent and mantissa into float32's places, rescaled by 2^112
        bits[i] = (np.uint32(half[i]) & 0x7FFF) << 13
    for i in range(n):
        out[i] *= np.float32(5.192296858534828e33)  # 2^112: subnormals come out right through the multiply
    for i in range(n):
        h = np.uint32(half[i])
        inf_nan = np.uint32(0x7F800000) if (h & 0x7FFF) >= 0x7C00 else np.uint32(0)
        bits[i] = bits[i] | inf_nan | ((h & 0x8000) << 16)


@nb.njit(**_JIT)
def _q4_row(kind, row, s, m, out):
    """Q4_0 (w = d·(c-8)) and Q4_1 (w = d·c + m)."""
    size, at = (18, 2) if kind == Q4_0 else (20, 4)
    for b in range(out.shape[0] // 32):
        o, y, d = b * size + at, b * 32, s[b]
        mb = m[b] if kind == Q4_1 else np.float32(-8.0) * d
        for j in range(16):
            q = row[o + j]
            out[y + j] = d * np.float32(q & 15) + mb
            out[y + j + 16] = d * np.float32(q >> 4) + mb


@nb.njit(**_JIT)
def _q5_row(kind, row, s, m, out):
    """Q5_0 (w = d·(c-16)) and Q5_1 (w = d·c + m): 4 low bits in qs, the 5th in qh."""
    size, at = (22, 2) if kind == Q5_0 else (24, 4)
    for b in range(out.shape[0] // 32):
        o, y, d = b * size + at, b * 32, s[b]
        mb = m[b] if kind == Q5_1 else np.float32(-16.0) * d
        qh = _u32(row, o)
        for j in range(16):
            q = np.uint32(row[o + 4 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            out[y + j] = d * np.float32(lo) + mb
            out[y + j + 16] = d * np.float32(hi) + mb


@nb.njit(**_JIT)
def _q8_row(row, s, out):
    for b in range(out.shape[0] // 32):
        o, y, d = b * 34 + 2, b * 32, s[b]
        for j in range(32):
            out[y + j] = d * np.float32(np.int8(row[o + j]))


@nb.njit(**_JIT)
def _k4_row(kind, row, s, m, out):
    """Q4_K and Q5_K: per 64 columns 32 bytes of nibbles (sub-block 2i low, 2i+1 high); Q5_K's 5th
    bits at bit 2i / 2i+1 of qh[l]. s, m: the 8 sub-blocks' d·sc and -dmin·m per super-block."""
    size, at = (144, 16) if kind == Q4_K else (176, 48)
    for b in range(out.shape[0] // 256):
        o, y = b * size, b * 256
        for i in range(4):
            d1, m1, d2, m2 = s[8 * b + 2 * i], m[8 * b + 2 * i], s[8 * b + 2 * i + 1], m[8 * b + 2 * i + 1]
            for l in range(32):
                q = np.uint32(row[o + at + 32 * i + l])
                lo, hi = q & 15, q >> 4
                if kind == Q5_K:
                    h = np.uint32(row[o + 16 + l])
                    lo |= ((h >> (2 * i)) & 1) << 4
                    hi |= ((h >> (2 * i + 1)) & 1) << 4
                out[y + 64 * i + l] = d1 * np.float32(lo) + m1
                out[y + 64 * i + 32 + l] = d2 * np.float32(hi) + m2


@nb.njit(**_JIT)
def _q6k_row(row, s, out):
    """Q6_K: per 128 columns ql[64] (low nibbles of cols l and l+64 / l+32 and l+96), qh[32] (2 bits
    of each of the four); s: d·sc per 16 columns in column order; w = s·(c - 32)."""
    for b in range(out.shape[0] // 256):
        o, y = b * 210, b * 256
        for half in range(2):
            ql, qh, yy, sb = o + 64 * half, o + 128 + 32 * half, y + 128 * half, 16 * b + 8 * half
            for l in range(32):
                a, c, h = np.int32(row[ql + l]), np.int32(row[ql + l + 32]), np.int32(row[qh + l])
                i = sb + l // 16
                out[yy + l] = s[i] * np.float32(((a & 15) | ((h & 3) << 4)) - 32)
                out[yy + l + 32] = s[i + 2] * np.float32(((c & 15) | (((h >> 2) & 3) << 4)) - 32)
                out[yy + l + 64] = s[i + 4] * np.float32(((a >> 4) | (((h >> 4) & 3) << 4)) - 32)
                out[yy + l + 96] = s[i + 6] * np.float32(((c >> 4) | (((h >> 6) & 3) << 4)) - 32)


@nb.njit(**_JIT)
def _mxfp4_row(row, s, out):
    """MXFP4: w = s · MXFP4_VALUES[c], s half the block's E8M0 scale; byte j holds columns j (low) and j + 16."""
    for b in range(out.shape[0] // 32):
        o, y, d = b * 17 + 1, b * 32, s[b]
        for j in range(16):
            q = row[o + j]
            out[y + j] = d * MXFP4_VALUES[q & 15]
            out[y + j + 16] = d * MXFP4_VALUES[q >> 4]


@nb.njit(**_JIT)
def dequant_row(kind, row, s, m, out):
    """One row of GGUF blocks into out float32 `[cols]`.

    kind: a `LAYOUTS` key; row: the row's uint8 bytes; s, m: its float32 scales and mins from
    `unpack_scales` (ignored by F32/F16/BF16)."""
    if kind == F32 or kind == F16 or kind == BF16:
        _float_row(kind, row, out)
    elif kind == Q4_0 or kind == Q4_1:
        _q4_row(kind, row, s, m, out)
    elif kind == Q5_0 or kind == Q5_1:
        _q5_row(kind, row, s, m, out)
    elif kind == Q8_0:
        _q8_row(row, s, out)
    elif kind == Q4_K or kind == Q5_K:
        _k4_row(kind, row, s, m, out)
    elif kind == MXFP4:
        _mxfp4_row(row, s, out)
    else:
        _q6k_row(row, s, out)
