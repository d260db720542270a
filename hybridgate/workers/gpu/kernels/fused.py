"""The layer's element-wise work around its matmuls and attention, fused in Triton: one launch each for
residual add + RMSNorm, RoPE on Q and K, and the gated FFN's activation times up.

Each kernel reads its inputs once and writes its outputs once, computing in float32 and rounding to the
tensors' dtype where the eager torch path (`hybridgate.workers.gpu.layers`, the reference) rounds, so in
bf16 the two differ by the order of float32 operations before the same rounding (RoPE rounds once where
the eager path rounds each product, so it is nearer the exact value):

- `add_rms_norm`: RMSNorm (Zhang & Sennrich 2019) over the last dim: `w * round(x / rms(x))`, rms in
  float32 as transformers computes it, optionally after adding the sublayer's output to the residual
  stream (rounded, as `x + out` is) and, for Gemma 2/3's sandwich norms, after normalizing that output
  with its own post-norm weight first. Gemma's `(1 + w)` weights need no offset: llama.cpp's converter
  stores `w + 1` in the GGUF (`hybridgate.models.architectures`), so every family's norm is `w * x / rms`.
- `rope`: rotary position embedding (Su et al. 2021) of every Q and K head of a token in one program,
  in place; the architecture row's layout as data: adjacent pairs (x[2i], x[2i+1], llama.cpp NORM, the
  project's convention for GGUF's permuted Q/K rows) or halves (x[i], x[i + d/2], NEOX); optionally each
  head's RMSNorm first (Qwen 3 and Gemma 3's Q/K norms), as the eager path applies it before rotating.
- `act_mul`: `act(gate) * up` of the gated FFN (SwiGLU, Shazeer 2020; GeGLU with GELU's tanh
  approximation, Hendrycks & Gimpel 2016) from the one `[tokens, 2 * ffn]` gate|up product.

A program handles one token row on a GPU (`_rows_per_program`). Launches per layer: `hybridgate.workers.gpu.ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridgate.models.architectures import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

ROTATE_PAIRS, ROTATE_HALVES = 0, 1  # `LAYOUT` of `_rope`
SILU, GELU_TANH, SWIGLU_OAI = 0, 1, 2  # `ACT` of `_act_mul`


def _bf16_rne(dtype: torch.dtype) -> bool:
    """Whether the kernels round float32 to bf16 by hand: Triton's interpreter converts by truncation
    (round toward zero) where a GPU rounds to nearest even, so under the interpreter they do it in bits."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _rows_per_program(tokens: int) -> int:
    """Token rows one program handles: one on a GPU (a program per row, as norm kernels are usually
    launched); under Triton's interpreter, whose cost is per program and per operation rather than per
    element, up to 64 (the whole step of a test), which makes an interpreted forward tens of times faster."""
    return min(64, triton.next_power_of_2(max(tokens, 1))) if triton.knobs.runtime.interpret else 1


@triton.jit
def _round(x, like_ptr, BF16_RNE: tl.constexpr):
    """float32 x rounded to the dtype `like_ptr` points at (to nearest even), back in float32: what storing
    then loading gives; storing the result is exact."""
    if BF16_RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _normalize(x, w, n, eps, like_ptr, BF16_RNE: tl.constexpr):
    """`w * round(x * rsqrt(mean(x^2) + eps))` of float32 rows x `[rows, n padded]` (padding lanes 0),
    rounded to the dtype."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 1)[:, None] / n + eps)
    return _round(w * _round(x * inv, like_ptr, BF16_RNE), like_ptr, BF16_RNE)


@triton.jit
def _add_rms_norm(x_ptr, res_ptr, w_ptr, post_ptr, out_ptr, tokens, n, eps, x_stride, res_stride, out_stride,
                  HAS_RESIDUAL: tl.constexpr, HAS_POST: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  BF16_RNE: tl.constexpr):
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    ok = (row < tokens) & (cols < n)
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_POST:  # Gemma's sandwich norm: the sublayer's output is normalized before the residual add
        post = tl.load(post_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        x = _normalize(x, post, n, eps, out_ptr, BF16_RNE)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_ptr + row * res_stride + cols, mask=ok, other=0.0).to(tl.float32), out_ptr,
                   BF16_RNE)
        tl.store(res_ptr + row * res_stride + cols, x.to(res_ptr.dtype.element_ty), mask=ok)
    w = tl.load(w_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols,
             _normalize(x, w, n, eps, out_ptr, BF16_RNE).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, hidden], got shape {tuple(t.shape)}")
    return t if t.stride(-1) == 1 else t.contiguous()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 post_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, residual) of one residual-stream step, in one launch (module doc).

    x `[tokens, hidden]`: the sublayer's output (or the embeddings, with `residual` None); residual
    `[tokens, hidden]`, updated in place to `residual + (rms_norm(x, post_weight) if post_weight else x)`
    (None: the residual is x itself, returned as it is); weight and post_weight `[hidden]`. normed is a
    new `[tokens, hidden]` tensor `rms_norm(residual, weight)`, in x's dtype. Float32 inside.
    Raises ValueError on shapes that disagree.
    """
    x = _rows(x, "x")
    tokens, n = x.shape
    if weight.shape != (n,) or (post_weight is not None and post_weight.shape != (n,)):
        raise ValueError(f"norm weights must be [{n}] (the hidden size), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} must equal x's {tuple(x.shape)}")
    if residual is not None and residual.stride(-1) != 1:
        raise ValueError("residual must have a unit stride in its last dim (it is updated in place)")
    out = torch.empty_like(x)
    if tokens:
        res = x if residual is None else residual
        rows = _rows_per_program(tokens)
        _add_rms_norm[(triton.cdiv(tokens, rows),)](
            x, res, weight, weight if post_weight is None else post_weight, out, tokens, n, eps, x.stride(0),
            res.stride(0), out.stride(0), HAS_RESIDUAL=residual is not None, HAS_POST=post_weight is not None,
            ROWS=rows, BLOCK=triton.next_power_of_2(n),
            BF16_RNE=_bf16_rne(x.dtype))
    return out, (x if residual is None else residual)


@triton.jit
def _rope(x_ptr, cos_ptr, sin_ptr, w_ptr, tokens, x_stride_t, x_stride_h, cs_stride, heads, eps,
          HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
          LAYOUT: tl.constexpr, QK_NORM: tl.constexpr, BF16_RNE: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None, None]  # [ROWS, 1, 1]
    h = tl.arange(0, HEADS_PAD)[None, :, None]  # [1, HEADS_PAD, 1]
    j = tl.arange(0, HALF_PAD)[None, None, :]  # [1, 1, HALF_PAD]
    ok = (t < tokens) & (h < heads) & (j < HALF)
    if LAYOUT == 0:  # adjacent pairs (x[2j], x[2j + 1])
        i0 = 2 * j
        i1 = 2 * j + 1
    else:  # halves (x[j], x[j + d/2])
        i0 = j
        i1 = j + HALF
    row = x_ptr + t * x_stride_t + h * x_stride_h
    x0 = tl.load(row + i0, mask=ok, other=0.0).to(tl.float32)  # [ROWS, HEADS_PAD, HALF_PAD]
    x1 = tl.load(row + i1, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:  # each head's RMSNorm over its head_dim values, weights [heads, head_dim]
        inv = 1.0 / tl.sqrt((tl.sum(x0 * x0, 2) + tl.sum(x1 * x1, 2)) / HEAD_DIM + eps)[:, :, None]
        w0 = tl.load(w_ptr + h * HEAD_DIM + i0, mask=ok, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + h * HEAD_DIM + i1, mask=ok, other=0.0).to(tl.float32)
        x0 = _round(w0 * _round(x0 * inv, x_ptr, BF16_RNE), x_ptr, BF16_RNE)
        x1 = _round(w1 * _round(x1 * inv, x_ptr, BF16_RNE), x_ptr, BF16_RNE)
    at = (t < tokens) & (j < HALF)
    c = tl.load(cos_ptr + t * cs_stride + j, mask=at, other=0.0).to(tl.float32)  # [ROWS, 1, HALF_PAD]
    s = tl.load(sin_ptr + t * cs_stride + j, mask=at, other=0.0).to(tl.float32)
    tl.store(row + i0, _round(x0 * c - x1 * s, x_ptr, BF16_RNE).to(x_ptr.dtype.element_ty), mask=ok)
    tl.store(row + i1, _round(x0 * s + x1 * c, x_ptr, BF16_RNE).to(x_ptr.dtype.element_ty), mask=ok)


def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: int, norm_weight: torch.Tensor | None = None,
         eps: float = 0.0) -> torch.Tensor:
    """Rotate every Q and K head of each token in place, in one launch; returns qk.

    qk `[tokens, heads + kv_heads, head_dim]` with a unit stride in its last dim (a view into the
    fused QKV product is fine); cos, sin `[tokens, head_dim / 2]` (the angles' cosines and sines times
    the attention factor); layout `ROTATE_PAIRS` or `ROTATE_HALVES`; norm_weight `[heads + kv_heads,
    head_dim]`: each head's RMSNorm (epsilon `eps`) before the rotation, None for none.
    Raises ValueError on an odd head_dim or shapes that disagree.
    """
    tokens, heads, d = qk.shape
    if d % 2 or qk.stride(-1) != 1:
        raise ValueError(f"head_dim must be even with a unit stride, got {d} (stride {qk.stride(-1)})")
    if cos.shape != (tokens, d // 2) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos and sin must be [{tokens}, {d // 2}] alike, got {tuple(cos.shape)}, {tuple(sin.shape)}")
    if norm_weight is not None and norm_weight.shape != (heads, d):
        raise ValueError(f"the Q/K norm weights must be [{heads}, {d}], got {tuple(norm_weight.shape)}")
    if tokens:
        rows = _rows_per_program(tokens)
        _rope[(triton.cdiv(tokens, rows),)](
            qk, cos, sin, cos if norm_weight is None else norm_weight.contiguous(), tokens, qk.stride(0),
            qk.stride(1), cos.stride(0), heads, eps, HEAD_DIM=d, ROWS=rows, HEADS_PAD=triton.next_power_of_2(heads),
            HALF_PAD=triton.next_power_of_2(d // 2), LAYOUT=layout, QK_NORM=norm_weight is not None,
            BF16_RNE=_bf16_rne(qk.dtype))
    return qk


@triton.jit
def _act_mul(x_ptr, out_ptr, tokens, ffn, x_stride, out_stride, limit, alpha, ACT: tl.constexpr,
             ROWS: tl.constexpr, BLOCK: tl.constexpr, BF16_RNE: tl.constexpr):
    t = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    ok = (t < tokens) & (cols < ffn)
    gate = tl.load(x_ptr + t * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * x_stride + ffn + cols, mask=ok, other=0.0).to(tl.float32)
    if ACT == 0:  # SiLU: x * sigmoid(x)
        a = gate / (1.0 + tl.exp(-gate))
    elif ACT == 2:  # gpt-oss: g = min(gate, limit); (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g)
        g = tl.minimum(gate, limit)
        a = g / (1.0 + tl.exp(-alpha * g))
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    else:  # GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
        y = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        a = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))  # 1 + tanh(y), exp overflow giving 2
    out = _round(_round(a, out_ptr, BF16_RNE) * up, out_ptr, BF16_RNE)
    tl.store(out_ptr + t * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def act_mul(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    """`act(gate) * up` `[tokens, ffn]` of gate_up `[tokens, 2 * ffn]` (gate columns, then up), one launch;
    act `SILU`, `GELU_TANH` or `SWIGLU_OAI` (gpt-oss's clamped SwiGLU, `layers.swiglu_oai`, with its limit
    and alpha). The activation is rounded to the dtype before the product, as the eager `F.silu(gate) * up`
    rounds it. Raises ValueError on an odd width."""
    gate_up = _rows(gate_up, "gate_up")
    tokens, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must hold gate and up columns alike (an even width), got {width}")
    ffn = width // 2
    out = gate_up.new_empty(tokens, ffn)
    block = min(1024, triton.next_power_of_2(ffn))
    if tokens:
        rows = _rows_per_program(tokens)
        _act_mul[(triton.cdiv(tokens, rows), triton.cdiv(ffn, block))](
            gate_up, out, tokens, ffn, gate_up.stride(0), out.stride(0), SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA,
            ACT=act, ROWS=rows, BLOCK=block,
            BF16_RNE=_bf16_rne(out.dtype))
    return out
