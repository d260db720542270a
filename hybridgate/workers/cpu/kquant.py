"""Integer dot products of 4- and 5-bit GGUF codes with activations quantized to int16 per 32-block.

Q4_0, Q4_1, Q5_0, Q5_1, Q4_K and Q5_K all store a weight as `w = d·c + m` per
32-column block: an unsigned code c (4 or 5 bits), a float scale d and a min m
(m = -8·d for Q4_0 and -16·d for Q5_0; for the K-quants d = d_super·sc and
m = -dmin·m_sub from their 6-bit sub-scales). MXFP4 (OCP MX v1.0's E2M1 codes
under an E8M0 scale) is `w = d·v(c)` with no min: v ggml's doubled E2M1 values
(`blocks.MXFP4_VALUES`, integers -12..12) and d half the block's scale, which is
how ggml's `dequantize_row_mxfp4` and `ggml_vec_dot_mxfp4_q8_0` take it; its
nibbles are turned into v in the tiles by a table lookup (`E2M1`). At load
(`pack`) every type is repacked into one layout, so one kernel serves them all,
a quad (4 blocks, 128 columns) at a time:

    qs  uint8  [rows, quads · 64]  per block 16 bytes of nibbles, byte j: column j low, j + 16
                                   high (Q4_0's order); int8 `[rows, quads · 128]` whole codes
                                   for the 5-bit types on the paths of `MERGE_FIVE`
    qh  uint32 [rows, quads · 4]   the other 5-bit types: per quad four bit masks, bit t of
                                   word s the 5th bit of lane t of code vector s
    d, m float32 [rows, nmin]      per 32-block, widened once (m is d for Q4_0/Q5_0: the kernel
                                   takes -bias·d, an exact power-of-two multiple); MXFP4's d is
                                   its uint8 E8M0 bytes, decoded in the tiles, and m is d, unread:
                                   the file's 17 bytes a block, regrouped

(`nmin` = blocks rounded up to 16; padding has d = m = 0). A quad's 64 code bytes
read as 32 16-bit lanes become four code vectors by in-lane masks and shifts (no
cross-lane widening), and the activations are stored in the order that gives
(`QUAD_COLUMNS`). Activations are quantized per 32-block as `intdot` does:
xq = rint(x · 32767 / max|x_b|), xs = max|x_b| / 32767, xsum = xs · Σ xq. The
product of weight row i and activation row k is

    Σ_b d_ib · xs_kb · Σ_j c_ibj · xq_kbj  +  Σ_b m_ib · xsum_kb

(c_ibj the value v for MXFP4, which has no min term) with each block's integer
sum exact in int32 lanes (4 lanes per block, each the sum of 8 products, at most
8 · 31 · 32767: `vpdpwssd` on AVX-512 VNNI, `vpmaddwd` on AVX-512 without
VNNI, on AVX2 and, as LLVM matches it, SSE2 on `generic`; the same integers on
every path), then one float step per quad: acc = fma(float(P) · xs, d, acc) on
16 lanes. The min term is a 16-block-wide FMA chain; then a fixed lane tree for
both. Every pair (i, k) gets the same operations whatever tile computes it, so a
row's result does not depend on its batch, nor on the path.

Error: the activations' rounding only, at most xs_kb / 2 per element, so at most
Σ_b (max|x_kb| / 65534) · Σ_j |w_ibj| per output (the tests' bound), plus float32
rounding of the terms; about 2e-5 of a product. Int8 activations (llama.cpp's
Q8_1/Q8_K) were tried first: 0.5% per product, which put the requantized default
model's top-1 agreement at 96.9% and mean KL at 1.1e-3, past the accuracy floor.

Sources: OCP Microscaling Formats (MX) v1.0 (E2M1, E8M0); ggml's block formats (ggml-common.h `block_q4_0` ...
`block_q5_K`, `block_mxfp4`, `kvalues_mxfp4`) and
dequantizers (ggml-quants.c `dequantize_row_*`), the activation-quantized dot
products of ggml-cpu (`ggml_vec_dot_q4_K_q8_K`, `ggml_vec_dot_mxfp4_q8_0`), Intel's
intrinsics guide for `vpdpwssd`, `vpmaddwd`, `vpermw` and `vpshufb`.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

_TARGET = isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba import types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu.blocks import (  # noqa: E402
    LAYOUTS, MXFP4, MXFP4_VALUES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, unpack_scales,
)
from hybridgate.workers.cpu.simd import PREFETCH_ROWS, X_TILE, _load_vec, _ptr, _tree_sum, prefetch_span  # noqa: E402

XQ_MAX = 32767.0  # int16 activations in ±32767, as intdot: a pair sum (at most 2 · 31 · 32767) fits int32
MIN_LANES = 16  # blocks per step of the min term's FMA chain (d and m rows are padded to a multiple)

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)


# ---- the layouts: each type's codes in column order, as data ----

def _bits(qh: np.ndarray) -> np.ndarray:
    """uint8 `[..., 4]` little-endian bit masks → `[..., 32]` bits (bit j of the u32 at j)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _nibbles16(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block (byte j: column j low, j + 16 high) → codes `[..., 32]`."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_codes(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes at `at` (32 per 64 columns: sub-block 2i low, 2i+1 high) → `[rows, n·8, 32]`."""
    qs = blocks[:, :, at : at + 128].reshape(blocks.shape[0], -1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=3).reshape(blocks.shape[0], -1, 32)


def _q5k_high(blocks: np.ndarray) -> np.ndarray:
    """Q5_K's qh[32] (bit s of byte l: column l of sub-block s) → 5th bits `[rows, n·8, 32]`."""
    bits = np.unpackbits(blocks[:, :, 16:48, None], axis=-1, bitorder="little")  # [rows, n, 32 (l), 8 (s)]
    return np.ascontiguousarray(bits.transpose(0, 1, 3, 2)).reshape(blocks.shape[0], -1, 32)


# type → (codes uint8 [rows, blocks of 32, 32] from the GGUF blocks [rows, n, bytes], bias): w = d·(c - bias)
# when bias, w = d·c + m otherwise.
CODES = {
    Q4_0: (lambda b: _nibbles16(b[:, :, 2:18]), 8),
    Q4_1: (lambda b: _nibbles16(b[:, :, 4:20]), 0),
    Q5_0: (lambda b: _nibbles16(b[:, :, 6:22]) | (_bits(b[:, :, 2:6]) << 4), 16),
    Q5_1: (lambda b: _nibbles16(b[:, :, 8:24]) | (_bits(b[:, :, 4:8]) << 4), 0),
    Q4_K: (lambda b: _k_codes(b, 16), 0),
    Q5_K: (lambda b: _k_codes(b, 48) | (_q5k_high(b) << 4), 0),
    MXFP4: (lambda b: _nibbles16(b[:, :, 1:17]), 0),  # E2M1 codes, kept as nibbles: looked up in the kernel
}
FIVE_BIT = (Q5_0, Q5_1, Q5_K)
# Types whose 4-bit codes are E2M1 (`MXFP4_VALUES`, ggml's doubled `kvalues_mxfp4`: signed integers -12..12):
# the tiles turn each nibble into its value by a lookup (`_e2m1_for`) and each E8M0 byte, kept as a byte, into
# half its scale (`_e8m0_scale`). No min term: m is d, unread (a weight is d·value, one float scale per block
# times an integer dot, as ggml's `ggml_vec_dot_mxfp4_q8_0`). The qh placeholder is int8 to tell the tiles so
# at compile time.
E2M1 = (MXFP4,)
# A quad's 128 columns (block · 32 + column) in the kernels' lane order [s, t]: the 64 code bytes read as
# 32 16-bit lanes t give 4 vectors, s = 0..3: the low nibble of the lane's first byte (2t), its high
# nibble, the low nibble of its second byte (2t + 1), its high nibble; byte y holds column y % 16 (low)
# and 16 + y % 16 (high) of block y // 16.
_BYTE = 2 * np.arange(32)[None, :] + np.array([0, 0, 1, 1])[:, None]  # [s, t]
QUAD_COLUMNS = (_BYTE // 16) * 32 + _BYTE % 16 + 16 * (np.arange(4)[:, None] % 2)
# Where the 5-bit types keep whole codes, one a byte (int8 qs, 8 bits a weight instead of 5: two 16-bit
# lanes' codes by one mask and one shift): the paths without mask registers, where spreading a bit mask
# over lanes costs more than reading the 3 bits.
MERGE_FIVE = {"avx512": False, "avx2": True, "generic": False}[_TARGET.isa]


def pack(kind: int, data: np.ndarray, shape: tuple[int, int]):
    """(qs, qh, d, m, mscale) of a `[rows, row_bytes]` uint8 weight of type `kind` (a `CODES` key), in
    the layout of the module docstring; qh is a `[rows, 1]` uint8 placeholder for a 4-bit type (int8
    for the `E2M1` types, whose d is their uint8 E8M0 bytes), m is d and mscale -bias for a type without
    a min (1.0 otherwise). Raises ValueError when cols is not a whole number of the type's blocks."""
    rows, cols = shape
    scale, minimum = unpack_scales(kind, data, shape)  # [rows, cols / 32] each (the ValueError)
    lay = LAYOUTS[kind]
    extract, bias = CODES[kind]
    codes = extract(np.ascontiguousarray(data).reshape(rows, cols // lay.weights, lay.nbytes))  # [rows, nb, 32]
    nb_ = cols // 32
    quads, nmin = -(-nb_ // 4), -(-nb_ // MIN_LANES) * MIN_LANES
    padded = np.zeros((rows, 4 * quads, 32), np.uint8)
    padded[:, :nb_] = codes
    low = padded & 15
    qs = np.ascontiguousarray(low[:, :, :16] | (low[:, :, 16:] << 4)).reshape(rows, quads * 64)
    qh = np.zeros((rows, 1), np.int8 if kind in E2M1 else np.uint8)
    if kind in FIVE_BIT:
        lanes = padded.reshape(rows, quads, 128)[:, :, QUAD_COLUMNS]  # [rows, quads, 4 (s), 32 (t)]
        if MERGE_FIVE:  # whole codes: (s 0, s 2) interleaved, then (s 1, s 3), as 16-bit lanes' two bytes
            merged = np.stack([lanes[:, :, [0, 1]], lanes[:, :, [2, 3]]], axis=-1)  # [rows, quads, 2, 32, 2]
            qs = np.ascontiguousarray(merged).view(np.int8).reshape(rows, quads * 128)
        else:
            qh = np.packbits(lanes >> 4, axis=-1, bitorder="little")  # [rows, quads, 4, 4 bytes]
            qh = np.ascontiguousarray(qh).view("<u4").reshape(rows, quads * 4)
    if kind in E2M1:  # the exponent bytes as the file has them (padding 0: its codes are 0 too)
        e = np.zeros((rows, nmin), np.uint8)
        e[:, :nb_] = np.ascontiguousarray(data).reshape(rows, nb_, lay.nbytes)[:, :, 0]
        return qs, qh, e, e, np.float32(0.0)
    d = np.zeros((rows, nmin), np.float32)
    d[:, :nb_] = scale
    if bias:
        return qs, qh, d, d, np.float32(-bias)
    m = np.zeros((rows, nmin), np.float32)
    m[:, :nb_] = minimum
    return qs, qh, d, m, np.float32(1.0)


# ---- the kernels ----

def _vec_const(ty, value):
    return ir.Constant(ty, [value] * ty.count)


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _dot_vnni(builder, ws, xs):
    acc = _vec_const(_V16I, 0)
    for w, x in zip(ws, xs):
        pair = [builder.bitcast(w, _V16I), builder.bitcast(x, _V16I)]
        acc = _x86(builder, "llvm.x86.avx512.vpdpwssd.512", _V16I, [acc, *pair])
    return acc


def _dot_bw512(builder, ws, xs):
    sums = [_x86(builder, "llvm.x86.avx512.pmaddw.d.512", _V16I, [w, x]) for w, x in zip(ws, xs)]
    return builder.add(builder.add(sums[0], sums[1]), builder.add(sums[2], sums[3]))


def _halves(builder, vec, n):
    ty = ir.VectorType(_I32, n)
    return [builder.shuffle_vector(vec, vec, ir.Constant(ty, list(range(h * n, h * n + n)))) for h in (0, 1)]


def _dot_avx2(builder, ws, xs):
    out = []
    for h in (0, 1):
        sums = [_x86(builder, "llvm.x86.avx2.pmadd.wd", ir.VectorType(_I32, 8),
                     [_halves(builder, w, 16)[h], _halves(builder, x, 16)[h]]) for w, x in zip(ws, xs)]
        out.append(builder.add(builder.add(sums[0], sums[1]), builder.add(sums[2], sums[3])))
    return builder.shuffle_vector(out[0], out[1], ir.Constant(_V16I, list(range(16))))


def _dot_generic(builder, ws, xs):
    v32 = ir.VectorType(_I32, 32)
    sums = []
    for w, x in zip(ws, xs):  # the shape LLVM matches to pmaddwd (SSE2)
        p = builder.mul(builder.sext(w, v32), builder.sext(x, v32))
        even, odd = (builder.shuffle_vector(p, p, ir.Constant(_V16I, list(range(r, 32, 2)))) for r in (0, 1))
        sums.append(builder.add(even, odd))
    return builder.add(builder.add(sums[0], sums[1]), builder.add(sums[2], sums[3]))


def _dot_for(target) -> callable:
    """(ws, xs): four <32 x i16> codes and four activation vectors → <16 x i32>, lane u = Σ_s
    Σ_{t = 2u, 2u+1} ws[s]_t · xs[s]_t (exact): one quad of blocks, 4 lanes per block."""
    if target.isa == "avx512":
        return _dot_vnni if target.vnni else _dot_bw512
    return _dot_avx2 if target.isa == "avx2" else _dot_generic


_DOT = _dot_for(_TARGET)


_V32S = ir.VectorType(_I16, 32)
_E2M1_WORDS = [int(v) for v in MXFP4_VALUES] * 2  # the 16 values, twice: vpermw's 32-word table


def _e2m1_vpermw(builder, codes):
    return _x86(builder, "llvm.x86.avx512.permvar.hi.512", _V32S, [ir.Constant(_V32S, _E2M1_WORDS), codes])


def _e2m1_pshufb(builder, codes):
    """Each half's bytes through vpshufb (a code's low byte picks its value, its zero high byte picks 0),
    then the value's byte sign-extended over its 16-bit lane."""
    v32b, v16s = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16)
    table = ir.Constant(v32b, [v & 0xFF for v in _E2M1_WORDS])
    halves = []
    for h in (0, 1):
        lanes = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16)))
        half = builder.shuffle_vector(codes, codes, lanes)
        looked = _x86(builder, "llvm.x86.avx2.pshuf.b", v32b, [table, builder.bitcast(half, v32b)])
        halves.append(builder.bitcast(looked, v16s))
    both = builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
    return builder.ashr(builder.shl(both, _vec_const(_V32S, 8)), _vec_const(_V32S, 8))


def _e2m1_arith(builder, codes):
    """Portable: magnitude m + max(m - 4, 0) + 2·[m = 7] of m = c & 7 (0, 1, 2, 3, 4, 6, 8, 12), negated for bit 3."""
    m = builder.and_(codes, _vec_const(_V32S, 7))
    over = builder.select(builder.icmp_unsigned(">", m, _vec_const(_V32S, 4)),
                          builder.sub(m, _vec_const(_V32S, 4)), _vec_const(_V32S, 0))
    top = builder.select(builder.icmp_unsigned("==", m, _vec_const(_V32S, 7)), _vec_const(_V32S, 2),
                         _vec_const(_V32S, 0))
    mag = builder.add(builder.add(m, over), top)
    negative = builder.icmp_unsigned("!=", builder.and_(codes, _vec_const(_V32S, 8)), _vec_const(_V32S, 0))
    return builder.select(negative, builder.neg(mag), mag)


def _e2m1_for(target) -> callable:
    """(codes): <32 x i16> E2M1 codes 0..15 → their `MXFP4_VALUES` as <32 x i16>: vpermw (AVX-512 BW), vpshufb
    (AVX2), arithmetic elsewhere; the same integers on every path."""
    return {"avx512": _e2m1_vpermw, "avx2": _e2m1_pshufb}.get(target.isa, _e2m1_arith)


_E2M1_LOOKUP = _e2m1_for(_TARGET)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(a.type, [a.type] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _quad_scale(builder, ptr):
    """The four floats at ptr as <16 x float>: each repeated over its block's 4 lanes."""
    four = _load_vec(builder, ptr, ir.VectorType(_F32, 4), 4)
    return builder.shuffle_vector(four, four, ir.Constant(_V16I, [j // 4 for j in range(16)]))


def _e8m0_scale(builder, ptr):
    """The four E8M0 bytes at ptr as <16 x float> half-scales 2^(e - 128) (`blocks.e8m0_half`), each repeated
    over its block's 4 lanes: (e - 1) in the exponent field, and for e = 0 and 1 the subnormals 2^-128, 2^-127."""
    v4 = ir.VectorType(_I32, 4)
    e = builder.zext(_load_vec(builder, ptr, ir.VectorType(_I8, 4), 1), v4)
    normal = builder.shl(builder.sub(e, _vec_const(v4, 1)), _vec_const(v4, 23))
    tiny = builder.shl(_vec_const(v4, 0x00200000), builder.and_(e, _vec_const(v4, 1)))  # 2^21 · 2^-149
    bits = builder.select(builder.icmp_unsigned("<", e, _vec_const(v4, 2)), tiny, normal)
    four = builder.bitcast(bits, ir.VectorType(_F32, 4))
    return builder.shuffle_vector(four, four, ir.Constant(_V16I, [j // 4 for j in range(16)]))


def _codes(builder, qptr, hptr, merged):
    """A quad's codes as four <32 x i16> vectors in the lane order of `QUAD_COLUMNS`: from 64 bytes of
    nibbles (with the 5th bits of the four u32 at hptr, None for a 4-bit type) or, merged, 128 bytes of
    whole codes."""
    v16 = ir.VectorType(_I16, 32)
    if merged:
        m0, m1 = (_load_vec(builder, builder.gep(qptr, [ir.Constant(_I32, h)]), v16, 1) for h in (0, 64))
        byte = _vec_const(v16, 0xFF)
        eight = _vec_const(v16, 8)
        return [builder.and_(m0, byte), builder.and_(m1, byte), builder.lshr(m0, eight), builder.lshr(m1, eight)]
    raw = _load_vec(builder, qptr, v16, 1)
    nibble = _vec_const(v16, 15)
    ws = [builder.and_(builder.lshr(raw, _vec_const(v16, 4 * s)), nibble) if s else builder.and_(raw, nibble)
          for s in range(4)]
    if hptr is None:
        return ws
    out = []
    for s, w in enumerate(ws):
        bits = builder.bitcast(builder.load(builder.gep(hptr, [ir.Constant(_I32, s)]), align=4),
                               ir.VectorType(ir.IntType(1), 32))
        out.append(builder.or_(w, builder.select(bits, _vec_const(v16, 16), _vec_const(v16, 0))))
    return out


def _min_terms(builder, m_row, t_row, nmin, wrows, xrows):
    """tree(Σ_b m_ib · xsum_kb) `[xrows][wrows]` as floats: a MIN_LANES-wide FMA chain per pair, m_row(i) and
    t_row(k) the pointers to weight row i's m and activation row k's xsum."""
    zero = _vec_const(_V16F, 0.0)
    maccs = [[cgutils.alloca_once_value(builder, zero) for _ in range(wrows)] for _ in range(xrows)]
    with cgutils.for_range(builder, builder.sdiv(nmin, ir.Constant(nmin.type, MIN_LANES))) as loop:
        b = builder.mul(loop.index, ir.Constant(nmin.type, MIN_LANES))
        mv = [_load_vec(builder, builder.gep(m_row(i), [b]), _V16F, 4) for i in range(wrows)]
        for k in range(xrows):
            tv = _load_vec(builder, builder.gep(t_row(k), [b]), _V16F, 4)
            for i in range(wrows):
                builder.store(_fma(builder, mv[i], tv, builder.load(maccs[k][i])), maccs[k][i])
    return [[_tree_sum(builder, builder.load(maccs[k][i])) for i in range(wrows)] for k in range(xrows)]


def _make_tile(wrows: int, xrows: int):
    """An intrinsic: `wrows` packed weight rows times `xrows` int16 activation rows.

    f(qs, q_off, q_stride, qh, h_off, h_stride, d, m, s_off, s_stride, quads, nmin, xq, x_off, x_stride,
      xs, xsum, a_off, a_stride, out, o_off, o_stride, mscale) writes, for weight row i, activation row k,
      out[o_off + k·o_stride + i] = tree(Σ_q float(P_ikq) · XS_kq · D_iq) + mscale · tree(Σ m_ib · xsum_kb)
    with quad q of row i's codes at qs[q_off + i·q_stride + 64q] (128q for whole codes, and the masks
    at qh[h_off + i·h_stride + 4q] when qh is uint32), its scales at d/m[s_off + i·s_stride + b],
    activation row k at xq[x_off + k·x_stride + 128q] and xs/xsum[a_off + k·a_stride + b]; P the quad's
    16 integer lanes, XS and D its 4 blocks' scales, each over its block's 4 lanes. When qh is int8
    (`E2M1`), the codes are looked up as E2M1 values first, d holds E8M0 bytes (D their half-scales), and
    there is no min term (m and mscale unread).
    """

    def generic(typingctx, qs, q_off, q_stride, qh, h_off, h_stride, d, m, s_off, s_stride, quads, nmin,
                xq, x_off, x_stride, xs, xsum, a_off, a_stride, out, o_off, o_stride, mscale):
        ip = types.intp
        sig = types.void(qs, ip, ip, qh, ip, ip, d, m, ip, ip, ip, ip, xq, ip, ip, xs, xsum, ip, ip, out, ip, ip,
                         types.float32)
        five = qh.dtype == types.uint32
        e2m1 = qh.dtype == types.int8  # `E2M1`: nibbles looked up, no min term
        merged = qs.dtype == types.int8  # `MERGE_FIVE`: 128 bytes of whole codes a quad

        def codegen(context, builder, signature, args):
            (qa, qo, qstr, ha, ho, hstr, da, ma, so, sstr, nquads, nmin_, xa, xo, xstr, xsa, xma, ao, astr,
             oa, oo, ostr, msc) = args
            ty = signature.args
            c = lambda v: ir.Constant(nquads.type, v)  # noqa: E731

            def at(index, arr, base, stride, i, off):
                offset = builder.add(builder.add(base, builder.mul(stride, c(i))), off)
                return _ptr(context, builder, ty[index], arr, offset)

            zero = _vec_const(_V16F, 0.0)
            accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(wrows)] for _ in range(xrows)]
            with cgutils.for_range(builder, nquads) as loop:
                q = loop.index
                codes = [_codes(builder, at(0, qa, qo, qstr, i, builder.mul(q, c(64 * (2 if merged else 1)))),
                                at(3, ha, ho, hstr, i, builder.mul(q, c(4))) if five else None, merged)
                         for i in range(wrows)]
                codes = [[_E2M1_LOOKUP(builder, w) for w in ws] for ws in codes] if e2m1 else codes
                scale = _e8m0_scale if e2m1 else _quad_scale
                dv = [scale(builder, at(6, da, so, sstr, i, builder.mul(q, c(4)))) for i in range(wrows)]
                for k in range(xrows):
                    xp = at(12, xa, xo, xstr, k, builder.mul(q, c(128)))
                    xv = [_load_vec(builder, builder.gep(xp, [c(32 * v)]), ir.VectorType(_I16, 32), 2)
                          for v in range(4)]
                    sv = _quad_scale(builder, at(15, xsa, ao, astr, k, builder.mul(q, c(4))))
                    for i in range(wrows):
                        prod = _DOT(builder, codes[i], xv)
                        f = builder.fmul(builder.sitofp(prod, _V16F), sv)
                        builder.store(_fma(builder, f, dv[i], builder.load(accs[k][i])), accs[k][i])
            mterms = None if e2m1 else _min_terms(builder, lambda i: at(7, ma, so, sstr, i, c(0)),
                                                  lambda k: at(16, xma, ao, astr, k, c(0)), nmin_, wrows, xrows)
            for k in range(xrows):
                for i in range(wrows):
                    value = _tree_sum(builder, builder.load(accs[k][i]))
                    if mterms is not None:
                        value = builder.fadd(value, builder.fmul(mterms[k][i], msc))
                    builder.store(value, at(19, oa, oo, ostr, k, c(i)))
            return context.get_dummy_value()

        return sig, codegen

    generic.__name__ = f"q8tile{wrows}x{xrows}"
    return intrinsic(generic)


# Weight rows × activation rows per tile, per path: the tile's accumulators (two sets: the products' and
# the min term's) and its rows' codes in the path's registers (AVX-512: 32 of 16 lanes; AVX2: 16 of 8).
TILES = {"avx512": (4, 4), "avx2": (4, 2), "generic": (2, 2)}
TILE_W, TILE_X = TILES[_TARGET.isa]
tile_wx, tile_w1, tile_11 = _make_tile(TILE_W, TILE_X), _make_tile(TILE_W, 1), _make_tile(1, 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # as intdot: no fast-math flags on the tiles' float steps
_CHUNKS = 16


@nb.njit(**_TILE_JIT)
def _quantize_row(x, k, xq, xs, xsum):
    """Row k of x float32 `[batch, cols]` → xq int16 `[batch, quads · 128]` (each quad's columns in
    `QUAD_COLUMNS` order), xs and xsum float32 `[batch, nmin]`; the padding stays zero."""
    cols = x.shape[1]
    for col in range(cols):  # each block's largest magnitude, into xs (zeros) first
        xs[k, col // 32] = max(xs[k, col // 32], abs(x[k, col]))
    for b in range(cols // 32):
        top = xs[k, b]
        inv = np.float32(XQ_MAX) / top if top > 0 else np.float32(0.0)
        total = 0
        at = (b // 4) * 128
        for j in range(32):  # column j of block b % 4 of its quad: lane t, vector s of `QUAD_COLUMNS`
            q = np.int32(np.rint(x[k, 32 * b + j] * inv))
            byte = (b % 4) * 16 + j % 16
            xq[k, at + (2 * (byte % 2) + j // 16) * 32 + byte // 2] = np.int16(q)
            total += q
        xs[k, b] = top / np.float32(XQ_MAX)
        xsum[k, b] = np.float32(total) * xs[k, b]


@nb.njit(**_TILE_JIT)
def _rows(xq, xs, xsum, qs, qh, d, m, mscale, out, r, wrows, b0, b1):
    """Weight rows r .. r + wrows (TILE_W or 1) against activation rows b0 .. b1, in tiles."""
    rows, nmin, quads, qw, hw, xw = qs.shape[0], d.shape[1], xq.shape[1] // 128, qs.shape[1], qh.shape[1], xq.shape[1]
    ahead = r + PREFETCH_ROWS  # see simd.PREFETCH_ROWS
    prefetch_span(qs, ahead * qw, wrows * qw)
    prefetch_span(d, ahead * nmin, wrows * nmin)
    prefetch_span(m, ahead * nmin, wrows * nmin)
    prefetch_span(qh, ahead * hw, wrows * hw)
    b, w0, s0 = b0, r * qw, r * nmin
    while b < b1:  # TILE_X rows at a time while they last, then one by one (a pair's bits are the same)
        o0, step = b * rows + r, TILE_X if wrows == TILE_W and b + TILE_X <= b1 else 1
        if wrows < TILE_W:
            tile_11(qs, w0, qw, qh, r * hw, hw, d, m, s0, nmin, quads, nmin, xq, b * xw, xw, xs, xsum, b * nmin,
                    nmin, out, o0, rows, mscale)
        elif step == 1:
            tile_w1(qs, w0, qw, qh, r * hw, hw, d, m, s0, nmin, quads, nmin, xq, b * xw, xw, xs, xsum, b * nmin,
                    nmin, out, o0, rows, mscale)
        else:
            tile_wx(qs, w0, qw, qh, r * hw, hw, d, m, s0, nmin, quads, nmin, xq, b * xw, xw, xs, xsum, b * nmin,
                    nmin, out, o0, rows, mscale)
        b += step


@nb.njit(parallel=True, **_JIT)
def matmul_packed(x, qs, qh, d, m, mscale, out):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T for W packed by `pack` (qs, qh or
    a `[rows, 1]` uint8 placeholder, d and m float32 `[rows, nmin]`, mscale float32: the module
    docstring), x quantized to int16 per 32-block first (`_quantize_row`). Error:
    the activations' rounding (module docstring). Tiles of TILE_W weight rows × TILE_X activation
    rows, X_TILE activation rows per pass over the weights."""
    batch, rows = x.shape[0], qs.shape[0]
    xq = np.zeros((batch, (x.shape[1] + 127) // 128 * 128), dtype=np.int16)  # whole quads of blocks
    xs = np.zeros((batch, d.shape[1]), dtype=np.float32)
    xsum = np.zeros((batch, d.shape[1]), dtype=np.float32)
    serial = batch if batch < 8 else 0  # a parallel region costs more than a few rows' quantization
    for k in range(serial):
        _quantize_row(x, k, xq, xs, xsum)
    if serial < batch:
        for k in prange(batch):
            _quantize_row(x, k, xq, xs, xsum)
    groups = rows // TILE_W
    per = (groups + _CHUNKS - 1) // _CHUNKS
    for b0 in range(0, batch, X_TILE):
        b1 = min(batch, b0 + X_TILE)
        for c in prange(_CHUNKS):
            for g in range(c * per, min(groups, (c + 1) * per)):
                _rows(xq, xs, xsum, qs, qh, d, m, mscale, out, TILE_W * g, TILE_W, b0, b1)
        for r in range(TILE_W * groups, rows):
            _rows(xq, xs, xsum, qs, qh, d, m, mscale, out, r, 1, b0, b1)
