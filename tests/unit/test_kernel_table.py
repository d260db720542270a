"""The CPU kernel table: its rows as literal expectations, and the matrices `quant_matrix` builds follow them.

The first test is the table as reviewed: a change of any row (a new kernel chosen, a type moved to another
class) has to change this file too. The others build every type on this process's path and check that the
class, activation format and kernel of what runs are the row's, and that `--cpu-activations f32` means
float32 activations for every type (Q5_1 and Q5_K once stayed int16 under it).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybridgate.workers.cpu import kernel_table
from tests.unit.test_cpu_kernels import random_blocks

T = gguf.GGMLQuantizationType
AMX = "; prompts of 32+ tokens bf16x2 amx.multiply"
I8 = "; prompts of 32+ tokens i8/32 int8.multiply"
FLOATS = {name: "FloatMatrix f32 simd.matmul_blocks" for name in ("F32", "F16", "BF16")}
K_QUANTS = {"Q4_K": "Q45KSuperMatrix i16/256 superblock.matmul_superblock",
            "Q5_K": "Q45KSuperMatrix i16/256 superblock.matmul_superblock",
            "Q6_K": "Q6KSuperMatrix i16/256 superblock.matmul_superblock"}
PACKED = "LowBitMatrix i16/32 kquant.matmul_packed"
ROWS = {"MXFP4": PACKED}  # E2M1 codes looked up as integers (`kquant.E2M1`): every path
EXPECTED = {
    "avx512": {**FLOATS, "Q4_0": "Q40Matrix f32 simd.matmul_blocks", "Q4_1": "Q41Matrix f32 simd.matmul_blocks",
               "Q5_0": PACKED, "Q5_1": PACKED,
               "Q8_0": "Q80Matrix i16/32 intdot.matmul_i16; prompts of 64+ tokens i16/32 i16_blocks.multiply_q8_0",
               **K_QUANTS, **ROWS,
               "Q4_K": K_QUANTS["Q4_K"] + I8, "Q5_K": K_QUANTS["Q5_K"] + I8, "Q6_K": K_QUANTS["Q6_K"] + I8},
    "avx2": {**FLOATS, "Q4_0": "Q40Matrix i16/32 avx2.matmul_i16", "Q4_1": "Q41Matrix i16/32 avx2.matmul_i16",
             "Q5_0": "Q50Matrix i16/32 avx2.matmul_i16", "Q5_1": PACKED, "Q8_0": "Q80Matrix i16/32 avx2.matmul_i16",
             "Q4_K": K_QUANTS["Q4_K"] + I8, "Q5_K": K_QUANTS["Q5_K"] + I8, "Q6_K": K_QUANTS["Q6_K"] + I8, **ROWS},
    "generic": {**FLOATS, "Q4_0": PACKED, "Q4_1": "Q41Matrix f32 simd.matmul_blocks", "Q5_0": PACKED,
                "Q5_1": PACKED, "Q8_0": "Q80Matrix f32 simd.matmul_blocks", "Q4_K": PACKED, "Q5_K": PACKED,
                "Q6_K": "Q6KMatrix f32 simd.matmul_blocks", **ROWS},
}
EXPECTED["avx512-amx"] = {name: row.split(";")[0] + AMX if name in ("BF16", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K",
                                                                    "Q6_K") else row
                          for name, row in EXPECTED["avx512"].items()}
# an explicit cpu_activations i8 only (below auto's accuracy floor on the default model), on the int16 decode kernels
I8_BLOCKS = "; prompts of 32+ tokens i8/32 int8_blocks.multiply_"
OPT_IN_I8 = {"avx2": {name: EXPECTED["avx2"][name] + I8_BLOCKS + kernel
                      for name, kernel in (("Q4_0", "q4"), ("Q4_1", "q4"), ("Q5_0", "q5_0"), ("Q8_0", "q8_0"))},
             "avx512": {"Q4_0": "Q40Matrix i16/32 intdot.matmul_i16" + I8_BLOCKS + "q4",
                        "Q4_1": "Q41Matrix i16/32 intdot.matmul_i16" + I8_BLOCKS + "q4",
                        "Q8_0": "Q80Matrix i16/32 intdot.matmul_i16" + I8_BLOCKS + "q8_0"}}
for _path in ("avx2", "avx512"):  # MXFP4's nibbles looked up in the int8 tiles, on its LowBitMatrix
    OPT_IN_I8[_path]["MXFP4"] = PACKED + I8_BLOCKS + "mxfp4"


def test_the_auto_rows_are_the_reviewed_table():
    got = {path: {name: row.describe() for name, row in rows.items()} for path, rows in kernel_table.AUTO.items()}
    assert got == EXPECTED


@pytest.mark.parametrize("path", kernel_table.PATHS)
def test_f32_is_float32_for_every_type_and_i16_int16_wherever_a_type_has_it(path):
    for name in kernel_table.AUTO[path]:
        f32, i16 = (kernel_table.choose(name, fmt, path) for fmt in ("f32", "i16"))
        assert f32.decode == "f32" and not f32.prompt_kernel, (path, name, f32)
        assert f32.kernel in ("simd.matmul_blocks", "quant.matmul_rows"), (path, name, f32)
        assert not i16.prompt_kernel
        assert i16.decode.startswith("i16") == (name not in ("F32", "F16", "BF16")), (path, name, i16)
    assert kernel_table.choose("Q5_K", "f32", path).matrix == "QuantMatrix"  # no float32 fast kernel: rows
    with pytest.raises(ValueError, match="cpu_activations"):
        kernel_table.choose("Q4_K", "i4", path)


@pytest.mark.parametrize("path", kernel_table.PATHS)
def test_i8_takes_the_int8_prompt_kernel_where_a_type_has_one_and_i16_elsewhere(path):
    for name in kernel_table.AUTO[path]:
        i8, i16 = (kernel_table.choose(name, fmt, path) for fmt in ("i8", "i16"))
        if name in OPT_IN_I8.get(path, {}):
            assert i8.describe() == OPT_IN_I8[path][name], (path, name)
            assert kernel_table.choose(name, "auto", path).describe() == EXPECTED[path][name]
        elif EXPECTED[path][name].endswith(I8):
            assert i8.describe() == EXPECTED[path][name], (path, name)
        else:
            assert i8 == i16, (path, name)
    with_int8 = path in ("avx2", "avx512")  # the paths with int8 prompt kernels (Q4_K, Q6_K)
    assert kernel_table.long_prompt("i8", path) == (32 if with_int8 else None)
    assert kernel_table.long_prompt("auto", path) == (32 if with_int8 or path == "avx512-amx" else None)
    assert kernel_table.long_prompt("i16", path) is None and kernel_table.long_prompt("f32", path) is None


def test_experts_take_the_prompt_kernels_where_a_prompt_gives_each_expert_the_dense_threshold_rows():
    assert kernel_table.expert_long_prompt(32, 128, 8) == 512  # Qwen3-30B-A3B: 32 rows an expert on average
    assert kernel_table.expert_long_prompt(32, 32, 4) == 256  # gpt-oss-20b
    assert kernel_table.expert_long_prompt(32, 60, 7) == 275  # rounded up: 274.3
    assert kernel_table.expert_long_prompt(None, 128, 8) is None  # no prompt kernels
    assert kernel_table.expert_long_prompt(32, 0, 0) is None  # a dense model


@pytest.mark.parametrize("activations", kernel_table.FORMATS)
def test_matrices_run_the_row_this_path_chose(activations):
    from hybridgate.workers.cpu import quant

    rng = np.random.default_rng(5)
    rows, cols = 32, 512
    x = rng.standard_normal((3, cols)).astype(np.float32)
    for name in kernel_table.AUTO[quant.PATH]:
        row = kernel_table.choose(name, activations, quant.PATH)
        data = random_blocks(name, rows, cols, rng)
        m = quant.quant_matrix("w", int(T[name]), data, (rows, cols), activations)
        assert (type(m).__name__, m.activations, m.kernel_name, m.prompt_kernel) == \
               (row.matrix, row.decode.split("/")[0], row.kernel, row.prompt_kernel), (name, activations)
        dense = np.asarray(gguf.quants.dequantize(data, T[name]), np.float64).reshape(rows, cols)
        want = x.astype(np.float64) @ dense.T
        bound = (1e-6 if m.activations == "f32" else 4e-5) * np.abs(x).max() * np.abs(dense).sum(axis=1)
        assert (np.abs(m.matmul(x) - want) <= bound).all(), (name, activations)
