"""Admission control: at most N requests in flight per gateway, and the retry pushback of a refusal.

A request counts once per choice it asks for (an HTTP call with `n` choices, or
several prompts, takes as many slots: each is a sequence on a worker).

A request over the limit is refused at once (RESOURCE_EXHAUSTED) rather than
queued, so that a load balancer in front learns to go elsewhere. The refusal
carries `grpc-retry-pushback-ms`, the trailer gRPC's retry policy reads
(gRFC A6, "Retry pushback"): how long until a slot is expected to free,
computed from the measured drain rate, not a constant:

- with at least two completions in the last `window` ones: the mean interval
  between them (completions per second, inverted), times how many slots the
  caller waits for (1 + callers already refused within that interval);
- before that, from the token rate the gateway streams: a request of `m`
  tokens frees its slot after about `m` tokens, so requests finish at about
  token_rate / mean(max_tokens of the requests in flight) per second;
- before any token has been streamed (nothing is measured yet), START_MS.

The result is bounded to [1 ms, MAX_MS].
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

START_MS = 1000  # nothing measured yet: one second
MAX_MS = 60_000


class Admission:
    """Counts requests in flight against `limit` and measures how fast they drain.

    Single-threaded (the gateway's event loop); `clock` is injectable for tests.
    """

    def __init__(self, limit: int, window: int = 64, clock: Callable[[], float] = time.monotonic):
        if limit < 1:
            raise ValueError(f"max_inflight_requests: must be >= 1, got {limit}")
        self.limit, self.clock = limit, clock
        self.inflight = 0
        self._max_tokens_sum = 0  # of the requests in flight
        self._done: deque[float] = deque(maxlen=window)  # completion times
        self._tokens: deque[tuple[float, int]] = deque(maxlen=4 * window)  # (time, ids streamed)
        self._refused: deque[float] = deque(maxlen=4 * window)  # refusal times

    def try_enter(self, max_tokens: int, slots: int = 1) -> bool:
        """Take `slots` slots (one per choice) for choices of up to `max_tokens` ids each; False, taking
        none, when fewer than `slots` of the `limit` are free."""
        if self.inflight + slots > self.limit:
            self._refused.append(self.clock())
            return False
        self.inflight += slots
        self._max_tokens_sum += max_tokens * slots
        return True

    def leave(self, max_tokens: int, slots: int = 1) -> None:
        """Give back what `try_enter(max_tokens, slots)` took (however the request ended)."""
        self.inflight -= slots
        self._max_tokens_sum -= max_tokens * slots
        now = self.clock()
        self._done.extend([now] * slots)

    def streamed(self, n: int, now: float | None = None) -> None:
        """`n` ids went out to a client at `now` (the clock's time; None: read it) (feeds the token-rate
        estimate)."""
        self._tokens.append((self.clock() if now is None else now, n))

    def drain_rate(self) -> float | None:
        """Requests finishing per second as measured now, or None when nothing is measured."""
        if len(self._done) >= 2 and self._done[-1] > self._done[0]:
            return (len(self._done) - 1) / (self._done[-1] - self._done[0])
        if len(self._tokens) >= 2 and self.inflight:
            span = self._tokens[-1][0] - self._tokens[0][0]
            if span > 0:
                token_rate = sum(n for _, n in list(self._tokens)[1:]) / span
                return token_rate / max(1.0, self._max_tokens_sum / self.inflight)
        return None

    def pushback_ms(self) -> int:
        """Milliseconds until a slot is expected to free for a caller refused now (see the module doc)."""
        rate = self.drain_rate()
        if rate is None or rate <= 0:
            return START_MS
        interval = 1.0 / rate
        now = self.clock()
        ahead = sum(1 for t in self._refused if now - t < interval)  # refused callers that retry before this one
        return int(min(MAX_MS, max(1, math.ceil(1e3 * interval * max(1, ahead)))))
