"""The sampler specification, numpy implementation (the CPU runner and tests use it).

One spec, two implementations (this and `hybridgate.workers.gpu.sampling`),
which give the same id for the same logits, parameters, seed and token index:

0. Constraint (a row with a token bitmask, `hybridgate.workers.constraints`):
   the logits of ids the bitmask does not allow are -inf, so no later step can
   bring them back (ids past the bitmask's width are not allowed).
1. Repetition penalty over the seen ids (prompt and generated), as in CTRL
   (Keskar et al. 2019, eq. 2) and transformers: a positive logit is divided by
   the penalty, a negative one multiplied.
2. Presence and frequency penalties over the generated ids only, as OpenAI
   defines them (API reference, "Parameter details"; vLLM does the same):
   logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, with
   c[j] the count of id j among the generated ids.
3. Temperature 0: the first argmax; stop here.
4. Divide by the temperature.
5. Min-p (p > 0; Nguyen et al. 2024, as vLLM): drop tokens whose probability
   is below min_p times the most likely one's, i.e. logit < max + log(min_p).
6. Top-k (k > 0): drop logits below the k-th largest (ties at it stay).
7. Top-p (p < 1), nucleus sampling (Holtzman et al. 2020): sort descending,
   stable, and keep a token while the mass before it is < p of the total;
   the first token always stays.
8. Gumbel-max: argmax(logit + g), g = -log(-log(u)) with u from a
   counter-based hash keyed by (seed, token index, vocab id), so a sequence's
   noise depends on nothing but its seed and position. Arithmetic is float64
   (the torch twin's `fp32` precision, the CUDA default, follows the same steps
   in float32 without a whole-vocabulary sort: see `hybridgate.workers.gpu.sampling`).

Log-probabilities (when a request asks for them, `SamplingParams.logprobs`):
the log-softmax of the model's raw logits, before any penalty and the
temperature (vLLM's default, "raw_logprobs"), of the sampled id and of the
`logprobs` most likely ids, most likely first (ties: the lower id first).

The hash is Chris Wellons' `lowbias32` integer mixer, whose multipliers are
below 2**31, so both implementations compute it exactly in int64.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from functools import lru_cache

import numpy as np

from hybridgate.wire import SamplingParams, TokenLogprobs

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


def apply_openai_penalties(x: np.ndarray, generated: Sequence[int], presence: float, frequency: float) -> np.ndarray:
    """OpenAI's presence and frequency penalties on a float64 row `[vocab]` (in place; returned)."""
    if (presence or frequency) and len(generated):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        x[ids] -= counts * frequency + presence
    return x


def _min_p(x: np.ndarray, min_p: float) -> np.ndarray:
    if min_p > 0.0:
        x = np.where(x < x.max() + math.log(min_p), -np.inf, x)
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


def allowed_of_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool `[..., vocab_size]` from token bitmasks int32 `[..., ceil(vocab / 32)]` (bit j % 32 of word
    j // 32 allows id j, llguidance's layout); ids past the bitmask's width are not allowed."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask, dtype="<i4").view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[-1] < vocab_size:
        pad = np.zeros((*bits.shape[:-1], vocab_size - bits.shape[-1]), dtype=bits.dtype)
        bits = np.concatenate([bits, pad], axis=-1)
    return bits[..., :vocab_size].astype(bool)


def sample_row(logits: np.ndarray, params: SamplingParams, seed: int, token_index: int, seen: Sequence[int],
               generated: Sequence[int] = (), bitmask: np.ndarray | None = None) -> int:
    """One id from one row of logits `[vocab]` (any float dtype); `generated`: the ids sampled so far;
    `bitmask`: the row's token bitmask, int32 `[ceil(vocab / 32)]` (None: unconstrained)."""
    x = np.array(logits, dtype=np.float64)
    if bitmask is not None:
        x = np.where(allowed_of_bitmask(bitmask, x.shape[0]), x, -np.inf)
    x = apply_repetition_penalty(x, seen, params.repetition_penalty)
    x = apply_openai_penalties(x, generated, params.presence_penalty, params.frequency_penalty)
    if params.temperature == 0.0:
        return int(np.argmax(x))
    x = _min_p(x / params.temperature, params.min_p)
    x = _top_k_top_p(x, params.top_k, params.top_p)
    return int(np.argmax(x + gumbel_noise(seed, token_index, x.shape[0])))


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    token_indices: Sequence[int],
    seen: Sequence[Sequence[int]],
    generated: Sequence[Sequence[int]] | None = None,
    bitmask: np.ndarray | None = None,
) -> np.ndarray:
    """Next ids for a batch: logits `[batch, vocab]` → int64 `[batch]`.

    `seeds[i]` (uint64) and `token_indices[i]` (index of the token being sampled
    among the sequence's generated tokens, from 0) key row i's noise. `seen[i]`:
    the ids the repetition penalty counts (prompt and generated); `generated[i]`:
    the ids the presence and frequency penalties count (None: none anywhere).
    `bitmask`: int32 `[batch, ceil(vocab / 32)]` token bitmasks (a row of all bits set is
    unconstrained; None: no row is constrained).
    """
    gen = generated if generated is not None else [()] * logits.shape[0]
    masks = [None if bitmask is None or (bitmask[i] == -1).all() else bitmask[i] for i in range(logits.shape[0])]
    return np.array(
        [sample_row(logits[i], params[i], seeds[i], token_indices[i], seen[i], gen[i], masks[i])
         for i in range(logits.shape[0])],
        dtype=np.int64,
    )


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis of `[..., vocab]` logits."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def top_ids(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The k ids of largest value in a row `[vocab]`, largest first, ties by the lower id (int64 `[k]`)."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    part = np.argpartition(-logprobs, k - 1)[:k] if k < logprobs.shape[0] else np.arange(logprobs.shape[0])
    return part[np.lexsort((part, -logprobs[part]))].astype(np.int64)


def token_logprobs(logits: np.ndarray, ids: Sequence[int], counts: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Per row of raw logits `[batch, vocab]`: the log-probability of `ids[i]` and the `counts[i]` most
    likely ids (None: the row asked for none; see the module doc)."""
    out: list[TokenLogprobs | None] = []
    for i, k in enumerate(counts):
        if k is None:
            out.append(None)
            continue
        lp = log_softmax(logits[i])
        top = top_ids(lp, k)
        out.append(TokenLogprobs(float(lp[ids[i]]), top.tolist(), lp[top].tolist()))
    return out
