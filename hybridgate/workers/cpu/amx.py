"""Prompt matmuls on AMX-BF16 tiles (Intel Xeons since Sapphire Rapids), from the GGUF weights as stored.

A prompt's weight matmuls are compute-bound: with int16 activations the superblock kernels multiply
32 pairs an instruction (`vpdpwssd`), and int8 activations fail the accuracy floor
(`docs/results/accuracy-activation-formats-smollm2*.json`). AMX's `tdpbf16ps` multiplies a 16 x 32 bf16 tile by a 32 x 16
one into 16 x 16 float32 sums: 512 products an instruction. Here the weights stay in their GGUF
codes (no bf16 copy: that would be 16 bits a weight beside Q4_K's 4.75); each job dequantizes a
panel of 32 weight rows once a call into AMX's B layout (`_dequant_panel`, in L2) and multiplies
every token block against it.

Accuracy: the activations are split in two bf16 planes, x ≈ hi + lo with hi = bf16(x) and
lo = bf16(x - hi) (about 16 bits of mantissa, int16's per-256 error or better), and both are
multiplied, so the error is the weights' rounding to bf16 (8 significant bits: at most a relative 2^-8 of
each dequantized weight, below a quantized weight's step; an F16 weight's own rounding is 2^-11). Sums are
float32.

Batch invariance: a token's output is its row of tiles, summed over k in one fixed order whatever
the other rows of its tile hold (padding rows are zeros), so a prompt token's result does not
depend on its batch or chunk. Which tokens run here is decided per request (`prompt_rows`): a
prompt's own tokens when it is long enough, never generated ones, so a preempted sequence's
recompute gives the bits of its first run.

Sources: Intel's Architecture Instruction Set Extensions Programming Reference (AMX: `ldtilecfg`,
`tileloadd`, `tdpbf16ps`, `tilestored`, the palette-1 configuration and the B tile's pair-interleaved
rows); Linux's Documentation/arch/x86/xstate.rst (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`,
needed once a process before the first tile instruction); ggml's block layouts (ggml-common.h) and
gguf-py's dequantizer for the weights.
"""

from __future__ import annotations

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import threading  # noqa: E402

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu import kernel_table, superblock  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)
PANEL = 32  # weight rows a job dequantizes: two B tiles
TOKENS = 32  # token rows a tile block multiplies: two A tiles
JOB_PANELS = 4  # panels of 32 weight rows a job holds: each token block is read from memory once per 128 rows
COLUMNS = 2048  # columns of a job's panels at a time (4 panels x 2048 columns of bf16: 512 KiB)
MIN_PROMPT = kernel_table.AMX_MIN_PROMPT  # shorter prompts stay on the int16 kernels (alone, one would spend more
# dequantizing panels); the kernel table's threshold, so that `hybridgate info` reads it without Numba


def tile_config() -> np.ndarray:
    """`ldtilecfg`'s 64 bytes: palette 1, tiles 0-7 of 16 rows x 64 bytes."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for i in range(8):
        cfg[16 + 2 * i] = 64
        cfg[48 + i] = 16
    return cfg


_CONFIG = tile_config()
_I8, _I64 = ir.IntType(8), ir.IntType(64)
_I8P = _I8.as_pointer()


def _fn(builder, name, args):
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), args), name)


def _bytes_at(context, builder, ty, arr, offset):
    """i8* to element `offset` of array value `arr` of Numba type `ty`."""
    data = context.make_array(ty)(context, builder, arr).data
    return builder.bitcast(builder.gep(data, [offset]), _I8P)


@intrinsic
def _tile_block(typingctx, cfg, a, a_off, a_stride, planes, plane_elems, b, b_off, ksteps, out, o_off, o_stride,
                accumulate):
    """out float32 `[32, 32]` at element o_off (row stride o_stride elements) = (out if accumulate else 0) + Σ
    over planes of the token rows a (bf16 bits uint16 in `_split_activations`' tiles: tokens 0-15 from a_off,
    16-31 a_stride elements on, a step's tile 512 elements after the last; plane p at + p·plane_elems) times the
    weight panel b (uint32 pair-interleaved B tiles, `_dequant_panel`'s layout from b_off), over ksteps steps of
    32 columns. Tiles: 0-3 the sums (tokens 0-15 / 16-31 x weight rows 0-15 / 16-31), 4-5 the token rows, 6-7
    the weights; per step the weights are loaded once for both planes."""
    ip = types.intp
    sig = types.void(cfg, a, ip, ip, ip, ip, b, ip, ip, out, ip, ip, types.boolean)

    def codegen(context, builder, signature, args):
        cfgv, av, ao, ast, npl, pel, bv, bo, ks, ov, oo, ost, acc = args
        ty = signature.args
        c = lambda n: ir.Constant(_I64, n)  # noqa: E731
        t = lambda n: ir.Constant(_I8, n)  # noqa: E731
        load = _fn(builder, "llvm.x86.tileloadd64", [_I8, _I8P, _I64])
        dp = _fn(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8])
        builder.call(_fn(builder, "llvm.x86.ldtilecfg", [_I8P]), [_bytes_at(context, builder, ty[0], cfgv, c(0))])
        o8 = _bytes_at(context, builder, ty[9], ov, oo)
        o_bytes = builder.mul(ost, c(4))
        corners = [builder.gep(o8, [builder.add(builder.mul(o_bytes, c(dm)), c(dn * 4))])
                   for dm, dn in [(0, 0), (0, 16), (16, 0), (16, 16)]]
        with builder.if_else(builder.icmp_unsigned("!=", acc, ir.Constant(acc.type, 0))) as (then, otherwise):
            with then:
                for i, at in enumerate(corners):
                    builder.call(load, [t(i), at, o_bytes])
            with otherwise:
                for i in range(4):
                    builder.call(_fn(builder, "llvm.x86.tilezero", [_I8]), [t(i)])
        a8, b8 = _bytes_at(context, builder, ty[1], av, ao), _bytes_at(context, builder, ty[6], bv, bo)
        a_half = builder.mul(ast, c(2))  # tokens 16-31
        plane_bytes = builder.mul(pel, c(2))
        with cgutils.for_range(builder, ks) as step:
            b_k = builder.gep(b8, [builder.mul(step.index, c(2048))])  # two 1 KiB tiles a step
            builder.call(load, [t(6), b_k, c(64)])
            builder.call(load, [t(7), builder.gep(b_k, [c(1024)]), c(64)])
            a_k = builder.gep(a8, [builder.mul(step.index, c(1024))])
            with cgutils.for_range(builder, npl) as plane:
                a_p = builder.gep(a_k, [builder.mul(plane.index, plane_bytes)])
                builder.call(load, [t(4), a_p, c(64)])
                builder.call(load, [t(5), builder.gep(a_p, [a_half]), c(64)])
                builder.call(dp, [t(0), t(4), t(6)])
                builder.call(dp, [t(1), t(4), t(7)])
                builder.call(dp, [t(2), t(5), t(6)])
                builder.call(dp, [t(3), t(5), t(7)])
        store = _fn(builder, "llvm.x86.tilestored64", [_I8, _I8P, _I64])
        for i, at in enumerate(corners):
            builder.call(store, [t(i), at, o_bytes])
        builder.call(_fn(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _bits(typingctx, x):
    """float32 → its bits as uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _float(typingctx, u):
    """uint32 bits → float32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@nb.njit(inline="always", **_JIT)
def _bf16(x):
    """float32 → bfloat16 bits (uint32, the low 16 bits set), to nearest even."""
    u = _bits(np.float32(x))
    return (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@nb.njit(parallel=True, **_JIT)
def _split_activations(x, rows, a):
    """a uint16 `[2, m_pad / 16, k / 32, 16, 32]` = x[rows] float32 `[m, k]` as bf16 hi and lo planes
    (x ≈ hi + lo) in AMX A tiles, each 16 token rows x 32 columns contiguous (1 KiB: rows 64 bytes apart,
    not k · 2, whose 4 KiB strides would put a tile's rows in one L1 set); padding rows m..m_pad zeros."""
    m, k = rows.shape[0], x.shape[1]
    for t in prange(a.shape[1] * 16):
        hi_tiles, lo_tiles = a[0, t >> 4], a[1, t >> 4]
        row = t & 15
        if t >= m:
            hi_tiles[:, row, :] = 0
            lo_tiles[:, row, :] = 0
            continue
        xr = x[rows[t]]
        for s in range(k // 32):
            hi_row, lo_row = hi_tiles[s, row], lo_tiles[s, row]
            for e in range(32):
                v = xr[32 * s + e]
                hi = _bf16(v)
                hi_row[e] = np.uint16(hi)
                lo_row[e] = np.uint16(_bf16(v - _float(hi << np.uint32(16))))


# The weight formats, by the dtypes of (qs, sc): what differs between them is data (`superblock.Kind` for the
# codes' layout, whether a min is added, sub-block scales per 32 columns). Q8_0 (and Q5_0 as int8 codes c - 16,
# `quant.Q50Matrix`): d·c with float32 d per 32 columns in sc.
_Q8_0 = superblock.Kind("q8_0", 32, 1, 0, False)
# Q5_0 and Q5_1 as `quant.LowBitMatrix` holds them on the avx512 path (`kquant.pack`): the low 4 bits in Q4_1's
# nibble order, 16 bytes a block; the 5th bits in uint32 words, a quad of 4 blocks in 4 words, block b's bits
# in byte b % 4 of each (`kquant.QUAD_COLUMNS`); d and m float32 per 32 columns: w = d·c + mscale·m.
_LOW5 = superblock.Kind("q5_lowbit", 16, 1, 0, True)
# BF16 as `quant.FloatMatrix` holds it (bfloat16 bits as uint16; sc its float32 placeholder): exactly itself. Not
# F16 (rounded to bf16 it failed the top-1 floor) nor F32 (its file asks for float32): `FloatMatrix._prompt_arrays`.
_BF16 = superblock.Kind("bf16", 0, 0, 0, False)
_FORMATS = {**{key: kind for key, kind in superblock.KINDS.items() if key != (types.int8, types.int8)},
            (types.int8, types.float32): _Q8_0, (types.uint8, types.float32): _LOW5,
            (types.uint16, types.float32): _BF16}
# Column j of a block: the word (of its quad's 4) and bit (of the block's byte) holding its 5th bit.
_FIFTH_WORD = [(j >= 16) + 2 * (j % 2) for j in range(32)]
_FIFTH_BIT = [(j % 16) // 2 for j in range(32)]
_V16I, _V32I = ir.VectorType(ir.IntType(32), 16), ir.VectorType(ir.IntType(32), 32)
_V32F = ir.VectorType(ir.FloatType(), 32)
_V16F = ir.VectorType(ir.FloatType(), 16)


def _transpose16(builder, rows):
    """16 <16 x i32> rows → the 16 columns: block swaps of 8, 4, 2 and 1 lanes between row pairs (a 2 x 2 block
    matrix's transpose is its blocks transposed and the off-diagonal ones swapped)."""
    rows = list(rows)
    for b in (8, 4, 2, 1):
        out = list(rows)
        for i in range(16):
            if i & b:
                continue
            lo = [c if (c // b) % 2 == 0 else 16 + c - b for c in range(16)]  # row i: its even blocks, i + b's
            hi = [c + b if (c // b) % 2 == 0 else 16 + c for c in range(16)]  # row i + b: i's odd blocks, its own
            out[i] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(_V16I, lo))
            out[i + b] = builder.shuffle_vector(rows[i], rows[i + b], ir.Constant(_V16I, hi))
        rows = out
    return rows


@intrinsic
def _dequant_tile(typingctx, qs, sc, d, ndmin, mins, r0, s, tiles, t_off):
    """tiles (uint32, flat) from element t_off, 256 elements = AMX's B tile of weight rows r0..r0+15 at columns
    32s..32s+31: tile row j holds, for each of the 16 weight rows, the pair (bf16 of column 32s + 2j, of
    32s + 2j + 1) in its low and high 16 bits. The weights as gguf's dequantizer computes them: Q4_K and Q5_K
    (d·sc)·c + (-dmin·m) (qs `quant.q4k_nibbles` or `superblock.q5k_codes`, sc and mins uint8 per 32 columns,
    d and ndmin float32 per 256), packed Q6_K (d·sc)·(c - 32) (`superblock.pack_q6k`, sc int8 per 16), Q8_0
    d·c (qs int8, sc float32 per 32), BF16 as stored (`_BF16`), Q5_0/Q5_1 d·c + mscale·m (`_LOW5`: qs uint8, sc
    d and d·m float32 per 32, ndmin float32 `[1, 1]` mscale, mins the uint32 5th bits), each rounded to bf16 to
    nearest even. The rows are decoded as vectors (`superblock._block_codes`) and transposed in registers
    (`_transpose16`)."""
    kind = _FORMATS[(qs.dtype, sc.dtype)]
    ip = types.intp
    sig = types.void(qs, sc, d, ndmin, mins, ip, ip, tiles, ip)

    def codegen(context, builder, signature, args):
        qv, scv, dv, nv, mv, r0v, sv, tv, tov = args
        ty = signature.args
        c = lambda n: ir.Constant(ir.IntType(64), n)  # noqa: E731
        f32 = ir.FloatType()

        def array(i, value):
            arr = context.make_array(ty[i])(context, builder, value)
            return arr.data, cgutils.unpack_tuple(builder, arr.shape)[1]

        (qd, q_cols), (scd, sc_cols), (dd, d_cols), (nd, _), (md, _) = (
            array(i, v) for i, v in enumerate((qv, scv, dv, nv, mv)))
        sub = builder.ashr(sv, c(3))  # the super-block of step s
        pairs = []
        for i in range(16):
            row = builder.add(r0v, c(i))
            if kind is _BF16:
                pairs.append(_bf16_pairs(builder, builder.gep(qd, [builder.add(builder.mul(row, q_cols),
                                                                               builder.mul(sv, c(32)))])))
                continue
            codes_at = builder.gep(qd, [builder.add(builder.mul(row, q_cols), builder.mul(sv, c(kind.code_bytes)))])
            codes = superblock._block_codes(builder, kind, builder.bitcast(codes_at, _I8P))[0]
            if kind is _LOW5:
                codes = builder.or_(codes, _fifth_bits(builder, md, row, sv, context, ty[4], mv))
            codes = builder.sitofp(codes, _V32F)
            if kind is _LOW5:
                scales = [builder.load(builder.gep(scd, [builder.add(builder.mul(row, sc_cols), sv)]))]
            elif kind is _Q8_0:
                scales = [builder.load(builder.gep(scd, [builder.add(builder.mul(row, sc_cols), sv)]))]
            else:
                dsub = builder.load(builder.gep(dd, [builder.add(builder.mul(row, d_cols), sub)]))
                convert = builder.sitofp if kind.scales == 2 else builder.uitofp
                first = builder.add(builder.mul(row, sc_cols), builder.mul(sv, c(kind.scales)))
                scales = [builder.fmul(dsub, convert(builder.load(builder.gep(scd, [builder.add(first, c(j))])), f32))
                          for j in range(kind.scales)]
            halves = [builder.shuffle_vector(codes, codes, ir.Constant(_V16I, list(range(h * 16, h * 16 + 16))))
                      for h in range(2)]
            w = [builder.fmul(half, _splat16(builder, scales[h % len(scales)])) for h, half in enumerate(halves)]
            if kind is _LOW5:
                low = builder.fmul(builder.load(builder.gep(dd, [builder.add(builder.mul(row, d_cols), sv)])),
                                   builder.load(nd))
                w = [builder.fadd(half, _splat16(builder, low)) for half in w]
            elif kind.has_min:
                minimum = builder.load(builder.gep(md, [builder.add(builder.mul(row, sc_cols), sv)]))
                low = builder.fmul(builder.load(builder.gep(nd, [builder.add(builder.mul(row, d_cols), sub)])),
                                   builder.uitofp(minimum, f32))
                w = [builder.fadd(half, _splat16(builder, low)) for half in w]
            pairs.append(_to_pairs(builder, w))
        out = builder.bitcast(builder.gep(context.make_array(ty[7])(context, builder, tv).data, [tov]),
                              _V16I.as_pointer())
        for j, column in enumerate(_transpose16(builder, pairs)):
            builder.store(column, builder.gep(out, [c(j)]), align=4)
        return context.get_dummy_value()

    return sig, codegen


def _fifth_bits(builder, bits, row, s, context, ty, value):
    """<32 x i16>: the 5th bits of block s of `row` (`_LOW5`), times 16, in column order."""
    c = lambda n: ir.Constant(ir.IntType(64), n)  # noqa: E731
    i32 = ir.IntType(32)
    cols = cgutils.unpack_tuple(builder, context.make_array(ty)(context, builder, value).shape)[1]
    first = builder.add(builder.mul(row, cols), builder.mul(builder.ashr(s, c(2)), c(4)))  # the quad's 4 words
    shift = builder.trunc(builder.mul(builder.and_(s, c(3)), c(8)), i32)  # block s's byte in each
    words = ir.Constant(ir.VectorType(i32, 4), ir.Undefined)
    for k in range(4):
        word = builder.lshr(builder.load(builder.gep(bits, [builder.add(first, c(k))])), shift)
        words = builder.insert_element(words, word, ir.Constant(i32, k))
    lanes = builder.shuffle_vector(words, words, ir.Constant(_V32I, _FIFTH_WORD))
    lanes = builder.and_(builder.lshr(lanes, ir.Constant(_V32I, _FIFTH_BIT)), ir.Constant(_V32I, [1] * 32))
    return builder.trunc(builder.shl(lanes, ir.Constant(_V32I, [4] * 32)), ir.VectorType(ir.IntType(16), 32))


def _to_pairs(builder, halves):
    """Columns 0-15 and 16-31 as two <16 x float> → bf16 (vcvtne2ps2bf16: to nearest even; its first source the
    upper half) in column order: as <16 x i32>, lane j is the pair (column 2j, column 2j + 1)."""
    return builder.asm(ir.FunctionType(_V16I, [_V16F, _V16F]), "vcvtne2ps2bf16 $2, $1, $0", "=v,v,v",
                       [halves[1], halves[0]], False, "vcvtne2ps2bf16")


def _bf16_pairs(builder, ptr):
    """32 stored BF16 values at ptr (uint16 pointer) → `_to_pairs`' bf16 pairs, widened exactly by a shift."""
    vec = builder.load(builder.bitcast(ptr, ir.VectorType(ir.IntType(16), 32).as_pointer()), align=2)
    vec = builder.bitcast(builder.shl(builder.zext(vec, _V32I), ir.Constant(_V32I, [16] * 32)), _V32F)
    return _to_pairs(builder, [builder.shuffle_vector(vec, vec, ir.Constant(_V16I, list(range(h * 16, h * 16 + 16))))
                               for h in range(2)])


def _splat16(builder, scalar):
    """A float in all 16 lanes."""
    vec = builder.insert_element(ir.Constant(_V16F, ir.Undefined), scalar, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(vec, vec, ir.Constant(_V16I, [0] * 16))


@nb.njit(**_JIT)
def _dequant_panel(qs, sc, d, ndmin, mins, r0, s0, steps, chunk, tiles):
    """tiles uint32 (flat, `[chunk, 2, 16, 16]`) = weight rows r0..r0+31 at steps s0..s0+steps-1 (32 columns
    each) as AMX B tiles (`_dequant_tile`), step by step, rows 0-15 then 16-31."""
    for s in range(steps):
        for h in range(2):
            _dequant_tile(qs, sc, d, ndmin, mins, r0 + 16 * h, s0 + s, tiles, (2 * s + h) * 256)


@nb.njit(parallel=True, **_JIT)
def matmul_amx(cfg, x, rows, qs, sc, d, ndmin, mins, out, a, tiles, sums):
    """out[rows] float32 `[len(rows), n]` = x[rows] float32 `[*, k]` @ W.T, W `[n, k]` in one of the formats of
    `_dequant_tile` (n a multiple of 32, k of 32); other rows of out are not written.

    A job holds JOB_PANELS panels of 32 weight rows, COLUMNS columns at a time, dequantized once into B tiles
    (`_dequant_panel`; 512 KiB, in L2), and multiplies every block of 32 token rows by them, its sums
    accumulating in float32 over the column chunks in order in `sums`, then copied into out (tiles stored
    straight into out ran 5-20% slower: its row strides of a multiple of 4 KiB put a tile's 16 rows in one L1
    set). Each thread takes a contiguous run of jobs.
    Scratch (`Scratch`): a uint16 `[≥ 2 · m_pad · k]` (the activations' tiles, m_pad = len(rows) rounded up
    to 32), tiles uint32 `[threads, JOB_PANELS · chunk · 512]`, sums float32 `[threads, ≥ m_pad · JOB_PANELS · 32]`
    with chunk = min(COLUMNS, k) / 32."""
    n, k = out.shape[1], x.shape[1]
    m = rows.shape[0]
    m_pad = (m + TOKENS - 1) // TOKENS * TOKENS
    tokens = a[: 2 * m_pad * k].reshape((2, m_pad // 16, k // 32, 16, 32))
    _split_activations(x, rows, tokens)
    flat_a = tokens.reshape(-1)
    panels = n // PANEL
    chunk = min(COLUMNS, k) // 32  # steps of 32 columns per chunk
    jobs = (panels + JOB_PANELS - 1) // JOB_PANELS
    threads = tiles.shape[0]
    per = (jobs + threads - 1) // threads
    for th in prange(threads):
        flat_t = tiles[th]
        for job in range(th * per, min(jobs, (th + 1) * per)):
            p0 = job * JOB_PANELS
            count = min(JOB_PANELS, panels - p0)
            width = count * PANEL
            flat_s = sums[th, : m_pad * width]
            for s0 in range(0, k // 32, chunk):
                steps = min(chunk, k // 32 - s0)
                for q in range(count):
                    _dequant_panel(qs, sc, d, ndmin, mins, (p0 + q) * PANEL, s0, steps, chunk,
                                   flat_t[q * chunk * 512 :])
                for tb in range(m_pad // TOKENS):
                    for q in range(count):
                        _tile_block(cfg, flat_a, (2 * tb * (k // 32) + s0) * 512, k // 32 * 512, 2, m_pad * k, flat_t,
                                    q * chunk * 512, steps, flat_s, tb * TOKENS * width + q * PANEL, width, s0 > 0)
            for t in range(m):
                out[rows[t], p0 * PANEL : p0 * PANEL + width] = flat_s[t * width : (t + 1) * width]


class Scratch(threading.local):
    """`matmul_amx`'s scratch arrays, kept between calls and grown as needed (a fresh large array costs a page
    fault a page at its first touch: 0.1-0.2 ms a MiB), one set per calling thread."""

    def __init__(self):
        self.a = np.empty(0, np.uint16)
        self.tiles = np.empty((0, 0), np.uint32)
        self.sums = np.empty((0, 0), np.float32)

    def get(self, m: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m_pad = -(-m // TOKENS) * TOKENS
        threads = nb.get_num_threads()
        if self.a.size < 2 * m_pad * k:
            self.a = np.empty(2 * m_pad * k, np.uint16)
        tile_len = JOB_PANELS * min(COLUMNS, k) // 32 * 512
        if self.tiles.shape[0] != threads or self.tiles.shape[1] < tile_len:
            self.tiles = np.empty((threads, max(tile_len, self.tiles.shape[1])), np.uint32)
        sums_len = m_pad * JOB_PANELS * PANEL
        if self.sums.shape[0] != threads or self.sums.shape[1] < sums_len:
            self.sums = np.empty((threads, max(sums_len, self.sums.shape[1])), np.float32)
        return self.a, self.tiles, self.sums


_SCRATCH = Scratch()


def multiply(x: np.ndarray, rows: np.ndarray, qs: np.ndarray, sc: np.ndarray, d: np.ndarray,
             ndmin: np.ndarray, mins: np.ndarray, out: np.ndarray) -> None:
    """`matmul_amx` with this process's tile configuration and this thread's scratch; rows int64 `[m]`,
    m ≥ 1. Raises ValueError when n is not a multiple of 32 or k of 32."""
    if out.shape[1] % PANEL or x.shape[1] % 32:
        raise ValueError(f"AMX matmul: weight {out.shape[1]}x{x.shape[1]}: rows and columns must be multiples of 32")
    matmul_amx(_CONFIG, x, rows, qs, sc, d, ndmin, mins, out, *_SCRATCH.get(len(rows), x.shape[1]))
