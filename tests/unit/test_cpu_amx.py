"""The AMX-BF16 prompt matmuls (`amx`, `quant.QuantMatrix.matmul_prompt`) against gguf's dequantizer.

Runs where this process's kernels were compiled with AMX (a Xeon since Sapphire Rapids whose Linux grants
the tile state); skipped elsewhere. For each weight format the tiles read (Q4_K, Q5_K, Q6_K on the avx512
path, Q8_0, Q5_0, Q5_1 and BF16): random blocks and blocks at the formats' limits (codes and
sub-scales at their extremes, subnormal and large fp16 scales) and rows longer than a job's column chunk,
against float64 products with gguf's dequantized weights rounded to bf16
(the tiles' weights: only the activations' split x ≈ hi + lo and float32 sums differ, so a wrong column,
row, pair or scale shows at once) and with the weights as gguf gives them (within bf16's rounding); rows
outside the prompt rows untouched; a row's bits the same in any batch and at any place in its tile; and the
rows `matmul_prompt` leaves to the matrix's own kernel the bits of that kernel alone.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybridgate.workers.cpu import isa

pytestmark = pytest.mark.skipif(not isa.selected().amx, reason="no AMX-BF16 here (a Xeon since Sapphire Rapids "
                                                              "with the tile state granted)")

KINDS = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q5_1", "BF16")
T = gguf.GGMLQuantizationType


def bf16(w: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 to nearest even, as float64 (no NaN here), float32 subnormals to
    zero as `vcvtne2ps2bf16` takes them (its inputs' denormals are zeros; only an F32 file holds any)."""
    u = np.ascontiguousarray(w, np.float32).view(np.uint32).astype(np.uint64)
    u = np.where(u & 0x7F800000, u, u & 0x80000000)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def matrix(kind: str, data: np.ndarray, rows: int, cols: int):
    from hybridgate.workers.cpu import quant

    m = quant.quant_matrix("w", int(T[kind]), data, (rows, cols))
    assert m._prompt_arrays() is not None, type(m).__name__
    return m


@pytest.fixture(scope="module", params=[(k, case) for k in KINDS for case in ("random", "edge")] +
                [("Q4_K", "long"), ("Q8_0", "long")], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request):
    from tests.unit.test_cpu_kernels import edge_blocks, random_blocks

    kind, which = request.param
    # long: more columns than a job's panels hold at once (amx.COLUMNS), its sums carried over three chunks
    rows, cols = {"random": (96, 768), "edge": (32, 512), "long": (64, 4352)}[which]
    rng = np.random.default_rng(7)
    data = (edge_blocks if which == "edge" else random_blocks)(kind, rows, cols, rng)
    dense = np.asarray(gguf.quants.dequantize(data, T[kind]), np.float64).reshape(rows, cols)
    x = rng.standard_normal((45, cols)).astype(np.float32)
    x[3] *= 1e-3  # rows of small and large activations: the split keeps each row's own precision
    x[4] *= 1e3
    return kind, matrix(kind, data, rows, cols), dense, x


def test_tiles_multiply_gguf_weights_rounded_to_bf16(case):
    from hybridgate.workers.cpu import amx

    kind, m, dense, x = case
    rows = np.arange(x.shape[0], dtype=np.int64)
    out = np.full((x.shape[0], m.shape[0]), np.nan, np.float32)
    amx.multiply(x, rows, *m._prompt_arrays(), out)
    scale = np.abs(x).astype(np.float64) @ np.abs(dense).T + 1e-30  # Σ |x_j w_ij| per output
    # hi + lo keeps about 16 bits of each activation (2^-17 relative), float32 sums add k · 2^-24
    err = np.abs(out - x.astype(np.float64) @ bf16(dense).T) / scale
    assert err.max() < 2e-5, (kind, err.max())
    # against the weights as gguf gives them: bf16's rounding, half a unit of its 8 significant bits: 2^-8 of a
    # weight at most
    err = np.abs(out - x.astype(np.float64) @ dense.T) / scale
    assert err.max() < 2.0**-8 + 2e-5, (kind, err.max())
    if kind not in ("Q8_0", "BF16"):  # and not the other kernels' result by another name: bf16 weights leave a trace
        assert err.max() > 1e-4, (kind, err.max())


def test_only_the_given_rows_are_written_and_each_rows_bits_hold_in_any_batch(case):
    from hybridgate.workers.cpu import amx

    _, m, _, x = case
    arrays = m._prompt_arrays()
    every = np.full((x.shape[0], m.shape[0]), np.nan, np.float32)
    amx.multiply(x, np.arange(x.shape[0], dtype=np.int64), *arrays, every)
    some = np.array([2, 5, 17, 40], np.int64)  # spread over two tile blocks, each at another place in its tile
    out = np.full_like(every, np.nan)
    amx.multiply(x, some, *arrays, out)
    others = np.setdiff1d(np.arange(x.shape[0]), some)
    assert np.isnan(out[others]).all()
    np.testing.assert_array_equal(out[some], every[some])
    for r in (0, 44):  # alone
        one = np.full_like(every, np.nan)
        amx.multiply(x, np.array([r], np.int64), *arrays, one)
        np.testing.assert_array_equal(one[r], every[r])


def test_matmul_prompt_puts_the_prompt_rows_on_tiles_and_the_rest_on_the_matrix_kernel(case):
    from hybridgate.workers.cpu import amx

    _, m, _, x = case
    prompt = np.arange(10, 45, dtype=np.int64)
    got = m.matmul_prompt(x, prompt)
    tiles = np.full_like(got, np.nan)
    amx.multiply(x, np.arange(x.shape[0], dtype=np.int64), *m._prompt_arrays(), tiles)
    np.testing.assert_array_equal(got[prompt], tiles[prompt])
    np.testing.assert_array_equal(got[:10], m.matmul(np.ascontiguousarray(x[:10])))
    np.testing.assert_array_equal(m.matmul_prompt(x, np.empty(0, np.int64)), m.matmul(x))


@pytest.mark.parametrize("kind", ["F32", "F16"])
def test_f32_and_f16_weights_stay_on_their_kernel(kind):
    from hybridgate.workers.cpu import quant
    from tests.unit.test_cpu_kernels import random_blocks

    rng = np.random.default_rng(4)
    m = quant.quant_matrix("w", int(T[kind]), random_blocks(kind, 32, 256, rng), (32, 256))
    x = rng.standard_normal((33, 256)).astype(np.float32)
    assert m._prompt_arrays() is None
    np.testing.assert_array_equal(m.matmul_prompt(x, np.arange(33, dtype=np.int64)), m.matmul(x))


def test_a_weight_whose_rows_are_not_a_multiple_of_32_stays_on_its_kernel():
    from tests.unit.test_cpu_kernels import random_blocks

    rng = np.random.default_rng(3)
    m = matrix("Q4_K", random_blocks("Q4_K", 40, 256, rng), 40, 256)
    x = rng.standard_normal((33, 256)).astype(np.float32)
    np.testing.assert_array_equal(m.matmul_prompt(x, np.arange(33, dtype=np.int64)), m.matmul(x))
