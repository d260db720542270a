"""The sampler specification, torch implementation, in two precisions.

See `hybridgate.workers.sampling` for the spec. `precision="fp64"` mirrors it
step for step on a `[batch, vocab]` float64 tensor and gives the numpy twin's
ids exactly: the torch runner on a CPU device uses it (there it is the exact
reference the tests and the numpy runner are held to). No contract between the
kinds needs more: a stream resumed after a lost worker or handed off from GPU
prefill to CPU decode continues from logits the other kind computes, so its
ids were never bit-equal across kinds.

`precision="fp32"` (the CUDA default) is the same spec in float32 without
sorting the vocabulary in the common cases: top-k and top-p take the
`CANDIDATES` largest logits (`torch.topk`), the nucleus is cut there against
the full vocabulary's mass, and only a row whose nucleus reaches past them
(a flat distribution under top-p alone) is sorted whole. The Gumbel noise is
the same hash, its top 24 bits as u = (h + 0.5) / 2^24 (exact in float32, so
u < 1 and the noise stays finite, at most 17.3). The ids follow the same
distributions; they are not bit-equal to the float64 twin's (a token at the
nucleus' edge within float32 rounding, noise rounded to float32).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridgate.wire import SamplingParams, TokenLogprobs
from hybridgate.workers.sampling import sampler_key, vocab_hash

_M32 = 0xFFFFFFFF
PRECISIONS = ("fp64", "fp32")
CANDIDATES = 1024  # fp32: the logits top-k and top-p look at before a whole-vocabulary sort


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 values in [0, 2**32); products stay below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def gumbel_noise(keys: torch.Tensor, vocab_ids_hash: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """`[batch, vocab]` standard Gumbel noise from int64 keys `[batch]` and mix32 of vocab ids `[vocab]`: float64
    from the hash's 32 bits (the spec), or float32 from its top 24 (exact in float32)."""
    h = mix32(vocab_ids_hash[None, :] ^ keys[:, None])
    if dtype == torch.float32:
        u = ((h >> 8).to(torch.float32) + 0.5) * 2.0**-24
    else:
        u = (h.to(torch.float64) + 0.5) / 2.0**32
    return -torch.log(-torch.log(u))


def allowed_of_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool `[batch, vocab_size]` from int32 token bitmasks `[batch, ceil(vocab / 32)]` (the numpy twin's
    `allowed_of_bitmask`); a row of all bits set allows every id, past the bitmask's width too."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()  # [batch, words * 32]
    if bits.shape[1] < vocab_size:
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))
    return bits[:, :vocab_size] | (bitmask == -1).all(dim=1)[:, None]


def _top_k(x: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Drop logits below each row's k-th largest (k_max >= every row's k; rows with k off keep all)."""
    vocab = x.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    kth = torch.topk(x, k_max, dim=-1, sorted=True).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
    return torch.where(k_on[:, None] & (x < kth), float("-inf"), x)


def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus: sort descending (stable), keep while the mass before a token is < p of the total."""
    ranked, order = torch.sort(x, dim=-1, descending=True, stable=True)
    e = torch.exp(ranked - ranked[:, :1])
    cum = torch.cumsum(e, dim=-1)
    keep_ranked = ((cum - e) < top_p[:, None] * cum[:, -1:]) | (top_p >= 1.0)[:, None]
    keep = torch.empty_like(keep_ranked).scatter_(1, order, keep_ranked)
    return torch.where(keep, x, float("-inf"))


def nucleus_fp32(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k_max: int,
                 any_top_p: bool) -> torch.Tensor:
    """bool `[batch, vocab]`: the ids top-k (k_max >= every row's k; 0: off) and then top-p keep of float32
    logits x, without sorting the vocabulary unless a row's nucleus reaches past the `CANDIDATES` largest
    (then that row is sorted whole, as `_top_p`). Ties at the k-th largest stay, as in the spec."""
    batch, vocab = x.shape
    keep = torch.ones_like(x, dtype=torch.bool)
    if k_max > 0:
        keep = _top_k(x, top_k, min(k_max, vocab)) > float("-inf")
    if not any_top_p:
        return keep
    k_on = ((top_k > 0) & (top_k < vocab)) if k_max > 0 else torch.zeros(batch, dtype=torch.bool, device=x.device)
    xk = torch.where(keep, x, float("-inf"))
    n = min(vocab, max(k_max, CANDIDATES))
    values, index = torch.topk(xk, n, dim=-1, sorted=True)
    top = values[:, :1]
    e = torch.exp(values - top)
    cum = torch.cumsum(e, dim=-1)
    total = torch.where(k_on, cum[:, -1], torch.exp(xk - top).sum(dim=-1))  # a top-k row's mass is all here
    mass = top_p * total
    kept = ((cum - e) < mass[:, None]) | (top_p >= 1.0)[:, None]
    nucleus = torch.zeros_like(keep).scatter_(1, index, kept)
    inside = k_on | (top_p >= 1.0) | (cum[:, -1] >= mass)  # the nucleus ends among the candidates
    keep = torch.where((inside & (top_p < 1.0))[:, None], nucleus, keep)
    outside = (~inside).nonzero()[:, 0]  # one host sync; rows here are rare (flat distributions, p near 1)
    if len(outside):
        keep[outside] = _top_p(xk[outside], top_p[outside]) > float("-inf")
    return keep


def sample_tensors(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    repetition_penalty: torch.Tensor,
    keys: torch.Tensor,
    seen_mask: torch.Tensor | None,
    vocab_ids_hash: torch.Tensor,
    *,
    any_sampled: bool = True,
    k_max: int = 0,
    any_top_p: bool = True,
    counts: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
    frequency: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
    precision: str = "fp64",
) -> torch.Tensor:
    """Next ids, int64 `[batch]`, from logits `[batch, vocab]`.

    Per-row tensors `[batch]`: temperature, top_p, repetition_penalty (float64),
    top_k and keys (int64; keys from `sampler_key`). seen_mask: bool
    `[batch, vocab]`, True where an id was seen (None: no penalty anywhere).
    counts: float64 `[batch, vocab]`, how often each id was generated, with
    presence and frequency (float64 `[batch]`): OpenAI's penalties (None: off
    everywhere). min_p: float64 `[batch]` (None: off everywhere). allowed: bool `[batch, vocab]`,
    False where a row's constraint forbids the id (`allowed_of_bitmask`; None: no row constrained).
    The keyword flags, known on the host, skip work no row needs (all greedy:
    no noise; k_max 0: no top-k; no top-p: no sort); they never change ids.
    precision: "fp64" (the spec's arithmetic: the numpy twin's ids) or "fp32" (see the module docstring);
    the float parameter tensors are converted to it.
    """
    dtype = torch.float64 if precision == "fp64" else torch.float32
    x = logits.to(dtype)
    temperature, top_p, repetition_penalty = (t.to(dtype) for t in (temperature, top_p, repetition_penalty))
    if allowed is not None:
        x = torch.where(allowed, x, float("-inf"))
    if seen_mask is not None:
        pen = repetition_penalty[:, None]
        x = torch.where(seen_mask & (pen != 1.0), torch.where(x > 0, x / pen, x * pen), x)
    if counts is not None:
        counts, frequency, presence = counts.to(dtype), frequency.to(dtype), presence.to(dtype)
        x = x - (counts * frequency[:, None] + (counts > 0) * presence[:, None])
    greedy = x.argmax(dim=-1)
    if not any_sampled:
        return greedy
    x = x / torch.where(temperature == 0, 1.0, temperature)[:, None]
    if min_p is not None:
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p.to(dtype))[:, None]  # log(0) = -inf: off
        x = torch.where(x < floor, float("-inf"), x)
    if dtype == torch.float32:
        if k_max > 0 or any_top_p:
            x = torch.where(nucleus_fp32(x, top_k, top_p, k_max, any_top_p), x, float("-inf"))
    else:
        if k_max > 0:
            x = _top_k(x, top_k, min(k_max, x.shape[-1]))
        if any_top_p:
            x = _top_p(x, top_p)
    sampled = (x + gumbel_noise(keys, vocab_ids_hash, dtype)).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


def _rows_and_ids(lists: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, id) int64 index tensors of every id of every row's list, made on the host and copied once."""
    lengths = np.fromiter((len(ids) for ids in lists), dtype=np.int64, count=len(lists))
    flat = np.fromiter((i for ids in lists for i in ids), dtype=np.int64, count=int(lengths.sum()))
    both = torch.from_numpy(np.stack([np.repeat(np.arange(len(lists), dtype=np.int64), lengths), flat]))
    both = both.to(device, non_blocking=True)
    return both[0], both[1]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    token_indices: Sequence[int],
    seen: Sequence[Sequence[int]],
    vocab_ids_hash: torch.Tensor | None = None,
    generated: Sequence[Sequence[int]] | None = None,
    bitmask=None,
    precision: str = "fp64",
) -> torch.Tensor:
    """Same contract as `hybridgate.workers.sampling.sample`, on `logits.device`.

    `vocab_ids_hash`: `vocab_hash(vocab)` already on the device (saves a copy per step). precision: one of
    PRECISIONS ("fp64": the numpy twin's ids; "fp32": see the module docstring). Raises ValueError naming
    it for another value.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"sampler precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    openai = generated is not None and any(p.presence_penalty or p.frequency_penalty for p in params)
    dev, batch, vocab = logits.device, logits.shape[0], logits.shape[1]
    f64 = lambda vals: torch.tensor(vals, dtype=torch.float64, device=dev)  # noqa: E731
    seen_mask = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=dev)
        seen_mask[_rows_and_ids(seen, dev)] = True
    counts = None
    if openai:
        counts = torch.zeros(batch, vocab, dtype=torch.float64, device=dev)
        rows, ids = _rows_and_ids(generated, dev)
        counts.index_put_((rows, ids), torch.ones(len(ids), dtype=torch.float64, device=dev), accumulate=True)
    keys = [sampler_key(s, t) for s, t in zip(seeds, token_indices)]
    any_min_p = any(p.min_p > 0 and p.temperature > 0 for p in params)
    allowed = None
    if bitmask is not None:  # int32 [batch, words], numpy (host) or a tensor
        allowed = allowed_of_bitmask(torch.as_tensor(bitmask).to(dev, non_blocking=True), vocab)
    return sample_tensors(
        logits,
        temperature=f64([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        top_p=f64([p.top_p for p in params]),
        repetition_penalty=f64([p.repetition_penalty for p in params]),
        keys=torch.tensor(keys, dtype=torch.int64, device=dev),
        seen_mask=seen_mask,
        vocab_ids_hash=vocab_ids_hash if vocab_ids_hash is not None else torch.from_numpy(vocab_hash(vocab)).to(dev),
        any_sampled=any(p.temperature > 0 for p in params),
        k_max=max((p.top_k for p in params if p.temperature > 0 and 0 < p.top_k < vocab), default=0),
        any_top_p=any(p.top_p < 1.0 and p.temperature > 0 for p in params),
        counts=counts,
        presence=f64([p.presence_penalty for p in params]) if openai else None,
        frequency=f64([p.frequency_penalty for p in params]) if openai else None,
        min_p=f64([p.min_p for p in params]) if any_min_p else None,
        allowed=allowed,
        precision=precision,
    )


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, counts: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """Same contract as `hybridgate.workers.sampling.token_logprobs`: raw logits `[batch, vocab]`, the
    sampled ids int64 `[batch]`; one device-to-host copy for the whole batch."""
    rows = [i for i, k in enumerate(counts) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(counts)
    if not rows:
        return out
    index = torch.tensor(rows, device=logits.device)
    lp = torch.log_softmax(logits[index].to(torch.float64), dim=-1)  # [rows, vocab]
    chosen = lp.gather(1, ids[index][:, None])[:, 0]
    k_max = max(counts[i] for i in rows)
    values, top = torch.topk(lp, k_max, dim=-1, sorted=True) if k_max else (lp[:, :0], ids[index][:, None][:, :0])
    # ties by the lower id, as the numpy twin: sort each row by id, then stably by value, descending
    by_id = torch.sort(top, dim=-1, stable=True)
    values = values.gather(1, by_id.indices)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    top, values = by_id.values.gather(1, order).tolist(), values.gather(1, order).tolist()
    for j, i in enumerate(rows):
        k = counts[i]
        out[i] = TokenLogprobs(float(chosen[j]), top[j][:k], values[j][:k])
    return out
