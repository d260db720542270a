"""A stream's outputs in token-index order, each index once: what lets a request take outputs
from two workers during a KV hand-off (hybridgate/router/handoff.py)."""

from __future__ import annotations

import time

from hybridgate.wire import SeqOutput


class Reorder:
    """Outputs of one request in token-index order, each index once.

    `push(out)` returns the outputs now deliverable, trimmed so that the first
    id of each is at the next expected index; outputs wholly before it are
    duplicates and dropped; outputs past it wait (a gap). `gap_since` is the
    monotonic time the oldest waiting gap opened, None when nothing waits.
    """

    def __init__(self, next_index: int = 0):
        self.next_index = next_index
        self.duplicates = 0
        self.finished = False  # a finishing output was passed on: nothing more is
        self._held: dict[int, SeqOutput] = {}
        self.gap_since: float | None = None

    def push(self, out: SeqOutput) -> list[SeqOutput]:
        if self.finished:
            self.duplicates += 1
            return []
        if out.token_index > self.next_index:
            held = self._held.get(out.token_index)
            if held is None or len(out.token_ids) > len(held.token_ids) or out.finish:
                self._held[out.token_index] = out
            if self.gap_since is None:
                self.gap_since = time.monotonic()
            return []
        ready = []
        trimmed = self._trim(out)
        if trimmed is not None:
            ready.append(trimmed)
        while self._held and not self.finished:
            waiting = [i for i in self._held if i <= self.next_index]
            if not waiting:
                break
            for i in sorted(waiting):
                trimmed = self._trim(self._held.pop(i))
                if trimmed is not None:
                    ready.append(trimmed)
        if self.finished:
            self._held.clear()
        self.gap_since = (self.gap_since or time.monotonic()) if self._held else None
        return ready

    def _trim(self, out: SeqOutput) -> SeqOutput | None:
        skip = self.next_index - out.token_index
        ids = out.token_ids[skip:]
        if self.finished or (not ids and not (out.finish and skip == len(out.token_ids))):
            self.duplicates += 1
            return None
        if skip:
            out = out.tail(skip, self.next_index)
        self.next_index += len(ids)
        self.finished = bool(out.finish)
        return out
