"""The avx2 path's Q4_K kernel (`superblock`, `quant.Q4KSuperMatrix`) against gguf's dequantizer.

Numba compiles for one target per process, so the avx2 path runs in a child
(`python tests/unit/test_cpu_superblock.py`), on any machine that runs avx2:
random blocks and blocks at the format's limits (codes and 6-bit sub-scales at 0
and their largest, subnormal and large fp16 scales) against gguf's dequantizer
times the activations in float64, each output within the bound the int16
rounding of the activations per 256 columns allows; the integer sums at their
largest (every code 15, every sub-scale 63, every activation ± its
super-block's largest: a lane that overflowed int32 shows far past the bound);
rows dequantized bit for bit; batch invariance bitwise through every tile
shape; the path's auto choice; and no AVX-512 register in its machine code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybridgate.workers.cpu import isa  # noqa: E402  (no Numba: safe to import here)
from tests.conftest import TIME_FACTOR  # noqa: E402

pytestmark = pytest.mark.skipif("avx2" not in isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):],
                                reason="this CPU cannot run the avx2 path")
# (rows, cols, batch): a 1-row tail past the 4-row GEMV tiles and the 2-row GEMM groups; one to eight
# super-blocks; batches through the GEMV tiles, the 2x4 and 2x1 GEMM tiles and two 64-row passes.
SHAPES = [(37, 256, 3), (13, 768, 5), (9, 2048, 70), (6, 512, 1)]


def _child(*args: str, **env_extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300 * TIME_FACTOR,
                          cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT), **env_extra})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    # compiled afresh, so the machine code can be read (a kernel loaded from the cache has none)
    return _child(NUMBA_CACHE_DIR=str(tmp_path_factory.mktemp("numba")))


def test_avx2_picks_the_superblock_kernel_for_q4_k(result):
    assert result["classes"] == {"auto": "Q4KSuperMatrix", "i16": "Q4KMatrix"}


def test_every_case_within_the_int16_rounding_bound_of_the_dequantizer(result):
    for case, ratio in result["worst_ratio"].items():
        assert ratio <= 1.0, (case, ratio)  # |got - ref| over its bound, the worst output
    # the int16 path ran: float32 activations would be about 100x closer (the extremes' activations, ±one
    # value, quantize exactly)
    assert min(v for k, v in result["worst_relative"].items() if k.startswith("random")) > 1e-7


def test_rows_dequantize_bit_for_bit(result):
    assert result["rows_exact"]


def test_a_rows_result_does_not_depend_on_its_batch(result):
    assert result["batch_invariant"]


def test_no_avx512_register_in_the_machine_code(result):
    assert "zmm" not in result["registers"] and "ymm" in result["registers"], result["registers"]


# ---- the child ----

def _bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """[batch, rows]: Σ_s max|x_ks| / 65534 · Σ_{j in s} |w_ij| over the 256-column super-blocks (the
    activations' rounding), 0.1% for the rounding of the quantization's reciprocal, plus float32
    rounding of the products' terms."""
    batch, rows = x.shape[0], dense.shape[0]
    x_max = np.abs(x.reshape(batch, -1, 256)).max(axis=2)
    w_sum = np.abs(dense.reshape(rows, -1, 256)).sum(axis=2)
    return (x_max / 65534) @ w_sum.T * 1.001 + 1e-6 * np.abs(x) @ np.abs(dense).T + 1e-30


def _extremes(rng, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K blocks with every code 15 and every sub-scale and sub-min 63 (d and dmin random), and
    activations at ± one value: each lane's integer sum at its largest, 8 · 4 · 15 · 63 · 32767."""
    from tests.unit.test_cpu_kernels import random_blocks

    data = random_blocks("Q4_K", rows, cols, rng).reshape(rows, cols // 256, 144)
    data[:, :, 4:144] = 0xFF  # 12 bytes of 6-bit scales and mins, then 128 of nibbles
    x = np.where(rng.random((5, cols)) < 0.5, -3.0, 3.0).astype(np.float32)
    return data.reshape(rows, -1), x


def _check() -> dict:
    import re

    import gguf

    from hybridgate.workers.cpu import quant, superblock
    from tests.unit.test_cpu_kernels import T, edge_blocks, random_blocks

    rng = np.random.default_rng(41)
    kind = int(T.Q4_K)
    worst_ratio, worst_relative, rows_exact, invariant = {}, {}, True, True
    cases = [(f"random {r}x{c}", random_blocks("Q4_K", r, c, rng), r, c, b) for r, c, b in SHAPES]
    cases.append(("edge 16x512", edge_blocks("Q4_K", 16, 512, rng), 16, 512, 6))
    data, x_ext = _extremes(rng, 8, 512)
    cases.append(("extremes 8x512", data, 8, 512, 5))
    for name, data, rows, cols, batch in cases:
        dense = np.asarray(gguf.quants.dequantize(data, T.Q4_K), np.float64).reshape(rows, cols)
        m = quant.quant_matrix("w", kind, data, (rows, cols))
        x = x_ext if name.startswith("extremes") else rng.standard_normal((batch, cols)).astype(np.float32)
        got = m.matmul(x)
        ref = x.astype(np.float64) @ dense.T
        worst_ratio[name] = float((np.abs(got - ref) / _bound(x, dense)).max())
        worst_relative[name] = float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))
        rows_exact &= all(np.array_equal(m.row(r), dense[r].astype(np.float32)) for r in range(rows))
        out = np.empty((1, rows), np.float32)
        invariant &= all(np.array_equal(m.matmul(x[b : b + 1], out)[0], got[b]) for b in range(batch))
        invariant &= np.array_equal(m.matmul(x[1:5]), got[1:5]) if batch >= 5 else True
    classes = {fmt: type(quant.quant_matrix("w", kind, cases[0][1], (37, 256), fmt)).__name__ for fmt in ("auto", "i16")}
    asm = "\n".join(a for k in (superblock.matmul_q4k, superblock._gemm_rows, superblock._gemv_rows)
                    for a in k.inspect_asm().values())
    return {"worst_ratio": worst_ratio, "worst_relative": worst_relative, "rows_exact": bool(rows_exact),
            "batch_invariant": bool(invariant), "classes": classes,
            "registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm)))}


if __name__ == "__main__":
    isa.select("avx2")
    print(json.dumps(_check()))
