"""A worker's measured speeds, as moving medians by step size, for the router's cost model.

Two small tables, each a window of the last `window` measurements per bucket:

- prefill: a step that ran a prompt chunk, keyed by the tokens of the whole
  step (power-of-two bucket, nearest in log scale), valued in tokens/s;
- decode: a decode-only step, keyed by its sequences (exact up to 8, then
  power-of-two buckets), valued in seconds per step.

Medians rather than means, since a step on a shared machine is sometimes
descheduled; the warm-up measurement (`EngineCore.measure_rates`) seeds both
tables so the first request is placed on measured figures.

`StepCost` reads the two tables as a step-time model, which the scheduler uses
to size the prompt chunk of a step that carries decodes; `ContextCost` adds what
a prompt token's attention over a long context costs beyond them, fitted to the
mixed steps the engine runs.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


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


MIN_CONTEXT = 256  # mean context position from which a mixed step informs the context term


class ContextCost:
    """The context term of the step-time model: a prompt token at context position c costs
    `token_s * (1 + slope * c)`, its attention reading c keys beside the weights every token reads.

    `slope` (per context position) is the median of the last `window` observations, each from a
    step that ran decodes and prompt tokens at a mean context position of at least MIN_CONTEXT:
    r = (step_s - decode_s) / (prompt_tokens * token_s), the measured cost of a prompt token over
    the context-free model's, gives slope = (r - 1) / mean_context (0 where r <= 1). It is read
    against the `token_s` of the moment, so it stays consistent as the rate tables move. 0 before
    any such step. Source: the linear attention term of Vidur's step-time model (Agrawal et al.,
    MLSys 2024), fitted online instead of profiled.
    """

    def __init__(self, window: int = 15):
        self._observed: deque[float] = deque(maxlen=window)
        self.slope = 0.0

    def observe(self, step_s: float, decode_s: float, prompt_tokens: int, token_s: float,
                mean_context: float) -> None:
        """One mixed step: `step_s` seconds for its decodes (predicted `decode_s`) and `prompt_tokens`
        prompt tokens at `mean_context` on average, each predicted at `token_s` without context."""
        if prompt_tokens < 1 or mean_context < MIN_CONTEXT or token_s <= 0 or not math.isfinite(step_s):
            return
        ratio = (step_s - decode_s) / (prompt_tokens * token_s)
        self._observed.append(max(0.0, (ratio - 1) / mean_context))
        self.slope = statistics.median(self._observed)

    def factor(self, context: float) -> float:
        """A prompt token's cost at mean context position `context`, over the context-free model's."""
        return 1 + self.slope * max(0.0, context)


@dataclass(frozen=True)
class StepCost:
    """A step's time predicted from measured rates; the two tables are `StepRates`' medians, read live.

    decode_step_s: {batch size: seconds} of decode-only steps. prefill_tokens_per_s: {step tokens:
    tokens/s} of steps that ran a prompt chunk. The model is affine in the prompt tokens of a step,
    as the step-time models of Sarathi-Serve (Agrawal et al., OSDI 2024) and Vidur (Agrawal et al.,
    MLSys 2024) are: a step of `b` decodes and `p` prompt tokens from context position `c` takes
    `decode_s(b) + p * token_s * context.factor(c + (p - 1) / 2)`, the decode step paying for the
    weights' read and each prompt token for its compute and its attention over `c` keys and more.
    """

    decode_step_s: Mapping[int, float]
    prefill_tokens_per_s: Mapping[int, float]
    context: ContextCost = field(default_factory=ContextCost)

    def decode_s(self, batch: int) -> float | None:
        """Seconds of a decode step of `batch` sequences: linear between the measured batch sizes,
        the nearest one's beyond them; None before any decode step was measured."""
        table = sorted(self.decode_step_s.items())
        if not table:
            return None
        below = [(b, s) for b, s in table if b <= batch] or table[:1]
        above = [(b, s) for b, s in table if b >= batch] or table[-1:]
        (b0, s0), (b1, s1) = below[-1], above[0]
        return s0 if b1 == b0 else s0 + (batch - b0) * (s1 - s0) / (b1 - b0)

    def token_s(self, tokens: int) -> float | None:
        """Marginal seconds of one prompt token in a step of `tokens` tokens, from the measured step size
        nearest in log scale (ties: the smaller): `(n / rate(n) - decode_s(1)) / (n - 1)`, or the mean
        `1 / rate(n)` where noise makes that not positive. None without a prefill step of 2 tokens or
        more, or without a decode step."""
        sizes = [n for n in self.prefill_tokens_per_s if n >= 2]
        one = self.decode_s(1)
        if not sizes or one is None:
            return None
        n = min(sorted(sizes), key=lambda k: abs(math.log2(k) - math.log2(max(1, tokens))))
        step = n / self.prefill_tokens_per_s[n]
        marginal = (step - one) / (n - 1)
        return marginal if marginal > 0 else 1 / self.prefill_tokens_per_s[n]

    def prefill_budget(self, decodes: int, factor: float, floor: int, context: int = 0) -> int | None:
        """Most prompt tokens a step carrying `decodes` decodes may run, from context position
        `context`, so that it takes at most `factor` x the decode step alone:
        `(factor - 1) * decode_s(decodes) / (token_s * context.factor(context + (p - 1) / 2))`, with
        `token_s` and the context factor read at `p = floor` and then again at that first answer;
        never below `floor`. None (no limit from this model) without the figures it needs."""
        step = self.decode_s(decodes)
        if step is None:
            return None
        tokens = floor
        for _ in range(2):
            cost = self.token_s(decodes + tokens)
            if cost is None:
                return None
            cost *= self.context.factor(context + (tokens - 1) / 2)
            tokens = max(floor, int((factor - 1) * step / cost))
        return tokens
