"""The sampler specification, numpy implementation (the CPU runner and tests use it).

One spec, two implementations (this and `hybridgate.workers.gpu.sampling`),
which give the same id for the same logits, parameters, seed and token index:

1. Repetition penalty over the seen ids (prompt and generated), as in CTRL
   (Keskar et al. 2019, eq. 2) and transformers: a positive logit is divided by
   the penalty, a negative one multiplied.
2. Temperature 0: the first argmax; stop here.
3. Divide by the temperature.
4. Top-k (k > 0): drop logits below the k-th largest (ties at it stay).
5. Top-p (p < 1), nucleus sampling (Holtzman et al. 2020): sort descending,
   stable, and keep a token while the mass before it is < p of the total;
   the first token always stays.
6. Gumbel-max: argmax(logit + g), g = -log(-log(u)) with u from a
   counter-based hash keyed by (seed, token index, vocab id), so a sequence's
   noise depends on nothing but its seed and position. Arithmetic is float64.

The hash is Chris Wellons' `lowbias32` integer mixer, whose multipliers are
below 2**31, so both implementations compute it exactly in int64.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from hybridgate.wire import SamplingParams

_M32 = 0xFFFFFFFF


def mix32(x: int) -> int:
    """lowbias32 on a Python int in [0, 2**32)."""
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & _M32
    x ^= x >> 15
    x = (x * 0x735A2D97) & _M32
    x ^= x >> 15
    return x


def mix32_array(x: np.ndarray) -> np.ndarray:
    """lowbias32 elementwise on an int64 array of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def sampler_key(seed: int, token_index: int) -> int:
    """The 32-bit noise key of one sampling step: seed (uint64) and token index (>= 0)."""
    k = mix32((token_index & _M32) ^ 0x9E3779B9)
    k = mix32(k ^ (seed & _M32))
    return mix32(k ^ ((seed >> 32) & _M32))


@lru_cache(maxsize=4)
def vocab_hash(vocab_size: int) -> np.ndarray:
    """mix32 of each vocab id: int64 `[vocab_size]`."""
    return mix32_array(np.arange(vocab_size, dtype=np.int64))


def gumbel_noise(seed: int, token_index: int, vocab_size: int) -> np.ndarray:
    """Standard Gumbel noise, float64 `[vocab_size]`."""
    h = mix32_array(vocab_hash(vocab_size) ^ sampler_key(seed, token_index))
    u = (h.astype(np.float64) + 0.5) / 2.0**32
    return -np.log(-np.log(u))


def apply_repetition_penalty(x: np.ndarray, seen: Sequence[int], penalty: float) -> np.ndarray:
    """Penalise seen ids in a float64 row `[vocab]` (in place; returned)."""
    if penalty != 1.0 and len(seen):
        ids = np.unique(np.asarray(seen, dtype=np.int64))
        v = x[ids]
        x[ids] = np.where(v > 0, v / penalty, v * penalty)
    return x


def _top_k_top_p(x: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    if top_k > 0 and top_k < x.shape[0] or top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        ranked = x[order]
        if 0 < top_k < x.shape[0]:
            x = np.where(x < ranked[top_k - 1], -np.inf, x)
            ranked = np.where(ranked < ranked[top_k - 1], -np.inf, ranked)
        if top_p < 1.0:
            e = np.exp(ranked - ranked[0])
            cum = np.cumsum(e)
            keep_ranked = (cum - e) < top_p * cum[-1]
            keep = np.empty_like(keep_ranked)
            keep[order] = keep_ranked
            x = np.where(keep, x, -np.inf)
    return x


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, token_index: int, seen: Sequence[int]) -> int:
    """One id from one row of logits `[vocab]` (any float dtype)."""
    x = apply_repetition_penalty(np.array(logits, dtype=np.float64), seen, params.repetition_penalty)
    if params.temperature == 0.0:
        return int(np.argmax(x))
    x = _top_k_top_p(x / params.temperature, params.top_k, params.top_p)
    return int(np.argmax(x + gumbel_noise(seed, token_index, x.shape[0])))


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    token_indices: Sequence[int],
    seen: Sequence[Sequence[int]],
) -> np.ndarray:
    """Next ids for a batch: logits `[batch, vocab]` → int64 `[batch]`.

    `seeds[i]` (uint64) and `token_indices[i]` (index of the token being sampled
    among the sequence's generated tokens, from 0) key row i's noise.
    """
    return np.array(
        [sample_row(logits[i], params[i], seeds[i], token_indices[i], seen[i]) for i in range(logits.shape[0])],
        dtype=np.int64,
    )
