"""The int8 prompt kernel (`int8`: Q4_K, Q5_K and Q6_K, weight rows interleaved) against gguf's dequantizer, on each
path of this CPU whose kernel table has it (avx2 and avx512).

In a child per path (Numba compiles for one target per process): random blocks, blocks at the formats'
limits and shapes with a tail of weight rows past the last group of 8 and of activation rows past the last
tile of 4, against (1) gguf's dequantizer times the int8-rounded activations in float64 (the integer sums are
exact, so only float32 rounding of the per-block float steps separates them) and (2) the float64 product of
the unrounded activations within the bound of the int8 rounding (max|x_b| / 254 per element); the extremes
put every int16 pair-sum at its largest (Q4_K: codes 15, sub-scales 63, activations ±127 in every column:
8 · 2 · 15 · 127 = 30,480 per lane; Q5_K: codes 31, sub-scales 63: 4 · 2 · 31 · 127 = 31,496 per lane and
16-column half; Q6_K: codes -32, sub-scales -128: 4 · 2 · 32 · 127 = 32,512), where a
saturated or wrapped lane would miss (1) by far. Then a row's bits do not depend on its batch or on how many
rows a pass takes; rows outside the prompt span keep the decode kernel's bits (`matmul_prompt`); and the machine
code is the path's.
The generic path has no int8 kernel (`kernel_table`): nothing runs there. The avx512 path with VNNI runs 16-row
512-bit `vpdpbusd` tiles (Q6_K's codes unpacked from the 6 bits that path keeps), whose integers and float steps
are the 8-row tiles': its bits are the avx2 path's, for both types. On a CPU with VNNI the avx512 path also runs
as one without it shows its features (`avx512-novnni`: the 8-row tiles, Q6_K's 6-bit codes unpacked to c - 32).
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

RUNS = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
# (rows, cols, batch): a tail of 5 rows past the groups of 8, one to eight super-blocks, batches through the
# 4-row tiles and their 1-row tail, and 8192 columns at 35 rows (also run one tile of rows a pass: `_check`)
SHAPES = [(37, 256, 3), (16, 768, 9), (8, 2048, 1), (13, 8192, 35)]

PATHS = [path for path in ("avx512", "avx2") if path in RUNS]  # the paths with int8 rows that this CPU runs
if "avx512" in PATHS and "avx512vnni" in isa.host_features():  # and the avx512 path of a CPU without VNNI
    PATHS.append("avx512-novnni")

pytestmark = pytest.mark.skipif(not PATHS, reason="this CPU runs neither the avx512 nor the avx2 path")


@pytest.fixture(scope="module")
def results():
    """The child's figures per path of PATHS, the children run at once (`json_children`). Each takes its kernels
    from the path's shared cache, and compiles afresh only the two whose machine code it reads (`fresh_asm`):
    a fresh cache each compiled every kernel it runs, about 34 CPU-seconds a child."""
    env = {k: v for k, v in os.environ.items() if k != isa.ENV} | {"PYTHONPATH": str(ROOT)}
    return json_children({path: ([sys.executable, __file__, path], env) for path in PATHS},
                         timeout=300 * len(PATHS))


@pytest.fixture(params=PATHS)
def result(request, results):
    return results[request.param]


def test_int8_sums_are_exact_against_the_dequantizer_times_the_rounded_activations(result):
    for case, ratio in result["exact_ratio"].items():
        assert ratio <= 1.0, (case, ratio)


def test_within_the_int8_rounding_bound_of_the_float_product(result):
    for case, ratio in result["rounding_ratio"].items():
        assert ratio <= 1.0, (case, ratio)
    # the int8 path ran: int16 activations would be about 250x closer
    assert min(v for k, v in result["relative"].items() if " random " in k) > 1e-4


def test_a_rows_result_does_not_depend_on_its_batch_or_the_passes(result):
    assert result["batch_invariant"]


def test_rows_outside_the_prompt_span_keep_the_decode_kernels_bits(result):
    assert result["decode_rows_kept"]
    assert result["prompt_rows_int8"]


def test_the_machine_code_is_the_paths(result):
    """avx2 (and avx512 without VNNI): `vpmaddubsw` and `vpsignb` on ymm; avx512 with VNNI: `vpdpbusd` on zmm."""
    vnni = result["path"] == "avx512" and result["vnni"]
    assert "zmm" in result["registers"] if vnni else "ymm" in result["registers"], result["registers"]
    assert result["path"] == "avx512" or "zmm" not in result["registers"], result["registers"]
    assert result["vpdpbusd"] == vnni
    assert result["vpmaddubsw"] == result["vpsignb"] == (not vnni)


def test_every_path_gives_the_same_bits(results):
    """The avx512 path's tiles (16 rows, `vpdpbusd` with VNNI) sum the avx2 tiles' integers with their float
    steps."""
    if len(results) < 2:
        pytest.skip("this CPU runs one path with int8 rows")
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        assert len({r["digest"][kind] for r in results.values()}) == 1, (kind, results.keys())


# ---- the child ----

def _rounded(x: np.ndarray, code_max: float = 127.0) -> np.ndarray:
    """x float32 `[batch, cols]` → the int8-rounded activations as float64: rint(x · 127 / max|x_b|) ·
    (max|x_b| / 127) per 32 columns, in `int8._quantize_row`'s float32 operations (code_max 32767: the int16
    ones of `intdot._quantize_row`)."""
    b = x.reshape(x.shape[0], -1, 32)
    top = np.abs(b).max(axis=2, keepdims=True)
    inv = np.where(top > 0, np.float32(code_max) / np.where(top > 0, top, 1), 0).astype(np.float32)
    q = np.rint(b * inv)
    return (q.astype(np.float64) * (top / np.float32(code_max)).astype(np.float32)).reshape(x.shape)


def _extremes(kind: str, rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    from tests.unit.test_cpu_kernels import random_blocks

    data = random_blocks(kind, rows, cols, rng).reshape(rows, cols // 256, -1)
    if kind in ("Q4_K", "Q5_K"):
        data[:, :, 4:] = 0xFF  # 6-bit scales and mins 63, every code 15 (Q5_K: 31, its 5th bits set)
    else:
        data[:, :, 0:192] = 0x00  # every code 0 - 32
        data[:, :, 192:208] = 0x80  # sub-scales -128
    x = np.full((5, cols), 3.0, np.float32)
    x[1] = -3.0
    x[2, ::2] = -3.0  # alternating signs: vpsignb's both ways
    return data.reshape(rows, -1), x


def _check() -> dict:
    import hashlib
    import re

    import gguf

    from hybridgate.workers.cpu import int8, kernel_table, quant
    from tests.unit.test_cpu_kernels import T, random_blocks

    rng = np.random.default_rng(8)
    exact, rounding, relative, invariant, kept, ran = {}, {}, {}, True, True, True
    digest = {}
    cases = []
    for kind in ("Q4_K", "Q5_K", "Q6_K"):  # each drawn on every path (the same random cases), run where a row has int8
        cases += [(f"{kind} random {r}x{c}", kind, random_blocks(kind, r, c, rng), None, r, c, b) for r, c, b in SHAPES]
        cases.append((f"{kind} extremes 24x512", kind, *_extremes(kind, rng, 24, 512), 24, 512, 5))
    for name, kind, data, x, rows, cols, batch in cases:
        x = rng.standard_normal((batch, cols)).astype(np.float32) if x is None else x
        if not kernel_table.choose(kind, "i8", quant.PATH).prompt_kernel:
            continue
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
        m = quant.quant_matrix("w", int(T[kind]), data, (rows, cols), "i8")
        everything = np.arange(batch, dtype=np.int64)
        got = m.matmul_prompt(x, everything)
        digest[kind] = hashlib.sha256(digest.get(kind, "").encode() + got.tobytes()).hexdigest()
        ref = _rounded(x) @ dense.T
        float_bound = 2e-6 * np.abs(_rounded(x)) @ np.abs(dense).T + 1e-30  # float32 steps over ≤ 256 blocks
        exact[name] = float((np.abs(got - ref) / float_bound).max())
        full = x.astype(np.float64) @ dense.T
        x_max = np.abs(x.reshape(batch, -1, 32)).max(axis=2)
        w_sum = np.abs(dense.reshape(rows, -1, 32)).sum(axis=2)
        bound = (x_max / 254) @ w_sum.T * 1.001 + float_bound
        rounding[name] = float((np.abs(got - full) / bound).max())
        relative[name] = float(np.linalg.norm(got - full) / max(np.linalg.norm(full), 1e-30))
        one = np.empty((1, rows), np.float32)
        invariant &= all(np.array_equal(m.matmul_prompt(x[b : b + 1], everything[:1], one)[0], got[b])
                         for b in range(batch))
        if batch > int8.TILE_X:  # passes of one tile of activation rows each: every group interleaved again
            qs, sc, d, ndmin, mins = m._prompt_arrays()
            passes = np.empty_like(got)
            int8.matmul_i8(x, qs.view(np.uint32), sc, d, ndmin, mins, passes, cols * int8.TILE_X)
            invariant &= np.array_equal(passes, got)
        if batch >= 3:  # prompt rows 1 .. batch-1; row 0 a decode row
            mixed = m.matmul_prompt(x, everything[1:])
            kept &= np.array_equal(mixed[0], m.matmul(x[:1])[0])
            ran &= np.array_equal(mixed[1:], got[1:])
            if " random " in name:  # (the extremes' activations, ±one value, round exactly in both formats)
                ran &= not np.array_equal(got[0], m.matmul(x[:1])[0])
    asm = fresh_asm(int8.matmul_i8, int8._tiles)  # _tiles compiled (from the cache) by the first's copy
    return {"exact_ratio": exact, "rounding_ratio": rounding, "relative": relative,
            "batch_invariant": bool(invariant), "decode_rows_kept": bool(kept), "prompt_rows_int8": bool(ran),
            "vpmaddubsw": "vpmaddubsw" in asm, "vpsignb": "vpsignb" in asm,
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm))), "path": quant.PATH,
            "vpdpbusd": "vpdpbusd" in asm, "vnni": isa.selected().vnni, "digest": digest}


if __name__ == "__main__":
    if sys.argv[1] == "avx512-novnni":  # the features an AVX-512 CPU without VNNI shows (8-row 256-bit tiles)
        _host = isa.host_features
        isa.host_features = lambda: _host() - {"avx512vnni"}
    isa.select(sys.argv[1].split("-")[0], "off")  # the int8 tiles: an AMX CPU takes AMX for prompts
    print(json.dumps(_check()))
