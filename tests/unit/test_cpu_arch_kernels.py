"""The CPU kernels every architecture needs, against float64 numpy (and torch) references: RoPE in both
layouts with per-layer tables, the Q/K/V prologue (biases, per-head RMSNorm), GELU-tanh gating, and
attention with sliding windows, softcaps and a given scale through the paged cache."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from hybridgate.models import RopeLayout
from hybridgate.workers.cpu import model as cpu_model

HEADS, KV_HEADS, DIM, BS = 4, 2, 32, 16


def reference_table(theta, scale, factors, attn_factor, positions, dim):
    """float64 (cos, sin) `[positions, dim / 2]`: angle p · scale / (theta^(2i/d) · factor_i)."""
    i = np.arange(dim // 2)
    angles = np.asarray(positions, np.float64)[:, None] * scale / (theta ** (2 * i / dim) * factors)[None, :]
    return np.cos(angles) * attn_factor, np.sin(angles) * attn_factor


def rope_reference(x, cos, sin, layout):
    """float64 RoPE of x `[tokens, heads, dim]` at per-token cos, sin `[tokens, dim / 2]`: llama.cpp's
    adjacent pairs (GGUF llama rows), or transformers' rotate_half (x · cos + rotate_half(x) · sin)."""
    x = x.astype(np.float64)
    if layout is RopeLayout.HALVES:
        c, s = np.concatenate([cos, cos], -1)[:, None], np.concatenate([sin, sin], -1)[:, None]
        half = x.shape[-1] // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * c + rotated * s
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos[:, None] - b * sin[:, None]
    out[..., 1::2] = a * sin[:, None] + b * cos[:, None]
    return out


@pytest.mark.parametrize("layout", list(RopeLayout))
@pytest.mark.parametrize(("theta", "scale", "with_factors", "attn_factor"),
                         [(10000.0, 1.0, False, 1.0), (500000.0, 0.25, True, 1.19)])
def test_rope_and_store_in_both_layouts_with_per_layer_tables(layout, theta, scale, with_factors, attn_factor):
    rng = np.random.default_rng(1)
    factors = rng.uniform(1.0, 8.0, DIM // 2) if with_factors else np.ones(DIM // 2)
    config = SimpleNamespace(head_dim=DIM, rope_freq_factors=tuple(factors) if with_factors else (),
                             rope_attn_factor=attn_factor)
    cos, sin = cpu_model.rope_table(config, theta, scale, 300)
    ref_cos, ref_sin = reference_table(theta, scale, factors, attn_factor, np.arange(300), DIM)
    np.testing.assert_allclose(cos, ref_cos, atol=3e-5)  # float32 angles up to ~300 rad
    np.testing.assert_allclose(sin, ref_sin, atol=3e-5)
    tokens = 5
    qkv = rng.standard_normal((tokens, HEADS + 2 * KV_HEADS, DIM)).astype(np.float32)
    positions = np.array([0, 7, 64, 250, 299], np.int64)
    slots = np.array([3, 17, 18, 40, 5], np.int64)
    k_blocks = np.zeros((3, KV_HEADS, DIM, BS), np.float32)
    v_cache = np.zeros((3 * BS, KV_HEADS, DIM), np.float32)
    q = np.empty((tokens, HEADS, DIM), np.float32)
    step, stride = cpu_model.ROPE_PAIRS[layout](DIM)
    cpu_model.rope_and_store(qkv, positions, cos, sin, step, stride, slots, k_blocks, v_cache, q)
    c, s = cos[positions].astype(np.float64), sin[positions].astype(np.float64)  # the kernel's own table
    np.testing.assert_allclose(q, rope_reference(qkv[:, :HEADS], c, s, layout), rtol=1e-5, atol=1e-5)
    want_k = rope_reference(qkv[:, HEADS : HEADS + KV_HEADS], c, s, layout)
    for t, slot in enumerate(slots):
        np.testing.assert_allclose(k_blocks[slot // BS, :, :, slot % BS], want_k[t], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(v_cache[slot], qkv[t, HEADS + KV_HEADS :])


@pytest.mark.parametrize(("bias", "norms"), [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("v_norm", [False, True])
def test_qkv_prologue_adds_biases_then_norms_q_k_and_v_heads(bias, norms, v_norm):
    rng = np.random.default_rng(2)
    tokens, eps = 3, 1e-6
    qkv = rng.standard_normal((tokens, HEADS + 2 * KV_HEADS, DIM)).astype(np.float32) * 3
    b = rng.standard_normal((HEADS + 2 * KV_HEADS, DIM)).astype(np.float32) if bias else np.empty((0, DIM), np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, (2, DIM)).astype(np.float32) if norms else np.empty((2, 0), np.float32))
    vn = np.ones(DIM, np.float32) if v_norm else np.empty(0, np.float32)  # gemma4's V norm has no weight
    want = qkv.astype(np.float64) + (b if bias else 0)
    heads = ((0, HEADS, qn), (HEADS, HEADS + KV_HEADS, kn)) if norms else ()
    for lo, hi, w in heads + (((HEADS + KV_HEADS, HEADS + 2 * KV_HEADS, 1.0),) if v_norm else ()):
        part = want[:, lo:hi]
        want[:, lo:hi] = part / np.sqrt((part**2).mean(-1, keepdims=True) + eps) * w
    for kernel in (cpu_model.qkv_prologue, cpu_model.qkv_prologue_serial):
        got = qkv.copy()
        kernel(got, b, np.ascontiguousarray(qn), np.ascontiguousarray(kn), vn, HEADS, eps)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_gelu_tanh_mul_against_torch():
    import torch

    rng = np.random.default_rng(5)
    gate_up = (rng.standard_normal((3, 2 * 40)) * 4).astype(np.float32)
    g, u = torch.from_numpy(gate_up[:, :40]).double(), torch.from_numpy(gate_up[:, 40:]).double()
    want = (torch.nn.functional.gelu(g, approximate="tanh") * u).numpy()
    for kernel in (cpu_model.gelu_tanh_mul, cpu_model.gelu_tanh_mul_serial):
        out = np.empty((3, 40), np.float32)
        kernel(gate_up, out)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


NO_SINKS = np.empty(0, np.float32)
SINKS = np.array([-1.0, 0.5, 2.0, 4.0], np.float32)  # per query head; 4.0 outweighs most rows' keys


def attention_reference(q, k, v, positions, window, scale, softcap, sinks=NO_SINKS):
    """float64 GQA for one sequence: token at position p reads positions max(0, p + 1 - window) .. p; a head's
    sink logit joins its softmax's denominator (transformers' eager GptOss attention: a last column, dropped)."""
    out = np.empty(q.shape, np.float64)
    group = HEADS // KV_HEADS
    for t, p in enumerate(positions):
        lo = max(0, p + 1 - window) if window else 0
        for h in range(HEADS):
            s = k[lo : p + 1, h // group].astype(np.float64) @ q[t, h].astype(np.float64) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if sinks.size:
                s = np.append(s, np.float64(sinks[h]))
            w = np.exp(s - s.max())
            w = (w / w.sum())[: p + 1 - lo]
            out[t, h] = w @ v[lo : p + 1, h // group].astype(np.float64)
    return out


@pytest.fixture(scope="module")
def cached_sequence():
    """A 75-token sequence's K and V in five shuffled blocks of a float32 paged cache."""
    rng = np.random.default_rng(3)
    n = 75
    table = np.array([4, 0, 5, 2, 1], np.int64)
    k = rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32)
    v = rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32)
    k_blocks = np.zeros((7, KV_HEADS, DIM, BS), np.float32)
    v_cache = np.zeros((7 * BS, KV_HEADS, DIM), np.float32)
    cpu_model.import_kv_layer(k, v, table, k_blocks, v_cache)
    slots = (table[:, None] * BS + np.arange(BS)).ravel()[:n]
    q = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
    return q, k, v, k_blocks, v_cache, slots


def attend(cached, positions, tiles, window, scale, softcap, sinks=NO_SINKS):
    """paged_attention for `positions` (one sequence's queries), in runs cut at `tiles`."""
    q, _, _, k_blocks, v_cache, slots = cached
    positions = np.asarray(positions, np.int64)
    length = positions + 1
    out = np.empty((len(positions), HEADS, DIM), np.float32)
    cpu_model.paged_attention(np.ascontiguousarray(q[positions]), k_blocks, v_cache,
                              np.zeros(len(positions), np.int64), cpu_model.window_starts(length, window), length,
                              slots, np.asarray(tiles, np.int64), np.float32(scale), np.float32(softcap), sinks, out)
    return out


@pytest.mark.parametrize("sinks", [NO_SINKS, SINKS], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize(("window", "softcap", "scale"), [(0, 0.0, 1 / math.sqrt(DIM)), (21, 0.0, 0.3),
                                                         (16, 2.0, 0.5), (40, 1.5, 1 / math.sqrt(DIM))])
def test_windowed_softcapped_attention_through_the_paged_cache(cached_sequence, window, softcap, scale, sinks):
    q, k, v = cached_sequence[:3]
    # A chunked prefill of positions 50..74 in runs of 16 and 9 (the window starts mid-chunk, moving
    # across 16-slot chunk boundaries within a run), then each token alone (a decode step's run).
    positions = list(range(50, 75))
    got = attend(cached_sequence, positions, [0, 16, 25], window, scale, softcap, sinks)
    want = attention_reference(q[50:], k, v, positions, window, scale, softcap, sinks)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    if sinks.size:  # the sinks take weight: the output differs from attention without them
        assert np.abs(want - attention_reference(q[50:], k, v, positions, window, scale, softcap)).max() > 0.05
    for t, p in enumerate(positions):
        alone = attend(cached_sequence, [p], [0, 1], window, scale, softcap, sinks)
        np.testing.assert_array_equal(alone[0], got[t])  # a token's bits whatever run it is in


def test_a_window_changes_only_tokens_past_it(cached_sequence):
    q, k, v = cached_sequence[:3]
    full = attend(cached_sequence, list(range(0, 30)), [0, 16, 30], 0, 0.2, 0.0)
    windowed = attend(cached_sequence, list(range(0, 30)), [0, 16, 30], 21, 0.2, 0.0)
    np.testing.assert_array_equal(windowed[:21], full[:21])  # positions 0..20 see the whole context anyway
    assert np.abs(windowed[21:] - full[21:]).max() > 1e-3
