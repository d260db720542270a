"""The sampler specification, torch implementation (batched; same ids as the numpy one).

See `hybridgate.workers.sampling` for the spec; every step here mirrors it on a
`[batch, vocab]` float64 tensor, with per-row parameters as tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridgate.wire import SamplingParams
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


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = x.shape[-1]
    k_on = (top_k > 0) & (top_k < vocab)
    ranked, order = torch.sort(x, dim=-1, descending=True, stable=True)
    k = torch.where(k_on, top_k, vocab)
    threshold = ranked.gather(1, (k - 1)[:, None])  # [batch, 1]
    x = torch.where(x < threshold, float("-inf"), x)
    ranked = torch.where(ranked < threshold, float("-inf"), ranked)
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
) -> torch.Tensor:
    """Next ids, int64 `[batch]`, from logits `[batch, vocab]`.

    Per-row tensors `[batch]`: temperature, top_p, repetition_penalty (float64),
    top_k and keys (int64; keys from `sampler_key`). seen_mask: bool
    `[batch, vocab]`, True where an id was seen (None: no penalty anywhere).
    """
    x = logits.to(torch.float64)
    if seen_mask is not None:
        pen = repetition_penalty[:, None]
        x = torch.where(seen_mask & (pen != 1.0), torch.where(x > 0, x / pen, x * pen), x)
    greedy = x.argmax(dim=-1)
    x = x / torch.where(temperature == 0, 1.0, temperature)[:, None]
    x = _top_k_top_p(x, top_k, top_p)
    sampled = (x + gumbel_noise(keys, vocab_ids_hash)).argmax(dim=-1)
    return torch.where(temperature == 0, greedy, sampled)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    token_indices: Sequence[int],
    seen: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Same contract as `hybridgate.workers.sampling.sample`, on `logits.device`."""
    dev, batch, vocab = logits.device, logits.shape[0], logits.shape[1]
    f64 = lambda vals: torch.tensor(vals, dtype=torch.float64, device=dev)  # noqa: E731
    seen_mask = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=dev)
        for i, ids in enumerate(seen):
            if len(ids):
                seen_mask[i, torch.as_tensor(list(ids), dtype=torch.int64, device=dev)] = True
    keys = [sampler_key(s, t) for s, t in zip(seeds, token_indices)]
    return sample_tensors(
        logits,
        temperature=f64([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
        top_p=f64([p.top_p for p in params]),
        repetition_penalty=f64([p.repetition_penalty for p in params]),
        keys=torch.tensor(keys, dtype=torch.int64, device=dev),
        seen_mask=seen_mask,
        vocab_ids_hash=torch.from_numpy(vocab_hash(vocab)).to(dev),
    )
