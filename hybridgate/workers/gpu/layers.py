"""The torch runner's building blocks: RMSNorm, RoPE in both layouts, gated-FFN activations, attention.

Each is chosen once per model from its architecture row (`ROTATIONS`,
`ACTIVATIONS`) or given the row's numbers (scale, softcap, window); nothing
here knows a family's name.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridgate.models import Activation, RopeLayout
from hybridgate.models.architectures import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) over the last dim, computed in float32 as transformers does.

    x `[..., n]`, weight `[n]` or broadcastable to x (per-head Q/K norms: `[heads, n]`).
    """
    if x.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, same math in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (x[2i], x[2i+1]) (llama.cpp NORM): x `[tokens, heads, d]`, cos/sin `[tokens, d/2]`."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]  # [num_tokens, heads, head_dim / 2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (x[i], x[i + d/2]) (llama.cpp NEOX, HF rotate_half): shapes as `rotate_pairs`."""
    x0, x1 = x.chunk(2, dim=-1)  # [num_tokens, heads, head_dim / 2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)


ROTATIONS = {RopeLayout.PAIRS: rotate_pairs, RopeLayout.HALVES: rotate_halves}


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (transformers' `GptOssExperts._apply_gate`, ggml_swiglu_oai): g = min(gate, 7),
    u = clamp(up, -7, 7), (u + 1) · g · sigmoid(1.702 g). gate, up `[tokens, ffn]` → `[tokens, ffn]`."""
    g = gate.clamp(max=SWIGLU_OAI_LIMIT)
    return (up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1) * g * torch.sigmoid(SWIGLU_OAI_ALPHA * g)


_gelu_tanh = functools.partial(F.gelu, approximate="tanh")
# The gated FFN's product of its gate and up halves, by the row's activation: (gate, up) → `[tokens, ffn]`.
ACTIVATIONS = {
    Activation.SILU: lambda gate, up: F.silu(gate) * up,
    Activation.GELU_TANH: lambda gate, up: _gelu_tanh(gate) * up,
    Activation.SWIGLU_OAI: swiglu_oai,
}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); cap 0 leaves x as it is."""
    return cap * torch.tanh(x / cap) if cap else x


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         cap: float = 0.0, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention: q `[b, heads, n, d]`, k/v `[b, kv_heads, m, d]`, bool mask broadcastable to
    `[b, heads, n, m]` (True = attend) -> `[b, heads, n, d]`. Query head h reads KV head h // (heads / kv_heads).

    With a softcap (Gemma 2) the scores `scale * q.k` become `cap * tanh(scores / cap)` before the mask and
    the float32 softmax, as transformers' eager Gemma 2 attention and llama.cpp's `build_attn_mha` do;
    SDPA has no such hook, so that path is written out. So are attention sinks (gpt-oss): float32 `[heads]`,
    one more logit per head in every query's softmax, whose weight reads no value (transformers' eager
    `GptOss` attention appends it as a last column and drops that column after the softmax).
    """
    if not cap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap((q @ k.transpose(-1, -2)).float() * scale, cap)  # [b, heads, n, m]
    if is_causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1).to(v.dtype) @ v
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1].to(v.dtype) @ v


def window_start(past: int, window: int) -> int:
    """First of `past` earlier keys that a sliding window of `window` tokens (0: none) lets a new token see.

    A token at position p sees positions p - window + 1 .. p (llama.cpp LLAMA_SWA_TYPE_STANDARD).
    """
    return max(0, past - window + 1) if window else 0


def visible(n: int, past: int, window: int, device: torch.device) -> torch.Tensor:
    """bool `[n, past + n]`: new token i (position past + i) sees key j: causal, within `window` (0: none)."""
    i = torch.arange(n, device=device)[:, None] + past
    j = torch.arange(past + n, device=device)[None, :]
    seen = j <= i
    return seen & (i - j < window) if window else seen


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int = 0,
                scale: float | None = None, cap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of n new queries over past + n keys, optionally in a sliding window.

    q `[n, heads, head_dim]`, k and v `[past + n, kv_heads, head_dim]` → `[n, heads, head_dim]`.
    Keys no query's window reaches are dropped before the product. scale: default 1/sqrt(head_dim); cap,
    sinks: as `sdpa`.
    """
    n = q.shape[0]
    skip = window_start(past, window)
    k, v, past = k[skip:], v[skip:], past - skip
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, tokens, head_dim]
    if n == 1:  # every remaining key is in the window
        out = sdpa(qh, kh, vh, None, scale, cap, sinks=sinks)
    elif past == 0 and (not window or n <= window):
        out = sdpa(qh, kh, vh, None, scale, cap, is_causal=True, sinks=sinks)
    else:
        out = sdpa(qh, kh, vh, visible(n, past, window, q.device), scale, cap, sinks=sinks)
    return out[0].transpose(0, 1)


def layer_sinks(config, layer: int, device: torch.device) -> torch.Tensor | None:
    """float32 `[heads]` of layer `layer`'s attention sinks (`ModelConfig.attention_sinks`), or None."""
    return torch.tensor(config.attention_sinks[layer], device=device) if config.attention_sinks else None


