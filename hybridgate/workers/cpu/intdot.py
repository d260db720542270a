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
FMA on the int32 lanes, whatever the weight type (on the avx2 path once per
four blocks, see `_make_itile`).

Paths: `avx512` calls `llvm.x86.avx512.pmaddw.d.512` (32 products into 16
lanes) and accumulates in 16 float lanes; `avx2` calls `llvm.x86.avx2.pmadd.wd`
twice and adds the halves (exact) into 8 float lanes, sums four blocks' lanes
with `llvm.x86.avx2.phadd.d`, and from 4 activation rows on widens each weight
row's codes once into a small int16 buffer that every tile then reads;
`generic` writes the same products as portable IR (sign-extend, multiply, add
lane pairs). The integer sums are exact, so lane layouts differ between paths
only in the float accumulation order, which is fixed within a path: a row's
result does not depend on the batch or tile it is computed in.

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
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu.simd import PREFETCH_ROWS, X_TILE, _load_vec, _ptr, prefetch_span  # noqa: E402

FORMATS = ("auto", "f32", "i16")  # the cpu_activations setting's choices
# "auto": the faster format of each weight type on each path, measured on one thread with the default
# model's matrices (batch 1 and 16, AVX-512 machine, both paths): on AVX-512 the float kernels beat
# int16 on Q4_1 (0.9x at batch 1, 0.5-0.8x at 16), int16 wins on Q8_0 (1.3x); on AVX2 int16 wins on
# both (1.6-1.7x), where the 8-lane float kernels need twice the converts. The generic path (merely
# correct, unmeasured) keeps float32.
AUTO = {"avx512": {"q4_1": "f32", "q8_0": "i16"}, "avx2": {"q4_1": "i16", "q8_0": "i16"},
        "generic": {"q4_1": "f32", "q8_0": "f32"}}
ACC_LANES = 16 if _ISA == "avx512" else 8  # float accumulator lanes: one register on each path
XQ_MAX = 32767.0  # int16 activations stay in ±32767, so a pair product never meets vpmaddwd's one overflow

_F32 = ir.FloatType()
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_VACC = ir.VectorType(_F32, ACC_LANES)
_VACCI = ir.VectorType(_I32, ACC_LANES)


def activation_format(activations: str, kind: str) -> str:
    """The format a `kind` ("q4_1" or "q8_0") matmul uses: "f32" (`simd.matmul_blocks`) or "i16"
    (`matmul_i16`). activations: one of FORMATS; "auto" picks by this process's path (`AUTO`).
    Raises ValueError naming cpu_activations for another name."""
    if activations not in FORMATS:
        raise ValueError(f"cpu_activations: expected one of {', '.join(FORMATS)}, got {activations!r}")
    return AUTO[_ISA][kind] if activations == "auto" else activations


def _lanes(builder, vec, lo: int, count: int):
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, count), list(range(lo, lo + count))))


def _splat(builder, scalar, vec_ty):
    n = vec_ty.count
    vec = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _pair_products(builder, w, x):
    """<32 x i16> w, x → <ACC_LANES x i32> whose lanes sum to Σ_j w_j x_j (exactly)."""
    if _ISA == "avx512":
        ty = ir.FunctionType(ir.VectorType(_I32, 16), [ir.VectorType(_I16, 32)] * 2)
        fn = cgutils.get_or_insert_function(builder.module, ty, "llvm.x86.avx512.pmaddw.d.512")
        return builder.call(fn, [w, x])
    if _ISA == "avx2":
        ty = ir.FunctionType(ir.VectorType(_I32, 8), [ir.VectorType(_I16, 16)] * 2)
        fn = cgutils.get_or_insert_function(builder.module, ty, "llvm.x86.avx2.pmadd.wd")
        lo = builder.call(fn, [_lanes(builder, w, 0, 16), _lanes(builder, x, 0, 16)])
        hi = builder.call(fn, [_lanes(builder, w, 16, 16), _lanes(builder, x, 16, 16)])
        return builder.add(lo, hi)
    v32 = ir.VectorType(_I32, 32)
    p = builder.mul(builder.sext(w, v32), builder.sext(x, v32))
    p = builder.add(builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))),
                    builder.shuffle_vector(p, p, ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))))
    return builder.add(_lanes(builder, p, 0, 8), _lanes(builder, p, 8, 8))


def _tree_sum(builder, vec):
    width = vec.type.count
    while width > 1:
        width //= 2
        vec = builder.fadd(_lanes(builder, vec, 0, width), _lanes(builder, vec, width, width))
    return builder.extract_element(vec, ir.Constant(_I32, 0))


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


def _phadd(builder, a, b):
    """AVX2's vphaddd on <8 x i32>: per 128-bit half, [a0+a1, a2+a3, b0+b1, b2+b3]."""
    ty = ir.VectorType(_I32, 8)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty]), "llvm.x86.avx2.phadd.d")
    return builder.call(fn, [a, b])


def _dup4(builder, vec4):
    """<4 x float> → <8 x float> [v0..v3, v0..v3] (one vbroadcastf128 from memory)."""
    return builder.shuffle_vector(vec4, vec4, ir.Constant(ir.VectorType(_I32, 8), [0, 1, 2, 3] * 2))


def _make_itile(wrows: int, xrows: int, quad: bool, unpacked: bool):
    """An intrinsic: `wrows` weight rows of GGUF blocks times `xrows` int16 activation rows.

    f(qs, q_off, q_stride, wq, w_off, w_stride, scale, minimum, s_off, s_stride, nblocks, xq, x_off,
      x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride) writes, for weight row i and
      activation row k,
      out[o_off + k·o_stride + i] = Σ_b d_ib · xs_kb · Σ_j q_ibj · xq_kbj + Σ_b m_ib · xsum_kb
    (the m term for Q4_1 only) with d_ib, m_ib at scale/minimum[s_off + i·s_stride + b], xs_kb and
    xsum_kb at xs/xsum[a_off + k·a_stride + b], xq int16 at x_off + k·x_stride + 32b. The codes
    come from qs (as in `simd._make_tile`, row i at q_off + i·q_stride) or, `unpacked`, from wq,
    the rows already widened to int16 in column order by `unpack_rows` (row i at w_off + i·w_stride).

    Per pair (i, k) and block: P_ibk = Σ_j q_ibj · xq_kbj exact in int32 lanes (`_pair_products`),
    acc = fma(float(P) · xs_kb, d_ib, acc) over the blocks in order. `quad` (the avx2 path): four
    blocks at a time, their 8-lane P summed down to two lanes each by three `vphaddd` (exact), so
    the convert, multiply and FMA are paid once per four blocks, with [d_b0..d_b3, d_b0..d_b3] and
    the same of xs as the scale vectors, and the m term folded in as one more FMA on the low four
    lanes ([m_b0..m_b3, 0, 0, 0, 0] times the xsum vector); blocks past the last four one at a time
    (the m term in lane 0). Otherwise the m term is a second pass over the blocks after the first,
    one FMA chain per pair in block order, vectorized across the tile's activation rows. Then a
    fixed lane tree. The same operations for a pair whatever the tile and whichever source of codes:
    a row's result does not depend on its batch. The m term stays out of the per-block float chain
    of scalars: inside it, the tile's scalar m chains spilled AVX2's 16 registers on every block.
    The tile issues no prefetches: `_irows` asks for the rows ahead once per row group.
    """

    def generic(typingctx, qs, q_off, q_stride, wq, w_off, w_stride, scale, minimum, s_off, s_stride, nblocks,
                xq, x_off, x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride):
        ip = types.intp
        sig = types.void(qs, ip, ip, wq, ip, ip, scale, minimum, ip, ip, ip, xq, ip, ip, xs, xsum, ip, ip,
                         out, ip, ip)
        kind = "q4_1" if qs.dtype == types.uint8 else "q8_0"

        def codegen(context, builder, signature, args):
            (qa, qo, qstr, wa, wo, wstr, sa, ma, so, sstr, n, xa, xo, xstr, xsa, xma, ao, astr,
             oa, oo, ostr) = args
            ty = dict(zip(("qs", "wq", "scale", "minimum", "xq", "xs", "xsum", "out"),
                          (signature.args[i] for i in (0, 3, 6, 7, 11, 14, 15, 18))))
            q41 = kind == "q4_1"
            fold = fold_m and q41  # the m term inside the block loop (Q8_0 has none)
            c = lambda v: ir.Constant(n.type, v)  # noqa: E731
            zero = ir.Constant(_VACC, [0.0] * ACC_LANES)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(wrows)] for _ in range(xrows)]
            block_bytes = 16 if kind == "q4_1" else 32
            v32 = ir.VectorType(_I16, 32)

            def codes(i, b):
                if unpacked:
                    off = builder.add(builder.add(wo, builder.mul(wstr, c(i))), builder.mul(b, c(32)))
                    return _load_vec(builder, _ptr(context, builder, ty["wq"], wa, off), v32, 2)
                qoff = builder.add(builder.add(qo, builder.mul(qstr, c(i))), builder.mul(b, c(block_bytes)))
                return _weights_i16(context, builder, kind, ty["qs"], qa, qoff)

            def acts(k, b):
                xp = _ptr(context, builder, ty["xq"], xa,
                          builder.add(builder.add(xo, builder.mul(xstr, c(k))), builder.mul(b, c(32))))
                return _load_vec(builder, xp, v32, 2)

            arrays = {"scale": sa, "minimum": ma, "xs": xsa, "xsum": xma}

            def at(arr, base, stride, i, b):
                return _ptr(context, builder, ty[arr], arrays[arr], builder.add(builder.add(base, builder.mul(stride, c(i))), b))

            def splat_at(arr, base, stride, i, b):
                return _splat(builder, builder.load(at(arr, base, stride, i, b)), _VACC)

            def dup4_at(arr, base, stride, i, b):
                return _dup4(builder, _load_vec(builder, at(arr, base, stride, i, b), ir.VectorType(_F32, 4), 4))

            zeros = ir.Constant(_VACC, [0.0] * ACC_LANES)

            def low(vec, count):
                """The first `count` lanes of vec, zeros above."""
                keep = list(range(count)) + [ACC_LANES] * (ACC_LANES - count)
                return builder.shuffle_vector(vec, zeros, ir.Constant(ir.VectorType(_I32, ACC_LANES), keep))

            def one_block(b):
                w = [codes(i, b) for i in range(wrows)]
                d = [splat_at("scale", so, sstr, i, b) for i in range(wrows)]
                m = [low(splat_at("minimum", so, sstr, i, b), 1) for i in range(wrows)] if fold else []
                for k in range(xrows):
                    xv = acts(k, b)
                    s = splat_at("xs", ao, astr, k, b)
                    t = splat_at("xsum", ao, astr, k, b) if fold else None
                    for i in range(wrows):
                        p = builder.fmul(builder.sitofp(_pair_products(builder, w[i], xv), _VACC), s)
                        acc = _fma(builder, p, d[i], builder.load(accs[k][i]))
                        builder.store(_fma(builder, m[i], t, acc) if fold else acc, accs[k][i])

            def four_blocks(b):
                bs = [builder.add(b, c(j)) for j in range(4)]
                d = [dup4_at("scale", so, sstr, i, b) for i in range(wrows)]
                m = [low(dup4_at("minimum", so, sstr, i, b), 4) for i in range(wrows)] if fold else []
                for k in range(xrows):
                    xv = [acts(k, bj) for bj in bs]
                    s = dup4_at("xs", ao, astr, k, b)
                    t = dup4_at("xsum", ao, astr, k, b) if fold else None
                    for i in range(wrows):
                        p = [_pair_products(builder, codes(i, bj), xv[j]) for j, bj in enumerate(bs)]
                        h = _phadd(builder, _phadd(builder, p[0], p[1]), _phadd(builder, p[2], p[3]))
                        f = builder.fmul(builder.sitofp(h, _VACC), s)
                        acc = _fma(builder, f, d[i], builder.load(accs[k][i]))
                        builder.store(_fma(builder, m[i], t, acc) if fold else acc, accs[k][i])

            if quad:
                quads = builder.sdiv(n, c(4))
                with cgutils.for_range(builder, quads) as loop:
                    four_blocks(builder.mul(loop.index, c(4)))
                tail = builder.sub(n, builder.mul(quads, c(4)))
                with cgutils.for_range(builder, tail) as loop:
                    one_block(builder.add(builder.mul(quads, c(4)), loop.index))
            else:
                with cgutils.for_range(builder, n) as loop:
                    one_block(loop.index)
            vxt = ir.VectorType(_F32, xrows)
            maccs = [cgutils.alloca_once_value(builder, ir.Constant(vxt, [0.0] * xrows)) for _ in range(wrows)]
            if q41 and not fold:
                with cgutils.for_range(builder, n) as loop:
                    b = loop.index
                    totals = ir.Constant(vxt, ir.Undefined)
                    for k in range(xrows):
                        totals = builder.insert_element(totals, builder.load(at("xsum", ao, astr, k, b)),
                                                        ir.Constant(_I32, k))
                    for i in range(wrows):
                        m = _splat(builder, builder.load(at("minimum", so, sstr, i, b)), vxt)
                        builder.store(_fma(builder, m, totals, builder.load(maccs[i])), maccs[i])
            for k in range(xrows):
                for i in range(wrows):
                    op = builder.add(builder.add(oo, builder.mul(ostr, c(k))), c(i))
                    mterm = builder.extract_element(builder.load(maccs[i]), ir.Constant(_I32, k))
                    value = builder.fadd(_tree_sum(builder, builder.load(accs[k][i])), mterm)
                    builder.store(value, _ptr(context, builder, ty["out"], oa, op))
            return context.get_dummy_value()

        return sig, codegen

    fold_m = quad  # see the docstring
    generic.__name__ = f"itile{wrows}x{xrows}{'q' if quad else ''}{'u' if unpacked else ''}"
    return intrinsic(generic)


@intrinsic
def unpack_rows(typingctx, qs, q_off, q_stride, nblocks, rows, wq):
    """wq[i·32·nblocks + 32b + j] = code j of block b of weight row i < rows (int16, column order; qs
    as in `_make_itile`, row i at q_off + i·q_stride): the codes widened once for every tile
    that reads them."""
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
                v = _weights_i16(context, builder, kind, signature.args[0], qa, qoff)
                woff = builder.add(builder.mul(row.index, builder.mul(n, c(32))), builder.mul(loop.index, c(32)))
                dst = builder.bitcast(_ptr(context, builder, signature.args[5], wa, woff), v.type.as_pointer())
                builder.store(v, dst, align=2)
        return context.get_dummy_value()

    return sig, codegen


# Weight rows × activation rows per tile, by path: a tile's accumulators and its rows' codes stay in
# registers (32 on AVX-512, 16 on AVX2). Measured on one thread, AVX2 forced on the AVX-512 machine, the
# default model's Q4_1 matrices (all 30 layers in turn), per-block tiles: 2x4 against 4x4 and 4x2, 39.6
# against 34.0 and 30.3 GMAC/s at batch 16, 18.3 against 10.3 and 15.4 at batch 1 (the old 4x4 tile with
# the m term inside: 32.7 and 14.3); with `quad` and `unpacked`, 2x4 against 1x4, 2x2 and 1x2 gave 39.5,
# 39.7, 37.4 and 25.0 at batch 16 and 42.9, 31.2, 41.0 and 32.8 at batch 64. At about 40 GMAC/s (13 MACs
# a cycle) one core runs near one vpmaddwd a cycle, the bound of 16-bit products on AVX2: `quad` gained
# 1.01-1.05x over per-block tiles there, not the 1.3x its count of float instructions promised.
TILE = {"avx512": (4, 4), "avx2": (2, 4), "generic": (4, 4)}
TILE_W, TILE_X = TILE[_ISA]
QUAD = _ISA == "avx2"  # vphaddd is an AVX2 instruction (no 512-bit form); see `_make_itile`
UNPACK_MIN = 4 if QUAD else 1 << 30  # activation rows from which a row group's codes are widened once first
itile_wx, itile_w1, itile_11 = (_make_itile(TILE_W, TILE_X, QUAD, False), _make_itile(TILE_W, 1, QUAD, False),
                                _make_itile(1, 1, QUAD, False))
itile_wx_u, itile_w1_u = _make_itile(TILE_W, TILE_X, QUAD, True), _make_itile(TILE_W, 1, QUAD, True)

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
def _irows(xq, xs, xsum, qs, scale, minimum, out, r, wrows, b0, b1, wq):
    """Weight rows r .. r + wrows (TILE_W or 1) against activation rows b0 .. b1, in tiles; from
    UNPACK_MIN activation rows on, the rows' codes are widened into wq (int16, TILE_W · cols) once."""
    rows, nblocks, cols, qw, batch = qs.shape[0], scale.shape[1], xq.shape[1], qs.shape[1], xq.shape[0]
    ahead = r + PREFETCH_ROWS  # see simd.PREFETCH_ROWS
    prefetch_span(qs, ahead * qw, wrows * qw)
    prefetch_span(scale, ahead * nblocks, wrows * nblocks)
    prefetch_span(minimum, ahead * nblocks, wrows * nblocks)
    b = b0
    if wrows == TILE_W and b1 - b0 >= UNPACK_MIN:
        unpack_rows(qs, r * qw, qw, nblocks, wrows, wq)
        while b + TILE_X <= b1:
            itile_wx_u(qs, r * qw, qw, wq, 0, cols, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                       cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            b += TILE_X
        while b < b1:
            itile_w1_u(qs, r * qw, qw, wq, 0, cols, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                       cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            b += 1
    elif wrows == TILE_W:
        while b + TILE_X <= b1:
            itile_wx(qs, r * qw, qw, wq, 0, cols, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                     cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            b += TILE_X
        while b < b1:
            itile_w1(qs, r * qw, qw, wq, 0, cols, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                     cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            b += 1
    else:
        while b < b1:
            itile_11(qs, r * qw, qw, wq, 0, cols, scale, minimum, r * nblocks, nblocks, nblocks, xq, b * cols,
                     cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_i16(x, qs, scale, minimum, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T with x quantized to int16 per
    32-block first (`quantize_i16`); W as in `simd.matmul_blocks` (Q4_1 uint8 nibbles or Q8_0
    int8 codes, float32 scale and minimum `[rows, cols / 32]`; minimum unused for Q8_0). Error:
    the activations' quantization, about 1.5e-5 of each block's largest value. Tiles of
    `TILE[path]` weight rows × activation rows."""
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
            wq = np.empty(TILE_W * cols if b1 - b0 >= UNPACK_MIN else 0, dtype=np.int16)
            for g in range(c * per, min(groups, (c + 1) * per)):
                _irows(xq, xs, xsum, qs, scale, minimum, out, TILE_W * g, TILE_W, b0, b1, wq)
        wq = np.empty(0, dtype=np.int16)
        for r in range(TILE_W * groups, qs.shape[0]):
            _irows(xq, xs, xsum, qs, scale, minimum, out, r, 1, b0, b1, wq)


if _ISA == "avx2":  # in-lane widening and one float step per block (see `avx2`)
    from hybridgate.workers.cpu.avx2 import matmul_i16  # noqa: E402, F811
