"""The avx2 path's int16 dot products: GGUF codes widened in-lane, one float step per block.

AVX2 has no cheap way to widen 16 bytes into 16 int16 lanes: `vpmovzxbw` and
`vpmovsxbw` cross the 128-bit halves (two uops each on Zen 3, one every 1.5
cycles), and `vphaddd`, which the first avx2 tiles used to sum four blocks'
lanes, is three uops on one pipe. Both sat on the kernels' critical pipes
(about 10 cycles per block and weight row at batch 1, measured on a Zen 3
EPYC). Here every widening is an in-lane shift or mask, and the activations
are stored in the order those produce instead:

- Q4_1: the block's 16 bytes are loaded into both halves of a register as
  16-bit lanes t (bytes 2t, 2t+1). Masking with 0x000F (low half) and 0x00F0
  (high half) gives columns 2t and 16·(column 2t+16); shifting right by 8
  first gives columns 2t+1 and 16·(column 2t+17). The factor 16 of the high
  half is exact and is taken out by the activation scale of those lanes,
  xs/16 (a power of two: exact), after the integer sums are converted (a
  multiple of 16 below 2^28 converts to float32 exactly).
- Q8_0: the block's 32 bytes as 16-bit lanes; `(v << 8) >> 8` and `v >> 8`
  (arithmetic) give the even and the odd columns, sign-extended.

So each 32-column activation block is stored as its 16 even columns, then its
16 odd ones (`quantize_block`), with a scale vector of 8 lanes per block
([xs ×4, xs/16 ×4] for Q4_1, [xs ×8] for Q8_0). Per block and pair of rows the
integer product is two `vpmaddwd` and one add, exact in int32, and the float
step one convert, one multiply by the scale vector and one FMA with the weight
block's scale, into 8 lanes per pair: acc = fma(float(P) · S_kb, d_ib, acc)
over the blocks in order (Q6_K's two scales per block, one per 16 columns, as
d_ib = [d0 ×4, d1 ×4]: lanes 0..3 hold columns 0..15, lanes 4..7 16..31).
The Q4_1 min term, Σ_b m_ib · xsum_kb, is a separate 8-block-wide FMA chain over the blocks (then its tail one by one), added after
the 8 lanes' fixed tree (`_min_terms`). From 4 activation rows on, a row group's codes are
widened once into a scratch (`unpack_rows`) in exactly the lanes the packed
tiles compute, so every tile gives a pair the same integers and the same float
operations: a row's result does not depend on its batch.

Sources: ggml's block formats (ggml-common.h `block_q4_1`, `block_q8_0`);
Intel's intrinsics guide for `vpmaddwd`; uop counts and pipes from LLVM's
Zen 3 scheduling model (llvm-mca -mcpu=znver3).
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

from hybridgate.workers.cpu.simd import (  # noqa: E402
    PREFETCH_ROWS,
    X_TILE,
    _load_vec,
    _ptr,
    _tree_sum,
    prefetch_span,
    reduce_halves,
    scale_pair,
)
from hybridgate.workers.cpu.tilegen import tile_intrinsic  # noqa: E402

XQ_MAX = 32767.0  # as intdot: int16 activations in ±32767, so no pair product meets vpmaddwd's overflow
_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_V8F = ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)
_V16S = ir.VectorType(_I16, 16)


def _const16(values):
    return ir.Constant(_V16S, list(values))


def _madd(builder, a, b):
    """vpmaddwd: <16 x i16> a, b → <8 x i32>, lane t = a_2t·b_2t + a_2t+1·b_2t+1 (exact)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I, [_V16S, _V16S]),
                                        "llvm.x86.avx2.pmadd.wd")
    return builder.call(fn, [a, b])


def _fma(builder, a, b, c):
    name = "llvm.fma.v8f32" if a.type == _V8F else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _splat8(builder, scalar):
    vec = builder.insert_element(ir.Constant(_V8F, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(_V8I, [0] * 8))


def _codes(builder, kind, ptr):
    """One block's codes at ptr (Q4_1: 16 bytes of nibbles; Q8_0: 32 int8) → (W1, W2) <16 x i16>,
    in the lanes the module docstring gives (W1 the even columns, W2 the odd)."""
    if kind == "q4_1":
        raw = _load_vec(builder, ptr, ir.VectorType(ir.IntType(8), 16), 1)
        both = builder.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 32), list(range(16)) * 2))
        v = builder.bitcast(both, _V16S)
        mask = _const16([0x000F] * 8 + [0x00F0] * 8)
        return builder.and_(v, mask), builder.and_(builder.lshr(v, _const16([8] * 16)), mask)
    v = _load_vec(builder, ptr, _V16S, 1)
    eight = _const16([8] * 16)
    return builder.ashr(builder.shl(v, eight), eight), builder.ashr(v, eight)


def _make_tile(wrows: int, xrows: int, unpacked: bool):
    """An intrinsic: `wrows` weight rows of GGUF blocks times `xrows` int16 activation rows.

    f(qs, q_off, q_stride, wq, w_off, w_stride, scale, minimum, s_off, s_stride, nblocks, xq, x_off, x_stride,
      xs8, xsum, a_off, a_stride, out, o_off, o_stride) writes, for weight row i and activation row k,
      out[o_off + k·o_stride + i] = tree8(Σ_b float(P_ikb) · S_kb · d_ib) + Σ_b m_ib · xsum_kb
    (the m term for Q4_1 only): d_ib, m_ib at scale/minimum[s_off + i·s_stride + b], xq (int16, each
    block's even columns then odd ones) at x_off + k·x_stride + 32b, S_kb the 8 floats at
    xs8[(a_off + k·a_stride + b)·8], xsum_kb at xsum[a_off + k·a_stride + b]. The codes come from qs
    (Q4_1 uint8 nibbles, Q8_0 int8; row i at q_off + i·q_stride) or, `unpacked`, from wq, the
    lanes `unpack_rows` wrote (row i at w_off + i·w_stride, 32 int16 per block).
    """

    def state_of(arg):
        per = 2 if arg["scale"].ndim == 3 else 1  # Q6_K: a scale per 16 columns, a block's pair at twice its index
        return wrows, xrows, unpacked, "q4_1" if arg["qs"].dtype == types.uint8 else "q8_0", per

    return tile_intrinsic(f"avx2_tile{wrows}x{xrows}{'u' if unpacked else ''}", _TILE_ARGS, state_of, _emit_tile)


_TILE_ARGS = ("qs", "q_off", "q_stride", "wq", "w_off", "w_stride", "scale", "minimum", "s_off", "s_stride",
              "nblocks", "xq", "x_off", "x_stride", "xs8", "xsum", "a_off", "a_stride", "out", "o_off", "o_stride")


def _emit_tile(t, state):
    """`_make_tile`'s body: per block two `vpmaddwd` and the float step per pair, then the min terms."""
    wrows, xrows, unpacked, kind, per = state
    builder, c = t.builder, t.c
    accs = t.accumulators(_V8F, wrows, xrows)
    block_bytes = 16 if kind == "q4_1" else 32
    with t.loop(t["nblocks"]) as b:
        if not unpacked:
            t.prefetch_ahead("qs", block_bytes, "scale", per, "minimum" if kind == "q4_1" else None, wrows, b)
        if unpacked:
            w = [_halves(t, t.at("wq", "w_off", "w_stride", i, b, 32)) for i in range(wrows)]
        else:
            w = [_codes(builder, kind, t.at("qs", "q_off", "q_stride", i, b, block_bytes)) for i in range(wrows)]
        d = [_weight_scale(t, per, i, b) for i in range(wrows)]
        for k in range(xrows):
            x1, x2 = _halves(t, t.at("xq", "x_off", "x_stride", k, b, 32))
            s = _load_vec(builder, t.ptr("xs8", builder.mul(builder.add(t.row("a_off", "a_stride", k), b), c(8))),
                          _V8F, 4)
            for i in range(wrows):
                prod = builder.add(_madd(builder, w[i][0], x1), _madd(builder, w[i][1], x2))
                f = builder.fmul(builder.sitofp(prod, _V8F), s)
                builder.store(_fma(builder, f, d[i], builder.load(accs[k][i])), accs[k][i])
    mterms = _min_terms(t, wrows, xrows) if kind == "q4_1" else {}

    def value(k, i):
        total = _tree_sum(builder, builder.load(accs[k][i]))
        return builder.fadd(total, mterms[i, k]) if kind == "q4_1" else total

    return t.store_outputs(wrows, xrows, value)


def _halves(t, p):
    """The 32 int16 at p as two <16 x i16>."""
    return _load_vec(t.builder, p, _V16S, 2), _load_vec(t.builder, t.builder.gep(p, [t.c(16)]), _V16S, 2)


def _weight_scale(t, per, i, b):
    """Row i's block b scale in every lane, or (Q6_K) its first in lanes 0..3 (columns 0..15) and its second
    in lanes 4..7 (see the module docstring's lane order)."""
    ptr = t.ptr("scale", t.builder.mul(t.builder.add(t.row("s_off", "s_stride", i), b), t.c(per)))
    if per == 2:
        return scale_pair(t.builder, ptr, _V8F)
    return _splat8(t.builder, t.builder.load(ptr))


def _min_terms(t, wrows, xrows):
    """{(i, k): Σ_b minimum[s_off + i·s_stride + b] · xsum[a_off + k·a_stride + b]} for the tile's pairs: per
    pair an 8-lane FMA chain over the blocks in order, its fixed tree, then the last n % 8 blocks one by one;
    the pairs' chains interleaved in one loop (one pair at a time, their latency made the m terms cost more
    than the products on 18-block rows)."""
    builder, c, n = t.builder, t.c, t["nblocks"]
    pairs = [(i, k) for k in range(xrows) for i in range(wrows)]
    mrow = {i: t.row("s_off", "s_stride", i) for i in range(wrows)}
    xrow = {k: t.row("a_off", "a_stride", k) for k in range(xrows)}
    vacc = {p: cgutils.alloca_once_value(builder, ir.Constant(_V8F, [0.0] * 8)) for p in pairs}
    eights = builder.sdiv(n, c(8))
    with t.loop(eights) as index:
        b = builder.mul(index, c(8))
        m = {i: _load_vec(builder, t.ptr("minimum", builder.add(mrow[i], b)), _V8F, 4) for i in range(wrows)}
        x = {k: _load_vec(builder, t.ptr("xsum", builder.add(xrow[k], b)), _V8F, 4) for k in range(xrows)}
        for i, k in pairs:
            builder.store(_fma(builder, m[i], x[k], builder.load(vacc[i, k])), vacc[i, k])
    sacc = {p: cgutils.alloca_once_value(builder, _tree_sum(builder, builder.load(vacc[p]))) for p in pairs}
    with t.loop(builder.sub(n, builder.mul(eights, c(8)))) as index:
        b = builder.add(builder.mul(eights, c(8)), index)
        m = {i: builder.load(t.ptr("minimum", builder.add(mrow[i], b))) for i in range(wrows)}
        x = {k: builder.load(t.ptr("xsum", builder.add(xrow[k], b))) for k in range(xrows)}
        for i, k in pairs:
            builder.store(_fma(builder, m[i], x[k], builder.load(sacc[i, k])), sacc[i, k])
    return {p: builder.load(sacc[p]) for p in pairs}


@intrinsic
def unpack_rows(typingctx, qs, q_off, q_stride, nblocks, rows, wq):
    """wq[(i·nblocks + b)·32 : +32] = (W1, W2) of block b of weight row i < rows (`_codes`): the codes
    widened once for every tile that reads them."""
    ip = types.intp
    sig = types.void(qs, ip, ip, ip, ip, wq)
    kind = "q4_1" if qs.dtype == types.uint8 else "q8_0"

    def codegen(context, builder, signature, args):
        qa, qo, qstr, n, nrows, wa = args
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        block_bytes = 16 if kind == "q4_1" else 32
        with cgutils.for_range(builder, nrows) as row:
            with cgutils.for_range(builder, n) as loop:
                qoff = builder.add(builder.add(qo, builder.mul(qstr, row.index)), builder.mul(loop.index, c(block_bytes)))
                w1, w2 = _codes(builder, kind, _ptr(context, builder, signature.args[0], qa, qoff))
                woff = builder.mul(builder.add(builder.mul(row.index, n), loop.index), c(32))
                dst = _ptr(context, builder, signature.args[5], wa, woff)
                builder.store(w1, builder.bitcast(dst, _V16S.as_pointer()), align=2)
                builder.store(w2, builder.bitcast(builder.gep(dst, [c(16)]), _V16S.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


# Weight rows × activation rows per tile. At batch 1, 4 weight rows share each activation load (4
# accumulators, 2 activation vectors and a row's codes fit AVX2's 16 registers). From UNPACK_MIN rows, 2 x 4:
# LLVM spills some of its 8 accumulators, yet 2x2, 2x3 and 4x2 measured no better (1 thread, the default
# model's 3072 x 576 gate/up at batch 16 and 64, within this host's run-to-run noise).
TILE_W, TILE_X = 2, 4
GEMV_W = 4
UNPACK_MIN = 4  # activation rows from which a row group's codes are widened once first
tile_wx_u, tile_w1_u = _make_tile(TILE_W, TILE_X, True), _make_tile(TILE_W, 1, True)
tile_g1, tile_11 = _make_tile(GEMV_W, 1, False), _make_tile(1, 1, False)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # as intdot: no fast-math flags on the tiles' float steps
_CHUNKS = 16
_EVEN_ODD = np.concatenate([np.arange(0, 32, 2), np.arange(1, 32, 2)])  # a block's columns in stored order


@intrinsic
def quantize_block(typingctx, x, x_off, xq, q_off, xs8, s_off, xsum, m_off, hi_scale):
    """One 32-column block of float32 activations x[x_off : x_off + 32] → xq[q_off : q_off + 32] int16
    (the block's even columns, then its odd ones), xs8[s_off : s_off + 8] = [xs ×4, xs · hi_scale ×4]
    and xsum[m_off] = xs · Σ xq, with xs = max|x| / 32767 and xq = rint(x / xs) (all zero for a zero
    block): one 32-lane vector (four AVX2 registers), the max exact in any order, the sum of the
    integers exact."""
    ip = types.intp
    sig = types.void(x, ip, xq, ip, xs8, ip, xsum, ip, types.float32)

    def codegen(context, builder, signature, args):
        xa, xo, qa, qo, sa, so, ma, mo, hi = args
        ty = signature.args
        c = lambda v: ir.Constant(xo.type, v)  # noqa: E731
        v32 = ir.VectorType(_F32, 32)
        vals = _load_vec(builder, _ptr(context, builder, ty[0], xa, xo), v32, 4)
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]), "llvm.fabs.v32f32")
        mags = builder.call(fabs, [vals])
        # the max is exact: any order gives the same value
        top = reduce_halves(builder, mags, lambda lo, up: builder.select(builder.fcmp_ordered(">", up, lo), up, lo))
        positive = builder.fcmp_ordered(">", top, ir.Constant(_F32, 0.0))
        inv = builder.select(positive, builder.fdiv(ir.Constant(_F32, XQ_MAX), top), ir.Constant(_F32, 0.0))
        splat = builder.shuffle_vector(builder.insert_element(ir.Constant(v32, ir.Undefined), inv, ir.Constant(_I32, 0)),
                                       ir.Constant(v32, ir.Undefined), ir.Constant(ir.VectorType(_I32, 32), [0] * 32))
        rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]), "llvm.rint.v32f32")
        q = builder.fptosi(builder.call(rint, [builder.fmul(vals, splat)]), ir.VectorType(_I32, 32))
        order = ir.Constant(ir.VectorType(_I32, 32), [int(j) for j in _EVEN_ODD])
        q16 = builder.trunc(builder.shuffle_vector(q, q, order), ir.VectorType(_I16, 32))
        builder.store(q16, builder.bitcast(_ptr(context, builder, ty[2], qa, qo), q16.type.as_pointer()), align=2)
        total = reduce_halves(builder, q, builder.add)
        xs = builder.fdiv(top, ir.Constant(_F32, XQ_MAX))
        xs_hi = builder.fmul(xs, hi)
        lanes = ir.Constant(_V8F, ir.Undefined)
        for j in range(8):
            lanes = builder.insert_element(lanes, xs if j < 4 else xs_hi, ir.Constant(_I32, j))
        builder.store(lanes, builder.bitcast(_ptr(context, builder, ty[4], sa, so), _V8F.as_pointer()), align=4)
        total = builder.sitofp(total, _F32)
        builder.store(builder.fmul(total, xs), _ptr(context, builder, ty[6], ma, mo))
        return context.get_dummy_value()

    return sig, codegen


@nb.njit(**_TILE_JIT)
def _quantize_row(x, k, xq, xs8, xsum, hi_scale):
    """Row k of x float32 `[batch, cols]` → xq int16, xs8 float32 `[batch, blocks · 8]` and xsum
    float32 `[batch, blocks]`, block by block (`quantize_block`)."""
    cols = x.shape[1]
    nblocks = cols // 32
    for b in range(nblocks):
        quantize_block(x, k * cols + 32 * b, xq, k * cols + 32 * b, xs8, (k * nblocks + b) * 8, xsum, k * nblocks + b,
                       hi_scale)


@nb.njit(**_TILE_JIT)
def _gemv_rows(xq, xs8, xsum, qs, scale, minimum, out, r0, r1, b0, b1):
    """Weight rows r0 .. r1 against activation rows b0 .. b1 (fewer than UNPACK_MIN), GEMV_W rows a tile."""
    rows, nblocks, cols, qw = qs.shape[0], scale.shape[1], xq.shape[1], qs.shape[1]
    r = r0  # the packed tiles read no unpacked codes: xq stands in for their wq argument
    while r < r1:
        w = GEMV_W if r + GEMV_W <= r1 else 1
        for b in range(b0, b1):
            if w == GEMV_W:
                tile_g1(qs, r * qw, qw, xq, 0, 0, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols, cols,
                        xs8, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            else:
                tile_11(qs, r * qw, qw, xq, 0, 0, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols, cols,
                        xs8, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        r += w


@nb.njit(**_TILE_JIT)
def _gemm_rows(xq, xs8, xsum, qs, scale, minimum, out, r, wrows, b0, b1, wq):
    """Weight rows r .. r + wrows (at most TILE_W) against activation rows b0 .. b1 (at least
    UNPACK_MIN): the rows' codes widened into wq once, then TILE_W x TILE_X tiles."""
    rows, nblocks, cols, qw = qs.shape[0], scale.shape[1], xq.shape[1], qs.shape[1]
    ahead = r + PREFETCH_ROWS
    prefetch_span(qs, ahead * qw, wrows * qw)
    per = scale.size // max(rows, 1)  # scales per row: nblocks, or 2 · nblocks for Q6_K
    prefetch_span(scale, ahead * per, wrows * per)
    prefetch_span(minimum, ahead * per, wrows * per)
    if wrows < TILE_W:
        for i in range(wrows):
            _gemv_rows(xq, xs8, xsum, qs, scale, minimum, out, r + i, r + i + 1, b0, b1)
        return
    unpack_rows(qs, r * qw, qw, nblocks, TILE_W, wq)
    b = b0
    while b + TILE_X <= b1:
        tile_wx_u(qs, r * qw, qw, wq, 0, 32 * nblocks, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                  cols, xs8, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        b += TILE_X
    while b < b1:
        tile_w1_u(qs, r * qw, qw, wq, 0, 32 * nblocks, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                  cols, xs8, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_i16(x, qs, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T, x quantized to int16 per 32-block
    first; W as in `simd.matmul_blocks` (Q4_1 uint8 nibbles or Q8_0 int8 codes, float32 scale and
    minimum `[rows, cols / 32]`; minimum unused for Q8_0). Error: the activations' quantization,
    at most 2^-16 of each block's largest value (as `intdot.matmul_i16`)."""
    batch, cols = x.shape
    nblocks = cols // 32
    xq = np.empty((batch, cols), dtype=np.int16)
    xs8 = np.empty((batch, nblocks * 8), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    hi_scale = np.float32(1.0 / 16.0) if qs.shape[1] * 2 == cols else np.float32(1.0)  # Q4_1: 2 codes a byte
    if batch < 8:
        for k in range(batch):
            _quantize_row(x, k, xq, xs8, xsum, hi_scale)
    else:
        for k in prange(batch):
            _quantize_row(x, k, xq, xs8, xsum, hi_scale)
    rows = qs.shape[0]
    if batch < UNPACK_MIN:
        groups = rows // GEMV_W
        per = (groups + _CHUNKS - 1) // _CHUNKS * GEMV_W
        for c in prange(_CHUNKS):  # chunks start on a GEMV_W boundary; the last takes the rows past the groups
            _gemv_rows(xq, xs8, xsum, qs, scale, minimum, out, c * per, rows if c == _CHUNKS - 1 else
                       min(rows, (c + 1) * per), 0, batch)
        return
    groups = (rows + TILE_W - 1) // TILE_W
    per = (groups + _CHUNKS - 1) // _CHUNKS
    for b0 in range(0, batch, X_TILE):
        b1 = min(batch, b0 + X_TILE)
        for c in prange(_CHUNKS):
            wq = np.empty(TILE_W * cols, dtype=np.int16)
            for g in range(c * per, min(groups, (c + 1) * per)):
                r = TILE_W * g
                _gemm_rows(xq, xs8, xsum, qs, scale, minimum, out, r, min(TILE_W, rows - r), b0, b1, wq)
