"""Predicted TTFT and TPOT of a request on a worker, from the worker's load report.

A step's time is read off the worker's own measured tables (`EngineStats.
prefill_tokens_per_s` by step tokens, `EngineStats.decode_step_s` by batch;
hybridgate/workers/rates.py), interpolated between buckets. A request's TTFT on
a worker is the time of the steps that prefill everything queued ahead of it
(prompt tokens not yet computed there) plus its own uncached tokens, in chunks
of the step budget left after the running decodes, each step also carrying
those decodes (chunked prefill as in Sarathi-Serve, Agrawal et al., OSDI
2024). Its TPOT is the decode step time at the batch the worker will have once
its queue is admitted. A `gpu->cpu` plan has the GPU worker's TTFT and the CPU
worker's TPOT plus the hand-off's copy time spread over the output.

All times in seconds. A worker that has reported no figures yet is priced with
`UNMEASURED_*` (a slow guess, so measured workers are preferred); one that has
reported no scheduler limits (`max_num_seqs`, `max_num_batched_tokens` 0) is
priced without them (one step per prefill, no batch cap): the limits come only
from the workers' reports, never from a default written here.

A hand-off's copy time is its bytes (the exporting worker's KV per token, from
its reported `kv_dtype`) over the rate measured on this router's recent imports
(`HandoffRate`: a moving median, seeded by `HANDOFF_BYTES_PER_S`).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridgate.mempool import DEFAULT_BLOCK_SIZE

UNMEASURED_PREFILL_TOKENS_PER_S = 100.0
UNMEASURED_DECODE_STEP_S = 0.1
HANDOFF_BYTES_PER_S = 2e9  # host-to-host copy of KV through the pinned slab; the seed of HandoffRate
HANDOFF_RATE_WINDOW = 32  # imports the hand-off rate is the median of
# Bytes per KV value by the `kv_dtype` a worker reports (wire.HANDOFF_DTYPES); a worker that reports
# none is priced at the widest, float32.
KV_BYTES_PER_VALUE = {"float32": 4, "bfloat16": 2, "float16": 2, "": 4}


def kv_bytes_per_value(kv_dtype: str) -> int:
    """Bytes of one K or V element in a cache of `kv_dtype`. Raises ValueError naming the dtype."""
    try:
        return KV_BYTES_PER_VALUE[kv_dtype]
    except KeyError:
        raise ValueError(f"kv_dtype: must be one of {', '.join(k for k in KV_BYTES_PER_VALUE if k)}, "
                         f"got {kv_dtype!r}") from None


class HandoffRate:
    """Bytes per second of this router's recent KV hand-offs: the median of the last
    `HANDOFF_RATE_WINDOW` imports (each its bytes over the seconds from the export's start to the
    import's confirmation), `HANDOFF_BYTES_PER_S` before the first."""

    def __init__(self, seed_bytes_per_s: float = HANDOFF_BYTES_PER_S, window: int = HANDOFF_RATE_WINDOW):
        self.seed = seed_bytes_per_s
        self._samples: deque[float] = deque(maxlen=window)

    def observe(self, nbytes: int, seconds: float) -> None:
        """One import of `nbytes` bytes in `seconds`; ignored without both (nothing was measured)."""
        if nbytes > 0 and seconds > 0:
            self._samples.append(nbytes / seconds)

    def bytes_per_s(self) -> float:
        return statistics.median(self._samples) if self._samples else self.seed


@dataclass(frozen=True)
class WorkerLoad:
    """One READY worker as a policy sees it: its last load report plus the router's own count.

    `queued_prefill_tokens` and `decoding` are the larger of the worker's report
    and this router's record of what it sent there since (a report is up to one
    heartbeat old; a burst of placements must see its own earlier members).
    """

    index: int  # position among the router's clients
    name: str
    kind: str  # "gpu" or "cpu"
    inflight: int = 0  # this router's requests on the worker
    queued_prefill_tokens: int = 0
    waiting: int = 0  # requests not yet admitted to the batch
    decoding: int = 0
    blocks_free: int = 1 << 30  # free blocks, cached ones included (they are evicted on demand)
    blocks_total: int = 1 << 30
    # Blocks its sequences hold once each has run to its max_tokens (a hand-off's to its first token),
    # those queued included: what the cache is promised, where `blocks_free` is only what it holds now.
    blocks_committed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 0  # the scheduler's batch cap, as reported (0: not reported, no cap)
    max_num_batched_tokens: int = 0  # its token budget per step, as reported (0: not reported, one step)
    prefill_tokens_per_s: Mapping[int, float] = field(default_factory=dict)
    decode_step_s: Mapping[int, float] = field(default_factory=dict)
    takes_handoff: bool = False  # a CPU worker with a hand-off socket
    kv_bytes_per_token: int = 0  # K and V of one token in its cache (its reported kv_dtype): what it exports


def _interpolate(table: Mapping[int, float], x: float, extrapolate_up: bool) -> float:
    """Piecewise-linear in x over the table's keys; flat below the first key; above the last one
    linear along the last two points (`extrapolate_up`) or flat."""
    keys = sorted(table)
    if len(keys) == 1 or x <= keys[0]:
        return table[keys[0]]
    if x >= keys[-1]:
        if not extrapolate_up:
            return table[keys[-1]]
        a, b = keys[-2], keys[-1]
        slope = max(0.0, (table[b] - table[a]) / (b - a))
        return table[b] + slope * (x - b)
    i = bisect.bisect_left(keys, x)
    a, b = keys[i - 1], keys[i]
    return table[a] + (table[b] - table[a]) * (x - a) / (b - a)


def step_s(w: WorkerLoad, tokens: int, batch: int) -> float:
    """Seconds of one step of `tokens` tokens over `batch` sequences (tokens == batch: decode only)."""
    if tokens <= batch and w.decode_step_s:
        return _interpolate(w.decode_step_s, batch, extrapolate_up=True)
    if w.prefill_tokens_per_s:
        return tokens / _interpolate(w.prefill_tokens_per_s, tokens, extrapolate_up=False)
    if tokens <= batch:
        return UNMEASURED_DECODE_STEP_S
    return tokens / UNMEASURED_PREFILL_TOKENS_PER_S


def prefill_s(w: WorkerLoad, tokens: int, decoding: int) -> float:
    """Seconds to prefill `tokens` prompt tokens in budget-sized chunks beside `decoding` decodes."""
    if tokens <= 0:
        return 0.0
    chunk = max(1, w.max_num_batched_tokens - decoding) if w.max_num_batched_tokens else tokens
    full, rest = divmod(tokens, chunk)
    t = full * step_s(w, decoding + chunk, decoding + 1)
    return t + (step_s(w, decoding + rest, decoding + 1) if rest else 0.0)


def ttft_s(w: WorkerLoad, uncached_tokens: int) -> float:
    """Predicted TTFT: the queue ahead of the request and its own uncached tokens (at least the one
    token every prompt computes), prefilled beside the running decodes."""
    return prefill_s(w, w.queued_prefill_tokens + max(1, uncached_tokens), w.decoding)


def tpot_s(w: WorkerLoad) -> float:
    """Predicted TPOT: a decode step at the batch the worker has once its queue is admitted."""
    batch = w.decoding + w.waiting + 1
    batch = min(w.max_num_seqs, batch) if w.max_num_seqs else batch
    return step_s(w, batch, batch)


def unloaded_ttft_s(w: WorkerLoad, prompt_tokens: int) -> float:
    """TTFT of the whole prompt on this worker with nothing else on it."""
    return prefill_s(w, max(1, prompt_tokens), 0)


def unloaded_tpot_s(w: WorkerLoad) -> float:
    """Decode step of one sequence alone on this worker."""
    return step_s(w, 1, 1)


def handoff_s(kv_bytes_per_token: int, tokens: int, bytes_per_s: float = HANDOFF_BYTES_PER_S) -> float:
    """Copy time of a sequence's KV in a gpu->cpu hand-off at `bytes_per_s` (HandoffRate's figure)."""
    return kv_bytes_per_token * tokens / bytes_per_s


def blocks_needed(w: WorkerLoad, tokens: int) -> int:
    return math.ceil(tokens / w.block_size)


def fits(w: WorkerLoad, tokens: int) -> bool:
    """Whether the worker's whole cache can hold `tokens` (else it refuses the request)."""
    return blocks_needed(w, tokens) <= w.blocks_total


def fits_now(w: WorkerLoad, tokens: int) -> bool:
    """Whether its free blocks hold `tokens` now (else something is preempted to make room)."""
    return blocks_needed(w, tokens) <= w.blocks_free


def fits_committed(w: WorkerLoad, tokens: int) -> bool:
    """Whether `tokens` fit beside what its sequences will hold at their end (`blocks_committed`), so
    that none of them is preempted on the way there."""
    return blocks_needed(w, tokens) <= min(w.blocks_free, w.blocks_total - w.blocks_committed)
