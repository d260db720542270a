"""The CPU worker's hot loops written as LLVM vector IR: GGUF block products and attention.

Numba's autovectorizer turns the nibble unpacking of Q4_1 and Q8_0 blocks into
scalar conversions (`vcvtsi2ss`, one per weight), whatever the loop shape; these
Numba intrinsics spell the 32-weight block out as 16-lane vectors instead
(load 16 bytes, zero-extend, split nibbles, convert, one FMA with the block's
scale and min to get the weights, two FMAs with the activations), in tiles of
4 weight rows × 4 activation rows held in registers. The IR is target-independent:
LLVM lowers `<16 x float>` to one AVX-512 register, two AVX2 registers or four
SSE registers, so no CPU feature check is needed and every x86-64 (and
AArch64) machine runs the same arithmetic in the same order. The reduction
order is fixed (per lane across blocks, then a pairwise tree over the 16
lanes) and the same in every tile shape, so an output does not depend on the
batch it is computed in (batch invariance).

The same holds for the attention pieces: `qk_rows*` (16 scores per broadcast
FMA from keys stored transposed within a cache block), `softmax_weights` (a
vector exp after Cephes' expf), `pv_rows*` (the weighted sum of values), and
`silu_mul16` for the MLP gate. Each has a 4-row form that loads a key or value
vector once for four query rows and gives each row the bits of the 1-row form.
The key and value loads widen a 16-bit cache (`kvdtype`) to float32 exactly, by
the cache array's type; `kv_encode` rounds a float32 to the cache's type.

Block formats: ggml's ggml-common.h (`block_q4_1`, `block_q8_0`).
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu.tilegen import (  # noqa: E402, F401  (the IR helpers, re-exported for the other tiles)
    _F32,
    _I32,
    _V16F,
    _V16I32,
    LANES,
    PREFETCH_ROWS,
    _fma,
    _ivec,
    _load_vec,
    _ptr,
    _splat,
    _tree_sum,
    prefetch,
    prefetch_span,
    reduce_halves,
    tile_intrinsic,
)


_V16I16 = ir.VectorType(ir.IntType(16), LANES)


def _widen_bf16(builder, bits):
    """<16 x i16> bfloat16 → <16 x float>: the bits are a float32's top half."""
    return builder.bitcast(builder.shl(builder.zext(bits, _V16I32), _ivec(16)), _V16F)


def _widen_fp16(builder, bits):
    """<16 x i16> binary16 → <16 x float>, exact for every value: the exponent and mantissa
    shifted into float32's places and rescaled by 2^112 (the bias difference; subnormals
    come out right through the multiply), infinities and NaNs given float32's all-ones exponent."""
    h = builder.zext(bits, _V16I32)
    em = builder.and_(h, _ivec(0x7FFF))
    sign = builder.shl(builder.and_(h, _ivec(0x8000)), _ivec(16))
    scaled = builder.fmul(builder.bitcast(builder.shl(em, _ivec(13)), _V16F), ir.Constant(_V16F, [2.0**112] * LANES))
    mag = builder.bitcast(scaled, _V16I32)
    mag = builder.select(builder.icmp_unsigned(">=", em, _ivec(0x7C00)), builder.or_(mag, _ivec(0x7F800000)), mag)
    return builder.bitcast(builder.or_(mag, sign), _V16F)


def _fpext_fp16(builder, bits):
    """<16 x i16> binary16 → <16 x float> by LLVM's fpext: one vcvtph2ps per 8 or 16 lanes where the
    target has F16C (the avx2 and avx512 paths); elsewhere LLVM would call a runtime helper."""
    return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), LANES)), _V16F)


# binary16 → float32 on this path: F16C's conversion where the path has it, integer operations elsewhere.
_widen_fp16_here = _widen_fp16 if isa.selected().isa == "generic" else _fpext_fp16

# The cache's element type (see `kvdtype`) → how 16 consecutive elements become <16 x float>.
_KV_LOADS = {
    types.float32: lambda builder, ptr: _load_vec(builder, ptr, _V16F, 4),
    types.uint16: lambda builder, ptr: _widen_bf16(builder, _load_vec(builder, ptr, _V16I16, 2)),
    types.int16: lambda builder, ptr: _widen_fp16_here(builder, _load_vec(builder, ptr, _V16I16, 2)),
}


def _i32(value):
    """An i32 constant written as an unsigned bit pattern."""
    return ir.Constant(_I32, value - 2**32 if value >= 2**31 else value)


def _round_bf16(builder, bits):
    """float32 bits → bfloat16 bits (i32), to nearest even; a NaN stays a (quiet) NaN."""
    odd = builder.and_(builder.lshr(bits, _i32(16)), _i32(1))
    rounded = builder.lshr(builder.add(builder.add(bits, _i32(0x7FFF)), odd), _i32(16))
    nan = builder.icmp_unsigned(">", builder.and_(bits, _i32(0x7FFFFFFF)), _i32(0x7F800000))
    return builder.select(nan, builder.or_(builder.lshr(bits, _i32(16)), _i32(0x40)), rounded)


def _round_fp16(builder, bits):
    """float32 bits → binary16 bits (i32), to nearest even, overflow to infinity, subnormals
    rounded by one float add (F. Giesen, "float->half variants", 2012: float_to_half_fast3_rtne)."""
    sign = builder.and_(bits, _i32(0x80000000))
    a = builder.xor(bits, sign)
    inf_nan = builder.select(builder.icmp_unsigned(">", a, _i32(0x7F800000)), _i32(0x7E00), _i32(0x7C00))
    magic = ir.Constant(_F32, 0.5)  # 2^-1: its ulp is binary16's smallest subnormal, 2^-24
    sub = builder.sub(builder.bitcast(builder.fadd(builder.bitcast(a, _F32), magic), _I32), _i32(0x3F000000))
    odd = builder.and_(builder.lshr(a, _i32(13)), _i32(1))
    # rebias the exponent (-112 · 2^23, wrapping) and add half an ulp less one, plus the odd bit
    normal = builder.lshr(builder.add(builder.add(a, _i32(0xC8000FFF)), odd), _i32(13))
    out = builder.select(builder.icmp_unsigned(">=", a, _i32(0x47800000)), inf_nan,
                         builder.select(builder.icmp_unsigned("<", a, _i32(0x38800000)), sub, normal))
    return builder.or_(out, builder.lshr(sign, _i32(16)))


# The cache's element type → how a float32 is rounded to it (identity for float32).
_KV_ROUNDS = {types.uint16: _round_bf16, types.int16: _round_fp16}


@intrinsic
def kv_encode(typingctx, x, cache):
    """x (float32) as an element of the KV array `cache`: unchanged for float32, rounded to nearest
    even for a 16-bit cache (int16: binary16 bits, uint16: bfloat16 bits; see `kvdtype`)."""
    dtype = cache.dtype
    sig = dtype(types.float32, cache)

    def codegen(context, builder, signature, args):
        if dtype == types.float32:
            return args[0]
        bits = _KV_ROUNDS[dtype](builder, builder.bitcast(args[0], _I32))
        return builder.trunc(bits, ir.IntType(16))

    return sig, codegen


# How one 32-column block of each weight layout becomes two <16 x float> weight vectors (columns 0..15 and
# 16..31), keyed by the codes' dtype (and, for int8, whether the scale is one per block or one per 16
# columns): the layout's name, its bytes per block in qs, and whether it has scales (and a min). The
# repacked layouts are `quant`'s: Q4_1 nibbles (Q4_0, Q4_K too), Q8_0 int8 codes (Q5_0 too), Q6_K
# int8 codes with two scales per block, and F32/F16/BF16 as stored (16-bit kinds as bit patterns,
# int16 binary16 and uint16 bfloat16, as `kvdtype` keeps them).
_LAYOUTS = {(types.uint8, 2): ("q4_1", 16), (types.int8, 2): ("q8_0", 32), (types.int8, 3): ("q6_k", 32),
            (types.int16, 2): ("f16", 64), (types.uint16, 2): ("bf16", 64), (types.float32, 2): ("f32", 128)}
_UNSCALED = ("f16", "bf16", "f32")


def tile_layout(qs, scale) -> tuple[str, int]:
    """(layout name, bytes per 32-column block) of a tile's codes and scales (Numba types); raises
    TypeError for a pair no tile multiplies."""
    key = (qs.dtype, scale.ndim)
    if key not in _LAYOUTS:
        raise TypeError(f"no GGUF tile for codes of {qs.dtype} with {scale.ndim}-D scales")
    return _LAYOUTS[key]


def _block_weights(builder, layout, qp, d, m):
    """The block at qp (an element pointer into the codes) → (w_lo, w_hi) <16 x float>: d and m the
    block's splatted scale and min (Q6_K: d a pair, one per 16 columns; unscaled kinds: None)."""
    c16 = ir.Constant(ir.IntType(64), 16)
    if layout == "q4_1":
        q = builder.zext(_load_vec(builder, qp, ir.VectorType(ir.IntType(8), LANES), 1), _V16I32)
        lo = builder.sitofp(builder.and_(q, _ivec(15)), _V16F)
        hi = builder.sitofp(builder.lshr(q, _ivec(4)), _V16F)
        return _fma(builder, lo, d, m), _fma(builder, hi, d, m)
    if layout in ("q8_0", "q6_k"):
        v16i8 = ir.VectorType(ir.IntType(8), LANES)
        lo = builder.sitofp(_load_vec(builder, qp, v16i8, 1), _V16F)
        hi = builder.sitofp(_load_vec(builder, builder.gep(qp, [c16]), v16i8, 1), _V16F)
        d_lo, d_hi = d if layout == "q6_k" else (d, d)
        return builder.fmul(lo, d_lo), builder.fmul(hi, d_hi)
    if layout == "f32":
        return _load_vec(builder, qp, _V16F, 4), _load_vec(builder, builder.gep(qp, [c16]), _V16F, 4)
    widen = _widen_fp16_here if layout == "f16" else _widen_bf16
    return (widen(builder, _load_vec(builder, qp, _V16I16, 2)),
            widen(builder, _load_vec(builder, builder.gep(qp, [c16]), _V16I16, 2)))


def scale_pair(builder, ptr, vec_ty):
    """The two float32 scales at ptr (a block's, one per 16 columns) as vec_ty lanes: the first in
    the lower half of the lanes, the second in the upper half (the integer tiles' lane order)."""
    pair = _load_vec(builder, ptr, ir.VectorType(_F32, 2), 4)
    half = vec_ty.count // 2
    return builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(_I32, vec_ty.count), [0] * half + [1] * half))


def _make_tile(wrows: int, xrows: int):
    """An intrinsic multiplying `wrows` weight rows of GGUF blocks by `xrows` activation rows.

    The layout follows the dtype of qs and the rank of scale (`tile_layout`): uint8 is Q4_1, int8 with
    scale `[rows, blocks]` Q8_0 and with scale `[rows, blocks, 2]` Q6_K (repacked), int16 / uint16 /
    float32 F16 / BF16 / F32 values.

    f(qs, q_off, q_stride, scale, minimum, s_off, s_stride, nblocks, x, x_off, x_stride, out, o_off,
      o_stride) writes, for weight row i < wrows and activation row k < xrows,
      out[o_off + k·o_stride + i] = Σ_b Σ_j w_ibj · x[x_off + k·x_stride + 32b + j]
    with w_ibj = scale_ib · code_ibj + minimum_ib (Q4_1), scale_ib · code_ibj (Q8_0), scale_ib,j//16 ·
    code_ibj (Q6_K) or the value itself (F16, BF16, F32), the codes read from qs at q_off + i·q_stride
    + block elements · b and the scales at s_off + i·s_stride + b (in blocks; Q6_K's pair at twice
    that). qs: Q4_1 uint8, 16 bytes per block in ggml's order (byte j: column j in the low nibble,
    column j + 16 in the high one); Q8_0 and Q6_K int8, 32 codes per block; the float kinds 32
    values per block. scale, minimum, x, out float32 (minimum is ignored but by Q4_1, both by the
    float kinds). Each weight block is decoded once for the `xrows` activation rows and each
    activation block loaded once for the `wrows` weight rows. Every output's arithmetic is the same
    whatever the tile: per lane acc = fma(w_hi, x_hi, fma(w_lo, x_lo, acc)) over the blocks in
    order, then a fixed tree over the 16 lanes.
    """
    return tile_intrinsic(f"tile{wrows}x{xrows}", _TILE_ARGS,
                          lambda arg: (wrows, xrows, *tile_layout(arg["qs"], arg["scale"])), _emit_tile)


_TILE_ARGS = ("qs", "q_off", "q_stride", "scale", "minimum", "s_off", "s_stride", "nblocks", "x", "x_off", "x_stride",
              "out", "o_off", "o_stride")


def _emit_tile(t, state):
    """`_make_tile`'s body: per block, each weight row's weights (`_row_weights`), then two FMAs per pair."""
    wrows, xrows, layout, block_bytes = state
    builder = t.builder
    accs = t.accumulators(_V16F, wrows, xrows)
    with t.loop(t["nblocks"]) as b:
        w = [_row_weights(t, layout, block_bytes, i, b) for i in range(wrows)]
        for k in range(xrows):
            xp = t.at("x", "x_off", "x_stride", k, b, 32)
            x0 = _load_vec(builder, xp, _V16F, 4)
            x1 = _load_vec(builder, builder.gep(xp, [t.c(16)]), _V16F, 4)
            for i in range(wrows):
                acc = _fma(builder, w[i][0], x0, builder.load(accs[k][i]))
                builder.store(_fma(builder, w[i][1], x1, acc), accs[k][i])
    return t.store_outputs(wrows, xrows, lambda k, i: _tree_sum(builder, builder.load(accs[k][i])))


def _row_weights(t, layout, block_bytes, i, b):
    """Weight row i's block b → (w_lo, w_hi) (`_block_weights`), with prefetches of the row PREFETCH_ROWS
    ahead: its codes, scales and mins."""
    builder, c = t.builder, t.c
    per_block = 2 if layout == "q6_k" else 1  # scales per block
    qp = t.at("qs", "q_off", "q_stride", i, b, block_bytes * 8 // t.types["qs"].dtype.bitwidth)
    ahead = builder.bitcast(builder.gep(qp, [builder.mul(t["q_stride"], c(PREFETCH_ROWS))]), ir.IntType(8).as_pointer())
    for line in range(0, block_bytes, 64):
        prefetch(builder, builder.gep(ahead, [ir.Constant(ir.IntType(64), line)]))
    d = m = None
    if layout not in _UNSCALED:
        sp = builder.mul(builder.add(t.row("s_off", "s_stride", i), b), c(per_block))
        prefetch(builder, t.ptr("scale", builder.add(sp, builder.mul(t["s_stride"], c(PREFETCH_ROWS * per_block)))))
        d = tuple(_splat(builder, builder.load(t.ptr("scale", builder.add(sp, c(h))))) for h in range(per_block))
        d = d if layout == "q6_k" else d[0]
    if layout == "q4_1":
        prefetch(builder, t.ptr("minimum", builder.add(sp, builder.mul(t["s_stride"], c(PREFETCH_ROWS)))))
        m = _splat(builder, builder.load(t.ptr("minimum", sp)))
    return _block_weights(builder, layout, qp, d, m)


TILE_W, TILE_X = 4, 4  # weight rows x activation rows per tile
tile_wx, tile_w1, tile1x1 = _make_tile(TILE_W, TILE_X), _make_tile(TILE_W, 1), _make_tile(1, 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_CHUNKS = 16  # weight-row ranges per parallel region (more than threads, for balance)
X_TILE = 64  # activation rows per pass over the weights: 64 x 1536 floats stay in L2


@nb.njit(**_JIT)
def _rows(x, qs, scale, minimum, out, r, wrows, b0, b1):
    """Weight rows r .. r + wrows (4 or 1) against activation rows b0 .. b1, in tiles."""
    rows, cols, qw = qs.shape[0], x.shape[1], qs.shape[1]
    nblocks = cols // 32
    b = b0
    if wrows == TILE_W:
        while b + TILE_X <= b1:
            tile_wx(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += TILE_X
        while b < b1:
            tile_w1(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += 1
    else:
        while b < b1:
            tile1x1(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_blocks(x, qs, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T for W in a tile layout (`tile_layout`).

    Q4_1 (qs uint8 `[rows, cols / 2]`, ggml's block_q4_1 nibbles without the fp16 header):
    W = scale · code + minimum. Q8_0 (qs int8 `[rows, cols]`, block_q8_0's codes): W = scale · code,
    minimum unused (pass scale). scale, minimum float32 `[rows, cols / 32]`, one per 32-column
    block. Q6_K repacked (qs int8 codes c - 32, scale float32 `[rows, cols / 32, 2]`, one per 16
    columns): W = scale · code. F16, BF16, F32 (qs int16 binary16 bits, uint16 bfloat16 bits,
    float32 `[rows, cols]`): W = qs, scale and minimum unused (any 2-D float32 array). cols: a
    multiple of 32. Tiles of 4 weight rows × 4 activation rows, `X_TILE` activation rows per pass
    over the weights; a row's result does not depend on the batch it is in (see `_make_tile`).
    """
    groups, batch = qs.shape[0] // TILE_W, x.shape[0]
    per = (groups + _CHUNKS - 1) // _CHUNKS
    for b0 in range(0, batch, X_TILE):
        b1 = min(batch, b0 + X_TILE)
        for c in prange(_CHUNKS):
            for g in range(c * per, min(groups, (c + 1) * per)):
                _rows(x, qs, scale, minimum, out, TILE_W * g, TILE_W, b0, b1)
        for r in range(TILE_W * groups, qs.shape[0]):
            _rows(x, qs, scale, minimum, out, r, 1, b0, b1)


def _vexp(builder, x):
    """e^x on `<16 x float>` (Cephes expf: range reduction by ln 2, degree-6 polynomial, 2^n by
    exponent bits; relative error about 1e-7 on [-87.3, 88.7], inputs clamped to that range)."""
    def k(v):
        return ir.Constant(_V16F, [v] * LANES)

    def fmax(a, b):
        return builder.select(builder.fcmp_ordered(">", a, b), a, b)

    x = fmax(builder.select(builder.fcmp_ordered("<", x, k(88.3762626647949)), x, k(88.3762626647949)),
             k(-87.3365478515625))
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F]), "llvm.floor.v16f32")
    fx = builder.call(floor, [_fma(builder, x, k(1.44269504088896341), k(0.5))])
    x = _fma(builder, fx, k(-0.693359375), x)
    x = _fma(builder, fx, k(2.12194440e-4), x)
    y = k(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = _fma(builder, y, x, k(c))
    y = builder.fadd(_fma(builder, y, builder.fmul(x, x), x), k(1.0))
    v16i32 = ir.VectorType(_I32, LANES)
    n = builder.fptosi(fx, v16i32)
    two_n = builder.bitcast(builder.shl(builder.add(n, ir.Constant(v16i32, [127] * LANES)),
                                        ir.Constant(v16i32, [23] * LANES)), _V16F)
    return builder.fmul(y, two_n)


def softmax_ir(context, builder, ty, scores, base, lo, n):
    """The IR of `softmax_weights` (lo None) and `attention.softmax_window` (lanes before lo masked too) over
    scores (a float32 array of Numba type ty) at base, n slots: returns the sum of the weights."""
    c = lambda v: ir.Constant(n.type, v)  # noqa: E731
    v16i = ir.VectorType(n.type, LANES)
    lanes = ir.Constant(v16i, list(range(LANES)))
    chunks = builder.sdiv(builder.add(n, c(LANES - 1)), c(LANES))

    def splat_int(value):
        return builder.shuffle_vector(
            builder.insert_element(ir.Constant(v16i, ir.Undefined), value, ir.Constant(_I32, 0)),
            ir.Constant(v16i, ir.Undefined), ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))

    def chunk(index):
        ptr = _ptr(context, builder, ty, scores, builder.add(base, builder.mul(index, c(LANES))))
        start = builder.mul(index, c(LANES))
        below = builder.icmp_signed("<", lanes, splat_int(builder.sub(n, start)))
        if lo is None:
            return ptr, below
        return ptr, builder.and_(below, builder.icmp_signed(">=", lanes, splat_int(builder.sub(lo, start))))

    neg_inf = ir.Constant(_V16F, [float("-inf")] * LANES)
    top = cgutils.alloca_once_value(builder, neg_inf)
    with cgutils.for_range(builder, chunks) as loop:
        ptr, mask = chunk(loop.index)
        v = builder.select(mask, _load_vec(builder, ptr, _V16F, 4), neg_inf)
        old = builder.load(top)
        builder.store(builder.select(builder.fcmp_ordered(">", v, old), v, old), top)
    # max is exact: any order gives the same value
    peak = _splat(builder, reduce_halves(builder, builder.load(top),
                                         lambda a, b: builder.select(builder.fcmp_ordered(">", a, b), a, b)))
    total = cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * LANES))
    with cgutils.for_range(builder, chunks) as loop:
        ptr, mask = chunk(loop.index)
        e = _vexp(builder, builder.fsub(_load_vec(builder, ptr, _V16F, 4), peak))
        e = builder.select(mask, e, ir.Constant(_V16F, [0.0] * LANES))
        builder.store(e, builder.bitcast(ptr, _V16F.as_pointer()), align=4)
        builder.store(builder.fadd(builder.load(total), e), total)
    return _tree_sum(builder, builder.load(total))


@intrinsic
def softmax_weights(typingctx, scores, base, n):
    """In place over scores[base : base + n] (float32): e^(s - max), and return their sum.

    Reads and writes whole 16-lane chunks up to base + n rounded up to 16 (the caller pads the
    row); lanes past n are masked out of the max and the sum. The sum is per lane over the chunks
    in order, then a fixed tree: the same for a row whatever batch it is in.
    """
    sig = types.float32(scores, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        sa, bo, nn = args
        return softmax_ir(context, builder, signature.args[0], sa, bo, None, nn)

    return sig, codegen


@intrinsic
def silu_mul16(typingctx, gate_up, g_off, u_off, out, o_off, n):
    """out[o_off + i] = silu(gate_up[g_off + i]) · gate_up[u_off + i] for i < n (a multiple of 16),
    silu(g) = g / (1 + e^-g) with the vector exp of `softmax_weights`."""
    sig = types.void(gate_up, types.intp, types.intp, out, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        ga, go, uo, oa, oo, nn = args
        ty = signature.args
        c = lambda v: ir.Constant(nn.type, v)  # noqa: E731
        one = ir.Constant(_V16F, [1.0] * LANES)
        with cgutils.for_range(builder, builder.sdiv(nn, c(LANES))) as loop:
            off = builder.mul(loop.index, c(LANES))
            g = _load_vec(builder, _ptr(context, builder, ty[0], ga, builder.add(go, off)), _V16F, 4)
            u = _load_vec(builder, _ptr(context, builder, ty[0], ga, builder.add(uo, off)), _V16F, 4)
            e = _vexp(builder, builder.fsub(ir.Constant(_V16F, [0.0] * LANES), g))
            value = builder.fmul(builder.fdiv(g, builder.fadd(one, e)), u)
            op = builder.bitcast(_ptr(context, builder, ty[3], oa, builder.add(oo, off)), _V16F.as_pointer())
            builder.store(value, op, align=4)
        return context.get_dummy_value()

    return sig, codegen


def _make_attention_rows(rows: int):
    """(qk, pv) intrinsics for `rows` query rows at once; each row's arithmetic equals rows=1's.

    qk(q, q_off, q_stride, kt, kt_off, kt_stride, dim, out, o_off, o_stride, scale): for row r,
      out[o_off + r·o_stride + l] = scale · Σ_i q[q_off + r·q_stride + i] · kt[kt_off + i·kt_stride + l], l < 16
      (one key vector load serves every row).
    pv(p, p_off, p_stride, v, v_off, v_stride, count, acc, a_off, a_stride, dim): for row r,
      acc[a_off + r·a_stride + i] += Σ_{j < count} p[p_off + r·p_stride + j] · v[v_off + j·v_stride + i],
      one fma per term in j order (one value vector load serves every row); dim a multiple of 16.
    kt and v are KV cache arrays of float32 or 16-bit bit patterns (see `kvdtype`), widened to
    float32 as they are loaded.
    """
    ip = types.intp

    def qk(typingctx, q, q_off, q_stride, kt, kt_off, kt_stride, dim, out, o_off, o_stride, scale):
        sig = types.void(q, ip, ip, kt, ip, ip, ip, out, ip, ip, types.float32)
        load = _KV_LOADS[kt.dtype]

        def codegen(context, builder, signature, args):
            qa, qo, qs, ka, ko, kstr, n, oa, oo, ostr, sc = args
            ty = signature.args
            c = lambda v: ir.Constant(n.type, v)  # noqa: E731
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * LANES)) for _ in range(rows)]
            with cgutils.for_range(builder, n) as loop:
                i = loop.index
                kv = load(builder, _ptr(context, builder, ty[3], ka, builder.add(ko, builder.mul(i, kstr))))
                for r in range(rows):
                    qp = _ptr(context, builder, ty[0], qa, builder.add(builder.add(qo, builder.mul(qs, c(r))), i))
                    builder.store(_fma(builder, _splat(builder, builder.load(qp)), kv, builder.load(accs[r])), accs[r])
            for r in range(rows):
                op = _ptr(context, builder, ty[7], oa, builder.add(oo, builder.mul(ostr, c(r))))
                builder.store(builder.fmul(builder.load(accs[r]), _splat(builder, sc)),
                              builder.bitcast(op, _V16F.as_pointer()), align=4)
            return context.get_dummy_value()

        return sig, codegen

    def pv(typingctx, p, p_off, p_stride, v, v_off, v_stride, count, acc, a_off, a_stride, dim):
        sig = types.void(p, ip, ip, v, ip, ip, ip, acc, ip, ip, ip)
        load = _KV_LOADS[v.dtype]

        def codegen(context, builder, signature, args):
            pa, po, ps, va, vo, vs, cnt, aa, ao, astr, n = args
            ty = signature.args
            c = lambda x: ir.Constant(n.type, x)  # noqa: E731
            with cgutils.for_range(builder, builder.sdiv(n, c(LANES))) as chunk:
                d = builder.mul(chunk.index, c(LANES))
                ptrs = [builder.bitcast(_ptr(context, builder, ty[7], aa,
                                             builder.add(builder.add(ao, builder.mul(astr, c(r))), d)),
                                        _V16F.as_pointer()) for r in range(rows)]
                accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * LANES)) for _ in range(rows)]
                for r in range(rows):
                    builder.store(builder.load(ptrs[r], align=4), accs[r])
                with cgutils.for_range(builder, cnt) as loop:
                    j = loop.index
                    vp = _ptr(context, builder, ty[3], va, builder.add(builder.add(vo, builder.mul(j, vs)), d))
                    vv = load(builder, vp)
                    for r in range(rows):
                        pp = _ptr(context, builder, ty[0], pa, builder.add(builder.add(po, builder.mul(ps, c(r))), j))
                        builder.store(_fma(builder, _splat(builder, builder.load(pp)), vv, builder.load(accs[r])),
                                      accs[r])
                for r in range(rows):
                    builder.store(builder.load(accs[r]), ptrs[r], align=4)
            return context.get_dummy_value()

        return sig, codegen

    qk.__name__, pv.__name__ = f"qk_rows{rows}", f"pv_rows{rows}"
    return intrinsic(qk), intrinsic(pv)


qk_rows4, pv_rows4 = _make_attention_rows(4)
qk_rows8, pv_rows8 = _make_attention_rows(8)
qk_rows1, pv_rows1 = _make_attention_rows(1)
