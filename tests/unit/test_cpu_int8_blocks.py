"""The int8 prompt kernels of the 32-column block types (`int8_blocks`: Q8_0, Q5_0, Q4_0, Q4_1, MXFP4) against gguf's
dequantizer.

In a child per path this machine runs among avx512 and avx2 (Numba compiles for one target per process; the
kernels are AVX2 instructions, which the avx512 path runs too; the table gives them prompt rows under
cpu_activations i8 only, and avx512's Q5_0 none): gguf's quantizer on random weights, blocks at the formats'
limits, and shapes with a tail of weight rows past the last group of 8 and of activation rows past the last
tile of 4, against (1) gguf's dequantizer times the int8-rounded activations in float64 (the integer sums are
exact, so only the float32 steps per block separate them) and (2) the float64 product of the unrounded
activations within the bound of the int8 rounding (max|x_b| / 254 per element, times Σ|w|). The extremes put
every int16 sum at its largest: Q8_0 codes -128 with activations ±127 (pair sums 2 · 128 · 127 = 32,512, each
widened alone) and codes 127; Q5_0 codes -16 (the block's 8 pair sums in int16: 8 · 2 · 16 · 127 = 32,512);
Q4_0 and Q4_1 codes 15 (8 · 2 · 15 · 127 = 30,480), with scales up to fp16's largest; MXFP4 codes 7 (v + 12 =
24: two quads' 4 pair sums 4 · 2 · 24 · 127 = 24,384) with E8M0 bytes 0 and 1 (subnormal) to 150; a saturated or wrapped
lane would miss (1) by far. Then a row's bits are the same at batch 1 and batch 37 and over several passes of
the activations; rows outside the prompt span keep the decode kernel's bits (`matmul_prompt`, cpu_activations
i8); and the machine code is the path's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybridgate.workers.cpu import isa  # noqa: E402  (no Numba: safe to import here)
from tests.conftest import fresh_asm, json_children  # noqa: E402
from tests.unit.test_cpu_int8 import _rounded  # noqa: E402  (the int8-rounded activations, in float64)

RUNS = [p for p in isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):] if p != "generic"]
TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "MXFP4")
KERNEL = {"Q8_0": "multiply_q8_0", "Q5_0": "multiply_q5_0", "Q4_0": "multiply_q4", "Q4_1": "multiply_q4",
          "MXFP4": "multiply_mxfp4"}
KIND_INDEX = {"Q8_0": 0, "Q5_0": 1, "Q4_0": 2, "Q4_1": 2, "MXFP4": 3}  # `int8_blocks.KINDS`
MATRIX = {"Q8_0": "Q80Matrix", "Q5_0": "Q50Matrix", "Q4_0": "Q40Matrix", "Q4_1": "Q41Matrix", "MXFP4": "LowBitMatrix"}
# (rows, cols, batch): a tail of 5 rows past the groups of 8, one block, the default model's 576 columns, and
# batch 37 (9 tiles of 4 and a 1-row tail)
SHAPES = [(37, 576, 37), (16, 32, 5), (8, 2048, 2)]
# the table's i8 rows (avx512's Q5_0: LowBitMatrix, whose 5-bit codes the tiles do not read)
TABLE_TYPES = {"avx2": TYPES, "avx512": ("Q8_0", "Q4_0", "Q4_1", "MXFP4")}
BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 22, "Q4_0": 18, "Q4_1": 20, "MXFP4": 17}

pytestmark = pytest.mark.skipif(not RUNS, reason="this CPU runs neither the avx512 nor the avx2 path")


@pytest.fixture(scope="module")
def results():
    """The child's figures per path of RUNS, the children run at once (`json_children`), their kernels from the
    path's shared cache but for those whose machine code they read (`fresh_asm`)."""
    env = {k: v for k, v in os.environ.items() if k != isa.ENV} | {"PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "1"}
    return json_children({path: ([sys.executable, __file__, path], env) for path in RUNS}, timeout=300 * len(RUNS))


@pytest.fixture(params=RUNS)
def result(request, results):
    return request.param, results[request.param]


def test_int8_sums_are_exact_against_the_dequantizer_times_the_rounded_activations(result):
    path, got = result
    assert len(got["exact_ratio"]) == len(TYPES) * (len(SHAPES) + 1)
    for case, ratio in got["exact_ratio"].items():
        assert ratio <= 1.0, (path, case, ratio)


def test_within_the_int8_rounding_bound_of_the_float_product(result):
    path, got = result
    for case, ratio in got["rounding_ratio"].items():
        assert ratio <= 1.0, (path, case, ratio)
    # the int8 path ran: int16 activations would be about 250x closer
    assert min(v for k, v in got["relative"].items() if " random " in k) > 1e-4


def test_a_rows_bits_are_the_same_at_batch_1_and_37_and_over_several_passes(result):
    path, got = result
    assert got["batch_invariant"], path
    assert got["passes_invariant"], path


def test_rows_outside_the_prompt_span_keep_the_decode_kernels_bits_under_i8(result):
    path, got = result
    assert got["table_kernels"] == {t: f"int8_blocks.{KERNEL[t]}" for t in TABLE_TYPES[path]}
    assert got["decode_rows_kept"] and got["prompt_rows_int8"]


def test_the_machine_code_is_the_paths_with_vpmaddubsw(result):
    path, got = result
    assert got["vpmaddubsw"] and got["vpsignb"], path
    assert "ymm" in got["registers"], got["registers"]
    if path == "avx2":
        assert "zmm" not in got["registers"], got["registers"]


# ---- the child ----

def _extremes(kind: str, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks at the formats' limits (see the module docstring) and activations ±3 in every column (each
    rounds to ±127), all of one sign, or alternating (vpsignb's both ways)."""
    blocks = np.zeros((rows, cols // 32, BLOCK_BYTES[kind]), np.uint8)
    scales = np.array([65504.0, 1.0, -2.0, 0.5, 60000.0, -65504.0, 3.0e-5, 1.0], np.float16)  # one per row
    blocks[:, :, 0:2] = scales[np.arange(rows) % 8].view(np.uint8).reshape(rows, 1, 2)
    if kind == "MXFP4":  # E8M0 bytes from the subnormal 0 and 1 to 2^22, codes 7 (+12: 24 after the offset) or 15
        blocks[:, :, 0] = np.array([150, 127, 1, 0, 140, 128, 100, 149], np.uint8)[np.arange(rows) % 8, None]
        blocks[:, :, 1:] = 0x77
        blocks[1::2, :, 1:] = 0xFF  # -12: v + 12 = 0
        blocks[2::4, :, 1::2] = 0xF7  # rows 2, 6: 12 and -12 alternating
    elif kind == "Q8_0":
        blocks[:, :, 2:] = 0x80  # -128
        blocks[1::2, :, 2:] = 0x7F  # odd rows 127
        blocks[2::4, :, 2::2] = 0x7F  # rows 2, 6: -128 and 127 alternating
    elif kind == "Q5_0":
        pass  # qh 0 and nibbles 0: every code 0 - 16
    else:
        blocks[:, :, -16:] = 0xFF  # every nibble 15
        if kind == "Q4_1":
            blocks[:, :, 2:4] = np.array([-60000.0], np.float16).view(np.uint8)  # m
    x = np.full((5, cols), 3.0, np.float32)
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3, 1::4] = -3.0
    return blocks.reshape(rows, -1), x


def _cases(rng) -> list:
    import gguf

    cases = []
    for kind in TYPES:
        for rows, cols, batch in SHAPES:
            data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                        gguf.GGMLQuantizationType[kind])
            x = rng.standard_normal((batch, cols)).astype(np.float32)
            cases.append((f"{kind} random {rows}x{cols}x{batch}", kind, np.ascontiguousarray(data).view(np.uint8)
                          .reshape(rows, -1), x, rows, cols))
        cases.append((f"{kind} extremes 8x512", kind, *_extremes(kind, 8, 512), 8, 512))
    return cases


def _check(path: str) -> dict:
    import re

    import gguf

    from hybridgate.workers.cpu import int8_blocks, quant

    rng = np.random.default_rng(41)
    exact, rounding, relative, invariant, passes, kept, ran, table = {}, {}, {}, True, True, True, True, {}
    for name, kind, data, x, rows, cols in _cases(rng):
        kind_id = int(gguf.GGMLQuantizationType[kind])
        batch = x.shape[0]
        dense = np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]), np.float64)
        dense = dense.reshape(rows, cols)
        m = getattr(quant, MATRIX[kind])("w", kind_id, data, (rows, cols), "i16")
        arrays, multiply = m._prompt_arrays(), getattr(int8_blocks, KERNEL[kind])
        everything = np.arange(batch, dtype=np.int64)
        got = np.empty((batch, rows), np.float32)
        multiply(x, everything, *arrays, got)
        # float32 steps over ≤ 64 blocks, of the weight and (Q4_0, Q4_1) of its minimum's term
        if kind == "MXFP4":  # its minimum -12 · d (`int8_blocks.MXFP4_OFFSET`), d half the E8M0 scale
            minimum = np.repeat(12 * np.ldexp(1.0, arrays[1][:, : cols // 32].astype(np.int64) - 128), 32, axis=1)
        else:
            minimum = np.repeat(np.abs(m.minimum.astype(np.float64)), 32, axis=1) if kind.startswith("Q4") else 0
        float_bound = 2e-6 * np.abs(_rounded(x)) @ (np.abs(dense) + minimum).T + 1e-30
        exact[name] = float((np.abs(got - _rounded(x) @ dense.T) / float_bound).max())
        full = x.astype(np.float64) @ dense.T
        x_max = np.abs(x.reshape(batch, -1, 32)).max(axis=2)
        w_sum = np.abs(dense.reshape(rows, -1, 32)).sum(axis=2)
        rounding[name] = float((np.abs(got - full) / ((x_max / 254) @ w_sum.T * 1.001 + float_bound)).max())
        relative[name] = float(np.linalg.norm(got - full) / max(np.linalg.norm(full), 1e-30))
        one = np.empty((1, rows), np.float32)
        for b in range(batch):
            multiply(x[b : b + 1], everything[:1], *arrays, one)
            invariant &= np.array_equal(one[0], got[b])
        several = np.empty_like(got)  # one pass per 4 activation rows
        int8_blocks.matmul_i8(KIND_INDEX[kind], x, arrays[0].view(np.uint32), arrays[1], arrays[2], several, 4 * cols)
        passes &= np.array_equal(several, got)
        if kind in TABLE_TYPES[path] and batch >= 3:  # by the table: prompt rows 1 .. batch-1; row 0 a decode row
            t = quant.quant_matrix("w", kind_id, data, (rows, cols), "i8")
            table[kind] = t.prompt_kernel
            mixed = t.matmul_prompt(x, everything[1:])
            kept &= np.array_equal(mixed[0], t.matmul(x[:1])[0])
            ran &= np.array_equal(mixed[1:], got[1:])
            if " random " in name:
                ran &= not np.array_equal(got[0], t.matmul(x[:1])[0])
    asm = fresh_asm(int8_blocks.matmul_i8, int8_blocks._tile)
    return {"exact_ratio": exact, "rounding_ratio": rounding, "relative": relative, "batch_invariant": bool(invariant),
            "passes_invariant": bool(passes), "decode_rows_kept": bool(kept), "prompt_rows_int8": bool(ran),
            "table_kernels": table, "vpmaddubsw": "vpmaddubsw" in asm, "vpsignb": "vpsignb" in asm,
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm)))}


if __name__ == "__main__":
    isa.select(sys.argv[1], "off")  # the int8 tiles: an AMX CPU takes AMX for prompts
    print(json.dumps(_check(sys.argv[1])))
