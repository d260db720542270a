"""The int8 prompt tiles' weight layout: KROWS weight rows interleaved a 32-bit lane each (see `int8`).

A group of KROWS rows is copied, per pass of `int8.matmul_i8` over the weights, into a scratch that every
activation tile of the pass reads, so the weights keep one layout (the decode kernels') and cost no memory:
Q4_K's nibbles and Q5_K's whole codes as 32-bit words (4 and 8 a block), Q6_K's codes as the tile reads
them (`_q6k_pair`), each row's sub-block scales as the tile's `vpmaddwd` pair or, with VNNI, a float32 lane,
and the float terms (the min term's -dmin · min, d) per row.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

_TARGET = isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402

ROWS = 8  # weight rows a 256-bit tile interleaves: one 32-bit lane each (`int8_blocks` too)
VNNI = _TARGET.vnni  # the avx512 path on a CPU with AVX-512 VNNI: 512-bit `vpdpbusd` tiles (`int8`)
KROWS = 16 if VNNI else ROWS  # weight rows the K-quant tiles interleave: a 32-bit lane each of their vectors
_JIT = dict(nogil=True, fastmath=True, cache=True)


@nb.njit(**_JIT)
def _interleave_q4k(qs32, sc, d, ndmin, mins, r0, wc32, wsc, wm, wd):
    """Weight rows r0 .. r0 + KROWS (rows past the end repeat row r0: their results are not kept) of a Q4_K or
    Q5_K weight split by `superblock.split_scales` (qs32 Q4_K's nibbles viewed as uint32 `[rows, cols / 8]`, or
    Q5_K's codes, `superblock.q5k_codes`, viewed as uint32 `[rows, cols / 4]`) → the tile's scratch: wc32 uint32
    `[nblocks · quads · KROWS]` (quads: 4 or 8 words a block), wsc int16 `[nblocks · 2 · KROWS]` (with VNNI
    viewed as float32 `[nblocks · KROWS]`), wm float32
    `[nblocks · KROWS]`, wd float32 `[nblocks / 8 · KROWS]`."""
    rows, nblocks = qs32.shape[0], sc.shape[1]
    wscf = wsc.view(np.float32)
    for r in range(KROWS):  # a row at a time through its own views: 1.3-1.5x faster than 2-D indexing
        row = r0 + r if r0 + r < rows else r0
        codes, scales, row_mins, row_ndmin, row_d = qs32[row], sc[row], mins[row], ndmin[row], d[row]
        for w in range(codes.shape[0]):  # word w: quad w % quads of block w // quads
            wc32[w * KROWS + r] = codes[w]
        for b in range(nblocks):
            if VNNI:  # a float32 lane
                wscf[KROWS * b + r] = np.float32(scales[b])
            else:  # twice for `vpmaddwd`'s pair
                wsc[2 * KROWS * b + 2 * r] = wsc[2 * KROWS * b + 2 * r + 1] = scales[b]
            wm[KROWS * b + r] = row_ndmin[b >> 3] * np.float32(row_mins[b])
        for s in range(nblocks // 8):
            wd[KROWS * s + r] = row_d[s]


_M4, _M2 = np.uint64(0x0F0F0F0F0F0F0F0F), np.uint64(0x0303030303030303)  # per byte: a nibble, 2 bits
_HI, _C32 = np.uint64(0x8080808080808080), np.uint64(0x2020202020202020)  # per byte: the top bit, 32


@nb.njit(**_JIT)
def _q6k_pair(words, b, i, packed):
    """Columns 8i..8i+7 of block b of a Q6_K row (words: its uint64 words) as the tile reads them, one byte each in a uint64: with VNNI
    the codes c (0..63), otherwise c - 32 as int8; from `superblock.pack_q6k`'s bytes (packed: 3 words a block,
    the low nibbles of columns 0-7 and 16-23, those of 8-15 and 24-31, then the top 2 bits, column 8a + p at
    bits 2a of byte p) or from `superblock.split_q6k`'s int8 codes c - 32 (4 words a block). The bytewise
    ± 32 goes through the top bit, so no carry or borrow crosses a byte."""
    if packed:
        nib = words[3 * b + i % 2] >> np.uint64(4 * (i // 2))
        top = words[3 * b + 2] >> np.uint64(2 * i)
        c = (nib & _M4) | ((top & _M2) << np.uint64(4))
        return c if VNNI else ((c | _HI) - _C32) ^ _HI
    w = words[4 * b + i]
    return ((w ^ _HI) + _C32) ^ _HI if VNNI else w


@nb.njit(**_JIT)
def _interleave_q6k(qs64, sc, d, r0, wc32, wsc, wd):
    """As `_interleave_q4k` for a Q6_K weight split by `superblock.split_q6k` (sc int8 `[rows, cols / 16]`; qs64
    its int8 codes c - 32 viewed as uint64 `[rows, cols / 8]`, or `superblock.pack_q6k`'s bytes viewed as uint64
    `[rows, cols · 3 / 32]`): wc32 uint32 `[nblocks · 8 · KROWS]` (`_q6k_pair`'s halves), wsc int16 `[nblocks ·
    4 · KROWS]` (the two halves' scales, as `vpmaddwd`'s pair or, with VNNI, as float32), wd as there."""
    rows, nblocks = qs64.shape[0], d.shape[1] * 8
    packed = qs64.shape[1] == 3 * nblocks
    wscf = wsc.view(np.float32)
    for r in range(KROWS):
        row = r0 + r if r0 + r < rows else r0
        words, scales, row_d = qs64[row], sc[row], d[row]
        for b in range(nblocks):
            for i in range(4):
                pair = _q6k_pair(words, b, i, packed)
                wc32[(8 * b + 2 * i) * KROWS + r] = np.uint32(pair & np.uint64(0xFFFFFFFF))
                wc32[(8 * b + 2 * i + 1) * KROWS + r] = np.uint32(pair >> np.uint64(32))
            for h in range(2):
                if VNNI:
                    wscf[2 * KROWS * b + KROWS * h + r] = np.float32(scales[2 * b + h])
                else:
                    wsc[4 * KROWS * b + 2 * KROWS * h + 2 * r] = wsc[4 * KROWS * b + 2 * KROWS * h + 2 * r + 1] = \
                        scales[2 * b + h]
        for s in range(nblocks // 8):
            wd[KROWS * s + r] = row_d[s]
