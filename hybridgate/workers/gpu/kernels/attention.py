"""Paged attention in Triton: a step's K/V written to their slots, and attention read in place through the
block table, for decodes and prefill chunks in one launch, with a split-KV path for few long decodes.

Cache layout (unchanged, so the hand-off exporter and the CPU import read it as before): per layer, K and V
are `[num_blocks * block_size, kv_heads, head_dim]`, one row per slot; block b holds slots
`b * block_size .. (b + 1) * block_size - 1`.

`paged_attention` runs the FlashAttention-2 online softmax (Dao 2023, Algorithm 1) over the KV blocks a
query block can see: one program per (sequence, block of BLOCK_Q query tokens, KV head), whose rows are
the BLOCK_Q tokens times every query head of that KV head (GQA packed: `q_per_kv` heads share each K/V
tile, so one `tl.dot` serves the group, as vLLM's unified Triton attention packs them). Query token i of
a sequence with `ctx` keys after this step sits at position `ctx - q_len + i` and sees keys
`max(0, pos - window + 1) .. pos` (window 0: from 0; llama.cpp's standard sliding window); only the
tiles of that range are read, each tile `TILE` keys (several blocks, each looked up in the table). Scores are `scale * q.k`, then `cap * tanh(scores / cap)` with a softcap
(Gemma 2), then the mask and the softmax, in float32. With attention sinks (gpt-oss: one learned logit per
query head, `sinks` float32 `[heads]`), each head's softmax takes its sink as one more logit that has no
value (weights `exp(s_j) / (sum_j exp(s_j) + exp(sink))`): the online softmax starts from the sink as its
running max with a sum of 1 instead of from -inf and 0 (in the split-KV path, split 0 only, so the combine
counts it once); a query that sees no key then gets a zero output, as the reference's softmax gives.

Split-KV (flash-decoding, Dao et al. 2023, "Flash-Decoding for long-context inference"): with
`num_splits > 1` each (sequence, KV head) program pair reads one of `num_splits` equal runs of the
visible blocks and writes its unnormalised output, running max and sum; `_combine` rescales and sums
them. The grid is (sequences, query blocks, KV heads x splits): it depends on the batch and on
`max_q_len`, never on context lengths, so one captured decode graph per batch size serves every context.

Dtypes: K/V and Q in fp16, bf16 or fp32, accumulation in fp32. `dot_fp32` makes every `tl.dot` take
float32 operands (Triton's interpreter computes `tl.dot` on bf16 operands wrongly, FACTS.md; the tests
use it, a GPU does not).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, k_stride, v_stride, ROW: tl.constexpr,
              ROW_PAD: tl.constexpr):
    """One program per new token: its K and V rows (kv_heads * head_dim values) into its slot."""
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        keep = offs < ROW
        k = tl.load(k_ptr + t * k_stride + offs, mask=keep)
        v = tl.load(v_ptr + t * v_stride + offs, mask=keep)
        tl.store(kc_ptr + slot * ROW + offs, k, mask=keep)
        tl.store(vc_ptr + slot * ROW + offs, v, mask=keep)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v `[num_tokens, kv_heads, head_dim]` into caches `[num_slots, kv_heads, head_dim]` at `slots`
    (int `[num_tokens]`; a negative slot is skipped: padding rows of a captured graph). One launch."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k, v = (t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous() for t in (k, v))
    row = k.shape[1] * k.shape[2]
    _write_kv[(num_tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), v.stride(0), ROW=row,
                             ROW_PAD=triton.next_power_of_2(row))


@triton.jit
def _softmax_start(sinks_ptr, head, row_ok, split, BLOCK_M: tl.constexpr, SINKS: tl.constexpr):
    """(running max, running sum) `[BLOCK_M]` that each row's online softmax starts from: -inf and 0, or with
    sinks its head's sink and 1 (one more logit of weight exp(sink - max) and no value), in split 0 only so
    that the combine counts it once."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    if SINKS:
        if split == 0:
            m = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
            l = tl.where(row_ok, 1.0, 0.0)
    return m, l


@triton.jit
def _attention(q_ptr, kc_ptr, vc_ptr, out_ptr, part_ptr, stat_ptr, tables_ptr, seq_lens_ptr, q_starts_ptr,
               sinks_ptr, scale, cap, window, q_stride_t, q_stride_h, o_stride_t, o_stride_h, kv_stride_slot,
               kv_stride_h, table_stride, num_heads,
               Q_PER_KV: tl.constexpr, Q_PER_KV_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               TILE: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
               WINDOW: tl.constexpr, DOT_FP32: tl.constexpr, SINKS: tl.constexpr):
    seq = tl.program_id(0)
    qblock = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(q_starts_ptr + seq)
    q_len = tl.load(q_starts_ptr + seq + 1) - q_start
    if qblock * BLOCK_Q < q_len:
        ctx = tl.load(seq_lens_ptr + seq)
        prefix = ctx - q_len
        BLOCK_M: tl.constexpr = BLOCK_Q * Q_PER_KV_PAD
        rows = tl.arange(0, BLOCK_M)
        tok = qblock * BLOCK_Q + rows // Q_PER_KV_PAD
        head_in_group = rows % Q_PER_KV_PAD
        row_ok = (tok < q_len) & (head_in_group < Q_PER_KV)
        head = kv_head * Q_PER_KV + head_in_group
        dims = tl.arange(0, DIM_PAD)
        dim_ok = dims < HEAD_DIM
        q_off = (q_start + tok).to(tl.int64)[:, None] * q_stride_t + head[:, None] * q_stride_h + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        qpos = prefix + tok  # [BLOCK_M]
        hi = tl.minimum(ctx, prefix + tl.minimum(q_len, (qblock + 1) * BLOCK_Q))  # keys [lo, hi) are visible
        lo = 0
        if WINDOW:
            lo = tl.maximum(0, prefix + qblock * BLOCK_Q - window + 1)
        first = lo // TILE
        last = (hi + TILE - 1) // TILE
        per = (last - first + NUM_SPLITS - 1) // NUM_SPLITS
        begin = first + split * per
        end = tl.minimum(last, begin + per)
        m_i, l_i = _softmax_start(sinks_ptr, head, row_ok, split, BLOCK_M, SINKS)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        offs = tl.arange(0, TILE)
        table = tables_ptr + seq.to(tl.int64) * table_stride
        for j in range(begin, end):  # TILE keys a step: TILE / BLOCK_SIZE blocks, each found in the table
            kpos = j * TILE + offs
            in_ctx = kpos < ctx
            block = tl.load(table + kpos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
            kv_off = (block * BLOCK_SIZE + kpos % BLOCK_SIZE)[:, None] * kv_stride_slot + kv_head * kv_stride_h + \
                dims[None, :]
            # Slots past the context are never read: a block's unused tail may hold anything, NaN included,
            # and 0 * NaN would reach the output through P.V.
            live = in_ctx[:, None] & dim_ok[None, :]
            k = tl.load(kc_ptr + kv_off, mask=live, other=0.0)  # [TILE, DIM_PAD]
            v = tl.load(vc_ptr + kv_off, mask=live, other=0.0)
            if DOT_FP32:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_M, TILE], fp32 (never tf32)
            if SOFTCAP:
                s = cap * (1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0))  # cap * tanh(s / cap)
            seen = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < ctx) & row_ok[:, None]
            if WINDOW:
                seen = seen & (qpos[:, None] - kpos[None, :] < window)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        store_ok = row_ok[:, None] & dim_ok[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            o_off = (q_start + tok).to(tl.int64)[:, None] * o_stride_t + head[:, None] * o_stride_h + dims[None, :]
            tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_ok)
        else:  # partials [tokens, heads, splits, DIM_PAD] and stats [tokens, heads, splits, 2], fp32
            at = ((q_start + tok).to(tl.int64) * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
            tl.store(part_ptr + at[:, None] * DIM_PAD + dims[None, :], acc, mask=store_ok)
            tl.store(stat_ptr + at * 2, m_i, mask=row_ok)
            tl.store(stat_ptr + at * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine(part_ptr, stat_ptr, out_ptr, o_stride_t, o_stride_h, num_heads, NUM_SPLITS: tl.constexpr,
             HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """One program per (token, head): the splits' partial outputs rescaled to one max and summed."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    at = (t.to(tl.int64) * num_heads + h) * NUM_SPLITS + splits
    m = tl.load(stat_ptr + at * 2)
    l = tl.load(stat_ptr + at * 2 + 1)
    top = tl.max(m, 0)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))  # an empty split weighs nothing
    dims = tl.arange(0, DIM_PAD)
    parts = tl.load(part_ptr + at[:, None] * DIM_PAD + dims[None, :])  # [NUM_SPLITS, DIM_PAD]
    total = tl.sum(l * w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t.to(tl.int64) * o_stride_t + h * o_stride_h + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, q_starts: torch.Tensor, max_q_len: int, block_size: int, scale: float,
                    softcap: float = 0.0, window: int = 0, num_splits: int = 1, dot_fp32: bool = False,
                    out: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a packed step's queries over the paged cache (see the module doc).

    q `[num_tokens, heads, head_dim]`, each sequence's tokens contiguous and in order; caches
    `[num_slots, kv_heads, head_dim]`; block_tables int32 `[num_seqs, max_blocks]`; seq_lens int32
    `[num_seqs]` (keys after this step, its own tokens included: they must be written first);
    q_starts int32 `[num_seqs + 1]` (first row of each sequence, then num_tokens); max_q_len: the most
    query tokens of one sequence (1 for a decode-only step). num_splits: split-KV runs (a power of two;
    1: none). sinks: float32 `[heads]` attention sinks on q's device, or None. Returns `out` (or a new
    tensor) `[num_tokens, heads, head_dim]` in q's dtype.

    Raises ValueError when heads is not a multiple of kv_heads, num_splits is not a power of two, or sinks
    is not `[heads]`.
    """
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if sinks is not None and tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must be [heads] = [{heads}], got {list(sinks.shape)}")
    if num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    q_per_kv = heads // kv_heads
    group = triton.next_power_of_2(q_per_kv)
    block_q = max(1, 16 // group)  # tl.dot wants at least 16 rows: a decode's block pads its one token
    if max_q_len > 1:
        block_q = max(block_q, min(triton.next_power_of_2(max_q_len), max(1, 64 // group)))
    dim_pad = triton.next_power_of_2(head_dim)
    part = stat = out
    if num_splits > 1:
        part = torch.empty((num_tokens, heads, num_splits, dim_pad), device=q.device, dtype=torch.float32)
        stat = torch.empty((num_tokens, heads, num_splits, 2), device=q.device, dtype=torch.float32)
    tile = max(block_size, 64 if head_dim <= 128 else 32)  # keys per step; K and V tiles stay in registers
    grid = (seq_lens.shape[0], triton.cdiv(max_q_len, block_q), kv_heads * num_splits)
    _attention[grid](q, k_cache, v_cache, out, part, stat, block_tables, seq_lens, q_starts,
                     sinks.float() if sinks is not None else seq_lens, scale,
                     float(softcap or 1.0), int(window), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                     k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), heads,
                     Q_PER_KV=q_per_kv, Q_PER_KV_PAD=group, BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE=tile,
                     HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits, SOFTCAP=bool(softcap),
                     WINDOW=bool(window), DOT_FP32=dot_fp32, SINKS=sinks is not None)
    if num_splits > 1:
        _combine[(num_tokens, heads)](part, stat, out, out.stride(0), out.stride(1), heads, NUM_SPLITS=num_splits,
                                      HEAD_DIM=head_dim, DIM_PAD=dim_pad)
    return out
