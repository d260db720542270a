"""The decoder forward pass on the CPU: Numba kernels over GGUF blocks, a paged host KV cache.

One forward for every family of `hybridgate.models.architectures`: the model's row and
`ModelConfig` say which tensors exist (fused or separate Q/K/V and gate/up, biases, per-head
Q/K norms, norms after the sublayers), the RoPE layout and per-layer tables, each layer's
sliding window, the attention scale and softcaps, the embedding scale and the gated
activation; nothing here tests a family's name. Same math as `hybridgate.workers.gpu.model`,
in float32 (the KV cache may hold fp16 or bf16, widened to float32 as attention reads it).
Each step reads every weight matrix once for all its tokens (Q, K, V fused into one matrix,
gate and up into another), so kernel calls per step do not grow with the batch:
`kernel_calls` counts them. Sources: llama.cpp src/models/{llama,qwen2,qwen3,gemma2,gemma3,phi3}.cpp
(the order of norms, biases, RoPE and softcaps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from hybridgate.models import GGUFModel, ModelConfig, RopeLayout  # noqa: E402
from hybridgate.workers.cpu.attention import (  # noqa: E402, F401 (QUERY_TILE: part of this module's surface)
    QUERY_TILE,
    paged_attention,
    token_contexts,
    window_starts,
)
from hybridgate.workers.cpu.layers import (  # noqa: E402, F401 (the kernels, for the runner's warm-up list)
    GATED_ACTIVATIONS,
    SERIAL_TOKENS,
    gelu_tanh_mul,
    gelu_tanh_mul_serial,
    qkv_prologue,
    qkv_prologue_serial,
    rms_norm,
    rms_norm_serial,
    rope_and_store,
    rope_and_store_serial,
    silu_mul,
    silu_mul_serial,
)
from hybridgate.workers.cpu.fused import tensor_matrix  # noqa: E402
from hybridgate.workers.cpu.moe import CpuExperts, experts_ffn, load_experts  # noqa: E402
from hybridgate.workers.cpu.simd import kv_encode  # noqa: E402
from hybridgate.workers.step_inputs import StepInputs  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)

# (step, stride) of `rope_and_store` per layout, from the head size: pair i is (x[i·step], x[i·step + stride]).
ROPE_PAIRS = {RopeLayout.PAIRS: lambda dim: (2, 1), RopeLayout.HALVES: lambda dim: (1, dim // 2)}


@nb.njit(parallel=True, **_JIT)
def import_kv_layer(k, v, table, k_blocks, v_cache):
    """One layer of a KV hand-off into the paged cache: k, v float32 `[tokens, kv_heads, dim]`
    (token t in slot t of the sequence); table int64 `[blocks]`, the sequence's block table;
    k_blocks `[blocks, kv_heads, dim, block]` (keys transposed within a block), v_cache
    `[slots, kv_heads, dim]`, of the cache's element type (`kvdtype`: rounded to it as they are
    stored). One job per (block, KV head); a block is 16 x dim elements, in cache."""
    kv_heads, dim, bs = k_blocks.shape[1], k_blocks.shape[2], k_blocks.shape[3]
    n = k.shape[0]
    nblk = (n + bs - 1) // bs
    for job in prange(nblk * kv_heads):
        b, g = job // kv_heads, job % kv_heads
        blk, t0 = table[b], b * bs
        count = min(bs, n - t0)
        for i in range(dim):
            for o in range(count):
                k_blocks[blk, g, i, o] = kv_encode(k[t0 + o, g, i], k_blocks)
        for o in range(count):
            for i in range(dim):
                v_cache[blk * bs + o, g, i] = kv_encode(v[t0 + o, g, i], v_cache)


def rope_table(config: ModelConfig, theta: float, scale: float, max_len: int, dim: int = 0,
               factors: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin `[max_len, d / 2]` for RoPE base `theta`, position scale `scale` and head size `dim`
    (0: `head_dim`): angle(p, i) = p · scale · theta^(-2i/d) / factor_i (Llama 3's `rope_freqs`, Phi-3's LongRoPE
    factors, Gemma 4's proportional RoPE; llama.cpp `freq_factors`, where `factors`), both times
    `rope_attn_factor`. Computed in float32 as transformers does."""
    d = dim or config.head_dim
    inv_freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv_freq = inv_freq.astype(np.float32)
    if factors and config.rope_freq_factors:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, np.float32)
    if scale != 1.0:
        inv_freq = inv_freq * np.float32(scale)
    angles = np.arange(max_len, dtype=np.float32)[:, None] * inv_freq[None, :]
    factor = np.float32(config.rope_attn_factor)
    return (np.cos(angles) * factor).astype(np.float32), (np.sin(angles) * factor).astype(np.float32)


# Steps of at most this many tokens keep their buffers for the next step of as many (`CpuModel._step_buffers`):
# decode steps, whose few microseconds of allocation a layer are worth saving; a prompt chunk's (2,048 tokens into
# a 1B model: about 280 MiB) are freed with the step.
KEEP_BUFFER_TOKENS = 64


class StepBuffers(NamedTuple):
    """float32 arrays of one step's `tokens` rows, reused by every layer: each is overwritten before it is read
    in a layer, and none of them leaves the step (the logits are their own array). Widths are the largest
    layer's; a layer takes the leading elements as its own shape (`view`)."""

    normed: np.ndarray  # [tokens, hidden]: a sublayer's normed input
    qkv: np.ndarray  # [tokens, (heads + 2 kv_heads) · head_dim]: the fused projection
    q: np.ndarray  # [tokens, heads · head_dim]: Q after RoPE
    attn: np.ndarray  # [tokens, heads · head_dim]: attention's output, `wo`'s input
    proj: np.ndarray  # [tokens, hidden]: `wo`'s and `down`'s output, added to the residual
    gate_up: np.ndarray  # [tokens, 2 ffn]
    act: np.ndarray  # [tokens, ffn]: the gated activation, `down`'s input


def view(buffer: np.ndarray, *shape: int) -> np.ndarray:
    """The leading `prod(shape)` elements of a contiguous `buffer` as a contiguous array of `shape`."""
    return buffer.reshape(-1)[: math.prod(shape)].reshape(shape)  # math.prod: np.prod costs 3 µs a call


@dataclass(frozen=True, eq=False)
class CpuLayer:
    """One block's weights as the kernels take them; an absent part is an empty array or None."""

    attn_norm: np.ndarray  # float32 [hidden]
    qkv: object  # matrix [q_dim + 2 kv_dim, hidden]: Q rows, K rows, V rows (Q only: a layer sharing K/V)
    qkv_bias: np.ndarray  # float32 [heads + 2 kv_heads, head_dim]; (0, head_dim): none
    q_norm: np.ndarray  # float32 [head_dim]; (0,): none
    k_norm: np.ndarray  # float32 [head_dim]; (0,): none
    wo: object  # matrix [hidden, q_dim]
    wo_bias: np.ndarray  # float32 [hidden] added to wo's output; (0,): none (gpt-oss has one)
    sinks: np.ndarray  # float32 [heads]: attention sink logits; (0,): none (gpt-oss)
    post_attn_norm: np.ndarray | None  # float32 [hidden] (gemma) or None
    ffn_norm: np.ndarray  # float32 [hidden]
    gate_up: object  # matrix [2 ffn, hidden]: gate rows then up rows; None: experts
    down: object  # matrix [hidden, ffn]; None: experts
    post_ffn_norm: np.ndarray | None  # float32 [hidden] (gemma) or None
    window: int  # sliding window in tokens; 0: full causal attention
    cos: np.ndarray  # float32 [max_len, head_dim / 2], shared by layers of one RoPE base and scale
    sin: np.ndarray
    experts: CpuExperts | None = None  # the FFN's router and experts (`arch.moe`); None: dense
    head_dim: int = 0  # this layer's (`ModelConfig.layer_head_dims`)
    kv_heads: int = 0
    qkv_heads: int = 0  # heads of the fused projection: Q, K and V, or Q alone where the layer shares K/V
    owns_kv: bool = True  # False: it reads the KV cache of an earlier layer (`ModelConfig.layer_kv_source`)
    ffn: int = 0  # the dense FFN's width
    v_norm: np.ndarray = field(default_factory=lambda: np.empty(0, np.float32))  # float32 [head_dim] ones: gemma4
    rope_pair: tuple[int, int] = (1, 0)  # (step, stride) of `rope_and_store` for this head size
    output_scale: float = 1.0  # the block's output times this (`layer_output_scale`)
    # (pre_ffw_norm_2, post_ffw_norm_1, post_ffw_norm_2), float32 [hidden] each: the experts' input and output
    # norms and the dense FFN's output norm where they run side by side (`MixtureOfExperts.beside_dense`)
    beside_norms: tuple | None = None

    @property
    def has_prologue(self) -> bool:
        return bool(self.qkv_bias.size or self.q_norm.size or self.k_norm.size or self.v_norm.size)

    def arrays(self) -> list:
        """The arrays and matrices held (each has `nbytes`)."""
        values = [getattr(self, f) for f in self.__dataclass_fields__ if f not in ("experts", "beside_norms")]
        values += list(self.beside_norms or ())
        return [v for v in values if hasattr(v, "nbytes")] + (self.experts.arrays() if self.experts else [])


def _vector(model: GGUFModel, name: str, shape: tuple[int, ...], present: bool) -> np.ndarray:
    """A float32 tensor (norms, biases) of `shape`, or an empty array of that rank when not `present`."""
    if not present:
        return np.empty((0,) + shape[1:], np.float32)
    return np.ascontiguousarray(model.tensors[name].dequantize(), np.float32).reshape(shape)


def load_layer(model: GGUFModel, i: int, activations: str, rope: dict) -> CpuLayer:
    """Block `i`'s weights, as its architecture row names them; `rope` maps `ModelConfig.layer_rope` keys to
    tables."""
    c, row = model.config, model.config.arch
    p, owns, moe = f"blk.{i}.", c.owns_kv(i), c.moe
    dim, kv_heads = c.layer_head_dims[i], c.layer_kv_heads[i]
    heads = c.num_heads + 2 * kv_heads if owns else c.num_heads
    bias = (np.concatenate([_vector(model, p + n + ".bias", (-1,), True) for n in c.layer_qkv[i]])
            .reshape(heads, dim) if row.qkv_bias else np.empty((0, dim), np.float32))
    post = {n: _vector(model, p + n + ".weight", (c.hidden_size,), True) if row.post_norms else None
            for n in ("post_attention_norm", "post_ffw_norm")}
    cos, sin = rope[c.layer_rope[i]]
    dense = moe is None or moe.beside_dense
    beside = None
    if moe is not None and moe.beside_dense:
        beside = tuple(_vector(model, p + n + ".weight", (c.hidden_size,), True)
                       for n in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"))
    return CpuLayer(
        attn_norm=_vector(model, p + "attn_norm.weight", (c.hidden_size,), True),
        qkv=tensor_matrix(model, [p + n + ".weight" for n in c.layer_qkv[i]], activations),
        qkv_bias=bias,
        q_norm=_vector(model, p + "attn_q_norm.weight", (dim,), row.qk_norm),
        k_norm=_vector(model, p + "attn_k_norm.weight", (dim,), row.qk_norm and owns),
        wo=tensor_matrix(model, [p + "attn_output.weight"], activations),
        wo_bias=_vector(model, p + "attn_output.bias", (c.hidden_size,), row.output_bias),
        sinks=np.asarray(c.attention_sinks[i] if c.attention_sinks else (), np.float32),
        post_attn_norm=post["post_attention_norm"],
        ffn_norm=_vector(model, p + row.ffn_norm + ".weight", (c.hidden_size,), True),
        gate_up=tensor_matrix(model, [p + n + ".weight" for n in row.gate_up_tensors], activations) if dense else None,
        down=tensor_matrix(model, [p + "ffn_down.weight"], activations) if dense else None,
        post_ffn_norm=post["post_ffw_norm"],
        window=c.layer_windows[i],
        cos=cos,
        sin=sin,
        experts=None if moe is None else load_experts(model, i, activations),
        head_dim=dim,
        kv_heads=kv_heads,
        qkv_heads=heads,
        owns_kv=owns,
        ffn=c.layer_intermediate_sizes[i],
        v_norm=np.ones(dim, np.float32) if row.v_norm and owns else np.empty(0, np.float32),
        rope_pair=ROPE_PAIRS[c.rope_layout](dim),
        output_scale=c.layer_output_scales[i],
        beside_norms=beside,
    )


class CpuModel:
    """Weights in GGUF blocks (Q4_1 and Q8_0 repacked), float32 norms, biases and RoPE tables.

    activations: the quantized matmuls' activation format (`kernel_table.FORMATS`; "auto": the table's row of each type on this path).
    Raises ValueError naming the value when the head size is not a multiple of 16 (the attention
    kernels' vector width), or a tensor's type or shape has no kernel."""

    def __init__(self, model: GGUFModel, max_model_len: int | None = None, activations: str = "auto"):
        c = self.config = model.config
        for d in sorted(set(c.layer_head_dims)):  # checked before any weight is copied (hybridgate info asks)
            if d % 16:
                raise ValueError(f"model head_dim {d}: the CPU runner needs a multiple of 16 (its vector width)")
        self.max_model_len = max_model_len or c.max_model_len
        rope = {key: rope_table(c, theta, scale, self.max_model_len, d, factors)
                for key in sorted(set(c.layer_rope)) for theta, scale, d, factors in [key]}
        self.layers = [load_layer(model, i, activations, rope) for i in range(c.num_layers)]
        self.embed = tensor_matrix(model, ["token_embd.weight"], activations)
        self.lm_head = self.embed if c.tie_word_embeddings else tensor_matrix(model, ["output.weight"], activations)
        self.out_norm = model.tensors["output_norm.weight"].dequantize()
        self.activation = GATED_ACTIVATIONS[c.arch.activation.value]
        self.kernel_calls = 0
        self._kept_buffers: StepBuffers | None = None

    @property
    def weight_bytes(self) -> int:
        """Bytes of every array and matrix the model holds, each counted once."""
        held = {id(m): m for layer in self.layers for m in layer.arrays()}
        held |= {id(m): m for m in (self.embed, self.lm_head, self.out_norm)}
        return sum(m.nbytes for m in held.values())

    @property
    def batch1_bytes(self) -> int:
        """Bytes of weights a batch-1 decode step reads: each layer's arrays but its RoPE tables (one row
        of them), of a mixture of experts the router and the `k` experts one token chooses
        (`CpuExperts.batch1_bytes`), the final norm and the LM head; the token embedding only where it is
        the LM head (one row of it otherwise)."""
        skip = {id(m) for layer in self.layers for m in [layer.cos, layer.sin, *(layer.experts.arrays()
                                                                                if layer.experts else [])]}
        held = {id(m): m.nbytes for layer in self.layers for m in layer.arrays() if id(m) not in skip}
        held |= {id(m): m.nbytes for m in (self.lm_head, self.out_norm)}
        return sum(held.values()) + sum(layer.experts.batch1_bytes for layer in self.layers if layer.experts)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        if hasattr(self.embed, "rows"):
            rows = self.embed.rows(ids)
        else:
            rows = np.stack([self.embed.row(int(i)) for i in ids])
        if self.config.embedding_scale != 1.0:
            rows *= np.float32(self.config.embedding_scale)
        return rows

    def _step_buffers(self, tokens: int) -> StepBuffers:
        """The arrays a step of `tokens` tokens reuses in every layer; the last ones kept for the next step of
        as many tokens (decode steps repeat their batch) when no larger than `KEEP_BUFFER_TOKENS`."""
        kept = self._kept_buffers
        if kept is not None and kept.normed.shape[0] == tokens:
            return kept
        c = self.config
        qkv_width = max((c.num_heads + 2 * layer.kv_heads) * layer.head_dim for layer in self.layers)
        q_width = c.num_heads * max(c.layer_head_dims)
        # the largest layer's (the file's shapes are checked at load); experts size their own per expert
        ffn = max(layer.ffn if layer.gate_up is not None else 0 for layer in self.layers)
        new = StepBuffers(*(np.empty((tokens, width), np.float32) for width in (
            c.hidden_size, qkv_width, q_width, q_width, c.hidden_size, 2 * ffn, ffn)))
        self._kept_buffers = new if tokens <= KEEP_BUFFER_TOKENS else None
        return new

    def forward(self, h: StepInputs, k_cache: list[np.ndarray], v_cache: list[np.ndarray]) -> np.ndarray:
        """Logits float32 `[entries, vocab]` at each entry's last new token; K/V written to their slots.

        k_cache: per layer `[blocks, kv_heads, head_dim, block_size]`; v_cache: per layer
        `[slots, kv_heads, head_dim]`; of one element type (`kvdtype`; see `attention.paged_attention`)."""
        return self.logits(self.hidden_states(h, k_cache, v_cache), h.last)

    def forward_pooled(self, h: StepInputs, k_cache: list[np.ndarray], v_cache: list[np.ndarray],
                       pool_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`forward`'s logits, and the hidden states after the final norm at rows `pool_rows` (int64 `[k]`):
        float32 `[k, hidden]`, what embedding requests pool (`hybridgate.workers.pooling`)."""
        x = self.hidden_states(h, k_cache, v_cache)
        return self.logits(x, h.last), self.final_norm(x, pool_rows)

    def final_norm(self, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """float32 `[len(rows), hidden]`: the final RMSNorm of rows `rows` of the residual stream `x`."""
        picked = np.ascontiguousarray(x[rows])
        out = np.empty_like(picked)
        (rms_norm_serial if picked.shape[0] <= SERIAL_TOKENS else rms_norm)(
            picked, self.out_norm, self.config.rms_norm_eps, out)
        return out

    def logits(self, x: np.ndarray, last: np.ndarray) -> np.ndarray:
        """float32 `[len(last), vocab]`: the final norm and LM head at rows `last` of `x`."""
        c = self.config
        logits = self.lm_head.matmul(self.final_norm(x, last))
        self.kernel_calls += 2
        if c.final_softcap:  # Gemma 2: cap · tanh(logits / cap)
            cap = np.float32(c.final_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

    def hidden_states(self, h: StepInputs, k_cache: list[np.ndarray], v_cache: list[np.ndarray]) -> np.ndarray:
        """float32 `[tokens, hidden]`: the residual stream after the last layer, before the final norm; K/V
        written to their slots (caches as in `forward`)."""
        c = self.config
        offset, length, slots, tiles = token_contexts(h)
        starts = {w: window_starts(length, w) for w in {layer.window for layer in self.layers}}
        x = self.embed_rows(h.ids)  # [tokens, hidden]
        buf = self._step_buffers(x.shape[0])
        serial = x.shape[0] <= SERIAL_TOKENS
        norm, prompt = (rms_norm_serial if serial else rms_norm), h.prompt_rows
        self.kernel_calls = 0
        for i, layer in enumerate(self.layers):
            norm(x, layer.attn_norm, c.rms_norm_eps, buf.normed)
            attn = self._attention(layer, buf, h, k_cache[i], v_cache[i], serial,
                                   (offset, starts[layer.window], length, slots, tiles))
            proj = layer.wo.matmul_prompt(attn, prompt, buf.proj)
            if layer.wo_bias.size:
                proj += layer.wo_bias
            self._residual(x, proj, layer.post_attn_norm, serial)
            norm(x, layer.ffn_norm, c.rms_norm_eps, buf.normed)
            self._residual(x, self._ffn(layer, buf, prompt, serial, x, h.expert_prompt_rows), layer.post_ffn_norm,
                           serial)
            if layer.output_scale != 1.0:
                x *= np.float32(layer.output_scale)
            self.kernel_calls += 3
        return x

    def _attention(self, layer: CpuLayer, buf: StepBuffers, h: StepInputs, k_cache: np.ndarray,
                   v_cache: np.ndarray, serial: bool, contexts: tuple) -> np.ndarray:
        """The attention sublayer's input to `wo`, from the normed input in `buf.normed`: float32
        `[tokens, heads · head_dim]` (a view of `buf.attn`); K/V stored, unless the layer reads another
        layer's (k_cache and v_cache are then that layer's: `layer.kv_source`)."""
        c, d = self.config, layer.head_dim
        tokens = buf.normed.shape[0]
        owns = layer.owns_kv
        qkv = layer.qkv.matmul_prompt(buf.normed, h.prompt_rows, view(buf.qkv, tokens, layer.qkv_heads * d)).reshape(
            tokens, layer.qkv_heads, d)
        if layer.has_prologue:
            (qkv_prologue_serial if serial else qkv_prologue)(qkv, layer.qkv_bias, layer.q_norm, layer.k_norm,
                                                               layer.v_norm, c.num_heads, c.rms_norm_eps)
            self.kernel_calls += 1
        # a layer without K/V of its own rotates Q alone: caches of no KV head take no keys
        k_store = k_cache if owns else np.empty((1, 0, d, k_cache.shape[3]), k_cache.dtype)
        v_store = v_cache if owns else np.empty((k_cache.shape[3], 0, d), v_cache.dtype)
        q, attn = view(buf.q, tokens, c.num_heads, d), view(buf.attn, tokens, c.num_heads, d)
        (rope_and_store_serial if serial else rope_and_store)(qkv, h.positions, layer.cos, layer.sin,
                                                              *layer.rope_pair, h.slots, k_store, v_store, q)
        offset, start, length, slots, tiles = contexts
        paged_attention(q, k_cache, v_cache, offset, start, length, slots, tiles, np.float32(c.attention_scale),
                        np.float32(c.attn_softcap), layer.sinks, attn)
        self.kernel_calls += 3
        return attn.reshape(tokens, c.num_heads * d)

    def _ffn(self, layer: CpuLayer, buf: StepBuffers, prompt: np.ndarray, serial: bool, x: np.ndarray,
             expert_prompt: np.ndarray) -> np.ndarray:
        """The FFN sublayer's output float32 `[tokens, hidden]` from the normed input in `buf.normed`: the dense
        gated FFN (in `buf.proj`), the experts the router chose (`moe.experts_ffn`), or both side by side, the
        experts and their router reading the stream `x` through their own norms (`layer.beside_norms`). prompt,
        expert_prompt: the rows on the prompt kernels in the dense FFN and in the experts (`StepInputs`)."""
        tokens, dense = buf.normed.shape[0], None
        if layer.gate_up is not None:
            gate_up = layer.gate_up.matmul_prompt(buf.normed, prompt, view(buf.gate_up, tokens, 2 * layer.ffn))
            act = view(buf.act, tokens, layer.ffn)
            self.activation[serial](gate_up, act)
            self.kernel_calls += 3
            dense = layer.down.matmul_prompt(act, prompt, buf.proj)
        if layer.experts is None:
            return dense
        experts, norms = layer.experts, layer.beside_norms
        inputs = buf.normed if norms is None else self._norm(x, norms[0], serial)
        router = self._norm(x, experts.router_scale, serial) if experts.router_scale.size else None
        out = buf.proj if dense is None else np.empty_like(buf.proj)
        self.kernel_calls += experts_ffn(inputs, experts, self.activation, out, router, expert_prompt)
        if dense is None:
            return out
        return self._norm(dense, norms[1], serial) + self._norm(out, norms[2], serial)

    def _norm(self, x: np.ndarray, weight: np.ndarray, serial: bool) -> np.ndarray:
        """A new float32 array: rms_norm(x) · weight over x's rows `[tokens, hidden]`."""
        out = np.empty_like(x)
        (rms_norm_serial if serial else rms_norm)(x, weight, self.config.rms_norm_eps, out)
        self.kernel_calls += 1
        return out

    def _residual(self, x: np.ndarray, y: np.ndarray, post_norm: np.ndarray | None, serial: bool) -> None:
        """x += y, or x += rms_norm(y) · post_norm where the architecture norms the sublayer's output."""
        x += y if post_norm is None else self._norm(y, post_norm, serial)


CpuLlama = CpuModel  # the name of the llama-only forward this replaced
