"""CPU kernels on GGUF blocks against gguf's own dequantizer and a float64 matmul."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hybridgate.workers.cpu import quant
from hybridgate.workers.cpu.fused import concat_rows

T = gguf.GGMLQuantizationType
QUANTIZABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]  # gguf.quants.quantize's types
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
FAST_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0"]  # repacked onto the simd/intdot kernels
ALL_TYPES = QUANTIZABLE + K_QUANTS
# Where each block type keeps its fp16 super-scale d (and dmin / m beside it where it has one).
D_AT = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}
HAS_MIN = {"Q4_1", "Q5_1", "Q4_K", "Q5_K"}
# The bytes of each block type that hold codes (and K-quants' sub-scales): everything but d (and min).
CODE_BYTES = {"Q4_0": slice(2, 18), "Q4_1": slice(4, 20), "Q5_0": slice(2, 22), "Q5_1": slice(4, 24),
              "Q8_0": slice(2, 34), "Q4_K": slice(4, 144), "Q5_K": slice(4, 176), "Q6_K": slice(0, 208)}


def random_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """uint8 `[rows, row_bytes]` of valid blocks (finite scales): gguf's quantizer for the types it
    has, random bytes with fp16 scales in [0.001, 0.05] for the K-quants (gguf cannot make them)."""
    if kind in QUANTIZABLE or kind == "MXFP4":  # gguf quantizes MXFP4 too (its own test: test_mxfp4)
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), T[kind])
        return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    block_weights, block_bytes = quant.BLOCK[int(T[kind])]
    raw = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.05, (rows, cols // block_weights, 1)).astype(np.float16).view(np.uint8)
    raw[:, :, D_AT[kind] : D_AT[kind] + 2] = scale
    if kind in HAS_MIN:
        raw[:, :, 2:4] = scale
    return raw.reshape(rows, -1)


EDGE_SCALES = np.array([5.96e-8, 6.1e-5, -3.0e-6, 1.0e-7, 2.0, 0.5, 60000.0, -1.0e-5], dtype=np.float16)


def edge_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Blocks at the formats' limits: every code byte (and K-quant sub-scale byte) 0x00 or 0xFF (so
    codes at their smallest and largest: 0/15, 0/31, 0/63, Q8_0 0/-1 and -128/127 through 0x80/0x7F),
    and fp16 scales (and mins) subnormal, tiny, negative or near the largest finite (`EDGE_SCALES`,
    one per row). F32/F16/BF16: values at their subnormal and large ends instead."""
    if kind in ("F32", "F16", "BF16"):
        magnitude = np.exp(rng.uniform(np.log(1e-38 if kind != "F16" else 6e-8), np.log(6e4), (rows, cols)))
        values = (magnitude * rng.choice([-1.0, 1.0], (rows, cols))).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(values, T[kind])).view(np.uint8).reshape(rows, -1)
    data = random_blocks(kind, rows, cols, rng)
    blocks = data.reshape(rows, -1, quant.BLOCK[int(T[kind])][1])
    code = blocks[:, :, CODE_BYTES[kind]]
    pick = rng.integers(0, 4, code.shape)
    code[...] = np.choose(pick, [0x00, 0xFF, 0x80, 0x7F] if kind in ("Q8_0", "Q6_K") else [0x00, 0xFF, 0xFF, 0x00])
    blocks[:, :, CODE_BYTES[kind]] = code
    at = D_AT[kind]
    for r in range(rows):
        blocks[r, :, at : at + 2] = EDGE_SCALES[r % 8 : r % 8 + 1].view(np.uint8)
        if kind in HAS_MIN:
            blocks[r, :, 2:4] = EDGE_SCALES[(r + 3) % 8 : (r + 3) % 8 + 1].view(np.uint8)
    return blocks.reshape(rows, -1)


def dense_reference(kind: str, data: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """float64 `[rows, cols]` by gguf's dequantizer."""
    return np.asarray(gguf.quants.dequantize(data, T[kind]), dtype=np.float64).reshape(rows, cols)


@pytest.mark.parametrize("kind", ALL_TYPES)
@pytest.mark.parametrize(("rows", "cols", "batch"), [(8, 256, 1), (40, 512, 3), (17, 768, 16)])
def test_matmul_matches_reference(kind, rows, cols, batch):
    rng = np.random.default_rng(rows * cols + batch)
    data = random_blocks(kind, rows, cols, rng)
    dense = dense_reference(kind, data, rows, cols)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    ref = x.astype(np.float64) @ dense.T
    for matrix in (quant.quant_matrix("w", int(T[kind]), data, (rows, cols)),
                   quant.QuantMatrix("w", int(T[kind]), data, (rows, cols))):
        y = matrix.matmul(x)
        # float32 activations: float32 rounding only; int16 ones (the default format of some weight
        # types on some paths): their quantization, ~2e-5 (test_cpu_isa checks both formats on every path)
        limit = 1e-5 if matrix.activations == "f32" else 5e-5
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= limit, (type(matrix).__name__, matrix.activations)
        np.testing.assert_allclose(matrix.row(rows // 2), dense[rows // 2], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_codes_at_their_extremes_and_edge_scales(kind):
    # Every code at 0 or its largest (and Q8_0/Q6_K's signed ends), fp16 scales and mins subnormal or near
    # 65504: each dequantized row equals gguf's bit for bit, and the matmul is within float32 rounding of
    # the float64 product (bounded by the size of the terms, as the row sums cancel).
    rng = np.random.default_rng(11)
    rows, cols, batch = 16, 512, 3
    data = edge_blocks(kind, rows, cols, rng)
    dense = dense_reference(kind, data, rows, cols)
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    size = np.abs(x).max(axis=1, keepdims=True) * np.abs(dense).sum(axis=1)[None, :]
    m = quant.QuantMatrix("w", int(T[kind]), data, (rows, cols))
    for r in range(rows):
        np.testing.assert_array_equal(m.row(r), dense[r].astype(np.float32), err_msg=f"row {r}")
    got = m.matmul(x)
    np.testing.assert_array_less(np.abs(got - x.astype(np.float64) @ dense.T), 1e-6 * size + 1e-30)
    for b in range(batch):
        np.testing.assert_array_equal(m.matmul(x[b : b + 1])[0], got[b])


# Q, K, V of one layer in three types (a Q4_K_M file's mix: Q5_0, Q6_K beside Q4_K or Q8_0), rows of
# each part not a multiple of any tile; and gate/up-like pairs of a fast-path type and a row-path one.
MIXES = [("Q5_0", "Q5_0", "Q6_K"), ("Q4_K", "Q8_0", "Q5_K"), ("Q4_1", "BF16"), ("F16", "Q8_0", "Q4_1", "Q5_1")]


@pytest.mark.parametrize("kinds", MIXES, ids=["+".join(m) for m in MIXES])
def test_fused_matrix_of_parts_of_different_types(kinds):
    rng = np.random.default_rng(len(kinds))
    cols, batch = 512, 6
    part_rows = [24, 8, 13, 5][: len(kinds)]
    parts = [(int(T[k]), random_blocks(k, r, cols, rng), (r, cols)) for k, r in zip(kinds, part_rows)]
    names = [f"blk.0.part{i}.weight" for i in range(len(kinds))]
    fused = concat_rows("+".join(names), parts)
    assert fused.shape == (sum(part_rows), cols)
    dense = np.concatenate([dense_reference(k, d, s[0], cols) for k, (_, d, s) in zip(kinds, parts)])
    x = rng.standard_normal((batch, cols)).astype(np.float32)
    y = fused.matmul(x)
    ref = x.astype(np.float64) @ dense.T
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) <= 5e-5  # int16 activations where a part takes them
    start = 0
    for (kind, data, shape) in parts:  # each part's columns are that part's own matrix's output
        alone = quant.quant_matrix("w", kind, data, shape).matmul(x)
        np.testing.assert_array_equal(y[:, start : start + shape[0]], alone)
        start += shape[0]
    for b in range(batch):
        np.testing.assert_array_equal(fused.matmul(x[b : b + 1])[0], y[b])
    np.testing.assert_allclose(fused.row(sum(part_rows) - 1), dense[-1], rtol=1e-6, atol=1e-7)


def test_fused_parts_must_share_their_columns():
    rng = np.random.default_rng(0)
    parts = [(int(T.Q8_0), random_blocks("Q8_0", 4, 64, rng), (4, 64)),
             (int(T.Q5_0), random_blocks("Q5_0", 4, 96, rng), (4, 96))]
    with pytest.raises(ValueError, match=r"'a\+b': parts differ in columns \(a 4x64, b 4x96\)"):
        concat_rows("a+b", parts)


def test_a_type_without_kernel_or_a_partial_block_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor 'w': GGUF type 10 has no CPU kernel \(supported: F32, "):
        quant.QuantMatrix("w", 10, np.zeros((1, 84), np.uint8), (1, 256))  # Q2_K
    with pytest.raises(ValueError, match=r"tensor 'w': Q4_K weight of 288 columns: not a multiple of its block, 256"):
        quant.QuantMatrix("w", int(T.Q4_K), np.zeros((1, 162), np.uint8), (1, 288))


def test_hand_built_q4_1_block():
    # d = 0.5, m = -1.0, nibbles 0..15 low and 15..0 high: weight j = 0.5 * q_j - 1.
    block = np.zeros(20, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    block[2:4] = np.array([-1.0], dtype=np.float16).view(np.uint8)
    block[4:20] = np.arange(16, dtype=np.uint8) | ((15 - np.arange(16, dtype=np.uint8)) << 4)
    m = quant.quant_matrix("w", int(T.Q4_1), block[None, :], (1, 32))
    expected = np.concatenate([0.5 * np.arange(16) - 1, 0.5 * (15 - np.arange(16)) - 1])
    np.testing.assert_array_equal(m.row(0), expected)
    x = np.ones((1, 32), dtype=np.float32)
    assert m.matmul(x)[0, 0] == pytest.approx(expected.sum())


@pytest.mark.parametrize("kind", ["F16", "BF16"])
def test_half_floats_cover_subnormals_and_specials(kind):
    values = [0.0, -0.0, 1.0, -2.5, 6.1e-5, 5.96e-8, -1e-7, 65504.0, np.inf, -np.inf]  # fp16's ends
    values = np.array(values + ([3e-39, -1e38] if kind == "BF16" else []), dtype=np.float32)  # and bf16's
    data = np.ascontiguousarray(gguf.quants.quantize(values.astype(np.float32).reshape(1, -1), T[kind])).view(np.uint8)
    row = quant.QuantMatrix("w", int(T[kind]), data, (1, len(values))).row(0)
    np.testing.assert_array_equal(row, dense_reference(kind, data, 1, len(values))[0].astype(np.float32))
    nan = np.array([np.nan], np.float32)
    data = np.ascontiguousarray(gguf.quants.quantize(nan.reshape(1, 1), T[kind])).view(np.uint8)
    assert np.isnan(quant.QuantMatrix("w", int(T[kind]), data, (1, 1)).row(0)[0])


def test_q4_1_repack_is_six_bits_per_weight():
    rng = np.random.default_rng(0)
    data = random_blocks("Q4_1", 64, 512, rng)
    m = quant.quant_matrix("w", int(T.Q4_1), data, (64, 512))
    assert m.nbytes * 8 / (64 * 512) <= 6.0


@pytest.mark.parametrize("kind", FAST_TYPES)
def test_fast_paths_at_the_formats_limits(kind):
    # The repacked types on the simd/intdot kernels, both activation formats, on `edge_blocks` (codes at
    # their extremes, binary16 scales and mins subnormal or near the largest finite) against gguf's
    # dequantizer (float64 products): a flushed scale, a lost code bit or a wrong nibble order shows.
    rng = np.random.default_rng(3)
    rows, cols = 8, 512
    data = edge_blocks(kind, rows, cols, rng)
    ref = dense_reference(kind, data, rows, cols)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    want = x.astype(np.float64) @ ref.T
    size = np.abs(x).max(axis=1, keepdims=True) * np.abs(ref).sum(axis=1)[None, :]
    for activations, bound in (("f32", 1e-6), ("i16", 4e-5)):
        m = quant.quant_matrix("w", int(getattr(T, kind)), data, (rows, cols), activations)
        assert type(m) is not quant.QuantMatrix and m.activations == activations
        np.testing.assert_array_less(np.abs(m.matmul(x) - want), bound * size, err_msg=activations)
        np.testing.assert_allclose(m.row(5), ref[5], rtol=1e-6, atol=1e-6 * np.abs(ref[5]).max())


@pytest.mark.parametrize("kind", FAST_TYPES)
def test_every_tile_shape_gives_the_bits_of_batch_one(kind):
    # 37 rows: 4-row tiles plus a 1-row tail; 70 activation rows: 4x4 and 4x1 tiles, two X_TILE passes.
    rng = np.random.default_rng(7)
    rows, cols = 37, 256 if kind == "Q4_K" else 96
    m = quant.quant_matrix("w", int(T[kind]), random_blocks(kind, rows, cols, rng), (rows, cols))
    x = rng.standard_normal((70, cols)).astype(np.float32)
    batched = m.matmul(x)
    for b in (0, 3, 4, 63, 64, 69):
        np.testing.assert_array_equal(m.matmul(x[b : b + 1])[0], batched[b])
    np.testing.assert_array_equal(m.matmul(x[5:13]), batched[5:13])


def test_attention_vector_pieces_against_numpy():
    import numba as nb

    from hybridgate.workers.cpu import simd

    @nb.njit
    def run(q, kt, scores, n, v, acc, width):
        # 8 query rows 20 floats apart; keys: 64 rows of 20 floats, 16 used from column 5; `width` rows a call.
        for r0 in range(0, 8, width):
            if width == 8:
                simd.qk_rows8(q, 3 + 20 * r0, 20, kt, 5, 20, 64, scores, 16 + 48 * r0, 48, np.float32(0.125))
            elif width == 4:
                simd.qk_rows4(q, 3 + 20 * r0, 20, kt, 5, 20, 64, scores, 16 + 48 * r0, 48, np.float32(0.125))
            else:
                simd.qk_rows1(q, 3 + 20 * r0, 20, kt, 5, 20, 64, scores, 16 + 48 * r0, 48, np.float32(0.125))
        total = simd.softmax_weights(scores, 16, n)
        for r0 in range(0, 8, width):  # 13 value rows of 32 floats, 10 apart, into 8 accumulator rows
            if width == 8:
                simd.pv_rows8(scores, 16 + 48 * r0, 48, v, 7, 10, n, acc, 40 * r0, 40, 32)
            elif width == 4:
                simd.pv_rows4(scores, 16 + 48 * r0, 48, v, 7, 10, n, acc, 40 * r0, 40, 32)
            else:
                simd.pv_rows1(scores, 16 + 48 * r0, 48, v, 7, 10, n, acc, 40 * r0, 40, 32)
        return total

    rng = np.random.default_rng(3)
    q = rng.standard_normal(3 + 20 * 8).astype(np.float32)
    kt = rng.standard_normal(5 + 64 * 20).astype(np.float32)
    v = rng.standard_normal(7 + 10 * 13 + 32).astype(np.float32)
    acc0 = rng.standard_normal(320).astype(np.float32)
    n = 13
    results = []
    for width in (1, 4, 8):
        scores = np.zeros(8 * 48, dtype=np.float32)
        acc = acc0.copy()
        total = run(q, kt, scores, n, v, acc, width)
        results.append((scores, acc))
    for scores, acc in results[1:]:  # 4 or 8 rows at once: the bits of one at a time
        np.testing.assert_array_equal(results[0][0], scores)
        np.testing.assert_array_equal(results[0][1], acc)
    scores, acc = results[2]
    keys = kt[5:].reshape(64, 20)[:, :16].astype(np.float64)  # [dim, 16]
    raw = 0.125 * (q[3:67].astype(np.float64) @ keys)
    weights = np.exp(raw[:n] - raw[:n].max())
    np.testing.assert_allclose(scores[16 : 16 + n], weights, rtol=2e-6)
    assert total == pytest.approx(weights.sum(), rel=2e-6)
    values = np.stack([v[7 + 10 * j : 7 + 10 * j + 32] for j in range(n)]).astype(np.float64)
    np.testing.assert_allclose(acc[:32], acc0[:32] + scores[16 : 16 + n] @ values, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(acc[32:40], acc0[32:40])  # columns past dim untouched


def test_vector_exp_over_the_softmax_range():
    import numba as nb

    from hybridgate.workers.cpu import simd

    @nb.njit
    def weights(row):
        return simd.softmax_weights(row, 0, row.shape[0])

    x = np.concatenate([np.linspace(-87, 0, 4000), [0.0, -1e-3, -20.5]]).astype(np.float32)
    x = np.concatenate([x, np.zeros(16 - len(x) % 16, np.float32)])  # the padding is real lanes here: zeros
    row = x.copy()
    weights(row)  # max is 0, so row becomes exp(x)
    np.testing.assert_allclose(row, np.exp(x.astype(np.float64)), rtol=3e-7, atol=1e-38)


def test_silu_mul_against_numpy():
    from hybridgate.workers.cpu.model import silu_mul

    rng = np.random.default_rng(5)
    gate_up = (rng.standard_normal((3, 2 * 40)) * 6).astype(np.float32)  # 40: two vectors and a tail of 8
    out = np.empty((3, 40), dtype=np.float32)
    silu_mul(gate_up, out)
    g, u = gate_up[:, :40].astype(np.float64), gate_up[:, 40:].astype(np.float64)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=1e-6, atol=1e-7)


def test_every_kernel_has_its_own_cache_entries():
    # Numba names a function's on-disk entries by qualified name and first line, not by its flags: the
    # serial twins once shared the parallel kernels' entries, and a later start loaded one body for both.
    from hybridgate.workers.cpu.runner import KERNELS

    names = [kernel._cache._cache_file._index_name for _, kernel in KERNELS]
    assert len(set(names)) == len(names), sorted(names)
    assert all(name.split("-")[0].endswith(f".{short}") for (short, _), name in zip(KERNELS, names))
