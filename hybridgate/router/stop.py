"""Stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Hold back text that may be the start of a stop string; cut at the first match.

    `push(text)` returns (text safe to emit, matched). The held-back tail is
    the longest suffix of the pending text that is a proper prefix of some
    stop string, so nothing before a stop string is lost and no part of one is
    emitted. `flush()` releases the tail when the stream ends another way.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._pending = ""
            return pending[: min(hits)], True
        keep = self._held_back(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text

    def _held_back(self, text: str) -> int:
        for n in range(min(len(text), max(len(s) for s in self.stops) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0
