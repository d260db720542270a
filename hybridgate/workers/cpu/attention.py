"""Causal grouped-query attention over the paged host KV cache, with sliding windows, logit softcaps and sinks.

One kernel for every layer of every family: a layer's window (0: the whole
causal context; w: a token reads only the w context slots ending at itself,
llama.cpp's LLAMA_SWA_TYPE_STANDARD and transformers' sliding-window mask),
its score scale and its softcap (s -> cap · tanh(s / cap) before the softmax,
Gemma 2) and its attention sinks (a logit per query head added to the softmax's
denominator, reading no value: gpt-oss) are arguments. Keys are scored 16 context slots at a time at absolute
context positions (chunks start at multiples of 16), so a token's arithmetic is
the same whatever run of tokens it is computed in: the batch invariance of
`simd`'s pieces carries over to windowed layers and chunked prefill.
"""

from __future__ import annotations

import math

from hybridgate.workers.cpu import isa

isa.selected()  # before Numba is imported: it compiles for the chosen instruction set

import numba as nb  # noqa: E402
import numpy as np  # noqa: E402
from numba import prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from hybridgate.workers.cpu.simd import (  # noqa: E402
    pv_rows1,
    pv_rows4,
    pv_rows8,
    qk_rows1,
    qk_rows4,
    qk_rows8,
    softmax_ir,
)
from hybridgate.workers.step_inputs import StepInputs  # noqa: E402

_JIT = dict(nogil=True, fastmath=True, cache=True)
QUERY_TILE = 16  # query tokens of one sequence that share each K/V load
# Rows a key or value load serves at most: 8 independent FMA chains on avx512's 32 registers (4 chains
# left the FMA units waiting on their latency); 4 where 16 lanes are two of avx2's 16 registers. A row's
# arithmetic is the same whichever count serves it.
ROWS8 = isa.selected().isa == "avx512"


@intrinsic
def softmax_window(typingctx, scores, base, lo, n):
    """In place over scores[base : base + n] (float32): e^(s - max) for lanes lo..n-1, 0 for lanes
    before lo; returns their sum. `simd.softmax_weights` with a lower bound (a window's first slot
    inside its first 16-slot chunk); with lo = 0 the same arithmetic.

    Reads and writes whole 16-lane chunks up to base + n rounded up to 16 (the caller pads the row);
    lanes outside [lo, n) are masked out of the max and the sum and stored as 0. The sum is per lane
    over the chunks in order, then a fixed tree: the same for a row whatever batch it is in.
    """
    sig = types.float32(scores, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        sa, bo, lo_, nn = args
        return softmax_ir(context, builder, signature.args[0], sa, bo, lo_, nn)

    return sig, codegen


@nb.njit(**_JIT)
def _scores(q, k_blocks, g, t0, t1, off, c0, longest, ctx_start, ctx_len, ctx_slots, scale, scores, width):
    """scale · q·k for run [t0, t1) and KV head g, chunk by chunk from context position c0: row
    k · ntok + (t - t0) holds query head g · group + k of token t at columns j - c0. A token reads a
    chunk only when the chunk meets its window [ctx_start[t], ctx_len[t]); both bounds grow with t in
    a run, so the tokens reading a chunk are consecutive and 4 of them share each key load."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads, bs = k_blocks.shape[1], k_blocks.shape[3]
    group = heads // kv_heads
    ntok = t1 - t0
    for j0 in range(c0, longest, 16):
        slot = ctx_slots[off + j0]
        kt_off = ((slot // bs) * kv_heads + g) * dim * bs + slot % bs
        for k in range(group):
            t = t0
            while t < t1:
                row = k * ntok + t - t0
                if j0 >= ctx_len[t] or j0 + 16 <= ctx_start[t]:
                    t += 1
                elif ROWS8 and t + 8 <= t1 and j0 < ctx_len[t + 7] and j0 + 16 > ctx_start[t + 7]:
                    qk_rows8(q, (t * heads + g * group + k) * dim, heads * dim, k_blocks, kt_off, bs, dim,
                             scores, row * width + j0 - c0, width, scale)
                    t += 8
                elif t + 4 <= t1 and j0 < ctx_len[t + 3] and j0 + 16 > ctx_start[t + 3]:
                    qk_rows4(q, (t * heads + g * group + k) * dim, heads * dim, k_blocks, kt_off, bs, dim,
                             scores, row * width + j0 - c0, width, scale)
                    t += 4
                else:
                    qk_rows1(q, (t * heads + g * group + k) * dim, heads * dim, k_blocks, kt_off, bs, dim,
                             scores, row * width + j0 - c0, width, scale)
                    t += 1


@nb.njit(**_JIT)
def _weights(scores, width, rows, ntok, t0, c0, ctx_start, ctx_len, softcap, sinks, head0, total):
    """Softcap (when softcap > 0) and softmax weights of each row over its window; total[row] their sum, plus
    e^(sink - max) of the row's query head (head0 + row // ntok) where sinks is not empty."""
    for row in range(rows):
        t = t0 + row % ntok
        lo, n = ctx_start[t], ctx_len[t]
        s0 = lo // 16 * 16
        base = row * width + s0 - c0
        if softcap > 0:
            for j in range(lo - s0, n - s0):
                scores[base + j] = softcap * np.float32(math.tanh(scores[base + j] / softcap))
        if sinks.shape[0]:
            peak = scores[base + lo - s0]
            for j in range(lo - s0 + 1, n - s0):
                peak = max(peak, scores[base + j])
            total[row] = softmax_window(scores, base, lo - s0, n - s0) + np.float32(
                math.exp(sinks[head0 + row // ntok] - peak))
        else:
            total[row] = softmax_window(scores, base, lo - s0, n - s0)


@nb.njit(parallel=True, **_JIT)
def paged_attention(q, k_blocks, v_cache, ctx_offset, ctx_start, ctx_len, ctx_slots, tiles, scale, softcap, sinks,
                    out):
    """Causal GQA over the paged cache: for token t, head h: softmax(cap(scale · q·k)) v over its window.

    q float32 `[tokens, heads, dim]`; k_blocks `[blocks, kv_heads, dim, block]` (keys transposed within
    each block); v_cache `[slots, kv_heads, dim]` (both float32, or 16-bit patterns widened to float32 as
    they are read: `kvdtype`); token t reads context positions ctx_start[t] .. ctx_len[t] - 1, whose
    slots are ctx_slots[ctx_offset[t] + j] (slot = block · block_size + offset); ctx_start is 0 on a
    layer without a window. tiles int64 `[n + 1]`: token boundaries of runs that share ctx_offset (one
    sequence's chunk, at most QUERY_TILE tokens); one job per (run, KV head) reads each key chunk and
    value row once for every query head of the group and every token of the run. scale float32
    multiplies q·k; softcap float32 > 0 caps the scaled scores (cap · tanh(s / cap)), 0 leaves them;
    sinks float32 `[heads]` (or `(0,)`: none) joins each head's softmax denominator as e^sink.
    A token's arithmetic is the same whatever run it is in: weights outside its window are exact
    zeros, and chunks sit at absolute context positions.
    """
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_blocks.shape[1]
    group = heads // kv_heads
    runs = tiles.shape[0] - 1
    # KV head major: prange gives each thread a contiguous range of jobs, so a long prompt's run (its
    # jobs much longer than a decode's) has its KV heads' jobs spread over the threads, and a long
    # prompt's runs (longer with every chunk of the causal context) are spread over them alike. Run
    # major, every job of one long run fell to one thread.
    for job in prange(runs * kv_heads):
        g, run = job // runs, job % runs
        t0, t1 = tiles[run], tiles[run + 1]
        off = ctx_offset[t0]
        longest, first = 0, ctx_len[t0]
        for t in range(t0, t1):
            longest = max(longest, ctx_len[t])
            first = min(first, ctx_start[t])
        c0 = first // 16 * 16
        width = (longest - c0 + 15) // 16 * 16
        ntok = t1 - t0
        rows = ntok * group
        scores = np.zeros(rows * width, dtype=np.float32)  # weights outside a row's window stay 0
        _scores(q, k_blocks, g, t0, t1, off, c0, longest, ctx_start, ctx_len, ctx_slots, scale, scores, width)
        total = np.empty(rows, dtype=np.float32)
        _weights(scores, width, rows, ntok, t0, c0, ctx_start, ctx_len, softcap, sinks, g * group, total)
        acc = np.zeros(rows * dim, dtype=np.float32)
        for j0 in range(c0, longest, 16):  # 16 context slots of one cache block: consecutive V rows
            v_off = (ctx_slots[off + j0] * kv_heads + g) * dim
            count = min(16, longest - j0)
            r = 0
            while ROWS8 and r + 8 <= rows:
                pv_rows8(scores, r * width + j0 - c0, width, v_cache, v_off, kv_heads * dim, count, acc, r * dim,
                         dim, dim)
                r += 8
            while r + 4 <= rows:
                pv_rows4(scores, r * width + j0 - c0, width, v_cache, v_off, kv_heads * dim, count, acc, r * dim,
                         dim, dim)
                r += 4
            while r < rows:
                pv_rows1(scores, r * width + j0 - c0, width, v_cache, v_off, kv_heads * dim, count, acc, r * dim,
                         dim, dim)
                r += 1
        for k in range(group):
            for t in range(t0, t1):
                row = k * ntok + t - t0
                for i in range(dim):
                    out[t, g * group + k, i] = acc[row * dim + i] / total[row]


def token_contexts(h: StepInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per new token: where its context slots start in one flat array and how many it reads
    (causal); the flat slots; and the boundaries of runs of at most QUERY_TILE tokens sharing a
    context. Returns (offset, length, slots, tiles), int64."""
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


def window_starts(length: np.ndarray, window: int) -> np.ndarray:
    """int64 `[tokens]`: each token's first context position on a layer with `window` (0: none):
    max(0, length - window), so a token reads itself and the window - 1 positions before it."""
    if window <= 0:
        return np.zeros_like(length)
    return np.maximum(length - window, 0)
