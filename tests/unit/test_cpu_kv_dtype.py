"""The CPU worker's 16-bit KV caches (--kv-cache-dtype fp16|bf16): values stored by the write kernels
against numpy's rounding, and attention over them against numpy on the same rounded K and V."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import bf16_bits, bf16_rounded
from hybridgate.workers.cpu import model as cpu_model
from hybridgate.workers.cpu.kvdtype import KV_DTYPES, kv_dtype

KV_HEADS, HEADS, DIM, BS = 2, 4, 32, 16

NO_SINKS = np.empty(0, np.float32)  # attention without sinks


def rounded(x: np.ndarray, name: str) -> np.ndarray:
    """x rounded to `name`'s precision, as float32, by numpy alone."""
    if name == "fp16":
        with np.errstate(over="ignore"):  # past 65504: infinity, as IEEE 754 rounds
            return x.astype(np.float16).astype(np.float32)
    if name == "bf16":
        return bf16_rounded(x)
    return x.astype(np.float32)


def stored_bits(x: np.ndarray, name: str) -> np.ndarray:
    if name == "fp16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.int16)
    return bf16_bits(x)


def awkward_values(rng, shape, specials: bool = True) -> np.ndarray:
    """Normals at several scales, with ties, subnormals and overflow planted (and, with
    `specials`, signed zeros and infinities)."""
    x = (rng.standard_normal(shape) * 10.0 ** rng.integers(-9, 6, shape)).astype(np.float32)
    planted = [1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11),  # binary16 ties
               np.uint32(0x3F808000).view(np.float32), np.uint32(0x3F818000).view(np.float32),  # bf16 ties
               6e-8, -3e-6, 2.0**-24, 2.0**-25, 1e-30,  # binary16 subnormals, underflow
               65504.0, 65519.0, 65520.0, -1e6, 3.0e38]  # binary16's largest, its overflow
    planted = np.array(planted + ([0.0, -0.0, np.inf, -np.inf] if specials else []), dtype=np.float32)
    flat = x.reshape(-1)
    flat[: planted.size] = planted
    return x


def cache(name: str, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    store = KV_DTYPES[name].storage
    return np.zeros((blocks, KV_HEADS, DIM, BS), store), np.zeros((blocks * BS, KV_HEADS, DIM), store)


def as_rows(k_blocks, v_cache, table, n):
    """The cache's raw elements of a sequence, `[n, kv_heads, dim]` each (keys untransposed)."""
    k = k_blocks[table].transpose(0, 3, 1, 2).reshape(-1, KV_HEADS, DIM)[:n]
    v = v_cache.reshape(-1, BS, KV_HEADS, DIM)[table].reshape(-1, KV_HEADS, DIM)[:n]
    return k, v


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_import_stores_numpys_rounding_and_reads_back_exactly(name):
    rng = np.random.default_rng(1)
    n = 37
    k, v = awkward_values(rng, (n, KV_HEADS, DIM)), awkward_values(rng, (n, KV_HEADS, DIM))[::-1].copy()
    table = np.array([3, 0, 2], np.int64)
    k_blocks, v_cache = cache(name, 4)
    cpu_model.import_kv_layer(k, v, table, k_blocks, v_cache)
    got_k, got_v = as_rows(k_blocks, v_cache, table, n)
    np.testing.assert_array_equal(got_k, stored_bits(k, name))
    np.testing.assert_array_equal(got_v, stored_bits(v, name))
    widen = KV_DTYPES[name].widen
    np.testing.assert_array_equal(widen(got_k), rounded(k, name))
    np.testing.assert_array_equal(widen(got_v), rounded(v, name))


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_rope_and_store_rounds_k_and_v_as_numpy_does(name):
    rng = np.random.default_rng(2)
    tokens = 5
    qkv = rng.standard_normal((tokens, HEADS + 2 * KV_HEADS, DIM)).astype(np.float32)
    # RoPE at angle 0 computes k·1 - k'·0: exact for finite, nonzero keys (the values are copied as they are).
    qkv[:, HEADS : HEADS + 2] = awkward_values(rng, (tokens, 2, DIM), specials=False)
    qkv[:, HEADS + 2 :] = awkward_values(rng, (tokens, 2, DIM))
    cos, sin = np.ones((8, DIM // 2), np.float32), np.zeros((8, DIM // 2), np.float32)
    slots = np.array([17, 18, 3, 40, 41], np.int64)
    k_blocks, v_cache = cache(name, 3)
    q = np.empty((tokens, HEADS, DIM), np.float32)
    cpu_model.rope_and_store(qkv, np.arange(tokens, dtype=np.int64), cos, sin, 2, 1, slots, k_blocks, v_cache, q)
    np.testing.assert_array_equal(q, qkv[:, :HEADS])  # queries stay float32
    for t, slot in enumerate(slots):
        np.testing.assert_array_equal(k_blocks[slot // BS, :, :, slot % BS], stored_bits(qkv[t, HEADS:HEADS + 2], name))
        np.testing.assert_array_equal(v_cache[slot], stored_bits(qkv[t, HEADS + 2:], name))


def attention_reference(q, k, v, contexts) -> np.ndarray:
    """float64 numpy GQA: token t attends over rows contexts[t] of its sequence's k, v."""
    out = np.empty(q.shape, np.float64)
    group = HEADS // KV_HEADS
    for t, (seq, length) in enumerate(contexts):
        for h in range(HEADS):
            keys, values = k[seq][:length, h // group].astype(np.float64), v[seq][:length, h // group]
            s = keys @ q[t, h].astype(np.float64) / math.sqrt(DIM)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ values.astype(np.float64)
    return out


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_attention_over_a_16_bit_cache_is_attention_over_the_rounded_kv(name):
    rng = np.random.default_rng(3)
    # Sequence 0: 45 cached tokens, one decode token; sequence 1: a 6-token prefill after 11 cached
    # (4-row tiles of queries and values); its blocks interleave with sequence 0's.
    lengths, tables = [46, 17], [np.array([4, 0, 2], np.int64), np.array([1, 3], np.int64)]
    k = [rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32) * 2 for n in lengths]
    v = [rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32) for n in lengths]
    q = rng.standard_normal((7, HEADS, DIM)).astype(np.float32)
    contexts = [(0, 46)] + [(1, 12 + i) for i in range(6)]
    slots = [np.array([tables[s][j // BS] * BS + j % BS for j in range(lengths[s])]) for s in range(2)]
    ctx_slots = np.concatenate(slots).astype(np.int64)
    ctx_offset = np.array([0] + [lengths[0]] * 6, np.int64)
    ctx_len = np.array([n for _, n in contexts], np.int64)
    tiles = np.array([0, 1, 7], np.int64)

    def attend(cache_name, ks, vs):
        k_blocks, v_cache = cache(cache_name, 5)
        for s in range(2):
            cpu_model.import_kv_layer(ks[s], vs[s], tables[s], k_blocks, v_cache)
        out = np.empty_like(q)
        cpu_model.paged_attention(q, k_blocks, v_cache, ctx_offset, np.zeros_like(ctx_len), ctx_len, ctx_slots, tiles,
                                  np.float32(1 / math.sqrt(DIM)), np.float32(0), NO_SINKS, out)
        return out

    got = attend(name, k, v)
    k_r, v_r = [rounded(x, name) for x in k], [rounded(x, name) for x in v]
    np.testing.assert_allclose(got, attention_reference(q, k_r, v_r, contexts), rtol=1e-5, atol=1e-6)
    # Widening is exact and the arithmetic the same: the fp32 cache holding the rounded KV gives the same bits.
    np.testing.assert_array_equal(got, attend("fp32", k_r, v_r))
    assert not np.array_equal(got, attend("fp32", k, v))  # and the rounding did change something


def test_bad_kv_cache_dtype_names_the_flag():
    assert kv_dtype("bf16").wire == "bfloat16"
    with pytest.raises(ValueError, match="--kv-cache-dtype.*fp32, fp16, bf16.*'int8'"):
        kv_dtype("int8")
