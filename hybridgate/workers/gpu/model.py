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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from hybridgate.models import GGUFModel, ModelConfig
from hybridgate.workers.gpu.layers import ACTIVATIONS, causal_sdpa, layer_sinks, rms_norm, softcap
from hybridgate.workers.gpu.moe import experts_ffn, route, shared_expert
from hybridgate.workers.gpu.ops import EagerOps, FusedOps

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
    w_gate_up: torch.Tensor | None  # [hidden, 2 * ffn]: gate columns then up columns, one GEMM; None: experts
    w_down: torch.Tensor | None  # [ffn, hidden]
    b_qkv: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim] (qwen2)
    bo: torch.Tensor | None = None  # [hidden]: the output projection's bias (gpt-oss)
    qk_norm: torch.Tensor | None = None  # [heads + kv_heads, head_dim]: each Q head's norm, then each K head's
    post_attn_norm: torch.Tensor | None = None  # [hidden] (gemma2/3)
    post_ffn_norm: torch.Tensor | None = None  # [hidden] (gemma2/3)
    router: torch.Tensor | None = None  # [hidden, experts] (`ffn_gate_inp`), float32
    router_bias: torch.Tensor | None = None  # [experts] selection bias (`exp_probs_b`), float32
    router_logit_bias: torch.Tensor | None = None  # [experts] added to the router's logits (gpt-oss), float32
    experts_gate_up_bias: torch.Tensor | None = None  # [experts, 2 * expert_ffn]: gate then up (gpt-oss)
    experts_down_bias: torch.Tensor | None = None  # [experts, hidden]
    experts_gate_up: torch.Tensor | None = None  # [experts, hidden, 2 * expert_ffn]: gate columns then up
    experts_down: torch.Tensor | None = None  # [experts, expert_ffn, hidden]
    shared_gate_up: torch.Tensor | None = None  # [hidden, 2 * shared_ffn]: the shared expert's gate then up columns
    shared_down: torch.Tensor | None = None  # [shared_ffn, hidden]
    shared_gate: torch.Tensor | None = None  # [hidden] float32: sigmoid(h · it) scales the shared expert
    v_norm: torch.Tensor | None = None  # [head_dim] ones: V's weightless RMSNorm (gemma4)
    output_scale: float = 1.0  # the block's output times this (`layer_output_scale`; folded into post_ffn_norm)
    # the dense FFN beside the experts (gemma4, `MixtureOfExperts.beside_dense`): its output norm and the
    # experts' input and output norms, each [hidden]
    post_ffn_norm_1: torch.Tensor | None = None
    pre_ffn_norm_2: torch.Tensor | None = None
    post_ffn_norm_2: torch.Tensor | None = None
    router_scale: torch.Tensor | None = None  # [hidden] float32: `ffn_gate_inp.scale` / sqrt(hidden) on rms_norm(x)
    expert_scales: torch.Tensor | None = None  # [experts] float32: each expert's output times its scale


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v `[num_tokens, kv_heads, head_dim]` and attend q `[num_tokens, heads, head_dim]` over layer
        `layer`'s cache; k and v None: attend over what that layer stored (a layer sharing its K/V)."""


class ContiguousKVCache:
    """One sequence's keys and values, per layer `[capacity, kv_heads, head_dim]` (the layer's), grown by
    doubling; a layer that shares another's K/V holds that layer's tensors (`ModelConfig.per_layer_kv`)."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype, capacity: int = 64):
        self.config = config
        make = lambda i: torch.empty((capacity, config.layer_kv_heads[i], config.layer_head_dims[i]),  # noqa: E731
                                     device=device, dtype=dtype)
        self.k, self.v = config.per_layer_kv(make), config.per_layer_kv(make)
        self.length = 0  # tokens committed by finished forward passes

    def reserve(self, tokens: int) -> None:
        capacity = self.k[0].shape[0]
        if tokens <= capacity:
            return
        while capacity < tokens:
            capacity *= 2
        grow = lambda t: torch.cat([t, t.new_empty(capacity - t.shape[0], *t.shape[1:])])  # noqa: E731
        old_k, old_v, c = self.k, self.v, self.config
        self.k, self.v = c.per_layer_kv(lambda i: grow(old_k[i])), c.per_layer_kv(lambda i: grow(old_v[i]))

    @property
    def nbytes(self) -> int:
        return sum(self.k[i].numel() * self.k[i].element_size() * 2 for i in self.config.kv_layers)


class ContiguousAttention:
    """Reference attention over per-sequence contiguous caches (packed new tokens, no padding)."""

    def __init__(self, seq_lens: Sequence[int], caches: Sequence[ContiguousKVCache]):
        self.seq_lens, self.caches = seq_lens, caches

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        out = torch.empty_like(q)  # [num_tokens, heads, head_dim]
        start = 0
        for n, cache in zip(self.seq_lens, self.caches):
            c, past, end = cache.config, cache.length, start + n
            if k is not None:  # None: a layer reading another's K/V (`layer` is that one)
                cache.k[layer][past : past + n] = k[start:end]
                cache.v[layer][past : past + n] = v[start:end]
            out[start:end] = causal_sdpa(q[start:end], cache.k[layer][: past + n], cache.v[layer][: past + n], past,
                                         c.layer_windows[layer], c.attention_scale, c.attn_softcap,
                                         layer_sinks(c, layer, q.device))
            start = end
        return out


class DecoderModel:
    """Batched forward over packed tokens; knows batches, not requests.

    Weights: dequantized once from the GGUF blocks (gguf's reference
    dequantizer) to `dtype` on `device`; which tensors, fused how, per the
    architecture row (`config.arch`). On the "meta" device nothing is
    dequantized or allocated: every check of the build runs on the tensors'
    shapes alone (`hybridgate info`'s verdict on an 8B file costs no 32 GB).
    `load` replaces the file as the source of every tensor: a GGUF tensor name ->
    its row-major tensor (`[out, in]` for matrices), made on `device` in any float
    dtype (`bench.device_weights`: random weights from a seed, nothing read).
    Norms, RoPE and the FFN activation run as torch ops (`ops.EagerOps`, the reference) or, with `fused`,
    as one Triton launch each (`ops.FusedOps`: CUDA's path; on a CPU device only under Triton's interpreter).
    """

    def __init__(self, model: GGUFModel, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 load: Callable[[str], torch.Tensor] | None = None, fused: bool = False):
        self.config = config = model.config
        self.device = device or default_device()
        self.dtype = dtype or default_dtype(self.device)
        if load is not None:
            self._load = load
        elif self.device.type == "meta":
            self._load = lambda name: torch.empty(model.tensors[name].shape, device="meta")  # noqa: E731
        else:
            self._load = lambda name: torch.from_numpy(model.tensors[name].dequantize())  # noqa: E731
        self.embed = self._put(self._load("token_embd.weight"))  # [vocab, hidden]
        self.lm_head = self.embed if config.tie_word_embeddings else self._put(self._load("output.weight"))
        self.out_norm = self._put(self._load("output_norm.weight"))
        self.layers = [self._layer(i) for i in range(config.num_layers)]
        del self._load
        self.ops = FusedOps(config) if fused else EagerOps(config)
        # One inverse-frequency table per distinct (base, position scale, head size, factors); each layer names its own.
        ropes = list(dict.fromkeys(config.layer_rope))
        self.layer_rope = tuple(ropes.index(r) for r in config.layer_rope)
        self.rope_tables = [(self._inv_freq(theta, d, factors), scale) for theta, scale, d, factors in ropes]

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, self.dtype).contiguous()

    def _layer(self, i: int) -> LayerWeights:
        c, row = self.config, self.config.arch
        w = lambda n, kind="weight": self._load(f"blk.{i}.{n}.{kind}")  # noqa: E731
        put_t = lambda t: self._put(t.t())  # noqa: E731  [out, in] -> [in, out]
        qk_norm, owns = None, c.owns_kv(i)
        if row.qk_norm:  # per-head weights laid out as the joint Q|K heads they scale
            k_norm = [w("attn_k_norm").expand(c.layer_kv_heads[i], -1)] if owns else []
            qk_norm = self._put(self._cat([w("attn_q_norm").expand(c.num_heads, -1)] + k_norm))
        dense = c.moe is None or c.moe.beside_dense
        return LayerWeights(
            attn_norm=self._put(w("attn_norm")),
            w_qkv=put_t(self._cat([w(n) for n in c.layer_qkv[i]])),
            wo=put_t(w("attn_output")),
            ffn_norm=self._put(w(row.ffn_norm)),
            w_gate_up=put_t(self._cat([w(n) for n in row.gate_up_tensors])) if dense else None,
            w_down=put_t(w("ffn_down")) if dense else None,
            b_qkv=self._put(self._cat([w(n, "bias") for n in row.qkv_tensors])) if row.qkv_bias else None,
            bo=self._put(w("attn_output", "bias")) if row.output_bias else None,
            qk_norm=qk_norm,
            post_attn_norm=self._put(w("post_attention_norm")) if row.post_norms else None,
            post_ffn_norm=self._scaled(self._put(w("post_ffw_norm")), c.layer_output_scales[i])
            if row.post_norms else None,
            v_norm=self._put(torch.ones(c.layer_head_dims[i])) if row.v_norm and owns else None,
            output_scale=c.layer_output_scales[i],
            **({} if c.moe is None else self._experts(i)),
        )

    def _scaled(self, t: torch.Tensor, scale: float) -> torch.Tensor:
        """t times `scale`; t itself at 1, and on the meta device (shapes only: meta arithmetic imports
        torch._dynamo, seconds of `hybridgate info`, see `_cat`)."""
        return t if scale == 1.0 or self.device.type == "meta" else t * scale

    def _cat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """`torch.cat(parts)` along rows. On the meta device the result's shape alone, checked as cat checks
        it: torch's meta kernel for cat is Python whose first call imports torch._dynamo (about 3 s of
        `hybridgate info`). Raises ValueError when the parts' other dimensions differ."""
        if self.device.type != "meta":
            return torch.cat(parts)
        rest = {tuple(p.shape[1:]) for p in parts}
        if len(rest) != 1:
            raise ValueError(f"cannot join tensors of shapes {[tuple(p.shape) for p in parts]} along their rows")
        return torch.empty((sum(p.shape[0] for p in parts), *rest.pop()), device="meta")

    def _experts(self, i: int) -> dict[str, torch.Tensor | None]:
        """Block `i`'s router (float32: the choice of experts is made in float32, as transformers does) and
        experts, transposed to `[experts, in, out]`."""
        c, moe = self.config, self.config.moe
        w = lambda n, kind="weight": self._load(f"blk.{i}.{n}.{kind}")  # noqa: E731
        put_t = lambda t: self._put(t.transpose(-1, -2))  # noqa: E731
        f32 = lambda t: t.to(self.device, torch.float32).contiguous()  # noqa: E731
        out = {
            "router": f32(w("ffn_gate_inp").t()),
            "router_bias": f32(w("exp_probs_b", "bias")) if moe.selection_bias else None,
            "experts_gate_up": put_t(torch.cat([w(n) for n in moe.expert_tensors], dim=1)),
            "experts_down": put_t(w("ffn_down_exps")),
        }
        if moe.biases:
            out |= {"router_logit_bias": f32(w("ffn_gate_inp", "bias")),
                    "experts_gate_up_bias": self._put(torch.cat([w(n, "bias") for n in moe.expert_tensors], dim=1)),
                    "experts_down_bias": self._put(w("ffn_down_exps", "bias"))}
        if moe.shared_expert:
            out |= {"shared_gate_up": put_t(torch.cat([w("ffn_gate_shexp"), w("ffn_up_shexp")])),
                    "shared_down": put_t(w("ffn_down_shexp")),
                    "shared_gate": f32(w("ffn_gate_inp_shexp")) if moe.shared_expert_gate else None}
        if moe.beside_dense:
            out |= {name: self._put(w(tensor)) for name, tensor in (
                ("post_ffn_norm_1", "post_ffw_norm_1"), ("pre_ffn_norm_2", "pre_ffw_norm_2"),
                ("post_ffn_norm_2", "post_ffw_norm_2"))}
        if moe.router_input_norm:
            out["router_scale"] = self._scaled(f32(w("ffn_gate_inp", "scale")), c.hidden_size ** -0.5)
        if moe.expert_scales:
            out["expert_scales"] = f32(w("ffn_down_exps", "scale"))
        return out

    def _inv_freq(self, theta: float, d: int, factors: bool) -> torch.Tensor:
        """float32 `[d / 2]`: theta^(-2i/d) as transformers computes it, over the file's frequency divisors
        where `factors` (Llama 3 `rope_freqs`, Phi-3 LongRoPE factors; llama.cpp's `freq_factors`)."""
        # On the meta device (shapes only) the table is made on the CPU: meta arithmetic runs torch's Python
        # reference kernels, whose first call imports torch._dynamo (seconds of `hybridgate info`).
        device = torch.device("cpu") if self.device.type == "meta" else self.device
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
        if factors:
            inv = inv / torch.tensor(self.config.rope_freq_factors, dtype=torch.float32, device=device)
        return inv.to(self.device)

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.out_norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        tensors += [t for layer in self.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
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
        state = self.hidden_states(token_ids, positions, attention)
        return self.logits(state, last_rows), self._final_norm(state, pool_rows).float()

    def _final_norm(self, state: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        """`[len(rows), hidden]`: the final norm at `rows` of the stream `state` (`hidden_states`)."""
        out, residual = state
        rows = rows.to(self.device, non_blocking=True)  # indexing copies: the fused norm's in-place add is local
        h, _ = self.ops.add_norm(out[rows], residual[rows], self.out_norm, self.layers[-1].post_ffn_norm)
        return h

    def logits(self, state: tuple[torch.Tensor, torch.Tensor], last_rows: torch.Tensor) -> torch.Tensor:
        """float32 `[len(last_rows), vocab]`: the final norm and LM head at rows `last_rows` of `state`."""
        return softcap(F.linear(self._final_norm(state, last_rows), self.lm_head).float(), self.config.final_softcap)

    def hidden_states(self, token_ids: torch.Tensor, positions: torch.Tensor,
                      attention: Attention) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's FFN output, the residual stream before it is added), each `[num_tokens, hidden]`
        in the model's dtype: the stream after the last layer, the final norm adds them (`_final_norm`).
        token_ids, positions: int64 `[num_tokens]`; attention stores K/V and attends."""
        c = self.config
        positions = positions.to(self.device, non_blocking=True)
        ropes = [self._rope(positions, inv, scale) for inv, scale in self.rope_tables]
        out = self.embed[token_ids.to(self.device, non_blocking=True)] * c.embedding_scale  # [num_tokens, hidden]
        residual = None  # the residual stream; each layer's output is added to it by the next norm
        for i, layer in enumerate(self.layers):
            out, residual = self._decoder_layer(i, layer, out, residual, ropes[self.layer_rope[i]], attention)
        return out, residual

    def _decoder_layer(self, i: int, layer: LayerWeights, out: torch.Tensor, residual: torch.Tensor | None,
                       rope: tuple[torch.Tensor, torch.Tensor], attention: Attention):
        """(this layer's FFN output, the residual stream before it is added), both `[num_tokens, hidden]`:
        the previous sublayer's `out` is added (through its post norm) by the norm that follows it. A layer's
        output scale multiplies the stream here and the FFN output through its post norm's folded weight."""
        c = self.config
        d, kv_heads, heads = c.layer_head_dims[i], c.layer_kv_heads[i], c.num_heads
        owns = c.owns_kv(i)
        q_dim, kv_dim = heads * d, kv_heads * d if owns else 0
        before = self.layers[i - 1].post_ffn_norm if i else None
        h, residual = self.ops.add_norm(out, residual, layer.attn_norm, before)
        qkv = h @ layer.w_qkv  # [num_tokens, q_dim + 2 * kv_dim]
        if layer.b_qkv is not None:
            qkv = qkv + layer.b_qkv
        qk = qkv[:, : q_dim + kv_dim].reshape(-1, q_dim // d + kv_dim // d, d)  # [num_tokens, heads + kv_heads, d]
        qk = self.ops.rope(qk, *rope, layer.qk_norm)
        q, k = qk[:, :heads], qk[:, heads:] if owns else None  # [num_tokens, heads | kv_heads, d]
        v = qkv[:, q_dim + kv_dim :].reshape(-1, kv_heads, d) if owns else None
        if layer.v_norm is not None:
            v = rms_norm(v, layer.v_norm, c.rms_norm_eps)
        out = attention(c.layer_kv_source[i], q, k, v).reshape(-1, q_dim) @ layer.wo
        if layer.bo is not None:
            out = out + layer.bo
        h, residual = self.ops.add_norm(out, residual, layer.ffn_norm, layer.post_attn_norm)
        out = self._ffn(layer, h, residual)
        return out, residual if layer.output_scale == 1.0 else residual * layer.output_scale

    def _ffn(self, layer: LayerWeights, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The gated FFN of normed `h` `[num_tokens, hidden]`: dense, or the chosen experts' weighted sum (their
        activation as torch ops: `ACTIVATIONS`), or both side by side, each through its own norms, the experts
        reading `residual` (the stream after attention) through theirs (`MixtureOfExperts.beside_dense`)."""
        dense = None if layer.w_gate_up is None else self.ops.act_mul(h @ layer.w_gate_up) @ layer.w_down
        if layer.router is None:
            return dense
        c, eps = self.config, self.config.rms_norm_eps
        act = ACTIVATIONS[c.arch.activation]
        x = h if layer.pre_ffn_norm_2 is None else rms_norm(residual, layer.pre_ffn_norm_2, eps)
        router_in = h.float() if layer.router_scale is None else rms_norm(residual.float(), layer.router_scale, eps)
        logits = router_in @ layer.router
        if layer.router_logit_bias is not None:
            logits = logits + layer.router_logit_bias
        weights, experts = route(logits, c.moe, c.experts_per_token, c.expert_weight_scale, layer.router_bias)
        if layer.expert_scales is not None:
            weights = weights * layer.expert_scales[experts]
        out = experts_ffn(x, weights, experts, layer.experts_gate_up, layer.experts_down, act,
                          layer.experts_gate_up_bias, layer.experts_down_bias)
        if layer.shared_gate_up is not None:
            out = out + shared_expert(x, layer.shared_gate_up, layer.shared_down, layer.shared_gate, act)
        if dense is None:
            return out
        return rms_norm(dense, layer.post_ffn_norm_1, eps) + rms_norm(out, layer.post_ffn_norm_2, eps)

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[num_tokens, head_dim / 2]` in the model's dtype, times the config's attention factor."""
        angles = (positions.float() * scale)[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2]
        f = self.config.rope_attn_factor
        return (angles.cos() * f).to(self.dtype), (angles.sin() * f).to(self.dtype)


LlamaModel = DecoderModel  # the name of its first family, kept for existing imports
