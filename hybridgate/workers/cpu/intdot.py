"""Integer dot products of GGUF blocks with activations quantized to int16 per 32-block.

The float kernels of `simd` turn every 4-bit weight into a float before the
multiply (a zero-extend, a convert and a fused multiply-add per 16 weights,
twice that on 8-lane AVX2). Here the codes stay integers: each activation row
is quantized per 32-column block to int16 with a float32 scale,
`xq = rint(x · 32767 / max|x_block|)`, `s = max|x_block| / 32767` (relative
error at most 2^-16 of the block's largest value, about 1.5e-5), and the block
product is
    Σ_j w_j x_j ≈ d · s · Σ_j q_j xq_j + m · Σ_j x_j
with Σ_j q_j xq_j exact in int32 (|q| ≤ 128, |xq| ≤ 32767, 32 terms: below
2^28) from pair products (`vpmaddwd`: two int16 products summed into one
int32 lane), and Σ_j x_j (the Q4_1 min term, 0 for Q8_0) the activation
block's exact float sum, computed once per activation row and block. So per
block and pair of rows the float work is one convert, one multiply and one
FMA on the int32 lanes, whatever the weight type. Q6_K, repacked as int8 codes
with a scale per 16 columns (`quant.Q6KMatrix`), takes d as a vector: the first
half of the int32 lanes holds a block's columns 0..15, the second 16..31, so the
block's two scales go to their own lanes in the same one FMA.

Paths: `avx512` calls `llvm.x86.avx512.pmaddw.d.512` (32 products into 16
lanes) and accumulates in 16 float lanes; `generic` writes the same products
as portable IR (sign-extend, multiply, add lane pairs) into 8 float lanes.
On the `avx2` path the kernel table (`kernel_table`) takes `avx2.matmul_i16`
instead (the codes widened in-lane, the activations stored in the order that gives). The integer sums
are exact, so lane layouts differ between paths only in the float
accumulation order, which is fixed within a path: a row's result does not
depend on the batch or tile it is computed in.

Sources: ggml's block formats (ggml-common.h `block_q4_1`, `block_q8_0`), the
activation-quantized dot products of ggml-cpu (`ggml_vec_dot_q4_1_q8_1`, which
quantizes activations to 8 bits; 16 bits here), Intel's intrinsics guide for
`vpmaddwd` and `vphaddd`.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

_ISA = isa.selected().isa  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402

from hybridgate.workers.cpu.simd import (  # noqa: E402
    PREFETCH_ROWS,
    X_TILE,
    _load_vec,
    _ptr,
    _tree_sum,
    prefetch_span,
    scale_pair,
)
from hybridgate.workers.cpu.tilegen import tile_intrinsic  # noqa: E402

ACC_LANES = 16 if _ISA == "avx512" else 8  # float accumulator lanes: one register on each path
XQ_MAX = 32767.0  # int16 activations stay in ±32767, so a pair product never meets vpmaddwd's one overflow

_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_VACC = ir.VectorType(_F32, ACC_LANES)
_VACCI = ir.VectorType(_I32, ACC_LANES)


def _lanes(builder, vec, lo: int, count: int):
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, count), list(range(lo, lo + count))))


def _splat(builder, scalar, vec_ty):
    n = vec_ty.count
    vec = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _pair_products(builder, w, x):
    """<32 x i16> w, x → <ACC_LANES x i32> whose lanes sum to Σ_j w_j x_j (exactly); the first half of
    the lanes holds columns 0..15, the second 16..31 (so a scale per 16 columns can be applied per lane)."""
    if _ISA == "avx512":
        ty = ir.FunctionType(ir.VectorType(_I32, 16), [ir.VectorType(_I16, 32)] * 2)
        fn = cgutils.get_or_insert_function(builder.module, ty, "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(fn, [w, x])
    v32 = ir.VectorType(_I32, 32)
    p = builder.mul(builder.sext(w, v32), builder.sext(x, v32))
    p = builder.add(builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))),
                    builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))))
    first, second = [0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]
    return builder.add(builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 8), first)),
                       builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 8), second)))


def _fma(builder, a, b, c):
    name = f"llvm.fma.{'v%df32' % a.type.count if isinstance(a.type, ir.VectorType) else 'f32'}"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


def _weights_i16(context, builder, kind, ty, qa, qoff):
    """One block's 32 codes as <32 x i16> in column order: Q4_1 16 bytes of nibbles (byte j:
    column j low, j + 16 high), Q8_0 32 int8."""
    if kind == "q4_1":
        raw = _load_vec(builder, _ptr(context, builder, ty, qa, qoff), ir.VectorType(ir.IntType(8), 16), 1)
        q = builder.zext(raw, ir.VectorType(_I16, 16))
        lo = builder.and_(q, ir.Constant(q.type, [15] * 16))
        hi = builder.lshr(q, ir.Constant(q.type, [4] * 16))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    raw = _load_vec(builder, _ptr(context, builder, ty, qa, qoff), ir.VectorType(ir.IntType(8), 32), 1)
    return builder.sext(raw, ir.VectorType(_I16, 32))


def _make_itile(wrows: int, xrows: int):
    """An intrinsic: `wrows` weight rows of GGUF blocks times `xrows` int16 activation rows.

    f(qs, q_off, q_stride, scale, minimum, s_off, s_stride, nblocks, xq, x_off, x_stride, xs, xsum,
      a_off, a_stride, out, o_off, o_stride) writes, for weight row i and activation row k,
      out[o_off + k·o_stride + i] = Σ_b d_ib · xs_kb · Σ_j q_ibj · xq_kbj + Σ_b m_ib · xsum_kb
    (the m term for Q4_1 only) with d_ib, m_ib at scale/minimum[s_off + i·s_stride + b], xs_kb and
    xsum_kb at xs/xsum[a_off + k·a_stride + b], xq int16 at x_off + k·x_stride + 32b, the codes
    from qs (as in `simd._make_tile`, row i at q_off + i·q_stride).

    Per pair (i, k) and block: P_ibk = Σ_j q_ibj · xq_kbj exact in int32 lanes (`_pair_products`),
    acc = fma(float(P) · xs_kb, d_ib, acc) over the blocks in order; the m term is a second pass
    over the blocks, one FMA chain per pair in block order, vectorized across the tile's activation
    rows. Then a fixed lane tree. The same operations for a pair whatever the tile: a row's result
    does not depend on its batch. The tile issues no prefetches: `_irows` asks for the rows ahead
    once per row group.
    """

    def state_of(arg):  # Q6_K: a scale per 16 columns, a block's pair at twice its index
        return wrows, xrows, "q4_1" if arg["qs"].dtype == types.uint8 else "q8_0", arg["scale"].ndim == 3

    return tile_intrinsic(f"itile{wrows}x{xrows}", _TILE_ARGS, state_of, _emit_itile)


_TILE_ARGS = ("qs", "q_off", "q_stride", "scale", "minimum", "s_off", "s_stride", "nblocks", "xq", "x_off",
              "x_stride", "xs", "xsum", "a_off", "a_stride", "out", "o_off", "o_stride")


def _emit_itile(t, state):
    """`_make_itile`'s body: the pair products and float step per block, then the m term's pass."""
    wrows, xrows, kind, pairs = state
    builder = t.builder
    accs = t.accumulators(_VACC, wrows, xrows)
    block_bytes = 16 if kind == "q4_1" else 32
    with t.loop(t["nblocks"]) as b:
        w = [_weights_i16(t.context, builder, kind, t.types["qs"], t["qs"],
                          t.offset("q_off", "q_stride", i, b, block_bytes)) for i in range(wrows)]
        d = [_weight_scale(t, pairs, i, b) for i in range(wrows)]
        for k in range(xrows):
            xv = _load_vec(builder, t.at("xq", "x_off", "x_stride", k, b, 32), ir.VectorType(_I16, 32), 2)
            s = _splat(builder, builder.load(t.at("xs", "a_off", "a_stride", k, b)), _VACC)
            for i in range(wrows):
                p = builder.fmul(builder.sitofp(_pair_products(builder, w[i], xv), _VACC), s)
                builder.store(_fma(builder, p, d[i], builder.load(accs[k][i])), accs[k][i])
    maccs = _min_terms(t, kind, wrows, xrows)

    def value(k, i):
        mterm = builder.extract_element(builder.load(maccs[i]), ir.Constant(_I32, k))
        return builder.fadd(_tree_sum(builder, builder.load(accs[k][i])), mterm)

    return t.store_outputs(wrows, xrows, value)


def _weight_scale(t, pairs, i, b):
    """Row i's block b scale in every lane, or (`pairs`, Q6_K) its two as `scale_pair` puts them."""
    if not pairs:
        return _splat(t.builder, t.builder.load(t.at("scale", "s_off", "s_stride", i, b)), _VACC)
    block = t.offset("s_off", "s_stride", i, b)
    return scale_pair(t.builder, t.ptr("scale", t.builder.mul(block, t.c(2))), _VACC)


def _min_terms(t, kind, wrows, xrows):
    """Per weight row i, a stack slot of <xrows x float>: lane k Σ_b m_ib · xsum_kb (Q4_1; zero for Q8_0),
    one FMA chain in block order, vectorized across the tile's activation rows."""
    builder = t.builder
    vxt = ir.VectorType(_F32, xrows)
    maccs = [cgutils.alloca_once_value(builder, ir.Constant(vxt, [0.0] * xrows)) for _ in range(wrows)]
    if kind == "q4_1":
        with t.loop(t["nblocks"]) as b:
            totals = ir.Constant(vxt, ir.Undefined)
            for k in range(xrows):
                totals = builder.insert_element(totals, builder.load(t.at("xsum", "a_off", "a_stride", k, b)),
                                                ir.Constant(_I32, k))
            for i in range(wrows):
                m = _splat(builder, builder.load(t.at("minimum", "s_off", "s_stride", i, b)), vxt)
                builder.store(_fma(builder, m, totals, builder.load(maccs[i])), maccs[i])
    return maccs


# Weight rows × activation rows per tile: a tile's accumulators and its rows' codes stay in AVX-512's 32
# registers (the generic path, merely correct, takes the same shape).
TILE_W, TILE_X = 4, 4
itile_wx, itile_w1, itile_11 = _make_itile(TILE_W, TILE_X), _make_itile(TILE_W, 1), _make_itile(1, 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
# The tiles' callers are compiled without fastmath: Numba puts its fast-math flags on every float
# instruction of a function, the intrinsics' inlined IR included, and LLVM then reassociated the last
# sums of some tile shapes and not others (1 ulp apart: the batch invariance test caught it).
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)
_CHUNKS = 16


@nb.njit(**_JIT)
def _quantize_row(x, k, xq, xs, xsum):
    """Row k of x float32 `[batch, cols]` into xq int16 (per 32-block scale xs, the block's
    sum xsum)."""
    for b in range(x.shape[1] // 32):
        top = np.float32(0.0)
        for j in range(32):
            top = max(top, abs(x[k, 32 * b + j]))
        inv = np.float32(XQ_MAX) / top if top > 0 else np.float32(0.0)
        total = 0
        for j in range(32):
            q = np.int32(np.rint(x[k, 32 * b + j] * inv))
            xq[k, 32 * b + j] = np.int16(q)
            total += q
        xs[k, b] = top / np.float32(XQ_MAX)
        xsum[k, b] = np.float32(total) * xs[k, b]


@nb.njit(parallel=True, **_JIT)
def quantize_i16(x, xq, xs, xsum):
    """x float32 `[batch, cols]` (cols a multiple of 32) → xq int16 `[batch, cols]`, xs and xsum
    float32 `[batch, cols / 32]`: x ≈ xs · xq per 32-column block, xsum the block's sum Σ xs · xq. Each row on its own (the same bits whatever the batch)."""
    for k in prange(x.shape[0]):
        _quantize_row(x, k, xq, xs, xsum)


@nb.njit(**_TILE_JIT)
def _irows(xq, xs, xsum, qs, scale, minimum, out, r, wrows, b0, b1):
    """Weight rows r .. r + wrows (TILE_W or 1) against activation rows b0 .. b1, in tiles."""
    rows, nblocks, cols, qw = qs.shape[0], scale.shape[1], xq.shape[1], qs.shape[1]
    ahead = r + PREFETCH_ROWS  # see simd.PREFETCH_ROWS
    prefetch_span(qs, ahead * qw, wrows * qw)
    per = scale.size // max(rows, 1)  # scales per row: nblocks, or 2 · nblocks for Q6_K
    prefetch_span(scale, ahead * per, wrows * per)
    prefetch_span(minimum, ahead * per, wrows * per)
    b = b0
    if wrows == TILE_W:
        while b + TILE_X <= b1:
            itile_wx(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols, cols, xs, xsum,
                     b * nblocks, nblocks, out, b * rows + r, rows)
            b += TILE_X
        while b < b1:
            itile_w1(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols, cols, xs, xsum,
                     b * nblocks, nblocks, out, b * rows + r, rows)
            b += 1
    else:
        while b < b1:
            itile_11(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols, cols, xs, xsum,
                     b * nblocks, nblocks, out, b * rows + r, rows)
            b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_i16(x, qs, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T with x quantized to int16 per
    32-block first (`quantize_i16`); W as in `simd.matmul_blocks` (Q4_1 uint8 nibbles or Q8_0
    int8 codes, float32 scale and minimum `[rows, cols / 32]`; minimum unused for Q8_0). Error:
    the activations' quantization, about 1.5e-5 of each block's largest value. Tiles of TILE_W
    weight rows × TILE_X activation rows."""
    batch, cols = x.shape
    nblocks = cols // 32
    xq = np.empty((batch, cols), dtype=np.int16)
    xs = np.empty((batch, nblocks), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    if batch < 8:
        for k in range(batch):
            _quantize_row(x, k, xq, xs, xsum)
    else:
        for k in prange(batch):
            _quantize_row(x, k, xq, xs, xsum)
    groups = qs.shape[0] // TILE_W
    per = (groups + _CHUNKS - 1) // _CHUNKS
    for b0 in range(0, batch, X_TILE):
        b1 = min(batch, b0 + X_TILE)
        for c in prange(_CHUNKS):
            for g in range(c * per, min(groups, (c + 1) * per)):
                _irows(xq, xs, xsum, qs, scale, minimum, out, TILE_W * g, TILE_W, b0, b1)
        for r in range(TILE_W * groups, qs.shape[0]):
            _irows(xq, xs, xsum, qs, scale, minimum, out, r, 1, b0, b1)
