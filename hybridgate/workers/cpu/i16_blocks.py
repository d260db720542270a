"""Prompt matmuls of Q8_0 with int16 activations on the avx512 path: weight rows interleaved a 32-bit lane each.

A Q8_0 prompt on `intdot.matmul_i16` (the decode kernel's GEMM tiles) takes, per block, weight row and activation
row, one `vpmaddwd` (32 products into 16 lanes, each lane a part of the row's block), a convert, a multiply and
an FMA, then a lane tree per output: four operations per 32 products. int8 activations would halve the
multiplies, but on Q8_0 they measured over `auto`'s accuracy floor (mean KL 1.0-1.1e-3 against 5e-4 on the
default model: `kernel_table.OPT_IN_I8`), so this kernel keeps `intdot`'s int16 activations (per 32 columns,
xs = max|x_b| / 32767: the decode kernel's rounding) and changes the layout instead, as `int8_blocks` does:
16 weight rows are interleaved into a scratch once a pass, lane r of every vector holding two consecutive int16
codes of row r, and an activation row's pair of int16 is broadcast to every lane. A block is then 16
`vpdpwssd` (with VNNI; `vpmaddwd` and an add without) into one int32 lane per weight row, and one float step
for the 16 rows: out_r += float(P_rb) · (d_rb · xs_b), with no lane tree. That is 20 operations per 512
products instead of 64.

Integers: |P_rb| = |Σ_j w_rj · xq_j| ≤ 32 · 128 · 32767 < 2^28, exact in int32 (two chains a row against the
latency, added once); its convert to float32 rounds above 2^24 (at most 2^-24 of |P|), where `intdot`'s lanes
(two products each) convert exactly. So a prompt row's bits differ from the decode kernel's (as every prompt
kernel's do: `kernel_table`, "Prompt kernels and a stream's continuity"), by float32 rounding, and do not depend
on the row's batch (every activation row runs the same operations).

Error: the activations' rounding, at most xs_b / 2 = max|x_b| / 65534 per element, as the decode kernel's.

Sources: ggml's `block_q8_0` (ggml-common.h); Intel's intrinsics guide for `vpdpwssd`, `vpmaddwd`; the
interleaved rows of `int8_blocks` (ik_llama.cpp's `_R8` idea, read, not copied).
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba.core import cgutils  # noqa: E402

from hybridgate.workers.cpu.int8 import _broadcast4  # noqa: E402
from hybridgate.workers.cpu.int8_blocks import prompt_rows  # noqa: E402
from hybridgate.workers.cpu.intdot import _quantize_row  # noqa: E402
from hybridgate.workers.cpu.superblock import _dot  # noqa: E402
from hybridgate.workers.cpu.tilegen import _fma, _load_vec, _splat, tile_intrinsic  # noqa: E402

BLOCK = 32
ROWS = 16  # weight rows a tile interleaves: one 32-bit lane each of a 512-bit vector
PAIRS = BLOCK // 2  # code pairs (one 32-bit lane) a block
TILE_X = 4  # activation rows a tile multiplies: 2 int32 chains and a float total each
X_BYTES = 4 * 1024 * 1024  # int16 activations of one pass over the weights: each group is interleaved once a pass
_CHUNKS = 16
_I16, _I32 = ir.IntType(16), ir.IntType(32)
_VS = ir.VectorType(_I16, 2 * ROWS)
_VI = ir.VectorType(_I32, ROWS)
_VF = ir.VectorType(ir.FloatType(), ROWS)

_TILE_ARGS = ("wc", "wd", "nblocks", "xq", "x_off", "x_stride", "xs", "a_off", "a_stride", "out", "o_off", "o_stride")


def _make_tile(xrows: int):
    """An intrinsic: ROWS interleaved Q8_0 weight rows times `xrows` int16 activation rows.

    f(wc, wd, nblocks, xq, x_off, x_stride, xs, a_off, a_stride, out, o_off, o_stride) writes
    out[o_off + k·o_stride + r] = Σ_b float(P_rkb) · (d_rb · xs_kb) in block order, for the weight rows r < ROWS and
    activation rows k < xrows: wc int16 `[nblocks · PAIRS · ROWS · 2]` (`_interleave`), wd float32 `[nblocks · ROWS]`
    (d_rb), xq int16 (row k at x_off + k·x_stride, columns in order), xs float32 at a_off + k·a_stride + b.
    """
    return tile_intrinsic(f"i16_q8_0_tile{ROWS}x{xrows}", _TILE_ARGS, lambda arg: xrows, _emit_tile)


def _emit_tile(t, xrows):
    """`_make_tile`'s body: per block the integer sums, two chains a row, then its float step."""
    builder, c = t.builder, t.c
    zero_i, zero_f = ir.Constant(_VI, [0] * ROWS), ir.Constant(_VF, [0.0] * ROWS)
    total = [cgutils.alloca_once_value(builder, zero_f) for _ in range(xrows)]
    with t.loop(t["nblocks"]) as blk:
        sums = [[zero_i, zero_i] for _ in range(xrows)]
        for p in range(PAIRS):
            at = builder.mul(builder.add(builder.mul(blk, c(PAIRS)), c(p)), c(2 * ROWS))
            w = _load_vec(builder, t.ptr("wc", at), _VS, 2)
            for k in range(xrows):
                x_at = builder.add(t.row("x_off", "x_stride", k), builder.add(builder.mul(blk, c(BLOCK)), c(2 * p)))
                x = builder.bitcast(_broadcast4(builder, builder.bitcast(t.ptr("xq", x_at), ir.IntType(8).as_pointer()),
                                                ROWS), _VS)
                sums[k][p % 2] = _dot(builder, sums[k][p % 2], w, x)
        d = _load_vec(builder, t.ptr("wd", builder.mul(blk, c(ROWS))), _VF, 4)
        for k in range(xrows):
            step = builder.fmul(d, _splat(builder, builder.load(t.at("xs", "a_off", "a_stride", k, blk)), _VF))
            p_rk = builder.sitofp(builder.add(*sums[k]), _VF)
            builder.store(_fma(builder, p_rk, step, builder.load(total[k])), total[k])
    for k in range(xrows):
        dst = t.ptr("out", t.row("o_off", "o_stride", k))
        builder.store(builder.load(total[k]), builder.bitcast(dst, _VF.as_pointer()), align=4)
    return t.context.get_dummy_value()


tile_x, tile_1 = _make_tile(TILE_X), _make_tile(1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # no fast-math flags on the float steps (as `int8`)


@nb.njit(**_JIT)
def _interleave(nblocks, qs, scale, r0, wide, wc32, wd):
    """Weight rows r0 .. r0 + ROWS (rows past the end repeat row r0: their results are not kept) → the tile's
    scratch: qs int8 codes `[rows, ≥ nblocks · 32]`, scale float32 `[rows, ≥ nblocks]`; wide int16 `[nblocks · 32]`
    a row's codes widened; wc32 uint32 `[nblocks · PAIRS · ROWS]` (lane r of pair p of block b: codes 2p and 2p + 1
    of row r's block b, as two int16), wd float32 `[nblocks · ROWS]`."""
    rows = qs.shape[0]
    pairs = wide.view(np.uint32)
    for r in range(ROWS):
        row = r0 + r if r0 + r < rows else r0
        codes = qs[row]
        for j in range(nblocks * BLOCK):
            wide[j] = codes[j]
        for w in range(nblocks * PAIRS):
            wc32[w * ROWS + r] = pairs[w]
        for b in range(nblocks):
            wd[ROWS * b + r] = scale[row, b]


@nb.njit(**_TILE_JIT)
def _tiles(wc, wd, nblocks, xq, xs, out, r0, b0, b1, tmp):
    """One interleaved group's ROWS rows (from r0) against activation rows b0 .. b1; a group past the weight's last
    row goes through tmp float32 `[TILE_X, ROWS]` and keeps only its rows."""
    rows, cols = out.shape[1], xq.shape[1]
    full = r0 + ROWS <= rows
    b = b0
    while b < b1:
        xr = TILE_X if b + TILE_X <= b1 else 1
        dst, off, stride = (out, b * rows + r0, rows) if full else (tmp, 0, ROWS)
        if xr == TILE_X:
            tile_x(wc, wd, nblocks, xq, b * cols, cols, xs, b * nblocks, nblocks, dst, off, stride)
        else:
            tile_1(wc, wd, nblocks, xq, b * cols, cols, xs, b * nblocks, nblocks, dst, off, stride)
        if not full:
            for k in range(xr):
                for r in range(rows - r0):
                    out[b + k, r0 + r] = tmp[k, r]
        b += xr


@nb.njit(parallel=True, **_JIT)
def matmul_q8_0(x, qs, scale, out, x_bytes=X_BYTES):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T for a Q8_0 weight (qs int8 codes `[rows, cols]`,
    scale float32 `[rows, cols / 32]`), x quantized to int16 per 32 columns (`intdot._quantize_row`). cols: a multiple
    of 32; x_bytes: the int16 activations of one pass over the weights (each group of ROWS rows is interleaved once a
    pass). Error: the activations' rounding, at most max|x_b| / 65534 per element."""
    batch, cols = x.shape
    nblocks = cols // BLOCK
    xq = np.empty((batch, cols), dtype=np.int16)
    xs = np.empty((batch, nblocks), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    for k in prange(batch):
        _quantize_row(x, k, xq, xs, xsum)
    rows = qs.shape[0]
    groups = (rows + ROWS - 1) // ROWS
    per = (groups + _CHUNKS - 1) // _CHUNKS
    x_tile = max(TILE_X, x_bytes // (2 * cols) // TILE_X * TILE_X)
    for b0 in range(0, batch, x_tile):
        b1 = min(batch, b0 + x_tile)
        for chunk in prange(_CHUNKS):
            wide = np.empty(nblocks * BLOCK, dtype=np.int16)
            wc32 = np.empty(nblocks * PAIRS * ROWS, dtype=np.uint32)
            wd = np.empty(nblocks * ROWS, dtype=np.float32)
            tmp = np.empty((TILE_X, ROWS), dtype=np.float32)
            for g in range(chunk * per, min(groups, (chunk + 1) * per)):
                _interleave(nblocks, qs, scale, ROWS * g, wide, wc32, wd)
                _tiles(wc32.view(np.int16), wd, nblocks, xq, xs, out, ROWS * g, b0, b1, tmp)


def multiply_q8_0(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, scale: np.ndarray,
                  *unread_and_out: np.ndarray) -> None:
    """out[rows] = x[rows] @ W.T by `matmul_q8_0` (the prompt kernel's signature, as `int8_blocks.multiply_q8_0`:
    `quant.Q80Matrix._prompt_arrays` (qs, scale, ...), out last): qs int8 codes `[n, cols]`, scale float32 `[n, cols /
    32]`; rows int64 `[m]`, m ≥ 1, ascending; out float32 `[batch, n]`. Raises ValueError when cols is not a multiple
    of 32 (`int8_blocks.prompt_rows`)."""
    prompt_rows(matmul_q8_0, x, rows, unread_and_out[-1], (), (qs, scale))
