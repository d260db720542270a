"""Stop strings matched across token boundaries."""

from __future__ import annotations

from collections.abc import Sequence

from hybridgate.models import IncrementalDetokenizer
from hybridgate.wire import FinishReason


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


def cut_text(detok: IncrementalDetokenizer, stop: StopMatcher, ids: list[int], finish: FinishReason | None,
             eos: int) -> tuple[str, list[int], FinishReason | None, bool]:
    """The text of a stream's next `ids` (the last ones when `finish` is set), cut at a stop string:
    (text, the ids taken up to and with the one that completed a stop, the finish reason, whether a stop
    matched). An EOS id that ends the stream adds no text; at the end the detokenizer's held bytes and
    the stop matcher's held text are flushed, and a stop that completes then finishes as STOP too."""
    parts, taken, stopped = [], [], False
    if not stop.stops:  # no stop string can cut the ids: detokenize them at once
        eos_last = finish == FinishReason.EOS and ids[-1:] == [eos]
        parts.append(detok.steps(ids[:-1] if eos_last else ids))
        taken, ids = ids, ()
    for k, tid in enumerate(ids):
        taken.append(tid)
        is_eos = finish == FinishReason.EOS and k == len(ids) - 1 and tid == eos
        text, matched = stop.push("" if is_eos else detok.step(tid))
        parts.append(text)
        if matched:
            finish, stopped = FinishReason.STOP, True
            break
    if finish is not None and not stopped:  # (a stop token id from the worker finishes as STOP, flushed here)
        text, matched = stop.push(detok.flush())
        if not matched:  # a stop held back behind one that can no longer complete still counts
            rest, matched = stop.flush()
            text += rest
        parts.append(text)
        finish = FinishReason.STOP if matched else finish
    return "".join(parts), taken, finish, stopped
