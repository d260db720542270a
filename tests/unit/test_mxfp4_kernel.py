"""MXFP4 on the packed int16 kernel (`kquant.matmul_packed`, `quant.LowBitMatrix`) on every path this machine runs.

Numba compiles for one target per process, so each path runs in a child (`python tests/unit/test_mxfp4_kernel.py
ISA`). Two references, neither from the code under test: gguf's dequantizer (the spec's float64 values from
test_mxfp4 where gguf's float32 overflows, exponent 254) times the activations rounded to int16 per 32-block as
kquant's docstring states the rounding, summed in float64 (the kernel's integer sums are exact, so only the float32
rounding of its few float steps may separate the two); and the float64 product, within the bound the int16 rounding
allows (test_cpu_kquant's). Blocks: gguf's quantization of Gaussian rows; random bytes with exponents 0..200; and
the format's extremes, exponent bytes 0, 127 and 254 (one per row) with every code 7 or 15 (±6, ggml's doubled ±12)
against activations at ±their block's largest value (every int16 ±32767: the integer sums at their limits), scaled
by 2^-40 at 254 so that the products stay finite in float32 (the weights alone do not: 6 · 2^127 > 2^128). A row's
result is bitwise the same alone as in a batch through every tile shape, and the paths agree bit for bit.
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

RUNNABLE = isa.ISAS[isa.ISAS.index(isa.best(isa.host_features())):]
XQ_MAX = np.float32(32767.0)  # int16 activations in ±32767 (kquant's docstring)


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != isa.ENV}
    procs = {p: subprocess.Popen([sys.executable, __file__, p], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}) for p in RUNNABLE}
    out = {}
    for path, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300 * TIME_FACTOR)
        assert proc.returncode == 0, stderr[-3000:]
        out[path] = json.loads(stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("path", RUNNABLE)
def test_the_packed_kernel_is_the_one_chosen_and_holds_the_files_bytes(results, path):
    assert results[path]["isa"] == path
    assert results[path]["matrix"] == ["LowBitMatrix", "kquant.matmul_packed", "i16"]
    assert results[path]["bits_per_weight"] == 4.25  # the file's 17 bytes per 32 weights: 16 of codes, the E8M0 byte


@pytest.mark.parametrize("path", RUNNABLE)
def test_within_float32_rounding_of_gguf_times_the_int16_activations(results, path):
    for case, ratio in results[path]["rounded_ratio"].items():
        assert ratio <= 1.0, (case, ratio)  # |got - ref| over the float32 bound, the worst output


@pytest.mark.parametrize("path", RUNNABLE)
def test_within_the_int16_rounding_bound_of_the_float64_product(results, path):
    out = results[path]
    for case, ratio in out["product_ratio"].items():
        assert ratio <= 1.0, (case, ratio)
    gaussian = [v for case, v in out["relative"].items() if not case.startswith("exponent")]  # ±max: exact
    assert min(gaussian) > 1e-7  # int16 activations ran: float32 ones are 100 times closer
    assert out["rows_exact"]


@pytest.mark.parametrize("path", RUNNABLE)
def test_a_rows_result_does_not_depend_on_its_batch(results, path):
    assert results[path]["batch_invariant"] and results[path]["prompt_is_decode"]


def test_every_path_computes_the_same_bits(results):
    assert len({results[p]["digest"] for p in RUNNABLE}) == 1, {p: results[p]["digest"] for p in RUNNABLE}


# ---- the child ----

def rounded_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(xq float64 `[batch, cols]` integers, xs float64 `[batch, cols / 32]`): per 32-block xq = rint(x · (32767 /
    max|x_b|)) and xs = max|x_b| / 32767, each step in float32 as kquant's docstring gives them."""
    blocks = x.reshape(x.shape[0], -1, 32)
    top = np.abs(blocks).max(axis=2, keepdims=True)  # float32
    with np.errstate(divide="ignore"):
        inv = np.where(top > 0, XQ_MAX / top, np.float32(0.0)).astype(np.float32)
    xq = np.rint((blocks * inv).astype(np.float32)).astype(np.float64)
    return xq.reshape(x.shape), (top[..., 0] / XQ_MAX).astype(np.float32).astype(np.float64)


def rounded_reference(x: np.ndarray, dense: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Σ_b xs_kb · Σ_j w_ibj · xq_kbj, the same sum of magnitudes) in float64, `[batch, rows]` each."""
    xq, xs = rounded_activations(x)
    rows, batch = dense.shape[0], x.shape[0]
    per_block = np.einsum("kbj,ibj->kib", xq.reshape(batch, -1, 32), dense.reshape(rows, -1, 32))
    size = np.einsum("kbj,ibj->kib", np.abs(xq).reshape(batch, -1, 32), np.abs(dense).reshape(rows, -1, 32))
    return (per_block * xs[:, None, :]).sum(axis=2), (size * xs[:, None, :]).sum(axis=2)


def float32_bound(size: np.ndarray, cols: int) -> np.ndarray:
    """The kernel's float steps on terms of total magnitude `size`: a product and an FMA per quad of blocks, then a
    16-lane tree (2^-24 each, relative to the terms' magnitude), and as many subnormal half-steps (2^-150)."""
    steps = -(-cols // 128) + 6
    return steps * (2.0**-24 * size + 2.0**-149)


def extreme_blocks(rng, exponents: list[int], rows: int, cols: int) -> np.ndarray:
    """uint8 `[rows, cols / 32 · 17]`: row r's blocks with exponent exponents[r % len], every code 7 or 15."""
    blocks = np.empty((rows, cols // 32, 17), np.uint8)
    blocks[..., 0] = np.array(exponents)[np.arange(rows) % len(exponents)][:, None]
    low, high = (np.where(rng.random((rows, cols // 32, 16)) < 0.5, 7, 15).astype(np.uint8) for _ in range(2))
    blocks[..., 1:] = low | (high << 4)
    return blocks.reshape(rows, -1)


def _cases(rng):
    import gguf

    for rows, cols, batch in ((37, 2880, 9), (9, 416, 70)):  # 90 blocks (half a quad of padding), 4-row tiles
        # and a tail; 70 rows: the 4x4, 4x1 tiles and two 64-row passes
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        data = np.ascontiguousarray(gguf.quants.quantize(w, gguf.GGMLQuantizationType.MXFP4)).view(np.uint8)
        yield f"quantized {rows}x{cols}", data.reshape(rows, -1), rng.standard_normal((batch, cols))
        raw = rng.integers(0, 256, (rows, cols // 32, 17), dtype=np.uint8)
        raw[..., 0] = rng.integers(0, 201, raw.shape[:2])
        yield f"random bytes {rows}x{cols}", raw.reshape(rows, -1), rng.standard_normal((batch, cols))
    for exponent, scale in ((0, 1.0), (127, 1.0), (254, 2.0**-40)):
        signs = np.where(rng.random((5, 512)) < 0.5, -3.0, 3.0)
        yield f"exponent {exponent}, codes ±12", extreme_blocks(rng, [exponent], 6, 512), signs * scale
    yield "exponents 0, 127, 254, codes ±12", extreme_blocks(rng, [0, 127, 254], 9, 512), \
        rng.standard_normal((4, 512)) * 2.0**-40


def _check() -> dict:
    import hashlib

    import gguf

    from hybridgate.workers.cpu import kernel_table, quant
    from hybridgate.workers.cpu.blocks import MXFP4
    from tests.unit.test_cpu_kquant import _bound
    from tests.unit.test_mxfp4 import spec_dequantize

    rng = np.random.default_rng(39)
    rounded_ratio, product_ratio, relative = {}, {}, {}
    rows_exact = invariant = prompt_is_decode = True
    digest = hashlib.sha256()
    for name, data, x in _cases(rng):
        rows, cols = data.shape[0], data.shape[1] // 17 * 32
        x = x.astype(np.float32)
        spec = spec_dequantize(data.reshape(rows, -1, 17))
        with np.errstate(over="ignore"):
            theirs = np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4), np.float64)
        dense = np.where(np.isfinite(theirs), theirs, spec)  # gguf's, but 6 · 2^127 where its float32 overflowed
        m = quant.quant_matrix("w", MXFP4, data, (rows, cols))
        got = m.matmul(x)
        want, size = rounded_reference(x, dense)
        rounded_ratio[name] = float((np.abs(got - want) / float32_bound(size, cols)).max())
        product = x.astype(np.float64) @ dense.T
        product_ratio[name] = float((np.abs(got - product) / _bound(x, dense)).max())
        relative[name] = float(np.linalg.norm(got - product) / np.linalg.norm(product))
        with np.errstate(over="ignore"):
            rows_exact &= all(np.array_equal(m.row(r), spec[r].astype(np.float32)) for r in range(rows))
        one = np.empty((1, rows), np.float32)
        invariant &= all(np.array_equal(m.matmul(x[b : b + 1], one)[0], got[b]) for b in range(x.shape[0]))
        prompt_is_decode &= np.array_equal(m.matmul_prompt(x, np.arange(x.shape[0])), got)
        digest.update(got.tobytes())
    row = kernel_table.choose("MXFP4", "auto", quant.PATH)
    matrix = quant.quant_matrix("w", MXFP4, extreme_blocks(rng, [127], 4, 2048), (4, 2048))
    return {"isa": isa.selected().isa, "matrix": [type(matrix).__name__, matrix.kernel_name, matrix.activations],
            "row": row.describe(), "bits_per_weight": matrix.nbytes * 8 / (4 * 2048),
            "rounded_ratio": rounded_ratio, "product_ratio": product_ratio, "relative": relative,
            "rows_exact": bool(rows_exact), "batch_invariant": bool(invariant),
            "prompt_is_decode": bool(prompt_is_decode), "digest": digest.hexdigest()}


if __name__ == "__main__":
    isa.select(sys.argv[1])
    print(json.dumps(_check()))
