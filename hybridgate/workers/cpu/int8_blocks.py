"""Prompt matmuls with int8 activations for the 32-column block types: Q8_0, Q5_0, Q4_0, Q4_1 and MXFP4.

`int8`'s idea (Q4_K and Q6_K) on the types with one float scale per 32 columns: activations int8 per 32
columns (`int8._quantize_row`: xs_b = max|x_b| / 127, xsum_b = xs_b · Σ xq_b), eight weight rows
interleaved per group into a scratch once a pass (4 bytes of each row in one 32-bit lane), an activation
row's 4 bytes broadcast to every lane, `vpmaddubsw` (32 byte products into 16 int16 pair sums) and one
float step per block for 8 rows at once: out_r += float(P_rb) · (d_rb · xs_b) [+ m_rb · xsum_b].

- Q8_0 (codes -128..127, as `quant.Q80Matrix` holds them) and Q5_0 (codes c - 16 in -16..15, as
  `quant.Q50Matrix` holds them): `vpmaddubsw(|w|, sign(x, w))` (`vpsignb`) is w · x pair-summed; |w| is 128
  for w = -128, which `vpmaddubsw` reads as the unsigned byte 128, so a pair sum is at most
  2 · 128 · 127 = 32,512 < 2^15 (exact, unsaturated), but two of them may not add in int16: each quad's
  pair sums are widened by a `vpmaddwd` with ones (Q8_0: 8 `vpmaddubsw` and 8 `vpmaddwd` per block).
  Q5_0's pair sums are at most 2 · 16 · 127 = 4,064 and a block's 8 quads sum to at most 32,512 in int16:
  one `vpmaddwd` per block.
- Q4_0 and Q4_1 (codes 0..15 in Q4_1's nibble order, `quant.Q41Matrix`: byte j of a block is column j low,
  j + 16 high; Q4_0's minimum is -8 · d): `vpmaddubsw(code, x)` on the low and high nibbles, pair sums at
  most 2 · 15 · 127 = 3,810, the block's 8 summed in int16 at most 30,480 < 2^15: one `vpmaddwd` per
  block, and the minimum's term m_rb · xsum_b per block (w = d·c + m).
- MXFP4 (OCP MX v1.0: E2M1 codes under an E8M0 scale; `quant.LowBitMatrix` keeps the file's nibbles in Q4_1's
  order and its exponent bytes): Q4_0's way with a lookup. Each nibble c becomes v(c) + 12 by `vpshufb` (v
  ggml's doubled E2M1 values, -12..12, `blocks.MXFP4_VALUES`; so 0..24, unsigned), d_rb is half the block's
  scale (2^(e - 128), exact) and m_rb = -12 · d_rb; pair sums at most 2 · 24 · 127 = 6,096, so two quads'
  (4 pair sums a lane) are summed in int16 (24,384 < 2^15) before each `vpmaddwd`.

The integer sums are exact (|P_rb| ≤ 32 · 128 · 127 < 2^24 converts exactly), so the result is the
dequantized weights times the int8-rounded activations up to the float32 steps. A row's result does not
depend on its batch (every activation row runs the same operations); it differs from the decode kernel's
(see `kernel_table`). Error: the activations' rounding, at most xs_b / 2 = max|x_b| / 254 per element.

Sources: ggml's `block_q8_0`, `block_q5_0`, `block_q4_0`, `block_q4_1` (ggml-common.h) and its AVX2
`ggml_vec_dot_q8_0_q8_0` (`vpsignb` then `vpmaddubsw`, widened by `vpmaddwd` with ones); Intel's
intrinsics guide for `vpmaddubsw`, `vpsignb`, `vpmaddwd`.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu.avx2 import _fma, _madd, _splat8  # noqa: E402
from hybridgate.workers.cpu.int8 import (  # noqa: E402  (int8's primitives, shared)
    _V8F,
    _V16S,
    _V32B,
    TILE_X,
    X_BYTES,
    _broadcast4,
    _maddubs,
    _quantize_row,
    _sign,
)
from hybridgate.workers.cpu.blocks import MXFP4_VALUES, e8m0_half  # noqa: E402
from hybridgate.workers.cpu.int8_interleave import ROWS  # noqa: E402
from hybridgate.workers.cpu.simd import _load_vec, _ptr  # noqa: E402

BLOCK = 32
KINDS = ("q8_0", "q5_0", "q4", "mxfp4")  # the `matmul_i8` kind ids 0, 1, 2, 3 (q4: Q4_0 and Q4_1)
QUADS = {"q8_0": 8, "q5_0": 8, "q4": 4, "mxfp4": 4}  # 32-byte code vectors per block (nibbles: two columns a byte)
WIDEN = {"q8_0": 1, "q5_0": 8, "q4": 4, "mxfp4": 2}  # code vectors summed in int16 before one `vpmaddwd` with ones
NIBBLES = ("q4", "mxfp4")  # the kinds whose codes are nibbles, with a minimum's term
MXFP4_OFFSET = 12  # v(c) + 12 ≥ 0: the tile's unsigned MXFP4 codes
# vpshufb's table, in both 128-bit lanes: nibble c → v(c) + 12 (`blocks.MXFP4_VALUES`, ggml's doubled E2M1)
_MXFP4_TABLE = [int(v) + MXFP4_OFFSET for v in MXFP4_VALUES] * 2
# E8M0 byte → half its scale, 2^(e - 128) (`blocks.e8m0_half`), float32 `[1, 256]`: MXFP4's `minimum` argument
E8M0_HALF = e8m0_half(np.arange(256)).reshape(1, 256)
_CHUNKS = 16


def _block_sums(builder, kind: str, codes, x_at, xrows: int) -> list:
    """One block's integer sums: for each activation row k < xrows an <8 x i32>, lane r = Σ_j w_rj · xq_kj.
    codes(q): the block's code vector q (<32 x i8>); x_at(k, column): activation row k's 4 bytes from the
    block's `column` broadcast to every lane."""
    ones = ir.Constant(_V16S, [1] * 16)
    low4 = ir.Constant(_V32B, [15] * 32)
    narrow, wide = [None] * xrows, [None] * xrows
    for q in range(QUADS[kind]):
        w = codes(q)
        if kind in NIBBLES:
            lo = builder.and_(w, low4)
            hi = builder.and_(builder.bitcast(builder.lshr(builder.bitcast(w, _V16S), ir.Constant(_V16S, [4] * 16)),
                                              _V32B), low4)
            if kind == "mxfp4":
                lo, hi = _shuffle(builder, _MXFP4_TABLE, lo), _shuffle(builder, _MXFP4_TABLE, hi)
        else:
            magnitude = builder.select(builder.icmp_signed("<", w, ir.Constant(_V32B, [0] * 32)), builder.neg(w), w)
        for k in range(xrows):
            if kind in NIBBLES:
                term = builder.add(_maddubs(builder, lo, x_at(k, 4 * q)), _maddubs(builder, hi, x_at(k, 16 + 4 * q)))
            else:
                term = _maddubs(builder, magnitude, _sign(builder, x_at(k, 4 * q), w))
            narrow[k] = term if narrow[k] is None else builder.add(narrow[k], term)
            if (q + 1) % WIDEN[kind] == 0:
                part = _madd(builder, narrow[k], ones)
                wide[k], narrow[k] = part if wide[k] is None else builder.add(wide[k], part), None
    return wide


def _shuffle(builder, table: list, index):
    """vpshufb: <32 x i8> table[index] per byte, index 0..15 into each 128-bit lane's 16 entries."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32B, [_V32B, _V32B]),
                                        "llvm.x86.avx2.pshuf.b")
    return builder.call(fn, [ir.Constant(_V32B, table), index])


def _make_tile(kind: str, xrows: int):
    """An intrinsic: 8 interleaved weight rows of `kind` (one of KINDS) times `xrows` int8 activation rows.

    f(wc, wd, wm, nblocks, xq, x_off, x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride) writes
    out[o_off + k·o_stride + r] for the 8 weight rows r and activation rows k < xrows (see the module
    docstring): wc uint8 `[nblocks · QUADS · 32]` the interleaved codes, wd float32 `[nblocks · 8]` d_rb,
    wm float32 `[nblocks · 8]` m_rb (q4 only; unread otherwise); xq int8 (row k at x_off + k·x_stride,
    columns in order), xs and xsum float32 per block at a_off + k·a_stride + b.
    """
    quads = QUADS[kind]

    def generic(typingctx, wc, wd, wm, nblocks, xq, x_off, x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride):
        ip = types.intp
        sig = types.void(wc, wd, wm, ip, xq, ip, ip, xs, xsum, ip, ip, out, ip, ip)

        def codegen(context, builder, signature, args):
            wca, wda, wma, n, xa, xo, xstr, xsa, xma, ao, astr, oa, oo, ostr = args
            ty = signature.args
            c = lambda v: ir.Constant(n.type, v)  # noqa: E731
            zero_f = ir.Constant(_V8F, [0.0] * 8)
            total = [cgutils.alloca_once_value(builder, zero_f) for _ in range(xrows)]

            with cgutils.for_range(builder, n) as loop:
                blk = loop.index

                def x_at(k, column):
                    at = builder.add(builder.add(xo, builder.mul(xstr, c(k))), builder.add(builder.mul(blk, c(BLOCK)),
                                                                                          c(column)))
                    return _broadcast4(builder, _ptr(context, builder, ty[4], xa, at))

                def codes(q):
                    at = builder.mul(builder.add(builder.mul(blk, c(quads)), c(q)), c(32))
                    return _load_vec(builder, _ptr(context, builder, ty[0], wca, at), _V32B, 1)

                def per_block(index, arr, k):
                    return _splat8(builder, builder.load(_ptr(context, builder, ty[index], arr,
                                                              builder.add(builder.add(ao, builder.mul(astr, c(k))),
                                                                          blk))))

                sums = _block_sums(builder, kind, codes, x_at, xrows)
                d = _load_vec(builder, _ptr(context, builder, ty[1], wda, builder.mul(blk, c(ROWS))), _V8F, 1)
                if kind in NIBBLES:
                    m = _load_vec(builder, _ptr(context, builder, ty[2], wma, builder.mul(blk, c(ROWS))), _V8F, 1)
                for k in range(xrows):
                    step = builder.fmul(d, per_block(7, xsa, k))
                    acc = _fma(builder, builder.sitofp(sums[k], _V8F), step, builder.load(total[k]))
                    if kind in NIBBLES:
                        acc = _fma(builder, m, per_block(8, xma, k), acc)
                    builder.store(acc, total[k])
            for k in range(xrows):
                dst = _ptr(context, builder, ty[11], oa, builder.add(oo, builder.mul(ostr, c(k))))
                builder.store(builder.load(total[k]), builder.bitcast(dst, _V8F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    generic.__name__ = f"int8_{kind}_tile8x{xrows}"
    return intrinsic(generic)


tile_q80, tile_q80_1 = _make_tile("q8_0", TILE_X), _make_tile("q8_0", 1)
tile_q50, tile_q50_1 = _make_tile("q5_0", TILE_X), _make_tile("q5_0", 1)
tile_q4, tile_q4_1 = _make_tile("q4", TILE_X), _make_tile("q4", 1)
tile_mx, tile_mx_1 = _make_tile("mxfp4", TILE_X), _make_tile("mxfp4", 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # no fast-math flags on the float steps (as `int8`)


@nb.njit(**_JIT)
def _interleave(kind, nblocks, qs32, scale, minimum, r0, wc32, wd, wm):
    """Weight rows r0 .. r0 + 8 (rows past the end repeat row r0: their results are not kept) → the tile's
    scratch: qs32 the codes viewed as uint32 `[rows, ≥ nblocks · quads]`, scale and minimum float32 `[rows,
    ≥ nblocks]` (MXFP4, kind 3: scale its E8M0 bytes, uint8, and minimum `E8M0_HALF`); wc32 uint32 `[nblocks ·
    quads · 8]`, wd and wm float32 `[nblocks · 8]`."""
    rows = qs32.shape[0]
    quads = 4 if kind >= 2 else 8  # `QUADS`
    for r in range(ROWS):
        row = r0 + r if r0 + r < rows else r0
        codes, scales = qs32[row], scale[row]
        for w in range(nblocks * quads):
            wc32[w * ROWS + r] = codes[w]
        for b in range(nblocks):
            if kind == 3:  # MXFP4: d half the E8M0 scale, m = -12 · d
                d = minimum[0, np.intp(scales[b])]  # (a cast the float-scaled kinds' typing needs)
                wd[ROWS * b + r] = d
                wm[ROWS * b + r] = np.float32(-MXFP4_OFFSET) * d
            else:
                wd[ROWS * b + r] = scales[b]
                wm[ROWS * b + r] = minimum[row, b]


@nb.njit(**_TILE_JIT)
def _tile(kind, xr, wc, wd, wm, nblocks, xq, x_off, xs, xsum, a_off, dst, o_off, o_stride):
    """The tile of `kind` (a KINDS index) for xr (TILE_X or 1) activation rows from x_off."""
    cols = xq.shape[1]
    if kind == 0:
        if xr == TILE_X:
            tile_q80(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
        else:
            tile_q80_1(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
    elif kind == 1:
        if xr == TILE_X:
            tile_q50(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
        else:
            tile_q50_1(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
    elif kind == 3:
        if xr == TILE_X:
            tile_mx(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
        else:
            tile_mx_1(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
    elif xr == TILE_X:
        tile_q4(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)
    else:
        tile_q4_1(wc, wd, wm, nblocks, xq, x_off, cols, xs, xsum, a_off, nblocks, dst, o_off, o_stride)


@nb.njit(**_TILE_JIT)
def _tiles(kind, wc, wd, wm, nblocks, xq, xs, xsum, out, r0, b0, b1, tmp):
    """One interleaved group's 8 rows (from r0) against activation rows b0 .. b1; a group past the weight's last
    row goes through tmp float32 `[TILE_X, 8]` and keeps only its rows."""
    rows, cols = out.shape[1], xq.shape[1]
    full = r0 + ROWS <= rows
    b = b0
    while b < b1:
        xr = TILE_X if b + TILE_X <= b1 else 1
        if full:
            _tile(kind, xr, wc, wd, wm, nblocks, xq, b * cols, xs, xsum, b * nblocks, out, b * rows + r0, rows)
        else:
            _tile(kind, xr, wc, wd, wm, nblocks, xq, b * cols, xs, xsum, b * nblocks, tmp, 0, ROWS)
            for k in range(xr):
                for r in range(rows - r0):
                    out[b + k, r0 + r] = tmp[k, r]
        b += xr


@nb.njit(parallel=True, **_JIT)
def matmul_i8(kind, x, qs32, scale, minimum, out, x_bytes=X_BYTES):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T, x quantized to int8 per 32 columns, for a
    weight of `kind` (a KINDS index): qs32 its codes viewed as uint32 (Q8_0 and Q5_0: int8 `[rows, cols]`;
    Q4_0, Q4_1 and MXFP4: Q4_1's nibbles `[rows, ≥ cols / 2]`), scale (d) and minimum (m, read for the nibble
    kinds only) float32 `[rows, ≥ cols / 32]` (MXFP4: scale its uint8 E8M0 bytes, minimum `E8M0_HALF`). x_bytes: the int8 activations of one pass over the weights (each group of 8 rows is
    interleaved once a pass). Error: the activations' rounding, at most max|x_b| / 254 per element."""
    batch, cols = x.shape
    nblocks = cols // BLOCK
    xq = np.empty((batch, cols), dtype=np.int8)
    xs = np.empty((batch, nblocks), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    for k in prange(batch):
        _quantize_row(x, k, xq, xs, xsum)
    rows = qs32.shape[0]
    groups = (rows + ROWS - 1) // ROWS
    per = (groups + _CHUNKS - 1) // _CHUNKS
    x_tile = max(TILE_X, x_bytes // cols // TILE_X * TILE_X)
    words = qs32.shape[1]
    for b0 in range(0, batch, x_tile):
        b1 = min(batch, b0 + x_tile)
        for chunk in prange(_CHUNKS):
            wc32 = np.empty(words * ROWS, dtype=np.uint32)
            wd = np.empty(nblocks * ROWS, dtype=np.float32)
            wm = np.empty(nblocks * ROWS, dtype=np.float32)
            tmp = np.empty((TILE_X, ROWS), dtype=np.float32)
            for g in range(chunk * per, min(groups, (chunk + 1) * per)):
                _interleave(kind, nblocks, qs32, scale, minimum, ROWS * g, wc32, wd, wm)
                _tiles(kind, wc32.view(np.uint8), wd, wm, nblocks, xq, xs, xsum, out, ROWS * g, b0, b1, tmp)


def prompt_rows(matmul, x: np.ndarray, rows: np.ndarray, out: np.ndarray, before: tuple, after: tuple) -> None:
    """out[rows] = matmul(*before, x[rows], *after, out[rows]): all of x and out when `rows` is every row, else the
    rows gathered into a contiguous copy and the result scattered back (a prompt kernel's rows of a mixed step).
    Raises ValueError when x's columns are not a multiple of 32."""
    if x.shape[1] % BLOCK:
        raise ValueError(f"prompt matmul: {x.shape[1]} columns: must be a multiple of {BLOCK}")
    if len(rows) == x.shape[0]:
        matmul(*before, x, *after, out)
        return
    part = np.empty((len(rows), out.shape[1]), dtype=np.float32)
    matmul(*before, np.ascontiguousarray(x[rows]), *after, part)
    out[rows] = part


def _multiply(kind: int, x: np.ndarray, rows: np.ndarray, qs: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
              out: np.ndarray) -> None:
    prompt_rows(matmul_i8, x, rows, out, (kind,), (qs.view(np.uint32), scale, minimum))


def multiply_q8_0(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
                  *unread_and_out: np.ndarray) -> None:
    """out[rows] = x[rows] @ W.T by `matmul_i8` for a Q8_0 weight (the prompt kernel's signature, as
    `amx.multiply`: `quant.Q80Matrix._prompt_arrays` (qs, scale, minimum, ...), out last): qs int8 codes
    `[n, cols]`, scale float32 `[n, cols / 32]`; rows int64 `[m]`, m ≥ 1, ascending; out float32 `[batch, n]`.
    Raises ValueError when cols is not a multiple of 32."""
    _multiply(0, x, rows, qs, scale, minimum, unread_and_out[-1])


def multiply_q5_0(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
                  *unread_and_out: np.ndarray) -> None:
    """`multiply_q8_0` for a Q5_0 weight as `quant.Q50Matrix` holds it (int8 codes c - 16 in -16..15)."""
    _multiply(1, x, rows, qs, scale, minimum, unread_and_out[-1])


def multiply_mxfp4(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, e: np.ndarray, table: np.ndarray,
                   *unread_and_out: np.ndarray) -> None:
    """`multiply_q8_0` for an MXFP4 weight as `quant.LowBitMatrix` holds it (`_prompt_arrays`): qs uint8 nibbles
    `[n, ≥ cols / 2]` (Q4_1's order, padded), e its uint8 E8M0 bytes `[n, ≥ cols / 32]`, table `E8M0_HALF`."""
    _multiply(3, x, rows, qs, e, table, unread_and_out[-1])


def multiply_q4(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, scale: np.ndarray, minimum: np.ndarray,
                *unread_and_out: np.ndarray) -> None:
    """`multiply_q8_0` for a Q4_0 or Q4_1 weight as `quant.Q41Matrix` holds it: qs uint8 nibbles `[n, cols /
    2]` (Q4_1's order), scale and minimum float32 `[n, cols / 32]` (Q4_0: minimum = -8 · scale)."""
    _multiply(2, x, rows, qs, scale, minimum, unread_and_out[-1])
