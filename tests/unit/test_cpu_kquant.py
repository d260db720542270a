"""The packed 4- and 5-bit kernels (`kquant`, `quant.LowBitMatrix`) on every path this machine runs.

Numba compiles for one target per process, so each path runs in a child
(`python tests/unit/test_cpu_kquant.py ISA`): every type on random blocks and on
blocks at the formats' limits (codes at their extremes, subnormal and large fp16
scales) against gguf's dequantizer times the activations in float64, each
output within the bound that the activations' int16 rounding allows; rows
dequantized bit for bit; batch invariance bitwise; and the forced avx2 path's
machine code without AVX-512 registers.
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
from tests.conftest import json_children  # noqa: E402

RUNNABLE = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"]
# (rows, cols, batch): rows past the 4-row tiles, 32-blocks not a whole quad (9 blocks of Q4_0..Q5_1),
# batches through every tile shape and two 64-row passes over the weights.
SHAPES = {"small": (37, 288, 9), "k": (13, 768, 5), "tall": (9, 512, 70)}
X_MAX_TERM = 1.0 / 65534  # int16 activations: each off by at most half a step, max|x_block| / 32767


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Each runnable path's check, and (key "asm") the forced avx2 path's machine code compiled afresh (a kernel
    loaded from the cache has no assembly to inspect), the children run at once (`json_children`)."""
    env = {k: v for k, v in os.environ.items() if k != isa.ENV} | {"PYTHONPATH": str(ROOT)}
    runs = {path: ([sys.executable, __file__, path], env) for path in RUNNABLE}
    if "avx2" in RUNNABLE:
        fresh = {"NUMBA_CACHE_DIR": str(tmp_path_factory.mktemp("numba"))}
        runs["asm"] = ([sys.executable, __file__, "avx2", "asm"], env | fresh)
    return json_children(runs, timeout=300 * len(runs))


@pytest.mark.parametrize("path", RUNNABLE)
def test_every_type_within_the_int16_rounding_bound_of_the_dequantizer(results, path):
    out = results[path]
    assert out["isa"] == path
    for case, ratio in out["worst_ratio"].items():
        assert ratio <= 1.0, (case, ratio)  # |got - ref| over its bound, the worst output
    assert min(out["worst_relative"].values()) > 1e-7  # the int16 path ran (float32 would be 100x closer)
    assert out["rows_exact"], out["rows_exact"]


@pytest.mark.parametrize("path", RUNNABLE)
def test_a_rows_result_does_not_depend_on_its_batch(results, path):
    assert results[path]["batch_invariant"]


def test_every_path_computes_the_same_bits(results):
    # The integer sums are exact and the float steps the same operations in the same order on every path
    # (kquant's docstring): the paths' outputs agree bit for bit.
    assert len({results[p]["digest"] for p in RUNNABLE}) == 1, {p: results[p]["digest"] for p in RUNNABLE}


def test_the_forced_avx2_path_has_no_zmm(results):
    out = results.get("asm", {"registers": []})
    assert "zmm" not in out["registers"]
    if "avx2" in RUNNABLE:
        assert "ymm" in out["registers"]


# ---- the child ----

def _bound(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """[batch, rows]: Σ_b max|x_kb| / 65534 · Σ_j |w_ibj| (the activations' rounding), with 0.1% for the
    rounding of the quantization's own reciprocal, plus float32 rounding of the products' terms."""
    batch, rows = x.shape[0], dense.shape[0]
    x_max = np.abs(x.reshape(batch, -1, 32)).max(axis=2)  # [batch, blocks]
    w_sum = np.abs(dense.reshape(rows, -1, 32)).sum(axis=2)  # [rows, blocks]
    return (x_max * X_MAX_TERM) @ w_sum.T * 1.001 + 1e-6 * np.abs(x) @ np.abs(dense).T + 1e-30


def _cases(rng):
    from tests.unit.test_cpu_kernels import edge_blocks, random_blocks

    for kind in TYPES:
        for shape_name, (rows, cols, batch) in SHAPES.items():
            if kind.endswith("_K"):
                cols = max(256, cols // 256 * 256)
            for make in (random_blocks, edge_blocks):
                if make is edge_blocks and shape_name != "k":
                    continue
                yield f"{kind} {rows}x{cols} {make.__name__}", kind, make(kind, rows, cols, rng), rows, cols, batch


def _check() -> dict:
    import hashlib

    import gguf

    from hybridgate.workers.cpu import quant
    from tests.unit.test_cpu_kernels import T

    rng = np.random.default_rng(27)
    worst_ratio, worst_relative, rows_exact, invariant = {}, {}, True, True
    digest = hashlib.sha256()  # of every output: the paths' bits compared
    for name, kind, data, rows, cols, batch in _cases(rng):
        dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
        m = quant.LowBitMatrix("w", int(T[kind]), data, (rows, cols))
        x = rng.standard_normal((batch, cols)).astype(np.float32)
        got = m.matmul(x)
        ref = x.astype(np.float64) @ dense.T
        worst_ratio[name] = float((np.abs(got - ref) / _bound(x, dense)).max())
        worst_relative[name] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        rows_exact &= all(np.array_equal(m.row(r), dense[r].astype(np.float32)) for r in (0, rows // 2, rows - 1))
        out = np.empty((1, rows), np.float32)
        invariant &= all(np.array_equal(m.matmul(x[b : b + 1], out)[0], got[b]) for b in range(batch))
        digest.update(got.tobytes())
    return {"isa": isa.selected().isa, "worst_ratio": worst_ratio, "worst_relative": worst_relative,
            "rows_exact": bool(rows_exact), "batch_invariant": bool(invariant), "digest": digest.hexdigest()}


def _asm() -> dict:
    import re

    from hybridgate.workers.cpu import kquant, quant
    from tests.unit.test_cpu_kernels import T, random_blocks

    rng = np.random.default_rng(1)
    for kind in ("Q4_K", "Q5_0", "MXFP4"):  # nibbles, the 5-bit codes this path keeps, E2M1 codes looked up
        m = quant.LowBitMatrix("w", int(T[kind]), random_blocks(kind, 8, 256, rng), (8, 256))
        m.matmul(rng.standard_normal((4, 256)).astype(np.float32))
    asm = "\n".join(a for k in (kquant.matmul_packed, kquant._rows) for a in k.inspect_asm().values())
    return {"registers": sorted(set(re.findall(r"%([xyz]mm)\d+", asm)))}


if __name__ == "__main__":
    isa.select(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "check"
    print(json.dumps({"check": _check, "asm": _asm}[mode]()))
