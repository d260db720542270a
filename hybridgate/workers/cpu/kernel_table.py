"""The CPU kernel table: which matrix class and kernels multiply each GGUF weight type on each path.

This is the one place the choice is made. `AUTO` is literal: for every
(path, weight type) the matrix class of `quant`, the kernel a step's decode
rows (and every row of a short prompt) run on, its activation format, and the
prompt kernel with its activation format and row threshold (a request's prompt
of at least `prompt_rows` tokens multiplies its own tokens there). An explicit
`cpu_activations` is a rule over the same data (`choose`): `f32` is float32
activations for every type (the row-dequantizing `QuantMatrix` for types
without a float32 fast kernel, Q5_1 and Q5_K), `i16` is int16 activations
wherever a type has an int16 kernel; neither takes a prompt kernel, so a prompt
row gets the bits a decode row would. `i8` is `auto` where the row's prompt
kernel is the int8 one (`int8`), the row of `OPT_IN_I8` where it has one (int8
prompt kernels below auto's accuracy floor on some models), and `i16` elsewhere.

Prompt kernels and a stream's continuity. A row's result does not depend on its
batch on any kernel. A prompt row on a prompt kernel (`int8`, `amx`) differs
from the same token as a decode row, so the prompt span is the request's own
prompt: a resumed stream's replayed ids (the tail of its prompt, after
`first_token_index`) run on the decode kernel as they first did, and the stream
continues bit for bit (`step_inputs.build_step_inputs`). A GPU-to-CPU hand-off
brings its KV along and decodes only.

Paths: `avx512-amx` is the avx512 path with AMX-BF16 granted (`isa.Target.amx`);
the others are `isa.ISAS`. Activation formats: `f32`; `i16/32` (int16 per
32-column block, `intdot`, `avx2`, `kquant`, and Q8_0's prompt GEMM on avx512, `i16_blocks`); `i16/256`
(int16 per 256-column super-block, the sub-block scales in integers, `superblock`); `i8/32` (int8 per 32-column block,
weight rows interleaved in a scratch per pass, no memory kept: `int8` for Q4_K, Q5_K and Q6_K, 16 rows in
512-bit `vpdpbusd` tiles on avx512 with VNNI and 8 elsewhere, `int8_blocks` for Q8_0, Q5_0, Q4_0,
Q4_1 and MXFP4); `bf16x2` (two
bf16 halves on AMX tiles, `amx`).

Why each row is what it is (`hybridgate bench kernels`, docs/results/cpu-kernels/*.json):
on avx512 the float kernels beat int16 on Q4_1 (0.9x at batch 1, 0.5-0.8x at 16) and int16
wins on Q8_0 (1.3x); on avx2 int16 wins on both (1.6-1.7x), where the 8-lane float kernels
need twice the converts. `LowBitMatrix` (`kquant`) replaced the formatted classes where it
measured faster at batch 1 and 16: Q5_0 and Q5_1 on avx512, Q5_1 on avx2 (the in-lane int16
kernels of `avx2` stay ahead for the types they take), every low-bit type but Q4_1 on generic.
The K-quants' super-block kernels (`superblock`) on avx2 measured Q4_K 1.5-1.7x the Q4_1 kernel at
batch 16-256 and 1.0-1.1x at 1, Q6_K 1.0-1.2x (2 threads, a Zen 3 EPYC). On avx512 with VNNI the
int8 prompt kernel's 16-row tiles measured Q4_K 1.78-2.52x and Q6_K 1.17-2.37x the int16 GEMM at
64-512 rows, 0.93-1.43x and 1.09-1.36x at 32 (a busy Zen 4 EPYC, *-int8-prompt-wide.json); Q6_K's
8-row tile had measured 0.9-1.2x. On an Emerald Rapids Xeon (load 4.6-6, *-xeon-emerald-rapids-*-int8-prompt-
k-quants.json) Q5_K's int8 tiles measured 1.21-1.95x the int16 GEMM at 32-512 rows on avx2 and, on avx512
with VNNI, 1.31-2.36x from 128 rows but 0.68-0.98x at 32 and 0.95-1.41x at 64 (Q6_K there: 0.83-0.94x at
32-64 rows of 2048 columns): the threshold is one per request (`long_prompt`), so these rows run int8 too. The generic path is merely correct (unmeasured): float32 where it
has a fast kernel. MXFP4 (gpt-oss's experts) is data on `LowBitMatrix` on every path (`kquant.E2M1`: its
nibbles become ggml's doubled E2M1 integers, -12..12, by a table lookup in the tiles, its E8M0 byte half a
float scale there, and no min term), the file's 17 bytes a block regrouped (4.25 bits a weight; the
row-dequantizing class held 5.25, a float32 scale beside the bytes). On avx512 (an Emerald Rapids Xeon at load
5-6, one thread, medians of 21) it measured 11.8-12.5x the row-dequantizing kernel it replaced at batch 1,
4.3-5.7x at 16 and 2.9-5.0x at 64 (2880 x 2880, gpt-oss-20b's expert width, and 2048 x 8192: *-mxfp4.json); an
earlier run with float32 scales, 7.9-9.6x, 3.3-3.4x and 2.7-4.6x, whose kernel times matched these side by
side: the ratios move that much with the machine's load. The avx2 path forced there: 9.1-9.7x, 1.9-2.6x and
1.5-2.0x (2880 x 2880, two one-off runs, not recorded); generic is tested, not measured. One gpt-oss-20b MoE
block (`moe.experts_ffn`: 32 experts of 2880, top 4, random codes, one thread) measured 4.6-5.5x, 3.7-5.0x and
3.1-3.3x the row-dequantizing experts at 1, 16 and 64 tokens, in 414 MiB instead of 500 (two one-off runs of a
script, not recorded).

This module imports no Numba: `hybridgate info` prints the rows a file uses without compiling.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMATS = ("auto", "f32", "i16", "i8")  # the cpu_activations setting's choices
PATHS = ("avx512-amx", "avx512", "avx2", "generic")
AMX_MIN_PROMPT = 32  # `amx.MIN_PROMPT`: shorter prompts stay on the decode kernel
# Prompts from this many tokens multiply on `int8` (shorter ones stay on the decode kernel). On avx2 (a Zen 3
# EPYC, 2 threads) the int8 GEMM measured 1.2-1.7x the int16 one at 64 and 256 rows (Q4_K and Q6_K, 2048 x 8192
# and 8192 x 2048), and at 16 and 32 rows as the int16 GEMM's tiles: see docs/results/cpu-kernels/*-int8-prompt.json.
I8_MIN_PROMPT = 32


@dataclass(frozen=True)
class KernelRow:
    """How one weight type is multiplied on one path."""

    matrix: str  # the class in `quant`
    decode: str  # activation format of the decode kernel (see the module docstring)
    kernel: str  # the decode kernel, "module.function" under hybridgate.workers.cpu
    prompt: str = ""  # activation format of the prompt kernel ("": prompts run on the decode kernel)
    prompt_kernel: str = ""  # "module.function"
    prompt_rows: int | None = None  # a prompt of at least this many tokens runs on the prompt kernel

    def describe(self) -> str:
        """One line, e.g. "Q45KSuperMatrix i16/256 superblock.matmul_superblock; prompts of 32+ tokens bf16x2
        amx.multiply"."""
        text = f"{self.matrix} {self.decode} {self.kernel}"
        if self.prompt_kernel:
            text += f"; prompts of {self.prompt_rows}+ tokens {self.prompt} {self.prompt_kernel}"
        return text


_ROWS = "quant.matmul_rows"  # dequantize a row into float32, then dot it
_FLOAT = KernelRow("FloatMatrix", "f32", "simd.matmul_blocks")
_DEQUANT = KernelRow("QuantMatrix", "f32", _ROWS)
_SUPER45 = KernelRow("Q45KSuperMatrix", "i16/256", "superblock.matmul_superblock")
_SUPER6 = KernelRow("Q6KSuperMatrix", "i16/256", "superblock.matmul_superblock")
_PACKED = KernelRow("LowBitMatrix", "i16/32", "kquant.matmul_packed")


def _amx(row: KernelRow) -> KernelRow:
    return KernelRow(row.matrix, row.decode, row.kernel, "bf16x2", "amx.multiply", AMX_MIN_PROMPT)


def _i8(row: KernelRow, kernel: str = "int8.multiply") -> KernelRow:
    return KernelRow(row.matrix, row.decode, row.kernel, "i8/32", kernel, I8_MIN_PROMPT)


# Q8_0 prompts on the avx512 path from this many tokens run on `i16_blocks` (int16 activations as the decode kernel's,
# 16 weight rows interleaved, `vpdpwssd`): against `intdot.matmul_i16`'s GEMM tiles 1.56-1.98x at 512 rows, 1.12-1.43x
# at 64 and 0.93-1.01x at 32 (2048 x 2048, 8192 x 2048, 2048 x 8192; one thread, CPU time, alternated, a Zen 5 EPYC
# beside an engine bench), and `bench kernels` in docs/results/cpu-kernels/*-zen5-*-q80-i16-prompt.json.
I16_MIN_PROMPT = 64
_Q80_I16 = KernelRow("Q80Matrix", "i16/32", "intdot.matmul_i16", "i16/32", "i16_blocks.multiply_q8_0", I16_MIN_PROMPT)

# AUTO[path][type name]: every type of `blocks.LAYOUTS` on every path.
_AVX512 = {
    "F32": _FLOAT, "F16": _FLOAT, "BF16": _FLOAT,
    "Q4_0": KernelRow("Q40Matrix", "f32", "simd.matmul_blocks"),
    "Q4_1": KernelRow("Q41Matrix", "f32", "simd.matmul_blocks"),
    "Q5_0": _PACKED, "Q5_1": _PACKED,
    "Q8_0": _Q80_I16,
    "Q4_K": _i8(_SUPER45), "Q5_K": _i8(_SUPER45), "Q6_K": _i8(_SUPER6), "MXFP4": _PACKED,
}
AUTO = {
    "avx512-amx": {**_AVX512, **{name: _amx(_AVX512[name]) for name in  # the types `amx` has a format for
                                 ("BF16", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")}},
    "avx512": _AVX512,
    "avx2": {
        "F32": _FLOAT, "F16": _FLOAT, "BF16": _FLOAT,
        "Q4_0": KernelRow("Q40Matrix", "i16/32", "avx2.matmul_i16"),
        "Q4_1": KernelRow("Q41Matrix", "i16/32", "avx2.matmul_i16"),
        "Q5_0": KernelRow("Q50Matrix", "i16/32", "avx2.matmul_i16"),
        "Q5_1": _PACKED,
        "Q8_0": KernelRow("Q80Matrix", "i16/32", "avx2.matmul_i16"),
        "Q4_K": _i8(_SUPER45), "Q5_K": _i8(_SUPER45), "Q6_K": _i8(_SUPER6), "MXFP4": _PACKED,
    },
    "generic": {
        "F32": _FLOAT, "F16": _FLOAT, "BF16": _FLOAT,
        "Q4_0": _PACKED,
        "Q4_1": KernelRow("Q41Matrix", "f32", "simd.matmul_blocks"),
        "Q5_0": _PACKED, "Q5_1": _PACKED,
        "Q8_0": KernelRow("Q80Matrix", "f32", "simd.matmul_blocks"),
        "Q4_K": _PACKED, "Q5_K": _PACKED,
        "Q6_K": KernelRow("Q6KMatrix", "f32", "simd.matmul_blocks"), "MXFP4": _PACKED,
    },
}
# The classes that take either activation format on the 32-column kernels (`simd.matmul_blocks` for f32,
# `intdot.matmul_i16` or on avx2 `avx2.matmul_i16` for i16), used by an explicit cpu_activations.
FORMATTED = {"Q4_0": "Q40Matrix", "Q4_1": "Q41Matrix", "Q4_K": "Q4KMatrix", "Q5_0": "Q50Matrix",
             "Q6_K": "Q6KMatrix", "Q8_0": "Q80Matrix"}


def path_of(isa: str, amx: bool = False) -> str:
    """The table's path of an `isa.Target` (its isa, and amx)."""
    return "avx512-amx" if isa == "avx512" and amx else isa


def formatted(type_name: str, fmt: str, path: str) -> KernelRow:
    """The row of `type_name`'s class in `FORMATTED` under an explicit format: "f32" (`simd.matmul_blocks`) or
    "i16" (int16 per 32 columns: `avx2.matmul_i16` on avx2, `intdot.matmul_i16` elsewhere). Raises ValueError
    naming cpu_activations for another format, KeyError for a type without such a class."""
    if fmt == "f32":
        return KernelRow(FORMATTED[type_name], "f32", "simd.matmul_blocks")
    if fmt == "i16":
        return KernelRow(FORMATTED[type_name], "i16/32", "avx2.matmul_i16" if path == "avx2" else "intdot.matmul_i16")
    raise ValueError(f"cpu_activations: expected one of {', '.join(FORMATS)}, got {fmt!r}")


# Int8 prompt rows that an explicit cpu_activations i8 takes and auto does not (`int8_blocks`, on the int16 decode
# kernels `formatted` gives): 1.3-2.3x the int16 kernels at 64 and 256 rows on avx2
# (docs/results/cpu-kernels/*-int8-prompt-blocks.json) and 1.6-2.1x the avx512 path's decode kernels there (a
# one-off run, 2048 x 2048, not recorded); avx512's Q5_0 is `LowBitMatrix`, whose codes they do not read. With every
# matmul of the default model on them, prompts measured mean KL 1.0-1.1e-3 against the fp32 reference (Q8_0 and
# Q4_1 files, top-1 98.6%), over auto's 5e-4 floor (docs/results/accuracy/*-zen4-smollm2-*-int8-prompts.json).
_BLOCK_KERNELS = {"Q4_0": "q4", "Q4_1": "q4", "Q5_0": "q5_0", "Q8_0": "q8_0"}
OPT_IN_I8 = {path: {name: _i8(formatted(name, "i16", path), f"int8_blocks.multiply_{_BLOCK_KERNELS[name]}")
                    for name in names} for path, names in (("avx2", ("Q4_0", "Q4_1", "Q5_0", "Q8_0")),
                                                           ("avx512", ("Q4_0", "Q4_1", "Q8_0")))}
# MXFP4 on its LowBitMatrix, the nibbles looked up in the tiles: 1.76-2.21x the int16 kernel at 32-512 rows of 2880 x
# 2880 and 5760 x 2880 (gpt-oss-20b's experts; one thread, CPU time, an Ice Lake Xeon at load 5, a one-off script,
# not recorded); opt-in as Q4_0's, whose way (an offset code, a minimum's term) it takes.
for _path in ("avx2", "avx512"):
    OPT_IN_I8[_path]["MXFP4"] = _i8(_PACKED, "int8_blocks.multiply_mxfp4")


def choose(type_name: str, activations: str, path: str) -> KernelRow:
    """The row multiplying a `type_name` ("Q4_K", `blocks.LAYOUTS[...].name`) weight on `path` under the
    cpu_activations setting `activations` (one of FORMATS). Raises ValueError naming cpu_activations for
    another setting, and KeyError for a path or type the table lacks."""
    if activations not in FORMATS:
        raise ValueError(f"cpu_activations: expected one of {', '.join(FORMATS)}, got {activations!r}")
    auto = AUTO[path][type_name]
    if activations == "i8" and type_name in OPT_IN_I8.get(path, {}):
        return OPT_IN_I8[path][type_name]
    if activations == "auto" or (activations == "i8" and auto.prompt == "i8/32"):
        return auto
    decode_only = KernelRow(auto.matrix, auto.decode, auto.kernel)
    has_format = type_name in FORMATTED
    if activations == "f32":
        if auto.decode == "f32":
            return decode_only
        return formatted(type_name, "f32", path) if has_format else _DEQUANT
    if auto.decode.startswith("i16") or not has_format:  # F32, F16, BF16: no int16 kernel
        return decode_only
    return formatted(type_name, "i16", path)  # i16, and i8 for a type without an int8 prompt kernel


def long_prompt(activations: str, path: str, type_names: list[str] | None = None) -> int | None:
    """The prompt length from which a request's prompt tokens run on a prompt kernel under `activations` on
    `path` (the smallest `prompt_rows` of the rows of `type_names`, default every type of the path), or None
    where none of those rows has a prompt kernel."""
    rows = [choose(name, activations, path) for name in (AUTO[path] if type_names is None else type_names)]
    return min((row.prompt_rows for row in rows if row.prompt_kernel), default=None)


PROMPT_NAMES = {"bf16x2": "AMX-BF16", "i8/32": "int8", "i16/32": "int16"}  # prompt formats as the logs name them


def prompt_kernels(activations: str, path: str, type_names: list[str]) -> str | None:
    """The prompt kernels' formats among the rows of `type_names` under `activations` on `path`, as the logs and the
    benches' JSON name them ("int8", "AMX-BF16", "int16", or several joined by "+"), or None where none has one."""
    rows = [choose(name, activations, path) for name in type_names]
    return "+".join(sorted({PROMPT_NAMES[row.prompt] for row in rows if row.prompt_kernel})) or None


def expert_long_prompt(long_prompt: int | None, num_experts: int, experts_per_token: int) -> int | None:
    """The prompt length from which a request's prompt tokens run on the prompt kernels inside a mixture of
    experts: where a step of the prompt gives an expert `long_prompt` rows on average (prompt · k / experts),
    the dense threshold's rows (None: no prompt kernels, or no experts).

    A prompt's rows spread over the experts: Qwen3-30B-A3B's 128 experts, 8 a token, give a 32-token prompt
    two rows an expert, where the prompt kernels' per-call work (AMX's bf16 panels, int8's interleave) costs
    more than the int16 GEMM tiles' (`moe_stack`). Measured on the AMX Xeon of the MoE bench (2 of its 8
    blocks, one thread, CPU time, the experts alone switched): int16 0.125 s against AMX 0.323 at 32 tokens,
    0.433 against 0.537 at 256, 0.888 against 0.796 at 512, 1.716 against 1.223 at 1024; 32 x 128 / 8 = 512."""
    if long_prompt is None or not num_experts:
        return None
    return -(-long_prompt * num_experts // experts_per_token)


def table_lines(type_names: list[str], activations: str, path: str) -> list[str]:
    """`hybridgate info`'s lines: one per type, "Q4_K: Q45KSuperMatrix i16/256 ..."."""
    return [f"{name}: {choose(name, activations, path).describe()}" for name in type_names]
