"""Row-times-activation dot products of GGUF blocks, written as LLVM vector IR.

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

Block formats: ggml's ggml-common.h (`block_q4_1`, `block_q8_0`).
"""

from __future__ import annotations

import numba as nb
from llvmlite import ir
from numba import prange
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, LANES)


def _ptr(context, builder, ty, value, offset):
    """Address of element `offset` of a Numba array value."""
    data = context.make_array(ty)(context, builder, value).data
    return builder.gep(data, [offset])


def _load_vec(builder, ptr, vec_ty, align):
    return builder.load(builder.bitcast(ptr, vec_ty.as_pointer()), align=align)


def _splat(builder, scalar):
    vec = builder.insert_element(ir.Constant(_V16F, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))


def _tree_sum(builder, vec):
    """Sum of 16 lanes, pairwise: (0..7 + 8..15), then halves again (fixed order)."""
    width = LANES
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width), list(range(width))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _fma(builder, a, b, c):
    """a * b + c on `<16 x float>`, fused (llvm.fma: one vfmadd where the target has FMA)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _make_tile(wrows: int, xrows: int):
    """An intrinsic multiplying `wrows` weight rows of GGUF blocks by `xrows` activation rows.

    The block type follows the dtype of qs: uint8 is Q4_1, int8 is Q8_0.

    f(qs, q_off, q_stride, scale, minimum, s_off, s_stride, nblocks, x, x_off, x_stride, out, o_off,
      o_stride) writes, for weight row i < wrows and activation row k < xrows,
      out[o_off + k·o_stride + i] = Σ_b Σ_j w_ibj · x[x_off + k·x_stride + 32b + j]
    with w_ibj = scale_ib · code_ibj + minimum_ib (Q4_1) or scale_ib · code_ibj (Q8_0), the codes
    read from qs at q_off + i·q_stride + block bytes · b and the scales at s_off + i·s_stride + b.
    qs: Q4_1 uint8, 16 bytes per block in ggml's order (byte j: column j in the low nibble, column
    j + 16 in the high one); Q8_0 int8, 32 codes per block. scale, minimum, x, out float32
    (minimum is ignored for Q8_0). Each weight block is dequantized once for the `xrows` activation
    rows and each activation block loaded once for the `wrows` weight rows. Every output's
    arithmetic is the same whatever the tile: per lane acc = fma(w_hi, x_hi, fma(w_lo, x_lo, acc))
    over the blocks in order, then a fixed tree over the 16 lanes.
    """
    v16i8 = ir.VectorType(ir.IntType(8), LANES)
    v16i32 = ir.VectorType(_I32, LANES)

    def generic(typingctx, qs, q_off, q_stride, scale, minimum, s_off, s_stride, nblocks, x, x_off, x_stride,
                out, o_off, o_stride):
        ip = types.intp
        sig = types.void(qs, ip, ip, scale, minimum, ip, ip, ip, x, ip, ip, out, ip, ip)
        kind = "q4_1" if qs.dtype == types.uint8 else "q8_0"

        def codegen(context, builder, signature, args):
            (qa, qo, qstr, sa, ma, so, sstr, n, xa, xo, xstr, oa, oo, ostr) = args
            ty = signature.args
            c = lambda v: ir.Constant(n.type, v)  # noqa: E731
            zero = ir.Constant(_V16F, [0.0] * LANES)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(wrows)] for _ in range(xrows)]
            with cgutils.for_range(builder, n) as loop:
                b = loop.index
                w = []
                for i in range(wrows):
                    row_q = builder.add(qo, builder.mul(qstr, c(i)))
                    sp = builder.add(builder.add(so, builder.mul(sstr, c(i))), b)
                    d = _splat(builder, builder.load(_ptr(context, builder, ty[3], sa, sp)))
                    if kind == "q4_1":
                        qp = _ptr(context, builder, ty[0], qa, builder.add(row_q, builder.mul(b, c(16))))
                        q = builder.zext(_load_vec(builder, qp, v16i8, 1), v16i32)
                        lo = builder.sitofp(builder.and_(q, ir.Constant(v16i32, [15] * LANES)), _V16F)
                        hi = builder.sitofp(builder.lshr(q, ir.Constant(v16i32, [4] * LANES)), _V16F)
                        m = _splat(builder, builder.load(_ptr(context, builder, ty[4], ma, sp)))
                        w.append((_fma(builder, lo, d, m), _fma(builder, hi, d, m)))
                    else:
                        qp = _ptr(context, builder, ty[0], qa, builder.add(row_q, builder.mul(b, c(32))))
                        lo = builder.sitofp(_load_vec(builder, qp, v16i8, 1), _V16F)
                        hi = builder.sitofp(_load_vec(builder, builder.gep(qp, [c(16)]), v16i8, 1), _V16F)
                        w.append((builder.fmul(lo, d), builder.fmul(hi, d)))
                for k in range(xrows):
                    xp = _ptr(context, builder, ty[8], xa,
                              builder.add(builder.add(xo, builder.mul(xstr, c(k))), builder.mul(b, c(32))))
                    x0 = _load_vec(builder, xp, _V16F, 4)
                    x1 = _load_vec(builder, builder.gep(xp, [c(16)]), _V16F, 4)
                    for i in range(wrows):
                        acc = _fma(builder, w[i][0], x0, builder.load(accs[k][i]))
                        builder.store(_fma(builder, w[i][1], x1, acc), accs[k][i])
            for k in range(xrows):
                for i in range(wrows):
                    op = builder.add(builder.add(oo, builder.mul(ostr, c(k))), c(i))
                    builder.store(_tree_sum(builder, builder.load(accs[k][i])), _ptr(context, builder, ty[11], oa, op))
            return context.get_dummy_value()

        return sig, codegen

    generic.__name__ = f"tile{wrows}x{xrows}"
    return intrinsic(generic)


tile4x4, tile4x1, tile1x1 = _make_tile(4, 4), _make_tile(4, 1), _make_tile(1, 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_CHUNKS = 16  # weight-row ranges per parallel region (more than threads, for balance)
X_TILE = 64  # activation rows per pass over the weights: 64 x 1536 floats stay in L2


@nb.njit(**_JIT)
def _rows(x, qs, scale, minimum, out, r, wrows, b0, b1):
    """Weight rows r .. r + wrows (4 or 1) against activation rows b0 .. b1, in tiles."""
    rows, nblocks, cols, qw = qs.shape[0], scale.shape[1], x.shape[1], qs.shape[1]
    b = b0
    if wrows == 4:
        while b + 4 <= b1:
            tile4x4(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += 4
        while b < b1:
            tile4x1(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += 1
    else:
        while b < b1:
            tile1x1(qs, r * qw, qw, scale, minimum, r * nblocks, nblocks, nblocks, x, b * cols, cols,
                    out, b * rows + r, rows)
            b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_blocks(x, qs, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T for W in Q4_1 or Q8_0 blocks.

    Q4_1 (qs uint8 `[rows, cols / 2]`, ggml's block_q4_1 nibbles without the fp16 header):
    W = scale · code + minimum. Q8_0 (qs int8 `[rows, cols]`, block_q8_0's codes): W = scale · code,
    minimum unused (pass scale). scale, minimum float32 `[rows, cols / 32]`, one per 32-column
    block. Tiles of 4 weight rows × 4 activation rows, `X_TILE` activation rows per pass over the
    weights; a row's result does not depend on the batch it is in (see `_make_tile`).
    """
    groups, batch = qs.shape[0] // 4, x.shape[0]
    per = (groups + _CHUNKS - 1) // _CHUNKS
    for b0 in range(0, batch, X_TILE):
        b1 = min(batch, b0 + X_TILE)
        for c in prange(_CHUNKS):
            for g in range(c * per, min(groups, (c + 1) * per)):
                _rows(x, qs, scale, minimum, out, 4 * g, 4, b0, b1)
        for r in range(4 * groups, qs.shape[0]):
            _rows(x, qs, scale, minimum, out, r, 1, b0, b1)
