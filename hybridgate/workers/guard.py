"""What a worker does with bad input: the checks an ADD must pass, and the count of what was refused.

A worker's queues between its threads are bounded too: a message past a
queue's bound is refused at once (an ADD with `queue_full`, which the router
places elsewhere; an export that fails, so the sequence decodes where it is)
and counted in `Refusals` (`hybridgate:worker_queue_refusals_total{worker,queue}`).

Nothing a router sends may reach the kernels unchecked or end a worker thread
(DESIGN.md, Errors and bad input): malformed or inconsistent messages are
dropped or answered with a `RequestError`, counted in `WireErrors` (exported as
`hybridgate:wire_decode_errors_total{side="worker"}` through the LOAD
heartbeat), and logged at most once per second per kind.
"""

from __future__ import annotations

import logging
import threading
import time

from hybridgate.wire import MAX_SEED, AddRequest, InvalidFieldError, PoolingType

log = logging.getLogger("hybridgate.worker")

MAX_REQUEST_ID_BYTES = 256


def check_add(request: AddRequest, vocab_size: int, max_model_len: int) -> None:
    """Raise if the ADD is not one a router could have sent for this model.

    Checks every field the engine and the kernels rely on: a prompt of 1 to
    max_model_len ids, each in [0, vocab_size); the sampling parameters within
    their limits (stop_token_ids within the vocabulary too); max_tokens >= 1 with prompt + max_tokens <= max_model_len; seed in
    [0, 2**64 - 1]; eos_token_id in [-1, vocab_size) (-1: none); first_token_index >= 0; pooling a PoolingType.

    Raises:
        InvalidFieldError: naming the field and its limit.
    """
    rid = request.request_id
    if not rid or len(rid.encode("utf-8", "replace")) > MAX_REQUEST_ID_BYTES:
        raise InvalidFieldError("request_id", f"must be 1 to {MAX_REQUEST_ID_BYTES} bytes, got {len(rid)} characters")
    ids = request.prompt_ids
    if not ids:
        raise InvalidFieldError("prompt_ids", "must not be empty")
    if len(ids) > max_model_len:
        raise InvalidFieldError("prompt_ids", f"at most {max_model_len} ids (max model length), got {len(ids)}")
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        raise InvalidFieldError("prompt_ids", f"every id must be in [0, {vocab_size}), got {low if low < 0 else high}")
    request.params.validate()
    bad_stop = [t for t in request.params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise InvalidFieldError("stop_token_ids", f"every id must be in [0, {vocab_size}), got {bad_stop[0]}")
    if request.max_tokens < 1:
        raise InvalidFieldError("max_tokens", f"must be >= 1, got {request.max_tokens}")
    if len(ids) + request.max_tokens > max_model_len:
        raise InvalidFieldError("max_tokens", f"prompt ({len(ids)}) + max_tokens ({request.max_tokens}) exceeds the "
                                f"max model length {max_model_len}")
    if not 0 <= request.seed <= MAX_SEED:
        raise InvalidFieldError("seed", f"must be in [0, 2**64 - 1], got {request.seed}")
    if not -1 <= request.eos_token_id < vocab_size:
        raise InvalidFieldError("eos_token_id", f"must be in [-1, {vocab_size}), got {request.eos_token_id}")
    if request.first_token_index < 0:
        raise InvalidFieldError("first_token_index", f"must be >= 0, got {request.first_token_index}")
    if not 0 <= request.deadline_s < float("inf"):  # NaN fails too
        raise InvalidFieldError("deadline_s", f"must be a finite number >= 0, got {request.deadline_s}")
    if request.pooling not in set(PoolingType):
        raise InvalidFieldError("pooling", f"must be one of {[int(p) for p in PoolingType]} (PoolingType), "
                                f"got {request.pooling}")


class Refusals:
    """Messages refused because a worker queue was at its bound, by queue name (both threads add)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._logged: dict[str, float] = {}

    def add(self, queue: str, bound: int) -> None:
        """Count one refusal by `queue` (full at `bound`); a warning at most once a second per queue."""
        now = time.monotonic()
        with self._lock:
            self._counts[queue] = self._counts.get(queue, 0) + 1
            if now - self._logged.get(queue, -1e18) < 1.0:
                return
            self._logged[queue] = now
            total = self._counts[queue]
        log.warning("the worker's %s queue is full (%d); refused a message (%d so far)", queue, bound, total)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class WireErrors:
    """Refused messages: one cumulative count (both worker threads add to it) and rate-limited logs.

    `record(kind, detail)` counts one message and logs a warning, at most one
    line per `interval_s` per kind; the next line for that kind says how many were
    suppressed in between.
    """

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._total = 0
        self._last_logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    @property
    def total(self) -> int:
        return self._total

    def record(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._total += 1
            if now - self._last_logged.get(kind, -1e18) < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last_logged[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        more = f" ({suppressed} more {kind} since the last such line)" if suppressed else ""
        log.warning("refused a message (%s): %s%s", kind, detail[:300], more)
