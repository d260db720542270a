"""The sampler specification, torch implementation (batched; same ids as the numpy one).

See `hybridgate.workers.sampling` for the spec; every step here mirrors it on a
`[batch, vocab]` float64 tensor, with per-row parameters as tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridgate.wire import SamplingParams, TokenLogprobs
from hybridgate.workers.sampling import sampler_key, vocab_hash

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 elementwise on int64 values in [0, 2**32); products stay below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def gumbel_noise(keys: torch.Tensor, vocab_ids_hash: torch.Tensor) -> torch.Tensor:
    """float64 `[batch, vocab]` from int64 keys `[batch]` and mix32 of vocab ids `[vocab]`."""
    h = mix32(vocab_ids_hash[None, :] ^ keys[:, None])
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
    """
    x = logits.to(torch.float64)
    if allowed is not None:
        x = torch.where(allowed, x, float("-inf"))
    if seen_mask is not None:
        pen = repetition_penalty[:, None]
        x = torch.where(seen_mask & (pen != 1.0), torch.where(x > 0, x / pen, x * pen), x)
    if counts is not None:
        x = x - (counts * frequency[:, None] + (counts > 0) * presence[:, None])
    greedy = x.argmax(dim=-1)
    if not any_sampled:
        return greedy
    x = x / torch.where(temperature == 0, 1.0, temperature)[:, None]
    if min_p is not None:
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log(0) = -inf: off
        x = torch.where(x < floor, float("-inf"), x)
    if k_max > 0:
        x = _top_k(x, top_k, min(k_max, x.shape[-1]))
    if any_top_p:
        x = _top_p(x, top_p)
    sampled = (x + gumbel_noise(keys, vocab_ids_hash)).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    token_indices: Sequence[int],
    seen: Sequence[Sequence[int]],
    vocab_ids_hash: torch.Tensor | None = None,
    generated: Sequence[Sequence[int]] | None = None,
    bitmask=None,
) -> torch.Tensor:
    """Same contract as `hybridgate.workers.sampling.sample`, on `logits.device`.

    `vocab_ids_hash`: `vocab_hash(vocab)` already on the device (saves a copy per step).
    """
    openai = generated is not None and any(p.presence_penalty or p.frequency_penalty for p in params)
    dev, batch, vocab = logits.device, logits.shape[0], logits.shape[1]
    f64 = lambda vals: torch.tensor(vals, dtype=torch.float64, device=dev)  # noqa: E731
    seen_mask = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=dev)
        for i, ids in enumerate(seen):
            if len(ids):
                seen_mask[i, torch.as_tensor(list(ids), dtype=torch.int64, device=dev)] = True
    counts = None
    if openai:
        counts = torch.zeros(batch, vocab, dtype=torch.float64, device=dev)
        for i, ids in enumerate(generated):
            if len(ids):
                index = torch.as_tensor(list(ids), dtype=torch.int64, device=dev)
                counts[i].index_add_(0, index, torch.ones(len(index), dtype=torch.float64, device=dev))
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
