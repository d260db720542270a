"""A probe, not a kernel: a prompt-sized GEMM on AMX-BF16 tiles beside the CPU worker's Q4_K kernel.

    .venv/bin/python bench/amx_bf16_probe.py [--tokens 512] [--shape 8192x2048 ...] [--threads N] [--repeats 7]

Why: with int16 activations (`vpdpwssd`, 32 products an instruction) the CPU worker's prompt GEMM
cannot reach 1.3x llama.cpp's int8 one, and int8 activations fail the accuracy floor;
`bench/activation_precision.py` shows bf16 activations and weights pass it on SmolLM2. AMX's
`tdpbf16ps` multiplies a 16x32 bf16 tile by a 32x16 one into 16x16 float32 sums (16,384 flops an
instruction). This checks that Numba can emit it (LLVM's `llvm.x86.ldtilecfg`, `tileloadd64`,
`tdpbf16ps`, `tilestored64`, `tilerelease` intrinsics, after Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`), that its sums are right, and how fast it multiplies a 1B-class projection
against `quant.quant_matrix` of Q4_K (the superblock kernel) on the same Q4_K weights and float32 activations,
alternated, medians. The AMX side's weights are the Q4_K blocks dequantized by gguf and rounded to
bf16, packed once in AMX's pair-interleaved B layout (16 bits a weight against Q4_K's 4.75: a
prompt-only copy would cost that memory); its timing includes rounding the activations to bf16.
Intel's Architecture Instruction Set Extensions Programming Reference (AMX chapter) gives the tile
layout; Linux's Documentation/arch/x86/xstate.rst the permission (`isa.request_tiles`). The CPU worker's
own prompt path (`hybridgate.workers.cpu.amx`) grew out of this: weights dequantized per panel instead of
a bf16 copy, activations split in two bf16 halves.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

def pack_b(w: np.ndarray, round_bf16) -> np.ndarray:
    """float32 `[n, k]` weights (n rows of the output, k inputs; multiples of 16 and 32) → uint16
    `[n / 16, k / 32, 16, 32]` bfloat16 bits (`round_bf16`, `build_gemm`'s): per 16 outputs and 32 inputs,
    AMX's B tile, whose row r holds for each output j the pair (w[j, 2r], w[j, 2r + 1])."""
    n, k = w.shape
    bits = np.empty((n, k), np.uint16)
    round_bf16(np.ascontiguousarray(w, dtype=np.float32), bits)
    t = bits.reshape(n // 16, 16, k // 32, 16, 2)  # [n tile, j, k step, r, pair]
    return np.ascontiguousarray(t.transpose(0, 2, 3, 1, 4)).reshape(n // 16, k // 32, 16, 32)


def build_gemm():
    """The Numba GEMM: out float32 `[m, n]` = a bf16 `[m, k]` @ packed weights (`pack_b`), in 32x32 output
    blocks of 4 tiles (m, n multiples of 32), one block per job over the threads."""
    import numba as nb
    from llvmlite import ir
    from numba import prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i64 = ir.IntType(8), ir.IntType(64)
    i8p = i8.as_pointer()

    def fn(builder, name, args):
        try:
            return builder.module.get_global(name)
        except KeyError:
            return ir.Function(builder.module, ir.FunctionType(ir.VoidType(), args), name=name)

    @intrinsic
    def block(typingctx, cfg, a, a_off, a_stride, b, b_off, k_steps, out, o_off, o_stride):
        ip = types.intp
        sig = types.void(cfg, a, ip, ip, b, ip, ip, out, ip, ip)

        def codegen(context, builder, signature, args):
            cfgv, av, ao, ast, bv, bo, ks, ov, oo, ost = args
            ty = signature.args

            def base(t, arr, off, size):
                data = cgutils.create_struct_proxy(t)(context, builder, value=arr).data
                return builder.bitcast(builder.gep(data, [off]), i8p), size

            cfg8, _ = base(ty[0], cfgv, ir.Constant(i64, 0), 1)
            a8, _ = base(ty[1], av, ao, 2)
            b8, _ = base(ty[4], bv, bo, 2)
            o8, _ = base(ty[7], ov, oo, 4)
            load, store = fn(builder, "llvm.x86.tileloadd64", [i8, i8p, i64]), fn(builder, "llvm.x86.tilestored64", [i8, i8p, i64])
            dp, zero = fn(builder, "llvm.x86.tdpbf16ps", [i8, i8, i8]), fn(builder, "llvm.x86.tilezero", [i8])
            t = lambda n: ir.Constant(i8, n)  # noqa: E731
            c = lambda n: ir.Constant(i64, n)  # noqa: E731
            builder.call(fn(builder, "llvm.x86.ldtilecfg", [i8p]), [cfg8])
            for i in range(4):
                builder.call(zero, [t(i)])
            a_bytes, b_step = builder.mul(ast, c(2)), builder.mul(ks, c(1024))  # next 16 rows of a; next n tile of b
            with cgutils.for_range(builder, ks) as loop:
                a_k = builder.gep(a8, [builder.mul(loop.index, c(64))])
                b_k = builder.gep(b8, [builder.mul(loop.index, c(1024))])
                builder.call(load, [t(4), a_k, a_bytes])
                builder.call(load, [t(5), builder.gep(a_k, [builder.mul(a_bytes, c(16))]), a_bytes])
                builder.call(load, [t(6), b_k, c(64)])
                builder.call(load, [t(7), builder.gep(b_k, [b_step]), c(64)])
                builder.call(dp, [t(0), t(4), t(6)])
                builder.call(dp, [t(1), t(4), t(7)])
                builder.call(dp, [t(2), t(5), t(6)])
                builder.call(dp, [t(3), t(5), t(7)])
            o_bytes = builder.mul(ost, c(4))
            for i, (dm, dn) in enumerate([(0, 0), (0, 16), (16, 0), (16, 16)]):
                at = builder.gep(o8, [builder.add(builder.mul(o_bytes, c(dm)), c(dn * 4))])
                builder.call(store, [t(i), at, o_bytes])
            builder.call(fn(builder, "llvm.x86.tilerelease", []), [])
            return context.get_dummy_value()

        return sig, codegen

    from hybridgate.workers.cpu.simd import kv_encode

    @nb.njit(parallel=True, nogil=True)
    def round_bf16(x, a):
        """a (uint16 bfloat16 bits) = x (float32, same shape, 2-d), to nearest even as the bf16 KV cache
        rounds (`simd.kv_encode`), over the threads."""
        flat_x, flat_a = x.reshape(-1), a.reshape(-1)
        for i in prange(flat_x.shape[0]):
            flat_a[i] = kv_encode(flat_x[i], flat_a)

    @nb.njit(parallel=True, nogil=True)
    def gemm(cfg, a, packed, out):
        m, k = a.shape
        n = out.shape[1]
        steps = k // 32
        m_blocks = m // 32
        flat_a, flat_b, flat_o = a.reshape(-1), packed.reshape(-1), out.reshape(-1)
        for job in prange((n // 32) * m_blocks):  # an n panel's m blocks in a row: its weights stay in L2
            nb_, mb = job // m_blocks, job % m_blocks
            block(cfg, flat_a, mb * 32 * k, k, flat_b, 2 * nb_ * steps * 512, steps, flat_o, mb * 32 * n + nb_ * 32, n)

    return gemm, round_bf16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="activation rows, a multiple of 32 (default 512)")
    parser.add_argument("--shape", action="append",
                        help="OUTxIN of the weight, both multiples of 256; repeatable (default: 8192x2048 and 2048x8192)")
    parser.add_argument("--threads", type=int, default=None, help="threads (default: all cores)")
    parser.add_argument("--repeats", type=int, default=7, help="alternated timings per side, their median (default 7)")
    args = parser.parse_args()
    if args.tokens < 32 or args.tokens % 32:
        parser.error(f"--tokens: must be a positive multiple of 32 (the GEMM's 32-row blocks), got {args.tokens}")
    for shape in args.shape or []:
        dims = shape.split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 and int(d) % 256 == 0 for d in dims):
            parser.error(f"--shape: OUTxIN with both multiples of 256 (Q4_K's super-blocks), got {shape!r}")
    from hybridgate.workers.cpu import isa

    if not isa.select().amx:  # the avx512 path with AMX's features, the tile state granted, before Numba is imported
        raise SystemExit("no AMX-BF16 here (or HYBRIDGATE_CPU_AMX=off): nothing to probe")
    import gguf
    import numba

    from hybridgate.bench.kernels import random_weight
    from hybridgate.workers.cpu import quant
    from hybridgate.workers.cpu.amx import tile_config

    if args.threads:
        numba.set_num_threads(args.threads)
    (gemm, round_bf16), cfg, rng = build_gemm(), tile_config(), np.random.default_rng(0)
    print(f"path {isa.selected().isa}, {numba.get_num_threads()} threads, {args.tokens} tokens")
    for shape in args.shape or ["8192x2048", "2048x8192"]:
        rows, cols = map(int, shape.split("x"))
        data = random_weight(quant.Q4_K, rows, cols, rng)
        ours = quant.quant_matrix("w", quant.Q4_K, data, (rows, cols))
        w = gguf.quants.dequantize(data.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K).reshape(rows, cols)
        packed = pack_b(w.astype(np.float32), round_bf16)
        x = rng.standard_normal((args.tokens, cols)).astype(np.float32)
        out = np.empty((args.tokens, rows), np.float32)
        xb = np.empty(x.shape, np.uint16)

        def amx():
            round_bf16(x, xb)
            gemm(cfg, xb, packed, out)
            return out

        want = x.astype(np.float64) @ w.astype(np.float64).T
        scale = np.abs(want).max()
        errs = {"ours": np.abs(ours.matmul(x) - want).max() / scale, "amx": np.abs(amx() - want).max() / scale}
        times = {"ours": [], "amx": []}
        for _ in range(args.repeats):
            for name, f in (("ours", lambda: ours.matmul(x)), ("amx", amx)):
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
        ms = {name: float(np.median(t)) * 1e3 for name, t in times.items()}
        flop = 2 * args.tokens * rows * cols
        print(f"{shape}: {type(ours).__name__} {ms['ours']:.2f} ms ({flop / ms['ours'] / 1e6:.0f} GFLOP/s), "
              f"AMX bf16 {ms['amx']:.2f} ms ({flop / ms['amx'] / 1e6:.0f} GFLOP/s): {ms['ours'] / ms['amx']:.2f}x; "
              f"largest error / largest output: ours {errs['ours']:.1e}, amx {errs['amx']:.1e}", flush=True)


if __name__ == "__main__":
    main()
