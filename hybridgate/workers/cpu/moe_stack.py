"""A block's experts as one stack of arrays, and the decode step's expert FFN over it in two parallel regions.

A batch-1 MoE decode step reads `expert_used_count` small matrices a layer (Qwen3-30B-A3B: 8 experts of
1536 x 2048 gate|up and 2048 x 768 down rows, about 1.8 and 1.3 MB each in Q4_K_M); run one kernel call
at a time, as `moe.experts_ffn`'s loops do, every matrix is its own parallel region (a wake-up of the
kernel threads and a barrier) with numpy and Python between, and a decode step of 16 sequences, whose
128 (token, expert) pairs spread over most of a layer's experts, runs three calls an expert. Here a
layer's experts of the super-block types (`Q45KSuperMatrix`, `Q6KSuperMatrix`: Q4_K, Q5_K and Q6_K on
the avx2 and avx512 paths) are stacked at load into one array per part, `[experts, rows, ...]` (each
expert's matrix keeps views of it: no second copy), and a decode step runs every chosen expert's
gate|up in one region and every down in another, each over (expert, rows chunk) items.

Same bits as the loops: each activation row is quantized by `superblock._quantize_row` and multiplied
by `superblock._gemv_rows` (`_gemm_rows` from `UNPACK_MIN` rows: the same integers) over row chunks that
start on its tile widths, as `matmul_superblock` does, and `combine` adds each
token's expert outputs in expert index order, each product rounded to float32 before its add, as the
loops' `out[rows] += y * w` does. A step with prompt rows keeps `moe.experts_ffn`'s grouped loop (their
rows go to the prompt kernels).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numba as nb
import numpy as np
from numba import prange

from hybridgate.workers.cpu import superblock
from hybridgate.workers.cpu.layers import SERIAL_TOKENS

# weight rows a work item, a multiple of every tile width (so a chunk's tiles are `matmul_superblock`'s): 128,
# 12 items of a 1536-row gate|up
CHUNK_ROWS = 32 * math.lcm(superblock.GEMV_W, superblock.TILE_W)


class ExpertStack(NamedTuple):
    """One part (gate|up or down) of a block's experts: `matmul_superblock`'s five arrays of every expert,
    stacked on a leading expert axis (qs `[experts, rows, ...]`, and so on; Q6_K's unread ndmin and mins
    `[experts, 1, 1]`)."""

    qs: np.ndarray
    sc: np.ndarray
    d: np.ndarray
    ndmin: np.ndarray
    mins: np.ndarray

    @property
    def rows(self) -> int:
        return self.qs.shape[1]


def stack(matrices: list) -> ExpertStack | None:
    """The experts' arrays stacked, each matrix left holding views of the stack (its own arrays freed), or
    None where they are not all super-block matrices (`superblock_fields`) of one class, shape and array
    layout (other types and the generic path keep the loops)."""
    fields = getattr(type(matrices[0]), "superblock_fields", None) if matrices else None
    if fields is None or len({type(m) for m in matrices}) != 1:
        return None
    arrays = [[getattr(m, f) for f in fields] for m in matrices]
    if len({tuple((a.shape, a.dtype.str) for a in parts) for parts in arrays}) != 1:
        return None
    stacked = ExpertStack(*(np.stack(part) for part in zip(*arrays)))
    for e, m in enumerate(matrices):
        for f, part in zip(fields, stacked):
            setattr(m, f, part[e])
    return stacked


@nb.njit(parallel=True, nogil=True, cache=True)
def experts_matmul(x, pair_rows, starts, group_experts, qs, sc, d, ndmin, mins, out):
    """out float32 `[pairs, rows]`: pair p's row of x (x float32 `[n, cols]`, row `pair_rows[p]`) times the
    transposed weights of its group's expert, the pairs grouped by expert (group g: pairs `starts[g]` ..
    `starts[g + 1]`, expert `group_experts[g]`), the stack's arrays as `matmul_superblock` takes them with
    a leading expert axis. One parallel region over (group, CHUNK_ROWS rows) items; a group of UNPACK_MIN rows
or more takes the GEMM tiles."""
    n, cols = x.shape
    nblocks = cols // 32
    xq_n = np.empty((n, cols), dtype=np.int16)
    xs_n = np.empty((n, cols // superblock.SUPER), dtype=np.float32)
    xsum_n = np.empty((n, nblocks), dtype=np.float32)
    if n < 8:
        for k in range(n):
            superblock._quantize_row(x, k, xq_n, xs_n, xsum_n)
    else:
        for k in prange(n):
            superblock._quantize_row(x, k, xq_n, xs_n, xsum_n)
    pairs = pair_rows.shape[0]
    in_order = pairs == n
    for p in range(pairs if in_order else 0):
        in_order = in_order and pair_rows[p] == p
    if in_order:  # the down matmuls: each pair's own row, quantized where it is
        xq, xs, xsum = xq_n, xs_n, xsum_n
    else:  # the gate|up matmuls: a token's quantized row copied to each of its pairs
        xq = np.empty((pairs, cols), dtype=np.int16)
        xs = np.empty((pairs, cols // superblock.SUPER), dtype=np.float32)
        xsum = np.empty((pairs, nblocks), dtype=np.float32)
        for p in range(pairs):
            xq[p] = xq_n[pair_rows[p]]
            xs[p] = xs_n[pair_rows[p]]
            xsum[p] = xsum_n[pair_rows[p]]
    rows = qs.shape[1]
    chunks = (rows + CHUNK_ROWS - 1) // CHUNK_ROWS
    for item in prange(group_experts.shape[0] * chunks):
        g, c = item // chunks, item % chunks
        e, b0, b1 = group_experts[g], starts[g], starts[g + 1]
        r0, r1 = c * CHUNK_ROWS, min(rows, (c + 1) * CHUNK_ROWS)
        if b1 - b0 < superblock.UNPACK_MIN:
            superblock._gemv_rows(xq, xs, xsum, qs[e], sc[e], d[e], ndmin[e], mins[e], out, r0, r1, b0, b1)
        else:  # the GEMM tiles, as matmul_superblock from UNPACK_MIN rows: the codes widened once per TILE_W rows
            wq = np.empty(superblock.TILE_W * cols, dtype=np.int16)
            for r in range(r0, r1, superblock.TILE_W):
                superblock._gemm_rows(xq, xs, xsum, qs[e], sc[e], d[e], ndmin[e], mins[e], out, r,
                                      min(superblock.TILE_W, r1 - r), b0, b1, wq)


@nb.njit(nogil=True, cache=True)
def combine(y, pair_tokens, pair_weights, out):
    """out float32 `[tokens, hidden]` = Σ over pairs p (in order) of y[p] · pair_weights[p] into row
    `pair_tokens[p]`, from zero; each product rounded to float32 before it is added (no fast-math)."""
    out[:] = 0.0
    for p in range(y.shape[0]):
        t, w = pair_tokens[p], pair_weights[p]
        for j in range(y.shape[1]):
            out[t, j] += y[p, j] * w


def decode_experts(x: np.ndarray, experts, weights: np.ndarray, chosen: np.ndarray, activation: tuple,
                   out: np.ndarray) -> int:
    """`moe.experts_ffn`'s expert sum for a step without prompt rows, over `experts.stacks` (gate|up, down);
    returns kernel calls. x float32 `[tokens, hidden]` (C-contiguous), weights float32 and chosen int64
    `[tokens, k]`, out float32 `[tokens, hidden]`; the shared expert is the caller's. Counts the router's
    call as `experts_ffn`'s loops do."""
    k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")  # pairs by expert; a token's pairs in expert order
    pair_experts = flat[order]
    pair_tokens = order // k
    group_experts, counts = np.unique(pair_experts, return_counts=True)
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    gate_up, down = experts.stacks
    gu = np.empty((len(order), gate_up.rows), np.float32)
    experts_matmul(x, pair_tokens, starts, group_experts, *gate_up, gu)
    if experts.gate_up_bias.size:
        gu += experts.gate_up_bias[pair_experts]
    act = np.empty((len(order), gate_up.rows // 2), np.float32)
    activation[len(order) <= SERIAL_TOKENS](gu, act)
    y = np.empty((len(order), down.rows), np.float32)
    experts_matmul(act, np.arange(len(order)), starts, group_experts, *down, y)
    if experts.down_bias.size:
        y += experts.down_bias[pair_experts]
    combine(y, pair_tokens, weights.reshape(-1)[order], out)
    return 1 + 4  # the router's, the two matmuls, the activation, the weighted sum
