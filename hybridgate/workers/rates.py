"""A worker's measured speeds, as moving medians by step size, for the router's cost model.

Two small tables, each a window of the last `window` measurements per bucket:

- prefill: a step that ran a prompt chunk, keyed by the tokens of the whole
  step (power-of-two bucket, nearest in log scale), valued in tokens/s;
- decode: a decode-only step, keyed by its sequences (exact up to 8, then
  power-of-two buckets), valued in seconds per step.

Medians rather than means, since a step on a shared machine is sometimes
descheduled; the warm-up measurement (`EngineCore.measure_rates`) seeds both
tables so the first request is placed on measured figures.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


def prefill_bucket(tokens: int) -> int:
    """Power-of-two bucket of a step's token count (nearest in log scale, at least 1)."""
    return 1 << max(0, round(math.log2(max(1, tokens))))


def decode_bucket(batch: int) -> int:
    """Bucket of a decode step's batch size: exact up to 8, then the nearest power of two."""
    return batch if batch <= 8 else prefill_bucket(batch)


class RateTable:
    """Moving medians by bucket; `medians` is the dict a load report carries."""

    def __init__(self, bucket, window: int = 15):
        self._bucket, self._window = bucket, window
        self._samples: dict[int, deque[float]] = {}
        self.medians: dict[int, float] = {}

    def record(self, size: int, value: float) -> None:
        """One measurement (`value`: tokens/s or seconds) of a step of `size` tokens or sequences."""
        if not math.isfinite(value) or value <= 0:
            return
        key = self._bucket(size)
        window = self._samples.setdefault(key, deque(maxlen=self._window))
        window.append(value)
        self.medians[key] = statistics.median(window)


class StepRates:
    """The two tables of one engine, fed one step at a time."""

    def __init__(self, window: int = 15):
        self.prefill = RateTable(prefill_bucket, window)  # step tokens → tokens/s
        self.decode = RateTable(decode_bucket, window)  # batch size → seconds per step

    def record_step(self, num_tokens: int, batch_size: int, has_prefill: bool, seconds: float) -> None:
        """A step that ran `num_tokens` tokens for `batch_size` sequences in `seconds`."""
        if seconds <= 0:
            return
        if has_prefill:
            self.prefill.record(num_tokens, num_tokens / seconds)
        else:
            self.decode.record(batch_size, seconds)
