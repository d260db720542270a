"""The CPU forward pass's per-token kernels: norms, the Q/K/V prologue, RoPE into the paged cache, gated FFNs.

Every kernel here is elementwise or per head within a token, so a token's
result does not depend on its batch mates. What differs between model families
(`hybridgate.models.architectures`) arrives as data: which RoPE layout (the
two indices of a rotated pair), which tables of cos and sin, whether a bias or
a per-head norm is applied (an empty array means none), which activation
(`GATED_ACTIVATIONS`).

Sources: RMSNorm (Zhang and Sennrich 2019); RoPE (Su et al. 2021) in
llama.cpp's two layouts (ggml-cpu ops.cpp `rope_f32`: NORM rotates adjacent
pairs, NEOX rotates x[i] with x[i + d/2]); GELU's tanh approximation (Hendrycks
and Gimpel 2016, ggml `ggml_gelu`, PyTorch `gelu(approximate="tanh")`); gpt-oss's clamped
SwiGLU (ggml `ggml_swiglu_oai`, transformers' `GptOssExperts._apply_gate`).
"""

from __future__ import annotations

import math
import types

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from hybridgate.models.architectures import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT  # noqa: E402
from hybridgate.workers.cpu.simd import kv_encode, silu_mul16  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))


@nb.njit(parallel=True, **_JIT)
def rms_norm(x, weight, eps, out):
    """out = x / rms(x) * weight over the last axis; x float32 `[tokens, hidden]`."""
    for t in prange(x.shape[0]):
        s = np.float32(0.0)
        for i in range(x.shape[1]):
            s += x[t, i] * x[t, i]
        inv = np.float32(1.0 / math.sqrt(s / x.shape[1] + eps))
        for i in range(x.shape[1]):
            out[t, i] = weight[i] * (x[t, i] * inv)


@nb.njit(**_JIT)
def _head_norm(qkv, t, h, weight, eps):
    """RMSNorm of one head's row qkv[t, h, :] in place, times weight `[dim]`."""
    dim = qkv.shape[2]
    s = np.float32(0.0)
    for i in range(dim):
        s += qkv[t, h, i] * qkv[t, h, i]
    inv = np.float32(1.0 / math.sqrt(s / dim + eps))
    for i in range(dim):
        qkv[t, h, i] = weight[i] * (qkv[t, h, i] * inv)


@nb.njit(parallel=True, **_JIT)
def qkv_prologue(qkv, bias, q_norm, k_norm, v_norm, heads, eps):
    """In place on the fused projection qkv float32 `[tokens, heads + 2 kv_heads, dim]`: add bias
    float32 `[heads + 2 kv_heads, dim]` (qwen2's Q, K and V biases; shape (0, dim): none), then RMSNorm
    each Q head by q_norm, each K head by k_norm and each V head by v_norm (float32 `[dim]`, qwen3 and
    gemma3's Q/K norms, gemma4's weightless V norm as ones; empty: none), as llama.cpp applies them
    before RoPE (src/models/qwen3.cpp, gemma3.cpp, gemma4.cpp)."""
    kv_heads = (qkv.shape[1] - heads) // 2
    for t in prange(qkv.shape[0]):
        if bias.shape[0]:
            for h in range(qkv.shape[1]):
                for i in range(qkv.shape[2]):
                    qkv[t, h, i] += bias[h, i]
        if q_norm.shape[0]:
            for h in range(heads):
                _head_norm(qkv, t, h, q_norm, eps)
        if k_norm.shape[0]:
            for h in range(heads, heads + kv_heads):
                _head_norm(qkv, t, h, k_norm, eps)
        if v_norm.shape[0]:
            for h in range(heads + kv_heads, heads + 2 * kv_heads):
                _head_norm(qkv, t, h, v_norm, eps)


@nb.njit(parallel=True, **_JIT)
def rope_and_store(qkv, positions, cos, sin, step, stride, slots, k_blocks, v_cache, q_out):
    """RoPE on Q and K, then Q into q_out and K, V into the cache.

    Pair i of a head is (x[a], x[a + stride]) with a = i · step: adjacent pairs (llama.cpp NORM,
    GGUF's permuted llama rows) are step 2, stride 1; halves (NEOX, rotate-half) step 1, stride dim / 2.
    Keys are stored rotated in that layout: the file's basis, which both runners and a KV hand-off share.

    qkv float32 `[tokens, heads + 2 kv_heads, dim]` (Q heads, K heads, V heads); positions, slots int64
    `[tokens]`; cos, sin float32 `[max_len, dim / 2]` (the layer's table: its base, frequency factors and
    attention factor already in it); k_blocks `[blocks, kv_heads, dim, block]` (keys transposed within a
    block), v_cache `[slots, kv_heads, dim]`, both of the cache's element type (`kvdtype`: K and V rounded
    to it as they are stored); q_out `[tokens, heads, dim]`. One pass per token.
    """
    heads, kv_heads, half = q_out.shape[1], k_blocks.shape[1], qkv.shape[2] // 2
    bs = k_blocks.shape[3]
    for t in prange(qkv.shape[0]):
        p, slot = positions[t], slots[t]
        blk, o = slot // bs, slot % bs
        for h in range(heads + kv_heads):
            for i in range(half):
                ia = i * step
                ib = ia + stride
                a, b = qkv[t, h, ia], qkv[t, h, ib]
                c, s = cos[p, i], sin[p, i]
                ra, rb = a * c - b * s, a * s + b * c
                if h < heads:
                    q_out[t, h, ia], q_out[t, h, ib] = ra, rb
                else:
                    k_blocks[blk, h - heads, ia, o] = kv_encode(ra, k_blocks)
                    k_blocks[blk, h - heads, ib, o] = kv_encode(rb, k_blocks)
        for g in range(kv_heads):
            for i in range(2 * half):
                v_cache[slot, g, i] = kv_encode(qkv[t, heads + kv_heads + g, i], v_cache)


@nb.njit(parallel=True, **_JIT)
def silu_mul(gate_up, out):
    """out = silu(gate) * up for gate_up `[tokens, 2 * ffn]` (gate columns first); 16 at a time
    (`simd.silu_mul16`), the last ffn % 16 one by one."""
    ffn = out.shape[1]
    vec = ffn // 16 * 16
    for t in prange(out.shape[0]):
        silu_mul16(gate_up, t * 2 * ffn, t * 2 * ffn + ffn, out, t * ffn, vec)
        for i in range(vec, ffn):
            g = gate_up[t, i]
            out[t, i] = g / (np.float32(1.0) + np.float32(math.exp(-g))) * gate_up[t, ffn + i]


@nb.njit(parallel=True, **_JIT)
def gelu_tanh_mul(gate_up, out):
    """out = gelu_tanh(gate) * up for gate_up float32 `[tokens, 2 * ffn]` (gate columns first), with
    gelu_tanh(g) = g/2 · (1 + tanh(√(2/π) · (g + 0.044715 g³))) (GeGLU; Gemma's FFN)."""
    ffn = out.shape[1]
    for t in prange(out.shape[0]):
        for i in range(ffn):
            g = gate_up[t, i]
            inner = _GELU_C * (g + np.float32(0.044715) * g * g * g)
            out[t, i] = np.float32(0.5) * g * (np.float32(1.0) + np.float32(math.tanh(inner))) * gate_up[t, ffn + i]


_OAI_LIMIT, _OAI_ALPHA = np.float32(SWIGLU_OAI_LIMIT), np.float32(SWIGLU_OAI_ALPHA)


@nb.njit(parallel=True, **_JIT)
def swiglu_oai_mul(gate_up, out):
    """gpt-oss's clamped SwiGLU for gate_up float32 `[tokens, 2 * ffn]` (gate columns first): g = min(gate, 7),
    u = clamp(up, -7, 7), out = (u + 1) · g · sigmoid(1.702 g)."""
    ffn = out.shape[1]
    for t in prange(out.shape[0]):
        for i in range(ffn):
            g = min(gate_up[t, i], _OAI_LIMIT)
            u = min(max(gate_up[t, ffn + i], -_OAI_LIMIT), _OAI_LIMIT)
            out[t, i] = (u + np.float32(1.0)) * g / (np.float32(1.0) + np.float32(math.exp(-_OAI_ALPHA * g)))


# Serial twins of the per-token kernels, for steps of few tokens: at batch 1 a parallel region's start
# and join cost more than the work (rms_norm 3.7 us, silu_mul 8.6 us a call on two threads, AVX2 forced,
# against about 1 us of work), and a decode step calls each once per layer. The same loop body (prange
# runs as range), compiled on its own: the batch-invariance tests hold the twins to the same bits. Attention
# has none: its fast-math reductions were vectorized differently alone and in the parallel region (1e-5
# apart in the logits on every path), so a request's logits would depend on its batch.
SERIAL_TOKENS = 2  # steps of at most this many tokens run the per-token kernels serially


def _serial_twin(kernel):
    """`kernel`'s Python function compiled without `parallel`, under its own name. Numba's on-disk cache
    names a function's entries by its qualified name and first line, not by its flags: a twin of the same
    function object shared the parallel kernel's entries, so a later process loaded one compiled body
    for both (the serial twin launching a parallel region per call, 20-50 us, or the parallel kernel
    running on one thread)."""
    f = kernel.py_func
    twin = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial", f.__defaults__, f.__closure__)
    twin.__qualname__, twin.__doc__ = f.__qualname__ + "_serial", f.__doc__
    return nb.njit(**_JIT)(twin)


rms_norm_serial = _serial_twin(rms_norm)
qkv_prologue_serial = _serial_twin(qkv_prologue)
rope_and_store_serial = _serial_twin(rope_and_store)
silu_mul_serial = _serial_twin(silu_mul)
gelu_tanh_mul_serial = _serial_twin(gelu_tanh_mul)
swiglu_oai_mul_serial = _serial_twin(swiglu_oai_mul)

# The gated FFN's activation by `Architecture.activation` value: (parallel, serial) kernels.
GATED_ACTIVATIONS = {
    "silu": (silu_mul, silu_mul_serial),
    "gelu_tanh": (gelu_tanh_mul, gelu_tanh_mul_serial),
    "swiglu_oai": (swiglu_oai_mul, swiglu_oai_mul_serial),
}
