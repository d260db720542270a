"""Embedding requests in the engine: which hidden rows a step pools, and the pooled vector at the end.

An embedding request (`AddRequest.pooling` not NONE) is a prefill-only sequence: it is scheduled,
chunked, batched with generations and preempted like any prompt, but no token is sampled for it.
Each step the runner returns, for each embedding entry, the sum of the final-norm hidden states of
the rows its pooling needs (`pool_plan`, `partial_sums`); the engine adds them up across chunks
(`accumulate`) and, once the whole prompt is computed, answers the vector (`embedding_bytes`).
Pooling types and their numbers are llama.cpp's (`llama_pooling_type`; llama.cpp's
`llm_graph_context::build_pooling`): MEAN averages every prompt token, CLS takes the first, LAST the last.

MEAN and CLS need every chunk from position 0, so the scheduler gives those sequences no prefix-cache
hit; LAST needs only the final row, which is always computed.
"""

from __future__ import annotations

import numpy as np

from hybridgate.wire import PoolingType
from hybridgate.workers.scheduler import ScheduledBatch
from hybridgate.workers.sequence import Sequence


def _rows(pooling: int, start: int, n: int, prompt_len: int) -> range:
    """Offsets, within an entry of `n` new tokens from position `start`, of the rows it pools."""
    if pooling == PoolingType.MEAN:
        return range(n)
    if pooling == PoolingType.CLS:
        return range(1) if start == 0 else range(0)
    return range(n - 1, n) if start + n == prompt_len else range(0)  # LAST


def pool_plan(batch: ScheduledBatch) -> tuple[np.ndarray, list[tuple[Sequence, int, int]]]:
    """The packed rows (int64 `[k]`) whose final-norm hidden states the step's embedding entries need, and
    per embedding entry (sequence, offset into those rows, count). Empty when the step has none."""
    rows, plan, first = [], [], 0
    for seq, n in batch.entries:
        if seq.pooling:
            take = _rows(seq.pooling, seq.num_computed, n, len(seq.prompt_ids))
            plan.append((seq, len(rows), len(take)))
            rows.extend(first + r for r in take)
        first += n
    return np.asarray(rows, dtype=np.int64), plan


def partial_sums(hidden: np.ndarray, plan: list[tuple[Sequence, int, int]]) -> dict[Sequence, np.ndarray]:
    """float64 `[hidden]` per embedding entry: the sum of its rows of `hidden` (float `[k, hidden]`, the
    final-norm states of `pool_plan`'s rows; zeros for an entry with no row this step)."""
    h = np.asarray(hidden, dtype=np.float64)
    return {seq: h[offset : offset + count].sum(axis=0) for seq, offset, count in plan}


def accumulate(seq: Sequence, partial: np.ndarray) -> None:
    """Add a step's partial sum to the sequence's (before its `num_computed` moves past the step's tokens);
    a chunk from position 0 (a first run, or a recomputation after preemption) starts the sum again."""
    if seq.num_computed == 0 or seq.pool_sum is None:
        seq.pool_sum = np.zeros_like(partial)
    seq.pool_sum += partial


def embedding_bytes(seq: Sequence) -> bytes:
    """The finished sequence's pooled vector: float32 little-endian `[hidden]` (MEAN: the sum over the
    prompt's length). Raises ValueError when nothing was pooled (a bug: the runner returned no rows)."""
    if seq.pool_sum is None:
        raise ValueError(f"request {seq.request_id!r}: no hidden state was pooled")
    vector = seq.pool_sum / len(seq.prompt_ids) if seq.pooling == PoolingType.MEAN else seq.pool_sum
    return vector.astype("<f4").tobytes()
