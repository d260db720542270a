"""The avx2 and avx512 paths' Q4_K, Q5_K and Q6_K matmuls: sub-block scales applied in integers, one float step per 256 columns.

Q4_K stores w = d·sc_b·c + m_b per 32-column sub-block b of a 256-column super-block (c a 4-bit
code, sc_b a 6-bit unsigned scale, d an fp16; m_b = -dmin·min_b). `avx2.matmul_i16` multiplies it
as Q4_1, converting each sub-block's integer sum to float (convert, multiply by the activation
scale, FMA with d·sc_b): three float operations per pair of rows and block beside two `vpmaddwd`.
Here the activations share one int16 scale per super-block, xs = max|x_sb| / 32767, so the
sub-block scales stay integers:

    Σ_b d·sc_b·xs·P_b  =  d·xs · Σ_b sc_b·P_b,    P_b = Σ_j c_bj·xq_bj

summed exactly in int32 lanes (a lane holds 4 products a block: at most 8 · 4 · 15 · 63 · 32767
< 2^31), then one float step per super-block: acc = fma(float(S) · xs, d, acc) on 8 lanes. Below
UNPACK_MIN activation rows (the GEMV tiles) the codes are widened from the nibbles and each block's
lane sums multiplied by sc_b (`vpmulld`); from UNPACK_MIN on, a row group's codes are widened once
into a scratch already multiplied by sc_b (c·sc_b ≤ 945 fits int16), so the GEMM tiles do two
`vpmaddwd` and two adds per pair and block (avx512: from PACKED_MAX rows). Both give the same integers, and the
same float operations follow: a row's result does not depend on its batch.

Lanes: a block's 16 bytes of nibbles (Q4_1's order: byte j holds column j low, j + 16 high) are
loaded into both 128-bit halves; a per-half shift of the 32-bit lanes (`vpsrlvd` by 0 | 4, then by
8 | 12) and a mask of 0x000F000F give columns 0, 2, .., 14 | 16, 18, .., 30, then 1, 3, .., 15 |
17, .., 31 as 16-bit lanes: each block's even columns, then its odd ones, the activation order of
`avx2.quantize_block`. The mins stay bytes beside -dmin per super-block (4.75 bits a weight, GGUF's
4.5): the min term, [-dmin·min_b] · [xs·Σ_j xq_bj] for the super-block's 8 blocks, is one 8-lane FMA
into the same float accumulator at each float step.

Q5_K is Q4_K with a 5th code bit: its codes 0..31 are kept whole as int8 in column order and widened
as Q6_K's below (a lane's bound over 8 blocks: 8 · 4 · 31 · 63 · 32767 < 2^31). Q6_K (w = d·sc_h·(c - 32)
per 16-column half h of a block, sc_h a signed byte) runs the same way (`KINDS`): its codes c - 32 are int8 in column order, loaded as 16-bit lanes and split by shifts into
even and odd columns (as `avx2._codes`), so int32 lanes 0..3 hold a block's columns 0..15 and lanes
4..7 columns 16..31, and the scale vector is [sc_0 ×4, sc_1 ×4] (in the scratch [sc_0 ×8, sc_1 ×8]:
16-bit lanes 0..7 are columns 0..14 or 1..15). A lane then takes 4 · 32 · 128 · 32767 ≤ 2^29 a
block, so its float step comes every 4 blocks (16 products of at most 2^27: 2,147,418,112 < 2^31),
with the super-block's one xs and d; it has no min term.

The avx512 path holds a block's 32 codes in one register as 16-bit lanes in column order (the
nibbles zero-extended, the low 4 bits masked and the high shifted into lanes 16..31; int8 codes
sign-extended), multiplies them by the sub-block scale in int16 (`vpmullw`; Q6_K's two scales as
[sc_0 ×16, sc_1 ×16]) and adds each pair and block with one `vpdpwssd` (VNNI; `vpmaddwd` and an add
without) into 16 int32 lanes: 2 products a lane and block, so every type's float step is a super-block
(Q6_K: 8 · 2 · 32 · 128 · 32767 = 2,147,418,112 < 2^31). The activations are stored in column order.
Q6_K's codes stay 6 bits there (`pack_q6k`: 6.6 bits a weight instead of 8.6; a decode step reads its
weights once, so bytes are time): the low 4 bits as Q4_K's nibbles, the top 2 of columns p + 8t at bits
2t of byte p, widened by a repeat of the 8 bytes in each 128-bit quarter and a per-quarter shift
(`vpsrlvw`). LLVM's machine combiner turns the `vpdpwssd` intrinsic back into `vpmaddwd` and `vpaddd`
(twice the uops; the GEMM tiles ran at about 0.7x), so `_dot` writes it as inline assembly.

Error: the activations' rounding, at most xs / 2 = max|x_sb| / 65534 per element.

Sources: ggml's `block_q4_K` (ggml-common.h) and `dequantize_row_q4_K` (ggml-quants.c); ggml-cpu's
`ggml_vec_dot_q4_K_q8_K` and `dequantize_row_q6_K` (integer sub-block scales, one float step per super-block; with int8
activations there); Intel's intrinsics guide for `vpmaddwd`, `vpdpwssd`, `vpsrlvd`, `vpsrlvw` and `vpmulld`.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

from typing import NamedTuple  # noqa: E402

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu import simd  # noqa: E402
from hybridgate.workers.cpu.avx2 import GEMV_W, UNPACK_MIN, _codes, _fma, _madd, _splat8  # noqa: E402
from hybridgate.workers.cpu.simd import PREFETCH_ROWS, X_TILE, _load_vec, _ptr, _tree_sum, prefetch_span  # noqa: E402
from hybridgate.workers.cpu.superpack import (  # noqa: E402, F401  (re-exported: the weights' repacking)
    SUPER,
    pack_q6k,
    q5k_codes,
    split_q6k,
    split_scales,
    unpack_q6k,
)
from hybridgate.workers.cpu.tilegen import tile_intrinsic  # noqa: E402

BLOCKS = SUPER // 32  # sub-blocks per super-block
XQ_MAX = 32767.0
_TARGET = isa.selected()
# The avx512 path holds a block's 32 int16 codes in one register: codes times sc in int16, then one
# vpdpwssd (VNNI) or vpmaddwd and add per pair and block, in 16 int32 lanes; avx2 splits a block in two.
WIDE = _TARGET.isa == "avx512"
if WIDE and _TARGET.vnni:
    import llvmlite.binding as _llvm

    _llvm.initialize_native_asmparser()  # for `_dot`'s inline vpdpwssd
LANES = 16 if WIDE else 8  # int32 lanes of a pair's integer sums, float lanes of its float steps
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V8I = ir.VectorType(_I32, 8)
_V8B = ir.VectorType(_I8, 8)
_V8F = ir.VectorType(ir.FloatType(), 8)
_V4I = ir.VectorType(_I32, 4)
_V16S = ir.VectorType(_I16, 16)
_V32S = ir.VectorType(_I16, 32)
_VI = ir.VectorType(_I32, LANES)
_VF = ir.VectorType(ir.FloatType(), LANES)
_MASK = ir.Constant(_V8I, [0x000F000F] * 8)


class Kind(NamedTuple):
    """What differs between the types this module multiplies (selected by the dtypes of codes and scales)."""

    name: str
    code_bytes: int  # bytes of codes per 32-column block in qs
    scales: int  # sub-block scales per 32-column block
    term: int  # the largest |code · sub-block scale|: times 32767, a product's bound
    has_min: bool

    @property
    def step(self) -> int:
        """Blocks per float step: the most (a divisor of BLOCKS) whose products an int32 lane can sum, a
        block giving each lane 32 / LANES of them (avx2: Q4_K and Q5_K 8, Q6_K 4; avx512: 8)."""
        most = (2**31 - 1) // (self.term * 32767 * (32 // LANES))
        return max(s for s in (1, 2, 4, 8) if s <= most)


# (codes, sub-block scales) → the type: Q4_K nibbles, Q5_K whole codes 0..31 and Q6_K codes c - 32 as int8;
# the 6-bit unsigned scales of Q4_K/Q5_K as uint8, Q6_K's signed ones as int8. Q5_K's bound over 8 blocks:
# 8 · 4 · 31 · 63 · 32767 = 2,047,806,432 < 2^31.
KINDS = {(types.uint8, types.uint8): Kind("q4_k", 16, 1, 15 * 63, True),
         (types.int8, types.uint8): Kind("q5_k", 32, 1, 31 * 63, True),
         (types.int8, types.int8): Kind("q6_k", 32, 2, 32 * 128, False),
         (types.uint8, types.int8): Kind("q6_k", 24, 2, 32 * 128, False)}  # avx512: 6-bit codes (`pack_q6k`)
# Where Q6_K's codes stay 6 bits (`pack_q6k`: 6.6 bits a weight, GGUF's 6.56, instead of 8.6): a decode step
# reads its weights once, so bytes are time. The avx512 path widens them in a few ops (`_block_codes`); the
# avx2 path keeps int8 codes (its even/odd lanes would need another bit order: not done).
Q6K_PACKED = WIDE


def _widen(builder, ptr):
    """16 bytes of nibbles at ptr → (even, odd) <16 x i16> codes 0..15 (the lanes of the docstring)."""
    raw = _load_vec(builder, ptr, _V4I, 1)
    both = builder.shuffle_vector(raw, raw, ir.Constant(_V8I, [0, 1, 2, 3, 0, 1, 2, 3]))
    even = builder.and_(builder.lshr(both, ir.Constant(_V8I, [0] * 4 + [4] * 4)), _MASK)
    odd = builder.and_(builder.lshr(both, ir.Constant(_V8I, [8] * 4 + [12] * 4)), _MASK)
    return builder.bitcast(even, _V16S), builder.bitcast(odd, _V16S)


def _scale_lanes(builder, kind: Kind, ptr, vec_ty, elem_ty):
    """The block's sub-block scale(s) at ptr (bytes: Q6_K's signed, the others' unsigned) as a vec_ty
    vector: one scale in every lane, or (Q6_K) the first in the lower half and the second in the upper
    (the lanes of the docstring)."""
    half = vec_ty.count // 2
    lanes = [0] * vec_ty.count if kind.scales == 1 else [0] * half + [1] * half
    if kind.scales == 2 and elem_ty == _I16:  # both bytes as one 16-bit lane in every lane, then each half's
        word = builder.load(builder.bitcast(ptr, _I16.as_pointer()), align=1)  # byte sign-extended by shifts
        vec = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), word, ir.Constant(_I32, 0))
        vec = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, vec_ty.count), [0] * vec_ty.count))
        vec = builder.shl(vec, ir.Constant(vec_ty, [8] * half + [0] * half))
        return builder.ashr(vec, ir.Constant(vec_ty, [8] * vec_ty.count))
    widen = builder.sext if kind.name == "q6_k" else builder.zext
    vec = ir.Constant(ir.VectorType(elem_ty, 2), ir.Undefined)
    for j in range(kind.scales):
        value = widen(builder.load(builder.gep(ptr, [ir.Constant(_I32, j)])), elem_ty)
        vec = builder.insert_element(vec, value, ir.Constant(_I32, j))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, vec_ty.count), lanes))


def _block_codes(builder, kind: Kind, ptr):
    """A block's codes at ptr → avx2: (even, odd) <16 x i16>, nibbles (`_widen`) or int8 (`avx2._codes`);
    avx512: (codes,) <32 x i16> in column order, the nibbles (byte j: column j low, j + 16 high)
    zero-extended and split, int8 sign-extended, packed Q6_K (`pack_q6k`) its nibbles and top bits joined."""
    if not WIDE:
        return _widen(builder, ptr) if kind.code_bytes == 16 else _codes(builder, "q8_0", ptr)
    if kind.code_bytes == 32:
        return (builder.sext(_load_vec(builder, ptr, ir.VectorType(_I8, 32), 1), _V32S),)
    raw = builder.zext(_load_vec(builder, ptr, ir.VectorType(_I8, 16), 1), _V16S)
    low = builder.and_(raw, ir.Constant(_V16S, [15] * 16))
    high = builder.lshr(raw, ir.Constant(_V16S, [4] * 16))
    codes = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    if kind.code_bytes == 16:
        return (codes,)
    # packed Q6_K: byte p of the 8 after the nibbles holds columns p + 8t at bits 2t; the 8 bytes repeated in
    # each 128-bit quarter, shifted per quarter (vpsrlvw), masked and put above the low 4 bits
    top = builder.zext(_load_vec(builder, builder.gep(ptr, [ir.Constant(_I32, 16)]), _V8B, 1), ir.VectorType(_I16, 8))
    top = builder.shuffle_vector(top, top, ir.Constant(ir.VectorType(_I32, 32), list(range(8)) * 4))
    top = builder.lshr(top, ir.Constant(_V32S, [0] * 8 + [2] * 8 + [4] * 8 + [6] * 8))
    top = builder.shl(builder.and_(top, ir.Constant(_V32S, [3] * 32)), ir.Constant(_V32S, [4] * 32))
    return (builder.sub(builder.or_(codes, top), ir.Constant(_V32S, [32] * 32)),)


def _scaled_codes(builder, kind: Kind, codes_ptr, scale_ptr):
    """avx512: a block's codes times its sub-block scale(s) in int16 lanes (at most 32 · 128: exact)."""
    return tuple(builder.mul(v, _scale_lanes(builder, kind, scale_ptr, _V32S, _I16))
                 for v in _block_codes(builder, kind, codes_ptr))


def _dot(builder, acc, w, x):
    """avx512: acc <16 x i32> + the pair sums of <32 x i16> w · x (exact; no lane leaves int32 by the
    bound of `Kind.step`): `vpdpwssd` with VNNI, `vpmaddwd` and an add without."""
    if _TARGET.vnni:  # inline: LLVM's machine combiner splits the intrinsic back into vpmaddwd and vpaddd
        return builder.asm(ir.FunctionType(_VI, [_VI] * 3), "vpdpwssd $2, $1, $0", "=v,v,v,0",
                           [builder.bitcast(w, _VI), builder.bitcast(x, _VI), acc], False, "vpdpwssd")
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_V32S] * 2),
                                        "llvm.x86.avx512.pmaddw.d.512")
    return builder.add(acc, builder.call(fn, [w, x]))


def _to_lanes(builder, v8):
    """<8 x float> → <LANES x float>: itself on avx2, zeros in lanes 8..15 on avx512."""
    if LANES == 8:
        return v8
    return builder.shuffle_vector(v8, ir.Constant(_V8F, [0.0] * 8), ir.Constant(_VI, list(range(16))))


# A float scalar in every lane, and a fused multiply-add, on the path's LANES floats.
_splat, _fma_f = (simd._splat, simd._fma) if WIDE else (_splat8, _fma)


def _make_tile(wrows: int, xrows: int, unpacked: bool):
    """An intrinsic: `wrows` Q4_K or Q6_K weight rows (`KINDS`, by the codes' dtype) times `xrows` int16
    activation rows.

    f(qs, q_off, q_stride, wq, w_off, w_stride, sc, d, ndmin, mins, s_off, s_stride, nblocks, xq, x_off,
      x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride) writes, for weight row i and activation
    row k, out[o_off + k·o_stride + i] = tree(Σ_t float(S_ikt) · xs_k · d_i + the min term)
    with S_ikt = Σ_{b in step t} sc_ib · P_ikb in int32 lanes, a step `Kind.step` blocks, and (Q4_K and
    Q5_K) the min term fma([ndmin_i·min_ib for the step's 8 blocks b], [xsum_kb], ·) in lanes 0..7; sc at [(s_off + i·s_stride
    + b) · Kind.scales], mins at [s_off + i·s_stride + b], d, ndmin and xs those of the step's super-block,
    at [(s_off + i·s_stride) / 8 + sb] and [(a_off + k·a_stride) / 8 + sb], xq (a block's columns in
    `_ORDER`) at x_off + k·x_stride + 32b, xsum (xs · Σ_j xq_kbj) at [a_off + k·a_stride + b]. The codes
    come from qs (row i at q_off + i·q_stride) or, `unpacked`, from wq (`unpack_rows`: already times sc;
    row i at w_off + i·w_stride, 32 int16 per block). nblocks: a multiple of 8.
    """

    def state_of(arg):
        kind = KINDS[arg["qs"].dtype, arg["sc"].dtype]
        if kind.has_min and kind.step != BLOCKS:  # the min term's step is a super-block
            raise TypeError(f"a weight type with a min term steps by {BLOCKS} blocks, got {kind.step}")
        return wrows, xrows, unpacked, kind

    return tile_intrinsic(f"superblock_tile{wrows}x{xrows}{'u' if unpacked else ''}", _TILE_ARGS, state_of,
                          _emit_tile)


_TILE_ARGS = ("qs", "q_off", "q_stride", "wq", "w_off", "w_stride", "sc", "d", "ndmin", "mins", "s_off", "s_stride",
              "nblocks", "xq", "x_off", "x_stride", "xs", "xsum", "a_off", "a_stride", "out", "o_off", "o_stride")


def _emit_tile(t, state):
    """`_make_tile`'s body: per step of `Kind.step` blocks the integer sums (`_block_sums`), then the float step."""
    wrows, xrows, unpacked, kind = state
    builder, c = t.builder, t.c
    facc = t.accumulators(_VF, wrows, xrows)
    iacc = [[cgutils.alloca_once(builder, _VI) for _ in range(wrows)] for _ in range(xrows)]
    step = c(kind.step)
    with t.loop(builder.sdiv(t["nblocks"], step)) as index:
        s = builder.sdiv(index, c(BLOCKS // kind.step))  # the step's super-block
        for k in range(xrows):
            for i in range(wrows):
                builder.store(ir.Constant(_VI, [0] * LANES), iacc[k][i])
        with t.loop(step) as block:
            _block_sums(t, kind, unpacked, wrows, xrows, iacc, builder.add(builder.mul(index, step), block))
        _float_step(t, kind, wrows, xrows, iacc, facc, s)
    return t.store_outputs(wrows, xrows, lambda k, i: _tree_sum(builder, builder.load(facc[k][i])))


def _halves(t, p):
    """32 int16 at p: avx2's (even, odd) pair of vectors, avx512's one."""
    if WIDE:
        return (_load_vec(t.builder, p, _V32S, 2),)
    return _load_vec(t.builder, p, _V16S, 2), _load_vec(t.builder, t.builder.gep(p, [t.c(16)]), _V16S, 2)


def _sc_at(t, kind, i, b):
    """Address of row i's block b sub-block scale(s)."""
    return t.ptr("sc", t.builder.mul(t.builder.add(t.row("s_off", "s_stride", i), b), t.c(kind.scales)))


def _weights(t, kind, unpacked, i, b):
    """Row i's block b codes: from the scratch (`unpack_rows`), or widened here (avx512: times sc too)."""
    if unpacked:
        return _halves(t, t.at("wq", "w_off", "w_stride", i, b, 32))
    codes = t.at("qs", "q_off", "q_stride", i, b, kind.code_bytes)
    return _scaled_codes(t.builder, kind, codes, _sc_at(t, kind, i, b)) if WIDE else _block_codes(t.builder, kind, codes)


def _block_sums(t, kind, unpacked, wrows, xrows, iacc, b):
    """Block b's integer products added into iacc[k][i] (avx512: one `_dot` a pair; avx2: two `vpmaddwd`,
    times sc unless the codes are unpacked)."""
    builder = t.builder
    if not unpacked:
        t.prefetch_ahead("qs", kind.code_bytes, "sc", kind.scales, "mins" if kind.has_min else None, wrows, b)
    w = [_weights(t, kind, unpacked, i, b) for i in range(wrows)]
    if WIDE:  # the codes already times sc: one dot per pair
        for k in range(xrows):
            (x1,) = _halves(t, t.at("xq", "x_off", "x_stride", k, b, 32))
            for i in range(wrows):
                builder.store(_dot(builder, builder.load(iacc[k][i]), w[i][0], x1), iacc[k][i])
        return
    scales = [] if unpacked else [_scale_lanes(builder, kind, _sc_at(t, kind, i, b), _V8I, _I32) for i in range(wrows)]
    for k in range(xrows):
        x1, x2 = _halves(t, t.at("xq", "x_off", "x_stride", k, b, 32))
        for i in range(wrows):
            acc = builder.load(iacc[k][i])
            if unpacked:
                acc = builder.add(builder.add(acc, _madd(builder, w[i][0], x1)), _madd(builder, w[i][1], x2))
            else:
                prod = builder.add(_madd(builder, w[i][0], x1), _madd(builder, w[i][1], x2))
                acc = builder.add(acc, builder.mul(prod, scales[i]))
            builder.store(acc, iacc[k][i])


def _float_step(t, kind, wrows, xrows, iacc, facc, s):
    """facc[k][i] += float(iacc[k][i]) · xs_k · d_i, and (Q4_K, Q5_K) the min term of super-block s."""
    builder, c = t.builder, t.c
    eight = c(BLOCKS)
    sb = [builder.add(builder.sdiv(t.row("s_off", "s_stride", i), eight), s) for i in range(wrows)]
    dvec = [_splat(builder, builder.load(t.ptr("d", sb[i]))) for i in range(wrows)]
    if kind.has_min:  # each row's 8 mins of the super-block, -dmin·min_b as gguf rounds it
        first = builder.mul(s, eight)
        mvec = []
        for i in range(wrows):
            raw = _load_vec(builder, t.ptr("mins", builder.add(t.row("s_off", "s_stride", i), first)), _V8B, 1)
            ndmin = _splat8(builder, builder.load(t.ptr("ndmin", sb[i])))
            mvec.append(_to_lanes(builder, builder.fmul(builder.uitofp(raw, _V8F), ndmin)))
    for k in range(xrows):
        xrow = t.row("a_off", "a_stride", k)
        xsv = _splat(builder, builder.load(t.ptr("xs", builder.add(builder.sdiv(xrow, eight), s))))
        if kind.has_min:  # the blocks' xs·Σ xq
            xsum8 = _to_lanes(builder, _load_vec(builder, t.ptr("xsum", builder.add(xrow, first)), _V8F, 4))
        for i in range(wrows):
            f = builder.fmul(builder.sitofp(builder.load(iacc[k][i]), _VF), xsv)
            acc = _fma_f(builder, f, dvec[i], builder.load(facc[k][i]))
            if kind.has_min:
                acc = _fma_f(builder, mvec[i], xsum8, acc)
            builder.store(acc, facc[k][i])


@intrinsic
def unpack_rows(typingctx, qs, q_off, q_stride, sc, s_off, s_stride, nblocks, rows, wq):
    """wq[(i·nblocks + b)·32 : +32] = sc_ib · (even, odd) codes of block b of weight row i < rows
    (`_block_codes`, `_scale_lanes`): the codes widened and scaled once for every tile that reads them."""
    ip = types.intp
    sig = types.void(qs, ip, ip, sc, ip, ip, ip, ip, wq)
    kind = KINDS[qs.dtype, sc.dtype]

    def codegen(context, builder, signature, args):
        qa, qo, qstr, sca, so, sstr, n, nrows, wa = args
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        with cgutils.for_range(builder, nrows) as row:
            with cgutils.for_range(builder, n) as loop:
                qoff = builder.add(builder.add(qo, builder.mul(qstr, row.index)), builder.mul(loop.index, c(kind.code_bytes)))
                codes = _ptr(context, builder, signature.args[0], qa, qoff)
                soff = builder.mul(builder.add(builder.add(so, builder.mul(sstr, row.index)), loop.index), c(kind.scales))
                scales = _ptr(context, builder, signature.args[3], sca, soff)
                if WIDE:
                    parts = _scaled_codes(builder, kind, codes, scales)
                else:
                    svec = _scale_lanes(builder, kind, scales, _V16S, _I16)
                    parts = [builder.mul(v, svec) for v in _block_codes(builder, kind, codes)]
                dst = _ptr(context, builder, signature.args[8], wa,
                           builder.mul(builder.add(builder.mul(row.index, n), loop.index), c(32)))
                for h, part in enumerate(parts):  # 32 int16 a block, in the lanes the tiles load
                    builder.store(part, builder.bitcast(builder.gep(dst, [c(16 * h)]), part.type.as_pointer()), align=2)
        return context.get_dummy_value()

    return sig, codegen


# Weight rows x activation rows of the GEMM tiles: 2 x 4 keeps 8 int32 accumulators, a row pair's 4 code vectors and 2
# activation vectors in AVX2's 16 registers; 4 x 2 and 3 x 4 measured no faster (Q4_K 8192 x 2048 and 2048 x 8192, Q6_K
# 2048 x 8192, batch 64 and 256, 2 threads, a Zen 3 EPYC). On avx512, 4 x 4 (16 accumulators of AVX-512's 32 registers)
# measured 1.1-1.4x the 2 x 4, 4 x 2, 2 x 8, 4 x 6 and 5 x 4 tiles (Q4_K, the same shapes, batch 16-256, 2 threads, a
# Zen 4 EPYC).
TILE_W, TILE_X = (4, 4) if WIDE else (2, 4)
tile_wx_u, tile_w1_u = _make_tile(TILE_W, TILE_X, True), _make_tile(TILE_W, 1, True)
tile_wx_p, tile_g1, tile_11 = _make_tile(TILE_W, TILE_X, False), _make_tile(GEMV_W, 1, False), _make_tile(1, 1, False)
# avx512 (TILE_W is GEMV_W): fewer rows skip the scratch, same bits; 1.10-2.08x at 4-8 rows, 0.85-1.02x at 16 (Zen 5)
PACKED_MAX = 16 if WIDE else 0

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # as `avx2`: no fast-math flags on the tiles' float steps
_CHUNKS = 16
# The int16 activations of one pass over the weights stay within a core's L2 (Zen 3: 512 KiB): X_TILE rows
# up to 2048 columns, 16 of an 8192-column ffn_down. With 64 rows of 8192 columns (1 MiB, read from L3 for
# every pair of weight rows) the 2048 x 8192 matmul ran at 0.85x (Q4_K) to 0.75x (Q6_K) the rate of its
# 8192 x 2048 transpose (Zen 3 EPYC, 2 threads, batch 64 and 256).
XQ_BYTES = 256 * 1024


# Where column j of a block is stored: avx2's even columns, then its odd ones; avx512's column order.
_ORDER = np.array([(j >> 1) + 16 * (j & 1) for j in range(32)] if not WIDE else list(range(32)), dtype=np.int64)


@nb.njit(**_TILE_JIT)
def _quantize_row(x, k, xq, xs, xsum):
    """Row k of x float32 `[batch, cols]` → xq int16 `[batch, cols]` (a block's columns in `_ORDER`), xs
    float32 `[batch, cols / 256]` (max|x_sb| / 32767) and xsum float32 `[batch, cols / 32]` (xs · the block's Σ xq)."""
    for s in range(x.shape[1] // SUPER):
        base = SUPER * s
        top = np.float32(0.0)
        for j in range(SUPER):
            top = max(top, abs(x[k, base + j]))
        inv = np.float32(XQ_MAX) / top if top > 0 else np.float32(0.0)
        scale = top / np.float32(XQ_MAX)
        xs[k, s] = scale
        for b in range(BLOCKS):
            at = base + 32 * b
            total = 0
            for j in range(32):
                q = np.int32(np.rint(x[k, at + j] * inv))
                xq[k, at + _ORDER[j]] = np.int16(q)
                total += q
            xsum[k, BLOCKS * s + b] = np.float32(total) * scale


@nb.njit(**_TILE_JIT)
def _gemv_rows(xq, xs, xsum, qs, sc, d, ndmin, mins, out, r0, r1, b0, b1):
    """Weight rows r0 .. r1 against activation rows b0 .. b1 (fewer than UNPACK_MIN), GEMV_W rows a tile."""
    rows, cols, qw = qs.shape[0], xq.shape[1], qs.shape[1]
    nblocks = cols // 32
    r = r0  # the packed tiles read no unpacked codes: xq stands in for their wq argument
    while r < r1:
        w = GEMV_W if r + GEMV_W <= r1 else 1
        for b in range(b0, b1):
            if w == GEMV_W:
                tile_g1(qs, r * qw, qw, xq, 0, 0, sc, d, ndmin, mins, r * nblocks, nblocks, nblocks, xq, b * cols, cols,
                        xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
            else:
                tile_11(qs, r * qw, qw, xq, 0, 0, sc, d, ndmin, mins, r * nblocks, nblocks, nblocks, xq, b * cols, cols,
                        xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        r += w


@nb.njit(**_TILE_JIT)
def _gemm_rows(xq, xs, xsum, qs, sc, d, ndmin, mins, out, r, wrows, b0, b1, wq):
    """Weight rows r .. r + wrows (at most TILE_W) against activation rows b0 .. b1 (at least UNPACK_MIN) in
    TILE_W x TILE_X tiles, the rows' codes widened and scaled into wq once (from PACKED_MAX rows) or per tile."""
    rows, cols, qw, per = qs.shape[0], xq.shape[1], qs.shape[1], sc.shape[1]
    nblocks = cols // 32
    ahead = r + PREFETCH_ROWS
    prefetch_span(qs, ahead * qw, wrows * qw)
    prefetch_span(sc, ahead * per, wrows * per)
    if mins.shape[1] == nblocks:  # Q4_K's and Q5_K's mins (Q6_K has none)
        prefetch_span(mins, ahead * nblocks, wrows * nblocks)
    if wrows < TILE_W:
        for i in range(wrows):
            _gemv_rows(xq, xs, xsum, qs, sc, d, ndmin, mins, out, r + i, r + i + 1, b0, b1)
        return
    packed = b1 - b0 < PACKED_MAX
    if not packed:
        unpack_rows(qs, r * qw, qw, sc, r * nblocks, nblocks, nblocks, TILE_W, wq)  # sc offsets in blocks
    head = (qs, r * qw, qw, wq, 0, 32 * nblocks, sc, d, ndmin, mins, r * nblocks, nblocks, nblocks, xq)
    b = b0
    while b + TILE_X <= b1:
        a = head + (b * cols, cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        tile_wx_p(*a) if packed else tile_wx_u(*a)
        b += TILE_X
    while b < b1:
        a = head + (b * cols, cols, xs, xsum, b * nblocks, nblocks, out, b * rows + r, rows)
        tile_g1(*a) if packed else tile_w1_u(*a)
        b += 1


@nb.njit(parallel=True, **_JIT)
def matmul_superblock(x, qs, sc, d, ndmin, mins, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T for a Q4_K weight W split by `split_scales` (qs
    uint8 `[rows, cols / 2]` nibbles in Q4_1's order, sc and mins uint8 `[rows, cols / 32]`, d and ndmin float32
    `[rows, cols / 256]`), a Q5_K one (qs int8 `[rows, cols]` codes 0..31, `q5k_codes`; the rest as Q4_K's) or a Q6_K
    one split by `split_q6k` (qs int8 `[rows, cols]`, sc int8 `[rows, cols / 16]`, d as Q4_K's; ndmin and mins unread:
    any float32 and uint8 `[rows, 1]`); `KINDS` names the type from the dtypes; x quantized to int16 per 256 columns
    first. Error: the activations' rounding, at most 2^-16 of each super-block's largest value."""
    batch, cols = x.shape
    nblocks = cols // 32
    xq = np.empty((batch, cols), dtype=np.int16)
    xs = np.empty((batch, cols // SUPER), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    if batch < 8:
        for k in range(batch):
            _quantize_row(x, k, xq, xs, xsum)
    else:
        for k in prange(batch):
            _quantize_row(x, k, xq, xs, xsum)
    rows = qs.shape[0]
    if batch < UNPACK_MIN:
        groups = rows // GEMV_W
        per = (groups + _CHUNKS - 1) // _CHUNKS * GEMV_W
        for c in prange(_CHUNKS):  # chunks start on a GEMV_W boundary; the last takes the rows past the groups
            _gemv_rows(xq, xs, xsum, qs, sc, d, ndmin, mins, out, c * per, rows if c == _CHUNKS - 1 else
                       min(rows, (c + 1) * per), 0, batch)
        return
    groups = (rows + TILE_W - 1) // TILE_W
    per = (groups + _CHUNKS - 1) // _CHUNKS
    x_tile = max(TILE_X, min(X_TILE, XQ_BYTES // (2 * cols) // TILE_X * TILE_X))
    for b0 in range(0, batch, x_tile):
        b1 = min(batch, b0 + x_tile)
        for c in prange(_CHUNKS):
            wq = np.empty(TILE_W * cols, dtype=np.int16)
            for g in range(c * per, min(groups, (c + 1) * per)):
                r = TILE_W * g
                _gemm_rows(xq, xs, xsum, qs, sc, d, ndmin, mins, out, r, min(TILE_W, rows - r), b0, b1, wq)
