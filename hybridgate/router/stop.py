"""Stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Cut streamed text at the earliest-starting stop string, wherever the pieces were cut.

    Spec: for the whole text T of a stream, the stream stops at
    P = min over stops s of T.find(s) (the earliest position where any stop
    string starts); the output is T[:P], or all of T when no stop occurs.
    Stops starting at the same position give the same cut, so ties need no
    rule: the first one to complete ends the stream. The answer depends only
    on T, never on how T was cut into pieces.

    Streaming it: `push(text)` returns (text safe to emit, matched). A
    completed match at p ends the stream only when no stop string that starts
    before p can still complete (an "open" start: the pending text from there
    on is a proper prefix of some stop). Text from the earliest open start on
    is held back; everything before it can start no match, whatever follows.
    So nothing before the cut is lost and no part of a stop is emitted.
    `flush()` ends the stream another way (EOS, length): open starts can then
    never complete, so a complete match held behind one still cuts the text.

    Example: stops ["a", "\\naa"] over "\\naa" give "" however it is cut: after
    "\\na" the match "a" at 1 waits, since "\\naa" may still start at 0; if
    the stream ends after "\\na", flush() gives "\\n" and a match.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        pending = self._pending + text
        done = min((i for i in (pending.find(s) for s in self.stops) if i >= 0), default=None)
        open_at = self._earliest_open(pending)
        if done is not None and (open_at is None or done <= open_at):
            self._pending = ""
            return pending[:done], True
        cut = len(pending) if open_at is None else open_at
        self._pending = pending[cut:]
        return pending[:cut], False

    def flush(self) -> tuple[str, bool]:
        """End of stream: (the held text up to its earliest complete match, True), or (all of it, False)."""
        text, self._pending = self._pending, ""
        done = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=None)
        return (text, False) if done is None else (text[:done], True)

    def _earliest_open(self, text: str) -> int | None:
        """The smallest i where text[i:] is a proper prefix of some stop (it may still complete)."""
        for n in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-n:]
            if any(len(s) > n and s.startswith(tail) for s in self.stops):
                return len(text) - n
        return None
