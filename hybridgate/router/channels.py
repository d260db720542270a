"""What the parsers of output formats with channels share (`hybridgate.router.harmony`, `.gemma4`): the
markers' search, and a parser's record and its interface.

Such a parser has `ToolCallParser`'s interface: `feed(text)` and `finish()` return (the content to stream, one
`ToolCallDelta` per call sent); `take_reasoning()` returns the reasoning parsed since its last call. It sends a
call whole (id, name and arguments in one delta) once the call has ended, so `calls` holds complete calls only.
Its modes are methods `_in_MODE` that consume `_buf` as far as they can and say whether to go on.
"""

from __future__ import annotations

from hybridgate.router.toolparse import ToolCall, ToolCallDelta, new_call_id


def first_of(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """(index, marker) of the earliest marker in `text`, (-1, "") when none."""
    best, found = -1, ""
    for m in markers:
        at = text.find(m)
        if at >= 0 and (best < 0 or at < best):
            best, found = at, m
    return best, found


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is a proper start of one of `markers` (0: none); every
    marker begins with "<"."""
    at = text.find("<", max(0, len(text) - max(map(len, markers)) + 1))
    while at >= 0:
        tail = text[at:]
        if any(m.startswith(tail) and m != tail for m in markers):
            return len(text) - at
        at = text.find("<", at + 1)
    return 0


class ChannelParser:
    """Content, reasoning and calls of one output (see the module doc). `calls`: the complete calls so far;
    `content` and `reasoning`: all of each so far (lists of pieces)."""

    def __init__(self, mode: str) -> None:
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self._mode = mode
        self._buf = ""
        self._out: list[str] = []
        self._reasoning_out: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        while getattr(self, "_in_" + self._mode)():
            pass
        return self._take()

    def take_reasoning(self) -> str:
        out, self._reasoning_out = "".join(self._reasoning_out), []
        return out

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        out, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return out, deltas

    def _to_content(self, text: str) -> None:
        if text:
            self._out.append(text)
            self.content.append(text)

    def _to_reasoning(self, text: str) -> None:
        if text:
            self._reasoning_out.append(text)
            self.reasoning.append(text)

    def _send_call(self, name: str, arguments: str) -> None:
        call = ToolCall(len(self.calls), new_call_id(), name, arguments, complete=True)
        self.calls.append(call)
        self._deltas.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))
