"""Q8_0's int16 prompt kernel on the avx512 path (`i16_blocks`: 16 weight rows interleaved, `vpdpwssd`) against gguf's
dequantizer.

In a child per variant of the avx512 path this CPU runs (Numba compiles for one target per process): with VNNI,
and as a CPU without VNNI shows its features (`vpmaddwd` and an add). Random weights from gguf's quantizer, and
blocks at the format's limits (codes -128, 127 and both alternating, fp16 scales up to its largest) against
activations at ±their block's largest value, so every int16 activation is ±32767 and a block's integer sum
reaches 32 · 128 · 32767 (a wrapped or saturated lane would miss by far); shapes with a tail of weight rows past
the last group of 16 and of activation rows past the last tile of 4. Against (1) gguf's dequantizer times the
int16-rounded activations in float64: the integer sums are exact, so only the float32 steps per block and the
convert of a sum above 2^24 separate them; (2) the float64 product of the unrounded activations within the bound
of the int16 rounding (max|x_b| / 65534 per element, times Σ|w|). Then a row's bits are the same at batch 1 and in
its batch and over several passes of the activations; rows outside the prompt span keep the decode kernel's bits
(`matmul_prompt` under the table's `auto` row); and the machine code is the variant's.
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
from tests.unit.test_cpu_int8 import _rounded  # noqa: E402  (the rounded activations, in float64)

HOST = isa.host_features()
VARIANTS = ["avx512", "avx512-novnni"] if "avx512vnni" in HOST else ["avx512-novnni"]
if isa.best(HOST) != "avx512":
    VARIANTS = []
# (rows, cols, batch): a tail of 5 rows past the groups of 16, one block, 8192 columns, and batch 37 (9 tiles of 4
# and a 1-row tail)
SHAPES = [(37, 576, 37), (16, 32, 5), (20, 8192, 6)]

pytestmark = pytest.mark.skipif(not VARIANTS, reason="this CPU does not run the avx512 path")


@pytest.fixture(scope="module")
def results():
    """The children's figures per variant, run at once (`json_children`), their kernels from the path's shared cache
    but for those whose machine code they read (`fresh_asm`)."""
    env = {k: v for k, v in os.environ.items() if k != isa.ENV} | {"PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "1"}
    return json_children({v: ([sys.executable, __file__, v], env) for v in VARIANTS}, timeout=300 * len(VARIANTS))


@pytest.fixture(params=VARIANTS)
def result(request, results):
    return request.param, results[request.param]


def test_sums_are_exact_against_the_dequantizer_times_the_int16_activations(result):
    variant, got = result
    assert len(got["exact_ratio"]) == len(SHAPES) + 1
    for case, ratio in got["exact_ratio"].items():
        assert ratio <= 1.0, (variant, case, ratio)


def test_within_the_int16_rounding_bound_of_the_float_product(result):
    variant, got = result
    for case, ratio in got["rounding_ratio"].items():
        assert ratio <= 1.0, (variant, case, ratio)


def test_a_rows_bits_are_the_same_at_batch_1_and_in_its_batch_and_over_several_passes(result):
    variant, got = result
    assert got["batch_invariant"], variant
    assert got["passes_invariant"], variant


def test_the_auto_row_runs_it_for_prompt_rows_and_decode_rows_keep_the_decode_kernels_bits(result):
    variant, got = result
    assert got["table_kernel"] == "i16_blocks.multiply_q8_0"
    assert got["decode_rows_kept"] and got["prompt_rows_i16"], variant


def test_the_machine_code_is_the_variants(result):
    variant, got = result
    assert "zmm" in got["registers"], got["registers"]
    assert got["vpdpwssd"] == (variant == "avx512"), variant


def test_both_variants_give_the_same_bits(results):
    if len(results) < 2:
        pytest.skip("this CPU runs one variant")
    assert len({r["digest"] for r in results.values()}) == 1


# ---- the child ----

def _rounded16(x: np.ndarray) -> np.ndarray:
    """The int16-rounded activations as float64, in `intdot._quantize_row`'s float32 operations."""
    return _rounded(x, 32767.0)


def _extremes(rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 blocks of codes -128 (even rows), 127 (odd rows), both alternating (rows 2, 6, ...), scales up to fp16's
    largest; activations ±3 in every column (each rounds to ±32767), of one sign or alternating."""
    blocks = np.zeros((rows, cols // 32, 34), np.uint8)
    scales = np.array([65504.0, 1.0, -2.0, 0.5, 60000.0, -65504.0, 3.0e-5, 1.0], np.float16)
    blocks[:, :, 0:2] = scales[np.arange(rows) % 8].view(np.uint8).reshape(rows, 1, 2)
    blocks[:, :, 2:] = 0x80
    blocks[1::2, :, 2:] = 0x7F
    blocks[2::4, :, 2::2] = 0x7F
    x = np.full((5, cols), 3.0, np.float32)
    x[1] = -3.0
    x[2, ::2] = -3.0
    x[3, 1::4] = -3.0
    return blocks.reshape(rows, -1), x


def _check() -> dict:
    import hashlib
    import re

    import gguf

    from hybridgate.workers.cpu import i16_blocks, kernel_table, quant

    q8_0 = gguf.GGMLQuantizationType.Q8_0
    rng = np.random.default_rng(47)
    cases = []
    for rows, cols, batch in SHAPES:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), q8_0)
        cases.append((f"random {rows}x{cols}x{batch}", np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1),
                      (rng.standard_normal((batch, cols)) * 3).astype(np.float32), rows, cols))
    cases.append(("extremes 16x512", *_extremes(16, 512), 16, 512))
    exact, rounding, invariant, passes, kept, ran, digest = {}, {}, True, True, True, True, hashlib.sha256()
    row = kernel_table.choose("Q8_0", "auto", quant.PATH)
    for name, data, x, rows, cols in cases:
        batch = x.shape[0]
        dense = np.asarray(gguf.quants.dequantize(data, q8_0), np.float64).reshape(rows, cols)
        m = quant.quant_matrix("w", int(q8_0), data, (rows, cols), "auto")
        arrays, everything = m._prompt_arrays(), np.arange(batch, dtype=np.int64)
        got = np.empty((batch, rows), np.float32)
        i16_blocks.multiply_q8_0(x, everything, *arrays, got)
        digest.update(got.tobytes())
        reference = _rounded16(x) @ dense.T
        # float32 steps over ≤ 256 blocks and the convert of a block's sum (2^-24 of it), each of |x| · |w|
        float_bound = 4e-6 * np.abs(_rounded16(x)) @ np.abs(dense).T + 1e-30
        exact[name] = float((np.abs(got - reference) / float_bound).max())
        full = x.astype(np.float64) @ dense.T
        x_max = np.abs(x.reshape(batch, -1, 32)).max(axis=2)
        w_sum = np.abs(dense.reshape(rows, -1, 32)).sum(axis=2)
        rounding[name] = float((np.abs(got - full) / ((x_max / 65534) @ w_sum.T * 1.001 + float_bound)).max())
        one = np.empty((1, rows), np.float32)
        for b in range(batch):
            i16_blocks.multiply_q8_0(x[b : b + 1], everything[:1], *arrays, one)
            invariant &= np.array_equal(one[0], got[b])
        several = np.empty_like(got)  # one pass per 4 activation rows
        i16_blocks.matmul_q8_0(x, arrays[0], arrays[1], several, 4 * 2 * cols)
        passes &= np.array_equal(several, got)
        if batch >= 3:  # prompt rows 1 .. batch-1; row 0 a decode row
            mixed = m.matmul_prompt(x, everything[1:])
            kept &= np.array_equal(mixed[0], m.matmul(x[:1])[0])
            ran &= np.array_equal(mixed[1:], got[1:])
    asm = fresh_asm(i16_blocks.matmul_q8_0, i16_blocks._tiles)
    return {"exact_ratio": exact, "rounding_ratio": rounding, "batch_invariant": bool(invariant),
            "passes_invariant": bool(passes), "decode_rows_kept": bool(kept), "prompt_rows_i16": bool(ran),
            "table_kernel": m.prompt_kernel, "row": row.describe(), "vpdpwssd": "vpdpwssd" in asm,
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm))), "digest": digest.hexdigest()}


if __name__ == "__main__":
    if sys.argv[1] == "avx512-novnni":  # the features an AVX-512 CPU without VNNI shows
        _host = isa.host_features
        isa.host_features = lambda: _host() - {"avx512vnni"}
    isa.select("avx512", "off")  # an AMX CPU would take AMX for Q8_0's prompts
    print(json.dumps(_check()))
