"""The avx2 and avx512 paths' Q4_K, Q5_K and Q6_K kernel (`superblock`, `quant.Q45KSuperMatrix`,
`Q6KSuperMatrix`) against gguf's dequantizer.

Numba compiles for one target per process, so each path runs in a child
(`python tests/unit/test_cpu_superblock.py PATH`), on any machine that runs it:
random blocks and blocks at the formats' limits (codes and sub-scales at their
extremes, subnormal and large fp16 scales) against gguf's dequantizer times the
activations in float64, each output within the bound the int16 rounding of the
activations per 256 columns allows; the integer sums at their largest (Q4_K:
every code 15 and sub-scale 63; Q5_K: every code 31 and sub-scale 63; Q6_K:
every code -32 and sub-scale -128; every
activation ± its super-block's largest: a lane that overflowed int32 shows far
past the bound); rows dequantized bit for bit; batch invariance bitwise through
every tile shape; the path's auto choice; and its machine code: no AVX-512
register on avx2, `vpdpwssd` on an avx512 machine with VNNI.
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

RUNS = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]  # the paths this CPU runs
PATHS = [pytest.param(path, marks=pytest.mark.skipif(path not in RUNS, reason=f"this CPU cannot run the {path} path"))
         for path in ("avx2", "avx512")]
# (rows, cols, batch): a 1-row tail past the 4-row GEMV tiles and the 2- and 4-row GEMM groups; one to
# eight super-blocks; batches through the GEMV tiles, the GEMM tiles (2x4 and 2x1; 4x4 and 4x1) and two
# 64-row passes.
SHAPES = [(37, 256, 3), (13, 768, 5), (9, 2048, 70), (6, 512, 1)]


@pytest.fixture(scope="module")
def results():
    """The child's figures per path of PATHS this CPU runs, the children run at once (`json_children`), their
    kernels from the path's shared cache but for those whose machine code they read (`fresh_asm`)."""
    env = {k: v for k, v in os.environ.items() if k != isa.ENV} | {"PYTHONPATH": str(ROOT)}
    runs = [path for path in ("avx2", "avx512") if path in RUNS]
    return json_children({path: ([sys.executable, __file__, path], env) for path in runs}, timeout=300 * len(runs))


@pytest.fixture(params=PATHS)
def result(request, results):
    return results[request.param]


def test_the_path_picks_the_superblock_kernels_for_the_k_quants(result):
    # auto and an explicit i16 (int16 wherever a type has it: `kernel_table.choose`) take the superblock
    # kernels; f32 takes Q4_K's and Q6_K's Q4_1-/Q8_0-style float kernels and Q5_K's row-dequantizing one
    assert result["classes"] == {"Q4_K": {"auto": "Q45KSuperMatrix", "i16": "Q45KSuperMatrix", "f32": "Q4KMatrix"},
                                 "Q5_K": {"auto": "Q45KSuperMatrix", "i16": "Q45KSuperMatrix", "f32": "QuantMatrix"},
                                 "Q6_K": {"auto": "Q6KSuperMatrix", "i16": "Q6KSuperMatrix", "f32": "Q6KMatrix"}}


def test_every_case_within_the_int16_rounding_bound_of_the_dequantizer(result):
    for case, ratio in result["worst_ratio"].items():
        assert ratio <= 1.0, (case, ratio)  # |got - ref| over its bound, the worst output
    # the int16 path ran: float32 activations would be about 100x closer (the extremes' activations, ±one
    # value, quantize exactly)
    assert min(v for k, v in result["worst_relative"].items() if " random " in k) > 1e-7


def test_rows_dequantize_bit_for_bit(result):
    assert result["rows_exact"]


def test_a_rows_result_does_not_depend_on_its_batch(result):
    assert result["batch_invariant"]


def test_the_machine_code_is_the_paths(result):
    if result["path"] == "avx2":
        assert "zmm" not in result["registers"] and "ymm" in result["registers"], result["registers"]
    else:  # one register a block; the inline vpdpwssd where the CPU has VNNI
        assert "zmm" in result["registers"], result["registers"]
        assert result["vpdpwssd"] == result["vnni"], result


# ---- the child ----

def _bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """[batch, rows]: Σ_s max|x_ks| / 65534 · Σ_{j in s} |w_ij| over the 256-column super-blocks (the
    activations' rounding), 0.1% for the rounding of the quantization's reciprocal, plus float32
    rounding of the products' terms."""
    batch, rows = x.shape[0], dense.shape[0]
    x_max = np.abs(x.reshape(batch, -1, 256)).max(axis=2)
    w_sum = np.abs(dense.reshape(rows, -1, 256)).sum(axis=2)
    return (x_max / 65534) @ w_sum.T * 1.001 + 1e-6 * np.abs(x) @ np.abs(dense).T + 1e-30


def _extremes(kind: str, rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks whose every product is at its largest magnitude (Q4_K: codes 15, Q5_K: 31, sub-scales and
    sub-mins 63; Q6_K: codes 0 - 32, sub-scales -128; d random) and activations all 3.0 (int16 32767):
    each lane's integer sum at its bound, on avx2 8 · 4 · 15 · 63 · 32767, 8 · 4 · 31 · 63 · 32767 or
    4 · 4 · 32 · 128 · 32767 (2^31 - 65536); on avx512 (2 products a lane and block, 8 blocks a step)
    half the first two and Q6_K's 8 · 2 · 32 · 128 · 32767, the same 2^31 - 65536."""
    from tests.unit.test_cpu_kernels import random_blocks

    data = random_blocks(kind, rows, cols, rng).reshape(rows, cols // 256, -1)
    if kind != "Q6_K":
        data[:, :, 4:] = 0xFF  # 12 bytes of 6-bit scales and mins, then Q5_K's 5th bits, then the nibbles
    else:
        data[:, :, 0:192] = 0x00  # ql and qh: every code 0, so c - 32 = -32
        data[:, :, 192:208] = 0x80  # sub-scales -128
    x = np.full((5, cols), 3.0, np.float32)
    x[1] = -3.0  # and a row of the other sign
    return data.reshape(rows, -1), x


def _check(path: str) -> dict:
    import re

    import gguf

    from hybridgate.workers.cpu import quant, superblock
    from tests.unit.test_cpu_kernels import T, edge_blocks, random_blocks

    rng = np.random.default_rng(41)
    worst_ratio, worst_relative, rows_exact, invariant = {}, {}, True, True
    cases = []
    for kind in ("Q4_K", "Q5_K", "Q6_K"):
        cases += [(f"{kind} random {r}x{c}", kind, random_blocks(kind, r, c, rng), None, r, c, b) for r, c, b in SHAPES]
        cases.append((f"{kind} edge 16x512", kind, edge_blocks(kind, 16, 512, rng), None, 16, 512, 6))
        cases.append((f"{kind} extremes 8x512", kind, *_extremes(kind, rng, 8, 512), 8, 512, 5))
    for name, kind, data, x, rows, cols, batch in cases:
        x = rng.standard_normal((batch, cols)).astype(np.float32) if x is None else x
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
        m = quant.quant_matrix("w", int(T[kind]), data, (rows, cols))
        got = m.matmul(x)
        ref = x.astype(np.float64) @ dense.T
        worst_ratio[name] = float((np.abs(got - ref) / _bound(x, dense)).max())
        worst_relative[name] = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        rows_exact &= all(np.array_equal(m.row(r), dense[r].astype(np.float32)) for r in range(rows))
        out = np.empty((1, rows), np.float32)
        invariant &= all(np.array_equal(m.matmul(x[b : b + 1], out)[0], got[b]) for b in range(batch))
        invariant &= np.array_equal(m.matmul(x[1:5]), got[1:5]) if batch >= 5 else True
    classes = {kind: {fmt: type(quant.quant_matrix("w", int(T[kind]), random_blocks(kind, 4, 256, rng), (4, 256),
                                                   fmt)).__name__ for fmt in ("auto", "i16", "f32")}
               for kind in ("Q4_K", "Q5_K", "Q6_K")}
    asm = fresh_asm(superblock.matmul_superblock, superblock._gemm_rows, superblock._gemv_rows)
    return {"path": path, "vnni": isa.selected().vnni, "vpdpwssd": "vpdpwssd" in asm,"worst_ratio": worst_ratio, "worst_relative": worst_relative, "rows_exact": bool(rows_exact),
            "batch_invariant": bool(invariant), "classes": classes,
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm)))}


if __name__ == "__main__":
    isa.select(sys.argv[1])
    print(json.dumps(_check(sys.argv[1])))
