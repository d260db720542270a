"""The decoder forward pass in PyTorch over GGUF weights dequantized once at load.

One forward for every family of `hybridgate.models.architectures`: what differs
(biases, Q/K norms, post-sublayer norms, RoPE layout, activation, softcaps,
sliding windows, embedding scale) is read from `ModelConfig` and its row.
Architecture: Touvron et al. 2023 (RMSNorm, SwiGLU, RoPE, grouped-query
attention, Ainslie et al. 2023), with Gemma 2's additions (Gemma Team 2024:
sandwich norms, GeGLU, logit softcaps, local/global attention). RoPE keeps the
file's Q/K row order and rotates in the family's layout, as llama.cpp does
(`llama_model_rope_type`): adjacent pairs for `llama` (whose converter permuted
Q/K rows so that this equals Hugging Face's rotate-half on the original
weights), halves for the others. Keys in every KV cache are in that basis.

Attention is a strategy handed to `forward_tokens`: `ContiguousAttention`
(one growing tensor per sequence, the reference) or the paged one in
`hybridgate.workers.gpu.attention`; both read each layer's window, the scale and
the attention softcap from the config of the cache they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridgate.models import GGUFModel, ModelConfig
from hybridgate.workers.gpu.layers import ACTIVATIONS, ROTATIONS, causal_sdpa, rms_norm, softcap

__all__ = ["DecoderModel", "LlamaModel", "causal_sdpa", "default_device", "default_dtype"]


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
    b_qkv: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim] (qwen2)
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: each Q head's norm, then each K head's
    post_attn_norm: torch.Tensor | None = None  # [hidden] (gemma2/3)
    post_ffn_norm: torch.Tensor | None = None  # [hidden] (gemma2/3)


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v `[num_tokens, kv_heads, head_dim]` and attend q `[num_tokens, heads, head_dim]`."""


class ContiguousKVCache:
    """One sequence's keys and values: `[layers, capacity, kv_heads, head_dim]`, grown by doubling."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, capacity: int = 64):
        self.config = config
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
            c, past, end = cache.config, cache.length, start + n
            cache.k[layer, past : past + n] = k[start:end]
            cache.v[layer, past : past + n] = v[start:end]
            out[start:end] = causal_sdpa(q[start:end], cache.k[layer, : past + n], cache.v[layer, : past + n], past,
                                         c.layer_windows[layer], c.attention_scale, c.attn_softcap)
            start = end
        return out


class DecoderModel:
    """Batched forward over packed tokens; knows batches, not requests.

    Weights: dequantized once from the GGUF blocks (gguf's reference
    dequantizer) to `dtype` on `device`; which tensors, fused how, per the
    architecture row (`config.arch`). On the "meta" device nothing is
    dequantized or allocated: every check of the build runs on the tensors'
    shapes alone (`hybridgate info`'s verdict on an 8B file costs no 32 GB).
    """

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None):
        self.config = config = model.config
        self.device = device or default_device()
        self.dtype = dtype or default_dtype(self.device)
        if self.device.type == "meta":
            self._load = lambda name: torch.empty(model.tensors[name].shape, device="meta")  # noqa: E731
        else:
            self._load = lambda name: torch.from_numpy(model.tensors[name].dequantize())  # noqa: E731
        self.embed = self._put(self._load("token_embd.weight"))  # [vocab, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else self._put(self._load("output.weight"))
        self.out_norm = self._put(self._load("output_norm.weight"))
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        del self._load
        self._rotate = ROTATIONS[config.rope_layout]
        self._act = ACTIVATIONS[config.arch.activation]
        # One inverse-frequency table per distinct (base, position scale); each layer names its own.
        ropes = list(dict.fromkeys(zip(config.layer_rope_theta, config.layer_rope_scale)))
        self.layer_rope = tuple(ropes.index(r) for r in zip(config.layer_rope_theta, config.layer_rope_scale))
        self.rope_tables = [(self._inv_freq(theta), scale) for theta, scale in ropes]

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype).contiguous()

    def _layer(self, i: int) -> LayerWeights:
        c, row = self.config, self.config.arch
        w = lambda n, kind="weight": self._load(f"blk.{i}.{n}.{kind}")  # noqa: E731
        put_t = lambda t: self._put(t.t())  # noqa: E731  [out, in] -> [in, out]
        qk_norm = None
        if row.qk_norm:  # per-head weights laid out as the joint Q|K heads they scale
            qk_norm = self._put(torch.cat([w("attn_q_norm").expand(c.num_heads, -1),
                                           w("attn_k_norm").expand(c.num_kv_heads, -1)]))
        return LayerWeights(
            attn_norm=self._put(w("attn_norm")),
            w_qkv=put_t(torch.cat([w(n) for n in row.qkv_tensors])),
            wo=put_t(w("attn_output")),
            ffn_norm=self._put(w("ffn_norm")),
            w_gate_up=put_t(torch.cat([w(n) for n in row.gate_up_tensors])),
            w_down=put_t(w("ffn_down")),
            b_qkv=self._put(torch.cat([w(n, "bias") for n in row.qkv_tensors])) if row.qkv_bias else None,
            qk_norm=qk_norm,
            post_attn_norm=self._put(w("post_attention_norm")) if row.post_norms else None,
            post_ffn_norm=self._put(w("post_ffw_norm")) if row.post_norms else None,
        )

    def _inv_freq(self, theta: float) -> torch.Tensor:
        """float32 `[head_dim / 2]`: theta^(-2i/d) as transformers computes it, over the file's frequency
        divisors (Llama 3 `rope_freqs`, Phi-3 LongRoPE factors; llama.cpp's `freq_factors`)."""
        d = self.config.head_dim
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=self.device).float() / d))
        if self.config.rope_freq_factors:
            inv = inv / torch.tensor(self.config.rope_freq_factors, dtype=torch.float32, device=self.device)
        return inv

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.out_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        tensors += [t for layer in self.layers for t in vars(layer).values() if t is not None]
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
        return self.logits(self.hidden_states(token_ids, positions, attention), last_rows)

    @torch.inference_mode()
    def forward_pooled(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                       last_rows: torch.Tensor, pool_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_tokens`' logits, and the hidden states after the final norm at rows `pool_rows` (int64
        `[k]`): float32 `[k, hidden]`, what embedding requests pool (`hybridgate.workers.pooling`)."""
        x = self.hidden_states(token_ids, positions, attention)
        normed = rms_norm(x[pool_rows.to(self.device, non_blocking=True)], self.out_norm, self.config.rms_norm_eps)
        return self.logits(x, last_rows), normed.float()

    def logits(self, x: torch.Tensor, last_rows: torch.Tensor) -> torch.Tensor:
        """float32 `[len(last_rows), vocab]`: the final norm and LM head at rows `last_rows` of `x`."""
        c = self.config
        h = rms_norm(x[last_rows.to(self.device, non_blocking=True)], self.out_norm, c.rms_norm_eps)
        return softcap(F.linear(h, self.lm_head).float(), c.final_softcap)  # [num_seqs, vocab]

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention) -> torch.Tensor:
        """`[num_tokens, hidden]` in the model's dtype: the residual stream after the last layer, before
        the final norm. token_ids, positions: int64 `[num_tokens]`; attention stores K/V and attends."""
        c = self.config
        positions = positions.to(self.device, non_blocking=True)
        ropes = [self._rope(positions, inv, scale) for inv, scale in self.rope_tables]
        x = self.embed[token_ids.to(self.device, non_blocking=True)] * c.embedding_scale  # [num_tokens, hidden]
        q_dim, kv_dim, heads = c.q_dim, c.kv_dim, c.num_heads + c.num_kv_heads
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.attn_norm, c.rms_norm_eps)
            qkv = h @ layer.w_qkv  # [num_tokens, q_dim + 2 * kv_dim]
            if layer.b_qkv is not None:
                qkv = qkv + layer.b_qkv
            qk = qkv[:, : q_dim + kv_dim].reshape(-1, heads, c.head_dim)  # [num_tokens, heads + kv_heads, head_dim]
            if layer.qk_norm is not None:
                qk = rms_norm(qk, layer.qk_norm, c.rms_norm_eps)
            qk = self._rotate(qk, *ropes[self.layer_rope[i]])
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]  # [num_tokens, heads | kv_heads, head_dim]
            v = qkv[:, q_dim + kv_dim :].reshape(-1, c.num_kv_heads, c.head_dim)
            out = attention(i, q, k, v).reshape(-1, q_dim) @ layer.wo
            x = x + (out if layer.post_attn_norm is None else rms_norm(out, layer.post_attn_norm, c.rms_norm_eps))
            h = rms_norm(x, layer.ffn_norm, c.rms_norm_eps)
            gate, up = (h @ layer.w_gate_up).chunk(2, dim=-1)
            out = (self._act(gate) * up) @ layer.w_down
            x = x + (out if layer.post_ffn_norm is None else rms_norm(out, layer.post_ffn_norm, c.rms_norm_eps))
        return x

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[num_tokens, head_dim / 2]` in the model's dtype, times the config's attention factor."""
        angles = (positions.float() * scale)[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2]
        f = self.config.rope_attn_factor
        return (angles.cos() * f).to(self.dtype), (angles.sin() * f).to(self.dtype)


LlamaModel = DecoderModel  # the name of its first family, kept for existing imports
