"""The Llama forward pass in PyTorch over GGUF weights dequantized once at load.

Architecture: Touvron et al. 2023 (RMSNorm, SwiGLU, RoPE, grouped-query
attention, Ainslie et al. 2023). RoPE keeps GGUF's Q/K row order and rotates
adjacent pairs (x[2i], x[2i+1]), as llama.cpp does: llama.cpp's converter
permuted the rows so that this equals Hugging Face's rotate-half RoPE on the
original weights. Keys in every KV cache are in that basis.

Attention is a strategy handed to `forward_tokens`: `ContiguousAttention`
(one growing tensor per sequence, the reference) or the paged one in
`hybridgate.workers.gpu.attention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridgate.models import GGUFModel, ModelConfig


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU, fp32 on a CPU torch device."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass
class LayerWeights:
    """Linear weights stored transposed, `[in, out]` contiguous: `x @ w` with a row-major
    right operand is 2-3x faster than `F.linear` on the CPU at decode batch sizes (MKL)."""

    attn_norm: torch.Tensor  # [hidden]
    w_qkv: torch.Tensor  # [hidden, (heads + 2 * kv_heads) * head_dim]: Q, K, V columns, one GEMM
    wo: torch.Tensor  # [heads * head_dim, hidden]
    ffn_norm: torch.Tensor  # [hidden]
    w_gate_up: torch.Tensor  # [hidden, 2 * ffn]: gate columns then up columns, one GEMM
    w_down: torch.Tensor  # [ffn, hidden]


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v `[num_tokens, kv_heads, head_dim]` and attend q `[num_tokens, heads, head_dim]`."""


class ContiguousKVCache:
    """One sequence's keys and values: `[layers, capacity, kv_heads, head_dim]`, grown by doubling."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, capacity: int = 64):
        shape = (config.num_layers, capacity, config.num_kv_heads, config.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.length = 0  # tokens committed by finished forward passes

    def reserve(self, tokens: int) -> None:
        capacity = self.k.shape[1]
        if tokens <= capacity:
            return
        while capacity < tokens:
            capacity *= 2
        grow = lambda t: torch.cat([t, t.new_empty(t.shape[0], capacity - t.shape[1], *t.shape[2:])], 1)  # noqa: E731
        self.k, self.v = grow(self.k), grow(self.v)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class ContiguousAttention:
    """Reference attention over per-sequence contiguous caches (packed new tokens, no padding)."""

    def __init__(self, seq_lens: Sequence[int], caches: Sequence[ContiguousKVCache]):
        self.seq_lens, self.caches = seq_lens, caches

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        start = 0
        for n, cache in zip(self.seq_lens, self.caches):
            past, end = cache.length, start + n
            cache.k[layer, past : past + n] = k[start:end]
            cache.v[layer, past : past + n] = v[start:end]
            out[start:end] = causal_sdpa(q[start:end], cache.k[layer, : past + n], cache.v[layer, : past + n], past)
            start = end
        return out


class LlamaModel:
    """Batched forward over packed tokens; knows batches, not requests.

    Weights: dequantized once from the GGUF blocks (gguf's reference
    dequantizer) to `dtype` on `device`.
    """

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.config = config = model.config
        self.device = device or default_device()
        self.dtype = dtype or default_dtype(self.device)
        load = lambda name: torch.from_numpy(model.tensors[name].dequantize())  # noqa: E731
        put = lambda t: t.to(self.device, self.dtype).contiguous()  # noqa: E731
        put_t = lambda t: put(t.t())  # noqa: E731  [out, in] -> [in, out]
        self.embed = put(load("token_embd.weight"))  # [vocab, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else put(load("output.weight"))
        self.out_norm = put(load("output_norm.weight"))
        self.layers = []
        for i in range(config.num_layers):
            w = lambda n: load(f"blk.{i}.{n}.weight")  # noqa: E731
            self.layers.append(LayerWeights(
                attn_norm=put(w("attn_norm")),
                w_qkv=put_t(torch.cat([w("attn_q"), w("attn_k"), w("attn_v")])),
                wo=put_t(w("attn_output")),
                ffn_norm=put(w("ffn_norm")),
                w_gate_up=put_t(torch.cat([w("ffn_gate"), w("ffn_up")])),
                w_down=put_t(w("ffn_down")),
            ))
        self.inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=self.device).float() / config.head_dim)
        )  # [head_dim / 2], float32 as transformers computes it

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.out_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        tensors += [t for layer in self.layers for t in vars(layer).values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def new_cache(self, capacity: int = 64) -> ContiguousKVCache:
        return ContiguousKVCache(self.config, self.device, self.dtype, capacity)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, seq_lens: Sequence[int], caches: Sequence[ContiguousKVCache]
    ) -> torch.Tensor:
        """Run new tokens of several sequences over contiguous caches (the reference path).

        Args:
            token_ids: int64 `[num_tokens]`, each sequence's new tokens in turn.
            seq_lens: new tokens per sequence (sum = num_tokens).
            caches: one per sequence; its `length` tokens come before the new
                ones (their positions follow on) and it grows by `seq_lens[i]`.
        Returns:
            float32 logits `[num_seqs, vocab]` at each sequence's last new token.
        Raises:
            ValueError: lengths and caches disagree, or a sequence would pass
                the model's context length.
        """
        if len(seq_lens) != len(caches) or sum(seq_lens) != token_ids.shape[0] or min(seq_lens, default=1) < 1:
            raise ValueError(f"seq_lens {list(seq_lens)} do not match {token_ids.shape[0]} tokens and {len(caches)} caches")
        for n, cache in zip(seq_lens, caches):
            if cache.length + n > self.config.max_model_len:
                raise ValueError(f"sequence of {cache.length + n} tokens exceeds max_model_len {self.config.max_model_len}")
            cache.reserve(cache.length + n)
        positions = torch.cat([torch.arange(c.length, c.length + n) for n, c in zip(seq_lens, caches)])
        last = torch.tensor(seq_lens).cumsum(0) - 1
        logits = self.forward_tokens(token_ids, positions, ContiguousAttention(seq_lens, caches), last)
        for n, cache in zip(seq_lens, caches):
            cache.length += n
        return logits

    @torch.inference_mode()
    def forward_tokens(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention, last_rows: torch.Tensor
    ) -> torch.Tensor:
        """Logits float32 `[len(last_rows), vocab]` at rows `last_rows` of the packed tokens.

        token_ids, positions: int64 `[num_tokens]`; attention stores K/V and attends.
        """
        c = self.config
        cos, sin = self._rope(positions.to(self.device, non_blocking=True))
        x = self.embed[token_ids.to(self.device, non_blocking=True)]  # [num_tokens, hidden]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = h @ layer.w_qkv  # [num_tokens, q_dim + 2 * kv_dim]
            qk = _rotate_pairs(qkv[:, : q_dim + kv_dim].reshape(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # [num_tokens, heads | kv_heads, head_dim]
            v = qkv[:, q_dim + kv_dim :].reshape(-1, c.num_kv_heads, c.head_dim)
            x = x + attention(i, q, k, v).reshape(-1, q_dim) @ layer.wo
            h = _rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
            gate, up = (h @ layer.w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer.w_down
        h = _rms_norm(x[last_rows.to(self.device, non_blocking=True)], self.out_norm, c.rms_norm_eps)
        return F.linear(h, self.lm_head).float()  # [num_seqs, vocab]

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [num_tokens, head_dim / 2]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 as transformers does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs: x `[num_tokens, heads, head_dim]`, cos/sin `[num_tokens, head_dim / 2]`."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [num_tokens, heads, head_dim / 2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of n new queries over past + n keys.

    q `[n, heads, head_dim]`, k and v `[past + n, kv_heads, head_dim]` → `[n, heads, head_dim]`.
    Query head h reads KV head h // (heads / kv_heads), as transformers' repeat_kv.
    """
    n = q.shape[0]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, tokens, head_dim]
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
    elif past == 0:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    else:
        mask = torch.ones(n, past + n, dtype=torch.bool, device=q.device).tril(diagonal=past)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)
