"""Prompt matmuls with int8 activations: Q4_K, Q5_K and Q6_K, weight rows interleaved a 32-bit lane each.

The kernel table runs them on the avx2 path and on the avx512 path. Without VNNI a tile is 8 weight rows in
256-bit vectors summed by `vpmaddubsw` (below); on the avx512 path with AVX-512 VNNI it is 16 rows in 512-bit
vectors summed by `vpdpbusd` into int32 (`KROWS`): Q4_K two chains a row against its latency, then the sum
times the sub-block scales in float32 (`_float_scales`: exact, so the int16 path's bits); Q6_K's codes unsigned c
(0..63) from -32 · Σ xq per 16-column half (`_half_sums`: P = Σ c · x - 32 · Σ x = Σ (c - 32) · x), the two
halves' scaled sums in float32 (exact too). Both give the integers of the 8-row tiles, and every lane takes the
same float steps in the same order, so the same bits on either path (tested). On a 2-core Zen 4 EPYC (one
thread, CPU time, alternated, a busy machine) the 16-row tiles measured Q4_K 1.04-1.25x the 8-row `vpdpbusd`
tile and Q6_K 1.25-1.85x the 8-row `vpsignb` one at 32-256 rows, where the 8-row Q6_K tile had measured 0.9-1.2x
the avx512 path's 512-bit `vpdpwssd` int16 GEMM; Zen 4 runs a 512-bit `vpdpbusd` a cycle as two 256-bit ones, so
what the width saves is the instructions around it. The float steps (one or two FMAs a block and activation
row for 8 `vpdpbusd`) share its ports: without them Q4_K's tile ran 1.4x faster (a measurement, not a kernel).
The scales were first applied by `vpmulld` (two uops and 10 cycles on Intel's port 0, where `vpdpbusd` runs);
the float multiply measured Q6_K 1.12-1.15x and Q5_K 1.0-1.17x at 512 rows of 2048 x 8192, Q4_K 1.0-1.03x
(an Ice Lake Xeon, one thread, CPU time, alternated, beside a compile at nice 19). A tile of 6 or 8 activation rows
measured no faster than 4.

A prompt's rows are many, so its matmuls are bound by the multiply rate, not by the weights' bytes
(issue "CPU tier ahead of llama.cpp"). `superblock`'s int16 GEMM tiles take two `vpmaddwd` (16
products each) per 32 products. Here the activations are int8, quantized per 32 columns (xs =
max|x_b| / 127: per 64 and per 256 columns measured below the accuracy floor,
docs/results/accuracy/*-int8-granularity.json), and `vpmaddubsw` multiplies 32 unsigned bytes by 32
signed ones into 16 int16 pair sums: one multiply per 32 products, the int16 sums widened by one
`vpmaddwd` with the sub-block scales per block.

Lanes. KROWS weight rows are interleaved, 4 bytes of each in one 32-bit lane (ik_llama.cpp's `_R8` idea;
our own layout), so lane r of every vector belongs to row r and an activation row's 4 bytes are
broadcast to all lanes: no horizontal sums, and the float steps serve KROWS rows at once. The
interleaving is done per group of KROWS rows into a scratch (`int8_interleave`: a copy of 32-bit words,
or with VNNI Q6_K's 6-bit codes unpacked) that every activation tile of the pass
reads, so the weights keep one layout (the decode kernels') and cost no memory.

- Q4_K (codes 0..15 in Q4_1's nibble order: byte j of a block is column j low, j + 16 high): a lane
  holds bytes 4q..4q+3 of the block, so its low nibbles are columns 4q..4q+3 and its high ones
  16 + 4q..; `vpmaddubsw(code, x)` pair sums are at most 2 · 15 · 127 = 3810, and the block's 8
  (4 quads, low and high) summed in int16 at most 30,480 < 2^15: exact. One `vpmaddwd` with
  [sc_r, sc_r] per lane pair gives lane r = sc_rb · P_rb in int32, then one float step per block:
  S_r += float(sc_rb · P_rb) · xs_b, and per super-block out_r += S_r · d_r; the min term
  out_r += (-dmin_r · min_rb) · (xs_b · Σ xq_b) per block (as `superblock`, in float32).
- Q5_K (codes 0..31 as int8 in column order, `superblock.q5k_codes`; sub-block scales and mins as Q4_K's):
  a lane holds columns 4q..4q+3, 8 lanes a block; `vpmaddubsw(code, x)` pair sums are at most 2 · 31 ·
  127 = 7874, so the int16 sums run per 16-column half (4 quads: 31,496 < 2^15, exact), each widened by
  one `vpmaddwd` with [sc_r, sc_r], the halves added in int32; with VNNI `vpdpbusd` on the codes as they
  are. Then Q4_K's float steps, its min term included.
- Q6_K (codes c - 32 in -32..31, column order): `vpmaddubsw(|c|, sign(x, c))` (`vpsignb`) is c · x
  pair-summed, at most 2 · 32 · 127 = 8128, and the 4 quads of a 16-column half summed in int16 at
  most 32,512 < 2^15: exact; then one `vpmaddwd` with the half's signed scale and the float step per
  block as Q4_K's (no min term).

Multiplies per 256 products and 8 rows: Q4_K 9 (8 `vpmaddubsw`, 1 `vpmaddwd`), Q6_K 10, against 16
`vpmaddwd` on int16 (with VNNI, per 512 products and 16 rows: 8 `vpdpbusd` and 1 or 2 float multiplies). A row's
result does not depend on its batch (every activation row runs the same operations), but it differs from the
int16 decode kernel's: see `kernel_table` for what a stream's continuity keeps.

Error: the activations' rounding, at most xs_b / 2 = max|x_b| / 254 per element.

Sources: ggml's `block_q4_K`, `block_q6_K` (ggml-common.h) and `ggml_vec_dot_q4_K_q8_K` (ggml-cpu,
`vpmaddubsw` then `vpmaddwd` with the scales, and the sign trick of its q8_0 dot); Intel's intrinsics
guide for `vpmaddubsw`, `vpsignb`, `vpmaddwd`, `vpdpbusd`; ik_llama.cpp's interleaved-rows idea (read, not
copied).
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

_TARGET = isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange  # noqa: E402
from numba.core import cgutils  # noqa: E402

from hybridgate.workers.cpu.avx2 import _madd  # noqa: E402
from hybridgate.workers.cpu.int8_interleave import KROWS, VNNI, _interleave_q4k, _interleave_q6k  # noqa: E402
from hybridgate.workers.cpu.simd import _load_vec  # noqa: E402
from hybridgate.workers.cpu.tilegen import _fma, _splat, tile_intrinsic  # noqa: E402

SUPER = 256
XQ_MAX = 127.0
TILE_X = 4  # activation rows a tile multiplies: 3 accumulators each, 12 of AVX2's 16 registers
X_BYTES = 1024 * 1024  # int8 activations of one pass over the weights: each group of rows is interleaved once a pass
# The 16-row tiles' passes: 4 MiB ran 2048 x 8192 at 512 and 1024 rows 1.16-1.38x faster than 1 MiB (fewer
# interleaves; a Zen 4 EPYC, 1 and 2 threads, CPU time), 16 MiB no faster than 4.
KX_BYTES = 4 * X_BYTES if VNNI else X_BYTES
_CHUNKS = 16
_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32B = ir.VectorType(_I8, 32)
_V16S = ir.VectorType(_I16, 16)
_V8F = ir.VectorType(ir.FloatType(), 8)
# the K-quant tiles' vectors: KROWS 32-bit lanes
_VKB, _VKS = ir.VectorType(_I8, 4 * KROWS), ir.VectorType(_I16, 2 * KROWS)
_VKI, _VKF = ir.VectorType(_I32, KROWS), ir.VectorType(ir.FloatType(), KROWS)
# 4-byte code quads per row and block: Q4_K's nibbles hold two columns a byte, Q5_K's and Q6_K's codes one
QUADS = {"q4_k": 4, "q5_k": 8, "q6_k": 8}
SCALES = {"q4_k": 1, "q5_k": 1, "q6_k": 2}  # sub-block scales per block
KINDS = ("q4_k", "q5_k", "q6_k")  # `_tiles`' kind: the index here


def _maddubs(builder, u, s):
    """vpmaddubsw: <32 x i8> u (unsigned) · s (signed) → <16 x i16>, lane t = u_2t·s_2t + u_2t+1·s_2t+1."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16S, [_V32B, _V32B]),
                                        "llvm.x86.avx2.pmadd.ub.sw")
    return builder.call(fn, [u, s])


def _sign(builder, a, b):
    """vpsignb: a with each byte negated where b's is negative, zeroed where b's is zero."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32B, [_V32B, _V32B]),
                                        "llvm.x86.avx2.psign.b")
    return builder.call(fn, [a, b])


def _dpbusd(builder, acc, u, s):
    """vpdpbusd: <KROWS x i32> acc + the sums of 4 products of u (unsigned bytes) · s (signed) per 32-bit lane
    (no saturation: exact while the sums stay in int32)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VKI, [_VKI, _VKI, _VKI]),
                                        f"llvm.x86.avx512.vpdpbusd.{32 * KROWS}")
    return builder.call(fn, [acc, builder.bitcast(u, _VKI), builder.bitcast(s, _VKI)])


def _broadcast4(builder, ptr, lanes=8):
    """The 4 bytes at ptr (an i8*) in every one of `lanes` 32-bit lanes, as bytes (one vpbroadcastd)."""
    vec_ty = ir.VectorType(_I32, lanes)
    word = builder.load(builder.bitcast(ptr, _I32.as_pointer()), align=1)
    vec = builder.insert_element(ir.Constant(vec_ty, ir.Undefined), word, ir.Constant(_I32, 0))
    return builder.bitcast(builder.shuffle_vector(vec, vec, ir.Constant(vec_ty, [0] * lanes)),
                           ir.VectorType(_I8, 4 * lanes))


def _make_tile(kind: str, xrows: int):
    """An intrinsic: KROWS interleaved weight rows of `kind` ("q4_k" or "q6_k") times `xrows` int8 activation rows:
    with VNNI 16 rows, `vpdpbusd` and int32 sums; otherwise 8 rows, `vpmaddubsw` and int16 sums (the same
    integers, so the same bits).

    f(wc, wsc, wm, wd, nblocks, xq, x_off, x_stride, xs, xsum, xh, a_off, a_stride, out, o_off, o_stride) writes
    out[o_off + k·o_stride + r] for the weight rows r and activation rows k < xrows (see the module docstring):
    wc uint8 `[nblocks · QUADS · KROWS · 4]` the interleaved codes, wsc int16 `[nblocks · SCALES · KROWS · 2]` each
    row's sub-block scale in its two 16-bit lanes (VNNI: as one int32 lane), wm float32 `[nblocks · KROWS]` (Q4_K:
    -dmin_r · min_rb; Q6_K: unread), wd float32 `[nblocks / 8 · KROWS]` d_r per super-block; xq int8 (row k at x_off
    + k·x_stride, columns in order), xs and xsum float32 per block at a_off + k·a_stride + b, xh int32 per 16
    columns at 2 · (a_off + k·a_stride) + h (Q6_K with VNNI: -32 · Σ xq; otherwise unread). nblocks: a
    multiple of 8.
    """
    sums = {("q4_k", True): _q4k_sums_vnni, ("q4_k", False): _q4k_sums, ("q5_k", True): _q5k_sums_vnni,
            ("q5_k", False): _q5k_sums, ("q6_k", True): _q6k_sums_vnni, ("q6_k", False): _q6k_sums}[kind, VNNI]
    return tile_intrinsic(f"int8_{kind}_tile{KROWS}x{xrows}", _TILE_ARGS, lambda arg: (kind, xrows, sums), _emit_tile)


_TILE_ARGS = ("wc", "wsc", "wm", "wd", "nblocks", "xq", "x_off", "x_stride", "xs", "xsum", "xh", "a_off", "a_stride",
              "out", "o_off", "o_stride")


def _emit_tile(t, state):
    """`_make_tile`'s body: per block the integer sums (`sums`) and their float step, per super-block d's."""
    kind, xrows, sums = state
    builder, c = t.builder, t.c
    zero_f = ir.Constant(_VKF, [0.0] * KROWS)
    total = [cgutils.alloca_once_value(builder, zero_f) for _ in range(xrows)]
    partial = [cgutils.alloca_once_value(builder, zero_f) for _ in range(xrows)]
    with t.loop(builder.sdiv(t["nblocks"], c(8))) as s:
        for k in range(xrows):
            builder.store(zero_f, partial[k])
        with t.loop(c(8)) as block:
            blk = builder.add(builder.mul(s, c(8)), block)
            block_sums = sums(t, xrows, blk)
            if kind != "q6_k":  # Q4_K's and Q5_K's min term
                mins = _load_vec(builder, t.ptr("wm", builder.mul(blk, c(KROWS))), _VKF, 1)
            for k in range(xrows):
                xsv = _splat(builder, builder.load(t.at("xs", "a_off", "a_stride", k, blk)), _VKF)
                builder.store(_fma(builder, block_sums[k], xsv, builder.load(partial[k])),
                              partial[k])
                if kind != "q6_k":
                    xsum = _splat(builder, builder.load(t.at("xsum", "a_off", "a_stride", k, blk)), _VKF)
                    builder.store(_fma(builder, mins, xsum, builder.load(total[k])), total[k])
        d = _load_vec(builder, t.ptr("wd", builder.mul(s, c(KROWS))), _VKF, 1)
        for k in range(xrows):
            builder.store(_fma(builder, builder.load(partial[k]), d, builder.load(total[k])), total[k])
    for k in range(xrows):
        dst = t.ptr("out", t.row("o_off", "o_stride", k))
        builder.store(builder.load(total[k]), builder.bitcast(dst, _VKF.as_pointer()), align=4)
    return t.context.get_dummy_value()


def _x_at(t, k, blk, column):
    """Activation row k's 4 bytes at `column` of block blk, in every 32-bit lane."""
    b, c = t.builder, t.c
    offset = b.add(t.row("x_off", "x_stride", k), b.add(b.mul(blk, c(32)), c(column)))
    return _broadcast4(b, t.ptr("xq", offset), KROWS)


def _codes(t, quads, blk, q):
    """Code vector q of block blk (4 bytes of each of the KROWS rows)."""
    b, c = t.builder, t.c
    return _load_vec(b, t.ptr("wc", b.mul(b.add(b.mul(blk, c(quads)), c(q)), c(4 * KROWS))), _VKB, 1)


def _scale_vec(t, scales, blk, h):
    """Block blk's scale vector h: each row's sub-block scale in its two 16-bit lanes."""
    b, c = t.builder, t.c
    return _load_vec(b, t.ptr("wsc", b.mul(b.add(b.mul(blk, c(scales)), c(h)), c(2 * KROWS))), _VKS, 1)


def _float_scales(t, scales, blk, h):
    """With VNNI: block blk's scale vector h as float32 lanes. sc · P is exact in float32 for every kind (|sc ·
    P| < 2^24: Q4_K 63 · 60,960, Q5_K 63 · 125,984, Q6_K 128 · 65,024 a half and two halves 16,646,144), so
    float(sc) · float(P) is float(sc · P), as the int16 path's `vpmaddwd` gives it, and costs one `vmulps`
    where `vpmulld` took two uops and 10 cycles on port 0 beside `vpdpbusd`."""
    return t.builder.bitcast(_scale_vec(t, scales, blk, h), _VKF)


def _nibbles(builder, w):
    """A code vector's (low, high) nibbles as bytes."""
    low4 = ir.Constant(w.type, [15] * w.type.count)
    shorts = ir.VectorType(_I16, w.type.count // 2)
    high = builder.bitcast(builder.lshr(builder.bitcast(w, shorts), ir.Constant(shorts, [4] * shorts.count)), w.type)
    return builder.and_(w, low4), builder.and_(high, low4)


def _q4k_sums_vnni(t, xrows, blk):
    """Q4_K block blk, per activation row: <KROWS x i32> sc_r · P_r by `vpdpbusd`."""
    builder = t.builder
    acc = [ir.Constant(_VKI, [0] * KROWS)] * xrows
    acc2 = list(acc)
    for q in range(QUADS["q4_k"]):
        lo, hi = _nibbles(builder, _codes(t, QUADS["q4_k"], blk, q))
        for k in range(xrows):  # two chains a row (low and high nibbles): vpdpbusd's latency
            acc[k] = _dpbusd(builder, acc[k], lo, _x_at(t, k, blk, 4 * q))
            acc2[k] = _dpbusd(builder, acc2[k], hi, _x_at(t, k, blk, 16 + 4 * q))
    sc = _float_scales(t, SCALES["q4_k"], blk, 0)
    return [builder.fmul(builder.sitofp(builder.add(a, a2), _VKF), sc) for a, a2 in zip(acc, acc2)]


def _q4k_sums(t, xrows, blk):
    """Q4_K block blk, per activation row: <8 x i32> sc_r · P_r by `vpmaddubsw`, int16 sums and `vpmaddwd`."""
    builder = t.builder
    acc = [None] * xrows
    for q in range(QUADS["q4_k"]):
        lo, hi = _nibbles(builder, _codes(t, QUADS["q4_k"], blk, q))
        for k in range(xrows):
            pair = builder.add(_maddubs(builder, lo, _x_at(t, k, blk, 4 * q)),
                               _maddubs(builder, hi, _x_at(t, k, blk, 16 + 4 * q)))
            acc[k] = pair if acc[k] is None else builder.add(acc[k], pair)
    sc = _scale_vec(t, SCALES["q4_k"], blk, 0)
    return [builder.sitofp(_madd(builder, a, sc), _VKF) for a in acc]


def _q5k_sums_vnni(t, xrows, blk):
    """Q5_K block blk, per activation row: <KROWS x i32> sc_r · P_r by `vpdpbusd` on the codes 0..31 as they are
    (unsigned), two chains a row against its latency."""
    builder = t.builder
    acc = [[ir.Constant(_VKI, [0] * KROWS)] * xrows for _ in range(2)]
    for q in range(QUADS["q5_k"]):
        w = _codes(t, QUADS["q5_k"], blk, q)
        for k in range(xrows):
            acc[q % 2][k] = _dpbusd(builder, acc[q % 2][k], w, _x_at(t, k, blk, 4 * q))
    sc = _float_scales(t, SCALES["q5_k"], blk, 0)
    return [builder.fmul(builder.sitofp(builder.add(a, a2), _VKF), sc) for a, a2 in zip(*acc)]


def _q5k_sums(t, xrows, blk):
    """Q5_K block blk, per activation row: <8 x i32> sc_r · P_r by `vpmaddubsw` (codes unsigned), int16 sums per
    16-column half (4 · 2 · 31 · 127 = 31,496 < 2^15) and one `vpmaddwd` with the scale pair a half."""
    builder = t.builder
    out = [None] * xrows
    sc = _scale_vec(t, SCALES["q5_k"], blk, 0)
    for h in range(2):
        acc = [None] * xrows
        for q in range(4 * h, 4 * h + 4):
            w = _codes(t, QUADS["q5_k"], blk, q)
            for k in range(xrows):
                prod = _maddubs(builder, w, _x_at(t, k, blk, 4 * q))
                acc[k] = prod if acc[k] is None else builder.add(acc[k], prod)
        for k in range(xrows):
            part = _madd(builder, acc[k], sc)
            out[k] = part if out[k] is None else builder.add(out[k], part)
    return [builder.sitofp(o, _VKF) for o in out]


def _q6k_sums_vnni(t, xrows, blk):
    """Q6_K block blk, per activation row: <KROWS x i32> Σ_h sc_rh · P_rh, P_rh = Σ c · x less 32 · Σ x (the
    codes c unsigned, 0..63) by `vpdpbusd` from -32 · Σ x (`xh`)."""
    builder, c = t.builder, t.c
    out = [None] * xrows
    for h in range(2):
        acc = []
        for k in range(xrows):
            at = builder.mul(builder.add(t.row("a_off", "a_stride", k), blk), c(2))  # xh: 2 halves a block
            acc.append(_splat(builder, builder.load(t.ptr("xh", builder.add(at, c(h)))), _VKI))
        for q in range(4 * h, 4 * h + 4):
            w = _codes(t, QUADS["q6_k"], blk, q)
            for k in range(xrows):
                acc[k] = _dpbusd(builder, acc[k], w, _x_at(t, k, blk, 4 * q))
        sc = _float_scales(t, SCALES["q6_k"], blk, h)
        for k in range(xrows):
            p = builder.sitofp(acc[k], _VKF)
            out[k] = builder.fmul(p, sc) if out[k] is None else _fma(builder, p, sc, out[k])
    return out


def _q6k_sums(t, xrows, blk):
    """Q6_K block blk, per activation row: <8 x i32> Σ_h sc_rh · P_rh (`vpsignb`, `vpmaddubsw`, `vpmaddwd`)."""
    builder = t.builder
    out = [None] * xrows
    for h in range(2):
        acc = [None] * xrows
        for q in range(4 * h, 4 * h + 4):
            w = _codes(t, QUADS["q6_k"], blk, q)
            magnitude = builder.select(builder.icmp_signed("<", w, ir.Constant(_V32B, [0] * 32)), builder.neg(w), w)
            for k in range(xrows):
                prod = _maddubs(builder, magnitude, _sign(builder, _x_at(t, k, blk, 4 * q), w))
                acc[k] = prod if acc[k] is None else builder.add(acc[k], prod)
        sc = _scale_vec(t, SCALES["q6_k"], blk, h)
        for k in range(xrows):
            part = _madd(builder, acc[k], sc)
            out[k] = part if out[k] is None else builder.add(out[k], part)
    return [builder.sitofp(o, _VKF) for o in out]


tile_q4k, tile_q4k_1 = _make_tile("q4_k", TILE_X), _make_tile("q4_k", 1)
tile_q5k, tile_q5k_1 = _make_tile("q5_k", TILE_X), _make_tile("q5_k", 1)
tile_q6k, tile_q6k_1 = _make_tile("q6_k", TILE_X), _make_tile("q6_k", 1)

_JIT = dict(nogil=True, fastmath=True, cache=True)
_TILE_JIT = dict(nogil=True, fastmath=False, cache=True)  # no fast-math flags on the float steps (as `superblock`)


@nb.njit(**_TILE_JIT)
def _quantize_row(x, k, xq, xs, xsum):
    """Row k of x float32 `[batch, cols]` → xq int8 `[batch, cols]` (rint(x / xs_b)), xs float32 `[batch,
    cols / 32]` (max|x_b| / 127) and xsum float32 `[batch, cols / 32]` (xs_b · Σ xq_b)."""
    for b in range(x.shape[1] // 32):
        at = 32 * b
        top = np.float32(0.0)
        for j in range(32):
            top = max(top, abs(x[k, at + j]))
        inv = np.float32(XQ_MAX) / top if top > 0 else np.float32(0.0)
        scale = top / np.float32(XQ_MAX)
        total = 0
        for j in range(32):
            q = np.int32(np.rint(x[k, at + j] * inv))
            xq[k, at + j] = np.int8(q)
            total += q
        xs[k, b] = scale
        xsum[k, b] = np.float32(total) * scale


@nb.njit(**_JIT)
def quantize(x, xq, xs, xsum):
    """`_quantize_row` for every row of x (xq, xs, xsum as there)."""
    for k in range(x.shape[0]):
        _quantize_row(x, k, xq, xs, xsum)


@nb.njit(**_JIT)
def _half_sums(xq, k, xh):
    """xh int32 `[batch, cols / 16]`: -32 · Σ xq over each 16 columns of row k (Q6_K's codes c less 32)."""
    for h in range(xh.shape[1]):
        total = 0
        for j in range(16):
            total += np.int32(xq[k, 16 * h + j])
        xh[k, h] = -32 * total


@nb.njit(**_TILE_JIT)
def _tiles(kind, wc, wsc, wm, wd, nblocks, xq, xs, xsum, xh, out, r0, b0, b1, tmp):
    """One interleaved group's KROWS rows (from r0) against activation rows b0 .. b1; a group past the weight's
    last row goes through tmp float32 `[TILE_X, KROWS]` and keeps only its rows."""
    rows, cols = out.shape[1], xq.shape[1]
    full = r0 + KROWS <= rows
    b = b0
    while b < b1:
        xr = TILE_X if b + TILE_X <= b1 else 1
        dst, off, stride = (out, b * rows + r0, rows) if full else (tmp, 0, KROWS)
        a = (wc, wsc, wm, wd, nblocks, xq, b * cols, cols, xs, xsum, xh, b * nblocks, nblocks, dst, off, stride)
        if kind == 0:
            tile_q4k(*a) if xr == TILE_X else tile_q4k_1(*a)
        elif kind == 1:
            tile_q5k(*a) if xr == TILE_X else tile_q5k_1(*a)
        else:
            tile_q6k(*a) if xr == TILE_X else tile_q6k_1(*a)
        if not full:
            for k in range(xr):
                for r in range(rows - r0):
                    out[b + k, r0 + r] = tmp[k, r]
        b += xr


@nb.njit(parallel=True, **_JIT)
def matmul_i8(x, qs32, sc, d, ndmin, mins, out, x_bytes=KX_BYTES):
    """out float32 `[batch, rows]` = x float32 `[batch, cols]` @ W.T, x quantized to int8 per 32 columns, for
    a Q4_K weight (qs32: `superblock.split_scales`' nibbles viewed as uint32 `[rows, cols / 8]`; sc, d, ndmin,
    mins as there), a Q5_K one (qs32: `superblock.q5k_codes` viewed as uint32 `[rows, cols / 4]`, the rest as
    Q4_K's) or a Q6_K one (qs32: `superblock.split_q6k`'s int8 codes viewed as uint32 `[rows, cols /
    4]`, or `superblock.pack_q6k`'s bytes viewed as uint32 `[rows, cols · 3 / 16]`; sc int8 `[rows,
    cols / 16]`; ndmin and mins unread), told apart by sc's columns (cols / 32 or cols / 16) and qs32's. cols: a multiple
    of 256; x_bytes: the int8 activations of one pass over the weights (each group of KROWS rows is interleaved
    once a pass). Error: the activations' rounding, at most max|x_b| / 254 per element."""
    batch, cols = x.shape
    nblocks = cols // 32
    mins_kind = sc.shape[1] == nblocks  # Q4_K or Q5_K (Q6_K: two scales a block)
    quads = qs32.shape[1] // nblocks  # Q4_K 4; Q5_K 8 (Q6_K's codes 8, packed 6)
    kind = (0 if quads == 4 else 1) if mins_kind else 2  # `KINDS`
    xq = np.empty((batch, cols), dtype=np.int8)
    xs = np.empty((batch, nblocks), dtype=np.float32)
    xsum = np.empty((batch, nblocks), dtype=np.float32)
    xh = np.empty((batch, cols // 16), dtype=np.int32)
    for k in prange(batch):
        _quantize_row(x, k, xq, xs, xsum)
        if VNNI and kind == 2:
            _half_sums(xq, k, xh)
    rows = qs32.shape[0]
    groups = (rows + KROWS - 1) // KROWS
    per = (groups + _CHUNKS - 1) // _CHUNKS
    x_tile = max(TILE_X, x_bytes // cols // TILE_X * TILE_X)
    quads = 4 if kind == 0 else 8
    for b0 in range(0, batch, x_tile):
        b1 = min(batch, b0 + x_tile)
        for chunk in prange(_CHUNKS):
            wc32 = np.empty(nblocks * quads * KROWS, dtype=np.uint32)
            wsc = np.empty(nblocks * 2 * KROWS * (1 if mins_kind else 2), dtype=np.int16)
            wm = np.zeros(nblocks * KROWS, dtype=np.float32)
            wd = np.empty(nblocks // 8 * KROWS, dtype=np.float32)
            tmp = np.empty((TILE_X, KROWS), dtype=np.float32)
            for g in range(chunk * per, min(groups, (chunk + 1) * per)):
                if mins_kind:
                    _interleave_q4k(qs32, sc, d, ndmin, mins, KROWS * g, wc32, wsc, wm, wd)
                else:
                    _interleave_q6k(qs32.view(np.uint64), sc, d, KROWS * g, wc32, wsc, wd)
                _tiles(kind, wc32.view(np.uint8), wsc, wm, wd, nblocks, xq, xs, xsum, xh, out, KROWS * g, b0,
                       b1, tmp)


def multiply(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, sc: np.ndarray, d: np.ndarray, ndmin: np.ndarray,
             mins: np.ndarray, out: np.ndarray) -> None:
    """out[rows] = x[rows] @ W.T by `matmul_i8` (the prompt kernel's signature, as `amx.multiply`): qs the
    weight's codes as its super-block matrix holds them (Q4_K nibbles uint8 `[n, cols / 2]`, Q5_K codes 0..31
    int8 `[n, cols]`, Q6_K codes int8
    `[n, cols]` or packed to 6 bits, uint8 `[n, cols · 3 / 4]`), rows int64 `[m]`, m ≥ 1, ascending; out
    float32 `[batch, n]`. Raises ValueError when cols is not a multiple of 256."""
    if x.shape[1] % SUPER:
        raise ValueError(f"int8 matmul: {x.shape[1]} columns: must be a multiple of {SUPER}")
    qs32 = qs.view(np.uint32)
    if len(rows) == x.shape[0]:
        matmul_i8(x, qs32, sc, d, ndmin, mins, out)
        return
    part = np.empty((len(rows), out.shape[1]), dtype=np.float32)
    matmul_i8(np.ascontiguousarray(x[rows]), qs32, sc, d, ndmin, mins, part)
    out[rows] = part
