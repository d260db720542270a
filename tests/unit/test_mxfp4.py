"""MXFP4 blocks on both runners against a float64 dequantization written from the OCP MX spec.

The spec (OCP Microscaling Formats v1.0, 2023, sections 5.3.3 and 5.4.1): an element is E2M1, bit 3
the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa; exponent 0 is subnormal (0.5 · m),
otherwise 2^(exp - 1) · (1 + m / 2). The shared scale is E8M0, 2^(e - 127), and e = 255 is NaN there;
ggml (whose layout GGUF stores: `block_mxfp4 { e; qs[16] }`, low nibbles elements 0..15, high ones
16..31) reads it as 2^128. Every one of the 16 codes appears in every block; the exponents cover 0 and 1
(subnormal scales in float32), 127 (scale 1) and 252, and 254 and 255, where the larger codes overflow
float32 to ±inf in gguf's dequantizer as in ours. Both runners'
values (the Numba runner's from its packed matrix and from the row-dequantizing one) are held to the spec
and to gguf's own dequantizer; gguf's quantizer round-trips blocks whose values are representable. The
packed int16 kernel's products: test_mxfp4_kernel.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from hybridgate.workers.cpu.blocks import MXFP4
from hybridgate.workers.cpu.quant import QuantMatrix, quant_matrix

EXPONENTS = [0, 1, 2, 100, 127, 128, 200, 252]  # 252: the largest whose every code is finite in float32


def e2m1(code: int) -> float:
    """The spec's E2M1 value of a 4-bit code, in float64."""
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    magnitude = 0.5 * mantissa if exponent == 0 else 2.0 ** (exponent - 1) * (1.0 + mantissa / 2.0)
    return sign * magnitude


def spec_dequantize(blocks: np.ndarray) -> np.ndarray:
    """float64 `[rows, 32 · blocks]` of uint8 `[rows, blocks, 17]`, from the spec and ggml's byte order."""
    scale = np.ldexp(1.0, blocks[..., 0].astype(np.int64) - 127)  # float64: 2^(e - 127), exact
    codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)  # elements 0..15, 16..31
    values = np.vectorize(e2m1, otypes=[np.float64])(codes)
    return (values * scale[..., None]).reshape(blocks.shape[0], -1)


def random_blocks(rng: np.random.Generator, rows: int, exponents: list[int]) -> np.ndarray:
    """uint8 `[rows, len(exponents), 17]`: block b scaled by exponents[b], each holding all 16 codes twice
    (shuffled)."""
    blocks = np.empty((rows, len(exponents), 17), np.uint8)
    blocks[..., 0] = exponents
    for r in range(rows):
        for b in range(len(exponents)):
            codes = rng.permutation(np.tile(np.arange(16, dtype=np.uint8), 2))
            blocks[r, b, 1:] = codes[:16] | (codes[16:] << 4)
    return blocks


def test_e2m1_table_is_the_specs():
    assert [e2m1(c) for c in range(8)] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert [e2m1(c) for c in range(8, 16)] == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_gguf_and_both_runners_match_the_spec_over_every_code_and_the_exponent_range():
    rows = 3
    blocks = random_blocks(np.random.default_rng(0), rows, EXPONENTS)
    data = blocks.reshape(rows, -1)
    want = spec_dequantize(blocks)
    assert np.isfinite(want.astype(np.float32)).all() and want.min() < 0 and (want == 0).any()
    ours = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4)  # the torch runner's weights
    np.testing.assert_array_equal(ours.astype(np.float64), want)
    shape = (rows, 32 * len(EXPONENTS))
    for matrix in (quant_matrix("w", MXFP4, data, shape), QuantMatrix("w", MXFP4, data, shape)):  # packed, bytes
        for r in range(rows):
            np.testing.assert_array_equal(matrix.row(r).astype(np.float64), want[r])


def test_exponents_254_and_255_overflow_as_ggml_reads_them():
    # 255 is the spec's NaN scale and ggml's 2^(255 - 127); at 254 and 255 the magnitudes from 2 and from 1 up (8 and 12 of the 16 codes) overflow
    # float32 (2^128) to ±inf: the float64 values cast to float32, in gguf's dequantizer and in ours.
    blocks = random_blocks(np.random.default_rng(1), 1, [254, 255])
    data = blocks.reshape(1, -1)
    with np.errstate(over="ignore"):
        want = spec_dequantize(blocks).astype(np.float32)
    assert np.isinf(want).sum() == 2 * (8 + 12) and not np.isnan(want).any()
    np.testing.assert_array_equal(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4), want)
    for matrix in (quant_matrix("w", MXFP4, data, (1, 64)), QuantMatrix("w", MXFP4, data, (1, 64))):
        with np.errstate(over="ignore"):
            np.testing.assert_array_equal(matrix.row(0), want[0])


@pytest.mark.parametrize("batch", [1, 5])
def test_numba_matmul_matches_a_float64_product(batch):
    rng = np.random.default_rng(batch)
    blocks = random_blocks(rng, 40, [120, 125, 127, 130, 126, 124, 127, 128])
    data = blocks.reshape(40, -1)
    w = spec_dequantize(blocks)  # [40, 256]
    x = rng.standard_normal((batch, 256)).astype(np.float32)
    got = QuantMatrix("w", MXFP4, data, w.shape).matmul(x)  # the row-dequantizing kernel (the packed one:
    # test_mxfp4_kernel)
    want = x.astype(np.float64) @ w.T
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(w).max() * 16)


def test_gguf_quantizer_round_trips_representable_blocks():
    # A block whose largest magnitude is 6 · 2^(e - 127) is stored with exponent e by ggml's rule
    # (floor(log2(max)) - 2 + 127); every value of such a block is representable, so it comes back exact.
    blocks = random_blocks(np.random.default_rng(3), 4, [100, 127, 127, 150])
    values = spec_dequantize(blocks).astype(np.float32)
    stored = gguf.quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)
    back = gguf.quants.dequantize(stored, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(back, values)
    assert (stored.reshape(4, -1, 17)[..., 0] == blocks[..., 0]).all()


def test_torch_runner_reads_mxfp4_through_gguf(tmp_path):
    # The torch runner's weights are `TensorView.dequantize` (gguf's dequantizer) of the file's bytes.
    from hybridgate.models.gguf_file import SUPPORTED_TENSOR_TYPES, TensorView

    assert gguf.GGMLQuantizationType.MXFP4 in SUPPORTED_TENSOR_TYPES
    blocks = random_blocks(np.random.default_rng(4), 2, [126, 129])
    view = TensorView("w", gguf.GGMLQuantizationType.MXFP4, (2, 64), blocks.reshape(2, -1))
    np.testing.assert_array_equal(torch.from_numpy(view.dequantize()).double().numpy(), spec_dequantize(blocks))
