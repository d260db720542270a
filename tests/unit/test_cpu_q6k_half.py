"""Q6_K, F16, BF16 (and F32) weights on the tiled kernels, against gguf's dequantizer in float64.

Every path this machine runs: the native one in this process, the others (avx2 and
generic always where the CPU has more) each in a child (`python
tests/unit/test_cpu_q6k_half.py ISA`), since Numba compiles for one target per
process. Per type and activation format: random blocks, codes at their extremes
with subnormal, tiny, negative and near-65504 fp16 scales (and F16/BF16 values
from subnormal to large), rows bit-exact against the dequantizer, finite outputs,
and every tile shape's result bit-equal to the row's alone (batch invariance).
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
sys.path.insert(0, str(ROOT / "tests"))

from hybridgate.workers.cpu import isa, kernel_table  # noqa: E402  (no Numba: safe to import here)
from tests.conftest import collect_json, start_children, stop_children  # noqa: E402

RUNNABLE = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
KINDS = ["Q6_K", "F16", "BF16", "F32"]
# Relative L2 error against float64: float32 activations round only in float32; int16 ones carry their
# quantization, at most 2^-16 of each 32-block's largest value (about 2e-5 on Gaussian activations).
LIMIT = {"f32": 1e-5, "i16": 5e-5}
# Codes at their extremes: error over the size of the terms (Σ|w|·max|x|): float32 rounding, or the
# int16 activations' quantization.
EDGE_LIMIT = {"f32": 1e-6, "i16": 4e-5}


def _formats(kind: str) -> tuple[str, ...]:
    return ("f32", "i16") if kind == "Q6_K" else ("f32",)


def check_path() -> dict:
    """The checks of this module on this process's path; JSON-able figures and flags."""
    import gguf

    from hybridgate.workers.cpu import quant
    from tests.unit.test_cpu_kernels import T, edge_blocks, random_blocks

    rng = np.random.default_rng(27)
    out: dict = {"isa": isa.selected().isa, "classes": {}, "random": {}, "edge": {}, "rows_exact": {},
                 "finite": {}, "invariant": {}}

    def dense(kind, data, rows, cols):
        return np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)

    for kind in KINDS:
        for fmt in _formats(kind):
            key = f"{kind} {fmt}"
            rows, cols = 37, 512
            data = random_blocks(kind, rows, cols, rng)
            ref_w = dense(kind, data, rows, cols)
            m = quant.quant_matrix("w", int(T[kind]), data, (rows, cols), fmt)
            out["classes"][key] = [type(m).__name__, m.activations]
            x = rng.standard_normal((9, cols)).astype(np.float32)
            ref = x.astype(np.float64) @ ref_w.T
            out["random"][key] = float(np.linalg.norm(m.matmul(x) - ref) / np.linalg.norm(ref))
            out["rows_exact"][key] = all(np.array_equal(m.row(r), ref_w[r].astype(np.float32)) for r in (0, 17, 36))

            data = edge_blocks(kind, 16, 512, rng)
            ref_w = dense(kind, data, 16, 512)
            m = quant.quant_matrix("w", int(T[kind]), data, (16, 512), fmt)
            x = rng.standard_normal((3, 512)).astype(np.float32)
            got = m.matmul(x)
            size = np.abs(x).max(axis=1, keepdims=True) * np.abs(ref_w).sum(axis=1)[None, :] + 1e-30
            out["edge"][key] = float((np.abs(got - x.astype(np.float64) @ ref_w.T) / size).max())
            out["finite"][key] = bool(np.isfinite(got).all())
            out["rows_exact"][key] &= all(np.array_equal(m.rows(np.array([r]))[0], ref_w[r].astype(np.float32))
                                          for r in range(16))

            # every tile shape: 4-row groups and a 1-row tail, 4x4 and 4x1 tiles, two 64-row passes
            data = random_blocks(kind, 37, 256, rng)
            m = quant.quant_matrix("w", int(T[kind]), data, (37, 256), fmt)
            x = rng.standard_normal((70, 256)).astype(np.float32)
            batched = m.matmul(x)
            out["invariant"][key] = all(np.array_equal(m.matmul(x[b : b + 1])[0], batched[b]) for b in range(70))
    # Q6_K's integer sums at their limits: every code -32 or 31 (ql/qh bytes 0x00 or 0xFF), every
    # activation ±its block's largest value (int16 ±32767)
    rows, cols = 8, 512
    data = random_blocks("Q6_K", rows, cols, rng).reshape(rows, cols // 256, 210)
    data[:, :, :192] = np.where(rng.random((rows, cols // 256, 1)) < 0.5, 0x00, 0xFF)
    data = data.reshape(rows, -1)
    ref_w = dense("Q6_K", data, rows, cols)
    x = np.where(rng.random((5, cols)) < 0.5, -3.0, 3.0).astype(np.float32)
    for fmt in _formats("Q6_K"):
        m = quant.quant_matrix("w", int(T.Q6_K), data, (rows, cols), fmt)
        ref = x.astype(np.float64) @ ref_w.T
        out["random"][f"Q6_K {fmt} extremes"] = float(np.linalg.norm(m.matmul(x) - ref) / np.linalg.norm(ref))
    return out


def assert_path(out: dict) -> None:
    for key, (cls, fmt) in out["classes"].items():
        kind, wanted = key.split()
        assert cls == kernel_table.choose(kind, wanted, out["isa"]).matrix and fmt == wanted, (key, cls, fmt)
    for key, err in out["random"].items():
        assert err <= LIMIT[key.split()[1]], (out["isa"], key, err)
    for key, err in out["edge"].items():
        assert err <= EDGE_LIMIT[key.split()[1]], (out["isa"], key, err)
    assert all(out["rows_exact"].values()), out["rows_exact"]
    assert all(out["finite"].values()), out["finite"]
    assert all(out["invariant"].values()), out["invariant"]
    if "Q6_K i16" in out["random"]:
        assert out["random"]["Q6_K i16"] > 1e-7  # the int16 kernel ran (float32 is 1e5 times closer)


@pytest.fixture(scope="module")
def other_paths():
    """The other paths' children, started at once (`start_children`) when the module's first test asks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = start_children({path: ([sys.executable, __file__, path], env) for path in RUNNABLE[1:]})
    yield procs
    stop_children(procs)  # those no test collected


@pytest.fixture(scope="module")
def other_results(other_paths):
    return collect_json(other_paths, timeout=300 * len(other_paths))


def test_native_path_matches_the_dequantizer(other_paths):  # the other paths compile meanwhile
    assert_path(check_path())


@pytest.mark.parametrize("path", RUNNABLE[1:])
def test_each_other_path_matches_the_dequantizer(path, other_results):
    out = other_results[path]
    assert out["isa"] == path
    assert_path(out)


def test_fast_classes_and_their_fallback():
    import gguf

    from hybridgate.workers.cpu import quant

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(3)
    half = rng.standard_normal((4, 48)).astype(np.float16)
    m = quant.quant_matrix("w", int(T.F16), half.view(np.uint8), (4, 48))  # 48 columns: not whole tiles
    assert type(m) is quant.QuantMatrix
    np.testing.assert_array_equal(m.matmul(np.eye(48, dtype=np.float32)[:2]), half[:, :2].T.astype(np.float32))
    f16 = quant.quant_matrix("w", int(T.F16), rng.standard_normal((4, 64)).astype(np.float16).view(np.uint8), (4, 64))
    assert type(f16) is quant.FloatMatrix and f16.nbytes == 4 * 64 * 2
    # Q6_K repacked: int8 codes and a float32 scale per 16 columns, 10 bits per weight
    from tests.unit.test_cpu_kernels import random_blocks

    q6 = quant.quant_matrix("w", int(T.Q6_K), random_blocks("Q6_K", 4, 512, rng), (4, 512), "f32")
    assert type(q6) is quant.Q6KMatrix and q6.nbytes == 4 * 512 * 10 // 8
    # auto: the path's own class (on avx2 the superblock kernel: int8 codes, an int32 scale per 16 columns
    # and a float32 d per 256, 10.125 bits per weight)
    q6 = quant.quant_matrix("w", int(T.Q6_K), random_blocks("Q6_K", 4, 512, rng), (4, 512))
    assert type(q6).__name__ == kernel_table.choose("Q6_K", "auto", quant.PATH).matrix and q6.nbytes <= 4 * 512 * 10.125 / 8


if __name__ == "__main__":
    isa.select(sys.argv[1])
    print(json.dumps(check_path()))
