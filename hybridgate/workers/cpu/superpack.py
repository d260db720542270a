"""A K-quant weight's GGUF bytes → the arrays `superblock`'s kernels (and `int8`'s, `amx`'s) read: Q4_K's and
Q5_K's sub-block scales and mins split out, Q5_K's codes whole, Q6_K's codes in column order, and Q6_K's codes
packed to 6 bits (`pack_q6k`). Plain numpy, run once at load; the layouts are `superblock`'s docstring's.

Sources: ggml's `block_q4_K`, `block_q5_K`, `block_q6_K` (ggml-common.h) and `dequantize_row_q6_K` (ggml-quants.c).
"""

from __future__ import annotations

import numpy as np

from hybridgate.workers.cpu.blocks import LAYOUTS, Q5_K, _f16, _k4_scales
from hybridgate.workers.cpu.kquant import CODES

SUPER = 256  # columns per super-block: one activation scale, one float step


def split_scales(kind: int, data: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """A Q4_K or Q5_K weight's GGUF bytes uint8 `[rows, row_bytes]` → (sc uint8 `[rows, cols / 32]`, the 6-bit
    sub-block scales; d float32 `[rows, cols / 256]`; ndmin float32 `[rows, cols / 256]`, -dmin; mins uint8
    `[rows, cols / 32]`, the 6-bit sub-block mins: w = d·sc_b·c + ndmin·min_b)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // SUPER, LAYOUTS[kind].nbytes)
    sc, m = _k4_scales(blocks[:, :, 4:16])
    return (np.ascontiguousarray(sc.reshape(rows, -1)).astype(np.uint8), _f16(blocks, 0), -_f16(blocks, 2),
            np.ascontiguousarray(m.reshape(rows, -1)).astype(np.uint8))


def q5k_codes(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """A Q5_K weight's codes 0..31 int8 `[rows, cols]` in column order (low nibbles and the 5th bits of
    ggml's layout, `kquant.CODES`)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // SUPER, LAYOUTS[Q5_K].nbytes)
    return np.ascontiguousarray(CODES[Q5_K][0](blocks)).astype(np.int8).reshape(shape)


def split_q6k(data: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K weight's GGUF bytes uint8 `[rows, row_bytes]` → (codes c - 32 int8 `[rows, cols]` in column
    order, sc int8 `[rows, cols / 16]` (the signed sub-block scales), d float32 `[rows, cols / 256]`)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // SUPER, 210)
    ql = blocks[:, :, :128].reshape(rows, -1, 2, 64)  # per 128 columns: ql[64], then qh[32]
    qh = blocks[:, :, 128:192].reshape(rows, -1, 2, 32)
    lo, hi = ql[..., :32], ql[..., 32:]  # low nibbles: columns l, l + 32; high: l + 64, l + 96
    codes = np.concatenate([(lo & 15) | ((qh & 3) << 4), (hi & 15) | (((qh >> 2) & 3) << 4),
                            (lo >> 4) | (((qh >> 4) & 3) << 4), (hi >> 4) | (((qh >> 6) & 3) << 4)], axis=-1)
    sc = np.ascontiguousarray(blocks[:, :, 192:208].view(np.int8).reshape(rows, -1))
    return (codes.astype(np.int8) - np.int8(32)).reshape(shape), sc, _f16(blocks, 208)


def pack_q6k(codes: np.ndarray) -> np.ndarray:
    """Q6_K codes c - 32 int8 `[rows, cols]` in column order (`split_q6k`) → uint8 `[rows, cols · 3 / 4]`: per
    32-column block 16 bytes of the codes' low 4 bits (byte j: column j low, j + 16 high, Q4_1's order) and 8
    of their top 2 (byte p: columns p, p + 8, p + 16 and p + 24 at bits 0, 2, 4 and 6)."""
    rows, cols = codes.shape
    c = (codes.astype(np.int16) + 32).astype(np.uint8).reshape(rows, cols // 32, 32)
    low = c & 15
    high = (c >> 4).reshape(rows, cols // 32, 4, 8)
    top = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.ascontiguousarray(np.concatenate([low[:, :, :16] | (low[:, :, 16:] << 4), top], axis=2).reshape(rows, -1))


def unpack_q6k(qs: np.ndarray) -> np.ndarray:
    """`pack_q6k`'s bytes uint8 `[n, cols · 3 / 4]` → the codes c - 32 int8 `[n, cols]`."""
    blocks = qs.reshape(qs.shape[0], -1, 24)
    nibbles, top = blocks[:, :, :16], blocks[:, :, 16:]
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)
    high = np.concatenate([(top >> (2 * t)) & 3 for t in range(4)], axis=2)
    return ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(qs.shape[0], -1)
