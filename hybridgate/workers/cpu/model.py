"""The Llama forward pass on the CPU: Numba kernels over GGUF blocks, a paged host KV cache.

Same math as `hybridgate.workers.gpu.model` (RMSNorm, RoPE on adjacent pairs in
GGUF's row order, grouped-query attention, SwiGLU, tied LM head), in float32
(the KV cache may hold fp16 or bf16, widened to float32 as attention reads it).
Each step reads every weight matrix once for all its tokens (Q, K, V fused into
one matrix, gate and up into another), so kernel calls per step do not grow
with the batch: `kernel_calls` counts them.
"""

from __future__ import annotations

import math
import types

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange  # noqa: E402

from hybridgate.models import GGUFModel  # noqa: E402
from hybridgate.workers.cpu.quant import QuantMatrix, concat_rows, quant_matrix  # noqa: E402
from hybridgate.workers.cpu.simd import (  # noqa: E402
    kv_encode,
    pv_rows1,
    pv_rows4,
    qk_rows1,
    qk_rows4,
    silu_mul16,
    softmax_weights,
)
from hybridgate.workers.step_inputs import StepInputs  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)


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


@nb.njit(parallel=True, **_JIT)
def rope_and_store(qkv, positions, cos, sin, slots, k_blocks, v_cache, q_out):
    """RoPE on adjacent pairs (x[2i], x[2i+1]) of Q and K, then Q into q_out and K, V into the cache.

    qkv float32 `[tokens, heads + 2 kv_heads, dim]` (Q heads, K heads, V heads); positions,
    slots int64 `[tokens]`; cos, sin `[max_len, dim / 2]`; k_blocks `[blocks, kv_heads, dim,
    block]` (keys transposed within a block), v_cache `[slots, kv_heads, dim]`, both of the
    cache's element type (`kvdtype`: K and V rounded to it as they are stored); q_out
    `[tokens, heads, dim]`. One pass per token replaces a RoPE kernel, two scattered numpy
    writes and a copy.
    """
    heads, kv_heads, half = q_out.shape[1], k_blocks.shape[1], qkv.shape[2] // 2
    bs = k_blocks.shape[3]
    for t in prange(qkv.shape[0]):
        p, slot = positions[t], slots[t]
        blk, o = slot // bs, slot % bs
        for h in range(heads + kv_heads):
            for i in range(half):
                a, b = qkv[t, h, 2 * i], qkv[t, h, 2 * i + 1]
                c, s = cos[p, i], sin[p, i]
                ra, rb = a * c - b * s, a * s + b * c
                if h < heads:
                    q_out[t, h, 2 * i], q_out[t, h, 2 * i + 1] = ra, rb
                else:
                    k_blocks[blk, h - heads, 2 * i, o] = kv_encode(ra, k_blocks)
                    k_blocks[blk, h - heads, 2 * i + 1, o] = kv_encode(rb, k_blocks)
        for g in range(kv_heads):
            for i in range(2 * half):
                v_cache[slot, g, i] = kv_encode(qkv[t, heads + kv_heads + g, i], v_cache)


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


QUERY_TILE = 16  # query tokens of one sequence that share each K/V load


@nb.njit(parallel=True, **_JIT)
def paged_attention(q, k_blocks, v_cache, ctx_offset, ctx_len, ctx_slots, tiles, out):
    """Causal GQA over the paged cache: for token t, head h: softmax(q·k / sqrt(d)) v over its context.

    q `[tokens, heads, dim]`; k_blocks `[blocks, kv_heads, dim, block]` (keys transposed within
    each block); v_cache `[slots, kv_heads, dim]` (both float32, or 16-bit patterns widened to
    float32 as they are read: `kvdtype`); token t reads context slots
    ctx_slots[ctx_offset[t] : ctx_offset[t] + ctx_len[t]] (slot = block · block_size + offset).
    tiles int64 `[n + 1]`: token boundaries of runs that share ctx_offset (one sequence's chunk,
    at most QUERY_TILE tokens); one job per (run, KV head) reads each key chunk and value row once
    for every query head of the group and every token of the run. Scores come 16 keys × 4 query
    rows at a time (`simd.qk_rows4`), softmax weights 16 at a time (`simd.softmax_weights`), the
    weighted values 16 slots × 4 rows at a time (`simd.pv_rows4`). A token's arithmetic is the
    same whatever run it is in (weights past its context are exact zeros).
    """
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, bs = k_blocks.shape[1], k_blocks.shape[3]
    group = heads // kv_heads
    scale = np.float32(1.0 / math.sqrt(dim))
    runs = tiles.shape[0] - 1
    for job in prange(runs * kv_heads):
        run, g = job // kv_heads, job % kv_heads
        t0, t1 = tiles[run], tiles[run + 1]
        off = ctx_offset[t0]
        longest = 0
        for t in range(t0, t1):
            longest = max(longest, ctx_len[t])
        width = (longest + 15) // 16 * 16
        ntok = t1 - t0
        rows = ntok * group  # row k · ntok + (t - t0): query head g · group + k of token t
        scores = np.zeros(rows * width, dtype=np.float32)  # weights past a row's context stay 0
        for j0 in range(0, longest, 16):
            slot = ctx_slots[off + j0]
            kt_off = ((slot // bs) * kv_heads + g) * dim * bs + slot % bs
            for k in range(group):
                t = t0
                while t < t1:  # contexts grow with t in a run: if token t reaches the chunk, t + 1.. do
                    row = k * ntok + t - t0
                    if j0 >= ctx_len[t]:
                        t += 1
                    elif t + 4 <= t1:
                        qk_rows4(q, (t * heads + g * group + k) * dim, heads * dim, k_blocks, kt_off, bs, dim,
                                 scores, row * width + j0, width, scale)
                        t += 4
                    else:
                        qk_rows1(q, (t * heads + g * group + k) * dim, heads * dim, k_blocks, kt_off, bs, dim,
                                 scores, row * width + j0, width, scale)
                        t += 1
        total = np.empty(rows, dtype=np.float32)
        for k in range(group):
            for t in range(t0, t1):
                row = k * ntok + t - t0
                total[row] = softmax_weights(scores, row * width, ctx_len[t])
        acc = np.zeros(rows * dim, dtype=np.float32)
        for j0 in range(0, longest, 16):  # 16 context slots of one cache block: consecutive V rows
            v_off = (ctx_slots[off + j0] * kv_heads + g) * dim
            count = min(16, longest - j0)
            r = 0
            while r + 4 <= rows:
                pv_rows4(scores, r * width + j0, width, v_cache, v_off, kv_heads * dim, count, acc, r * dim, dim, dim)
                r += 4
            while r < rows:
                pv_rows1(scores, r * width + j0, width, v_cache, v_off, kv_heads * dim, count, acc, r * dim, dim, dim)
                r += 1
        for k in range(group):
            for t in range(t0, t1):
                row = k * ntok + t - t0
                for i in range(dim):
                    out[t, g * group + k, i] = acc[row * dim + i] / total[row]


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
rope_and_store_serial = _serial_twin(rope_and_store)
silu_mul_serial = _serial_twin(silu_mul)


def _matrix(model: GGUFModel, names: list[str], activations: str) -> QuantMatrix:
    parts = [(int(model.tensors[n].ggml_type), model.tensors[n].data, model.tensors[n].shape) for n in names]
    fused = concat_rows("+".join(names), parts, activations) if len(parts) > 1 else None
    if fused is not None:
        return fused
    if len(parts) > 1:
        raise ValueError(f"tensors {names} differ in type or columns and cannot be fused")
    return quant_matrix(names[0], *parts[0], activations)


class CpuLlama:
    """Weights in GGUF blocks (Q4_1 and Q8_0 repacked), float32 norms and RoPE tables.

    activations: the quantized matmuls' activation format (`intdot.FORMATS`; "auto" by path)."""

    def __init__(self, model: GGUFModel, max_model_len: int | None = None, activations: str = "auto"):
        c = self.config = model.config
        if c.head_dim % 16:  # checked before any weight is copied (hybridgate info builds this to ask)
            raise ValueError(f"model head_dim {c.head_dim}: the CPU runner needs a multiple of 16 (its vector width)")
        self.max_model_len = max_model_len or c.max_model_len
        self.layers = []
        for i in range(c.num_layers):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": model.tensors[p + "attn_norm.weight"].dequantize(),
                "qkv": _matrix(model, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], activations),
                "wo": _matrix(model, [p + "attn_output.weight"], activations),
                "ffn_norm": model.tensors[p + "ffn_norm.weight"].dequantize(),
                "gate_up": _matrix(model, [p + "ffn_gate.weight", p + "ffn_up.weight"], activations),
                "down": _matrix(model, [p + "ffn_down.weight"], activations),
            })
        self.embed = _matrix(model, ["token_embd.weight"], activations)
        self.lm_head = self.embed if c.tie_word_embeddings else _matrix(model, ["output.weight"], activations)
        self.out_norm = model.tensors["output_norm.weight"].dequantize()
        inv_freq = 1.0 / (c.rope_theta ** (np.arange(0, c.head_dim, 2, dtype=np.int64).astype(np.float32) / c.head_dim))
        angles = np.arange(self.max_model_len, dtype=np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        self.kernel_calls = 0

    @property
    def weight_bytes(self) -> int:
        mats = [m for layer in self.layers for m in layer.values()] + [self.embed, self.out_norm, self.cos, self.sin]
        if self.lm_head is not self.embed:
            mats.append(self.lm_head)
        return sum(m.nbytes for m in mats)

    def embed_rows(self, ids: np.ndarray) -> np.ndarray:
        if hasattr(self.embed, "rows"):
            return self.embed.rows(ids)
        return np.stack([self.embed.row(int(i)) for i in ids])

    def forward(self, h: StepInputs, k_cache: list[np.ndarray], v_cache: list[np.ndarray]) -> np.ndarray:
        """Logits float32 `[entries, vocab]` at each entry's last new token; K/V written to their slots.

        k_cache: per layer `[blocks, kv_heads, head_dim, block_size]`; v_cache: per layer
        `[slots, kv_heads, head_dim]`; of one element type (`kvdtype`; see `paged_attention`)."""
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        ctx_offset, ctx_len, ctx_slots, tiles = _token_contexts(h)
        x = self.embed_rows(h.ids)  # [tokens, hidden]
        tokens = x.shape[0]
        normed = np.empty_like(x)
        attn = np.empty((tokens, heads, dim), dtype=np.float32)
        q = np.empty((tokens, heads, dim), dtype=np.float32)
        self.kernel_calls = 0
        serial = tokens <= SERIAL_TOKENS
        norm, rope, silu = (rms_norm_serial, rope_and_store_serial, silu_mul_serial) if serial else (
            rms_norm, rope_and_store, silu_mul)
        for i, layer in enumerate(self.layers):
            norm(x, layer["attn_norm"], c.rms_norm_eps, normed)
            qkv = layer["qkv"].matmul(normed).reshape(tokens, heads + 2 * kv_heads, dim)
            rope(qkv, h.positions, self.cos, self.sin, h.slots, k_cache[i], v_cache[i], q)
            paged_attention(q, k_cache[i], v_cache[i], ctx_offset, ctx_len, ctx_slots, tiles, attn)
            x += layer["wo"].matmul(attn.reshape(tokens, heads * dim))
            norm(x, layer["ffn_norm"], c.rms_norm_eps, normed)
            gate_up = layer["gate_up"].matmul(normed)
            act = np.empty((tokens, gate_up.shape[1] // 2), dtype=np.float32)
            silu(gate_up, act)
            x += layer["down"].matmul(act)
            self.kernel_calls += 8
        last = np.ascontiguousarray(x[h.last])
        out = np.empty_like(last)
        norm(last, self.out_norm, c.rms_norm_eps, out)
        self.kernel_calls += 2
        return self.lm_head.matmul(out)


def _token_contexts(h: StepInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per new token: where its context slots start in one flat array and how many it reads
    (causal); and the boundaries of runs of at most QUERY_TILE tokens sharing a context."""
    tokens = h.ids.shape[0]
    offset = np.empty(tokens, dtype=np.int64)
    length = np.empty(tokens, dtype=np.int64)
    width = h.decode_context.shape[1] if h.decode_context.size else 0
    for j, i in enumerate(h.decodes):
        row = int(h.last[i])
        offset[row], length[row] = j * width, h.contexts[i]
    base = h.decode_context.size
    for start, n, ctx_off, ctx_len in h.prefills:
        past = ctx_len - n
        offset[start : start + n] = base + ctx_off
        length[start : start + n] = past + 1 + np.arange(n)
    cuts = [0]
    for t in range(1, tokens):
        if offset[t] != offset[t - 1] or t - cuts[-1] == QUERY_TILE:
            cuts.append(t)
    cuts.append(tokens)
    return offset, length, np.concatenate([h.decode_context.reshape(-1), h.prefill_context]), np.array(cuts)
