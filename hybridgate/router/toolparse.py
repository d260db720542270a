"""Tool calls out of streamed text: an incremental parser whose result does not depend on how the text is split.

A model writes its calls as text in its format (`CallSyntax`): free content, a
trigger (`<tool_call>`, `[TOOL_CALLS]`, ...), a JSON value holding one or more
call objects, an end marker, and again. `ToolCallParser.feed` takes the text of
each delta and returns the content to stream and a `ToolCallDelta` per call it
advanced; `finish` flushes what it held. Only a possible prefix of the trigger
(or of the end marker) is held back, so the stream never goes silent while the
parser waits.

A call's `arguments` are the exact text the model wrote for the value of its
`arguments` (or `parameters`) key, streamed as it arrives: the fragments of all
deltas concatenate to exactly the final `ToolCall.arguments`, whatever the
split (a value written as a JSON string is decoded, the same way). A call's
first delta carries its index, id and name; an arguments value written before
the name is held until the name is known.

The JSON is scanned leniently by `_Scanner` (RFC 8259's structure: strings with
escapes, objects, arrays, scalars); text that is not JSON never raises: a
trigger not followed by a JSON value is content, and a value cut short (the
token limit) leaves its call with the arguments written so far; a call cut
before its name is no call, and an end marker cut short is not content.
"""

from __future__ import annotations

import re
import secrets
import string
from dataclasses import dataclass, field

from hybridgate.router.jsonstring import StringDecoder, decode_raw

_STRING_STOP = re.compile(r'["\\]')
_SCALAR_CHARS = frozenset(string.ascii_letters + string.digits + "+-.")
_WS = " \t\r\n"
_ID_ALPHABET = string.ascii_letters + string.digits
ANY = "*"  # a path step matching every index of an array


def new_call_id() -> str:
    """A fresh OpenAI-style call id: `call_` and 24 random letters and digits (unique per call): 143 random
    bits in base 62, one call to the system's generator."""
    n, digits = secrets.randbits(143), []
    for _ in range(24):
        n, d = divmod(n, 62)
        digits.append(_ID_ALPHABET[d])
    return "call_" + "".join(digits)


@dataclass(frozen=True)
class CallSyntax:
    """How one format writes calls (one row of the formats table, `hybridgate.router.tools.FORMATS`).

    trigger: the text that opens a call region ("": the region opens at the start of the output).
    keep_trigger: the trigger is the start of the JSON value itself (Llama 3's `{"name"`).
    end: the text that closes a region after its JSON value ("" for none).
    calls_at: JSON paths of call objects inside the region's value (`ANY` matches an array index).
    content_at: the path of a string value that is content (the generic envelope's `response`).
    repeat: a region may follow another; otherwise the rest after the first region is content.
    gap: characters between two regions (or after the last) that are no content (blanks, Llama 3's `;`).
    """

    trigger: str
    end: str = ""
    keep_trigger: bool = False
    calls_at: tuple[tuple, ...] = ((),)
    content_at: tuple | None = None
    repeat: bool = True
    gap: str = _WS
    name_keys: tuple[str, ...] = ("name",)
    argument_keys: tuple[str, ...] = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCallDelta:
    """What one delta adds to call `index`: its first carries `id` and `name` (None later)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    """One parsed call: `arguments` is the JSON text of its arguments; `complete` once the call's JSON
    object has closed (a call the output ended inside is not)."""

    index: int
    id: str
    name: str = ""
    arguments: str = ""
    complete: bool = False


class _Capture:
    """The text of one JSON value being captured: raw (arguments as written) or decoded (a string's text)."""

    def __init__(self, depth: int, decoded: bool):
        self.depth = depth  # the scanner's stack depth where the value began
        self.decoder = StringDecoder() if decoded else None
        self.text: list[str] = []

    def push(self, raw: str, closed: bool = False) -> str:
        out = self.decoder.push(raw, closed) if self.decoder is not None else raw
        if out:
            self.text.append(out)
        return out


class _Frame:
    __slots__ = ("close", "key", "expect", "call")

    def __init__(self, close: str, call: _CallState | None):
        self.close = close  # "}" or "]"
        self.key: str | int = 0 if close == "]" else ""
        self.expect = "value" if close == "]" else "key"  # key, colon, value, comma
        self.call = call  # the call this object is, if it is one


@dataclass
class _CallState:
    call: ToolCall
    announced: bool = False
    held: list[str] = field(default_factory=list)  # arguments written before the name was known


class _Scanner:
    """One region's JSON value, scanned incrementally; calls and content are reported to its parser.

    A stack of open containers; inside a string, runs of plain characters are skipped by one regex
    search. One value at a time is captured (a call's name or arguments, or content): `_mark` is
    where its text starts within the current feed."""

    def __init__(self, parser: ToolCallParser):
        self.p, self.syntax = parser, parser.syntax
        self.stack: list[_Frame] = []
        self.started = self.done = False
        self.in_string = self.escape = self.in_scalar = False
        self.key_raw: list[str] | None = None
        self.capture: _Capture | None = None
        self.capture_role = ""  # "name", "arguments" or "content"
        self.capture_call: _CallState | None = None
        self._mark = 0

    def feed(self, text: str) -> int:
        """Scan `text`: the index just past the end of the value, -1 when it goes on, -2 when the
        region does not begin with an object or an array (it is not a call)."""
        i, n = 0, len(text)
        self._mark = 0
        while i < n and not self.done:
            if self.in_string:
                i = self._string(text, i)
                continue
            c = text[i]
            if self.in_scalar:
                if c in _SCALAR_CHARS:
                    i += 1
                    continue
                self.in_scalar = False
                self._value_end(text, i)
                continue
            if c in _WS:
                i += 1
            elif not self.started:
                if c not in "{[":
                    return -2
                self._begin_value(c, i)
                i += 1
            elif self.stack and (self.stack[-1].expect != "value" or c == self.stack[-1].close):
                self._punctuation(c, text, i)
                i += 1
            else:
                self._begin_value(c, i)
                i += 1
        if self.done:
            return i
        if self.capture is not None:
            self._push_capture(text[self._mark :])
        return -1

    def _string(self, text: str, i: int) -> int:
        """Advance inside a string from `i`; the index after what was consumed."""
        if self.escape:
            self.escape = False
            if self.key_raw is not None:
                self.key_raw.append(text[i])
            return i + 1
        m = _STRING_STOP.search(text, i)
        end = m.start() if m else len(text)
        if self.key_raw is not None:
            self.key_raw.append(text[i:end])
        if m is None:
            return end
        if m.group() == "\\":
            self.escape = True
            if self.key_raw is not None:
                self.key_raw.append("\\")
            return end + 1
        self.in_string = False
        if self.key_raw is not None:  # a key ended
            self.stack[-1].key, self.key_raw = decode_raw("".join(self.key_raw)), None
            self.stack[-1].expect = "colon"
        else:
            self._value_end(text, end + 1)
        return end + 1

    def _punctuation(self, c: str, text: str, i: int) -> None:
        top = self.stack[-1]
        if c == top.close:
            self.stack.pop()
            if top.call is not None:
                self.p._call_closed(top.call)
            self._value_end(text, i + 1)
        elif top.expect == "key" and c == '"':
            self.key_raw, self.in_string = [], True
        elif top.expect == "colon" and c == ":":
            top.expect = "value"
        elif top.expect == "comma" and c == ",":
            if top.close == "]":
                top.key, top.expect = top.key + 1, "value"
            else:
                top.expect = "key"
        # anything else is not JSON (only an output without a grammar writes it): skipped

    def _begin_value(self, c: str, i: int) -> None:
        """A value begins at text[i]: a call, a captured value (name, arguments, content) or neither."""
        self.started = True
        parent = self.stack[-1] if self.stack else None
        if parent is not None:
            parent.expect = "comma"
        if self.capture is None:
            self._maybe_capture(parent, c, i)
        if c in "{[":
            call = None
            if c == "{" and self.capture is None and _matches(tuple(f.key for f in self.stack), self.syntax.calls_at):
                call = self.p._call_opened()
            self.stack.append(_Frame("}" if c == "{" else "]", call))
        elif c == '"':
            self.in_string = True
        else:
            self.in_scalar = True

    def _maybe_capture(self, parent: _Frame | None, c: str, i: int) -> None:
        depth = len(self.stack)
        if parent is not None and parent.call is not None:
            if parent.key in self.syntax.name_keys and c == '"':
                self._start_capture(parent.call, "name", depth, True, i)
            elif parent.key in self.syntax.argument_keys:
                self._start_capture(parent.call, "arguments", depth, c == '"', i)
        elif c == '"' and self.syntax.content_at is not None and \
                _matches(tuple(f.key for f in self.stack), (self.syntax.content_at,)):
            self._start_capture(None, "content", depth, True, i)

    def _start_capture(self, call: _CallState | None, role: str, depth: int, decoded: bool, i: int) -> None:
        self.capture, self.capture_role, self.capture_call = _Capture(depth, decoded), role, call
        self._mark = i

    def _value_end(self, text: str, end: int) -> None:
        """A value ended just before text[end]: close the capture it ends, and the region at the top."""
        if self.capture is not None and len(self.stack) == self.capture.depth:
            self._push_capture(text[self._mark : end], closed=True)
            capture, role, call = self.capture, self.capture_role, self.capture_call
            self.capture = self.capture_call = None
            if role == "name":
                call.call.name = "".join(capture.text)
                self.p._announce(call)
        if not self.stack:
            self.done = True

    def _push_capture(self, raw: str, closed: bool = False) -> None:
        out = self.capture.push(raw, closed)
        if self.capture_role == "arguments":
            self.p._arguments(self.capture_call, out)
        elif self.capture_role == "content":
            self.p._emit_content(out)

    def flush(self) -> None:
        """The output ended inside this value: a scalar at its end is whole; the rest stays as written."""
        if self.in_scalar and self.capture is not None and len(self.stack) == self.capture.depth:
            self.in_scalar = False
            self._value_end("", 0)
        for frame in reversed(self.stack):
            if frame.call is not None:
                self.p._call_cut(frame.call)


def _matches(path: tuple, patterns) -> bool:
    return any(pattern is not None and len(pattern) == len(path) and
               all(p == k or (p == ANY and isinstance(k, int)) for p, k in zip(pattern, path))
               for pattern in patterns)


class ToolCallParser:
    """Content and calls of one output, fed delta by delta (see the module doc).

    `feed(text)` and `finish()` return (content, deltas): the content to stream now, and one
    `ToolCallDelta` per call advanced. `calls` holds the calls so far; `content` all content so far.
    """

    def __init__(self, syntax: CallSyntax):
        self.syntax = syntax
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self._mode = "content"  # content | gap | region | tail | plain
        self._held = ""  # content: a possible start of the trigger; tail: a possible start of the end
        self._scanner: _Scanner | None = None
        self._pre = ""  # region: the trigger and blanks read before its value began
        self._out: list[str] = []
        self._deltas: dict[int, list] = {}  # index -> [id, name, [arguments fragments]] of this feed
        if syntax.trigger == "":
            self._open_region("")

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        while text:
            text = getattr(self, "_in_" + self._mode)(text)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: a held trigger's start is content, unless it follows a call (then it is the start of
        the next call's markup, as a held end marker is); a region cut short keeps its named calls."""
        if self._mode == "content":
            self._emit_content(self._held)  # a trigger's start that the output did not finish
        elif self._mode == "region":
            if self._scanner.started:
                self._scanner.flush()
            else:
                self._emit_content(self._pre)
        self._held, self._mode = "", "plain"
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content = "".join(self._out)
        deltas = [ToolCallDelta(i, d[0], d[1], "".join(d[2])) for i, d in self._deltas.items()]
        self._out, self._deltas = [], {}
        return content, deltas

    # --- modes: each takes text and returns what is left for the next mode ---

    def _in_plain(self, text: str) -> str:
        self._emit_content(text)
        return ""

    def _in_content(self, text: str) -> str:
        text, self._held = self._held + text, ""
        trigger = self.syntax.trigger
        at = text.find(trigger)
        if at >= 0:
            self._emit_content(text[:at])
            self._open_region(trigger)
            return text[at:] if self.syntax.keep_trigger else text[at + len(trigger) :]
        keep = _partial_suffix(text, trigger)
        self._emit_content(text[: len(text) - keep])
        self._held = text[len(text) - keep :]
        return ""

    def _in_gap(self, text: str) -> str:
        """After a region: its separators are held; dropped before the next trigger or at the end."""
        text, self._held = self._held + text, ""
        body = text.lstrip(self.syntax.gap)
        if not body or self.syntax.trigger.startswith(body):
            self._held = text
            return ""
        self._mode = "content"
        return body if body.startswith(self.syntax.trigger) else text

    def _open_region(self, trigger: str) -> None:
        self._mode, self._scanner = "region", _Scanner(self)
        self._pre = "" if self.syntax.keep_trigger else trigger

    def _in_region(self, text: str) -> str:
        scanner = self._scanner
        was_started = scanner.started
        end = scanner.feed(text)
        if end == -2:  # not a call after all: the trigger and what followed are content
            blanks = len(text) - len(text.lstrip(_WS))
            self._emit_content(self._pre + text[:blanks])
            self._mode = "content" if self.syntax.repeat and self.syntax.trigger else "plain"
            rest = text[blanks:]
            if self._mode == "content" and rest.startswith(self.syntax.trigger):
                self._emit_content(rest[: len(self.syntax.trigger)])  # the same trigger cannot open a region twice
                rest = rest[len(self.syntax.trigger) :]
            return rest
        if not was_started and not scanner.started:
            self._pre += text
        if end == -1:
            return ""
        self._mode = "tail" if self.syntax.end else self._after_region()
        return text[end:]

    def _after_region(self) -> str:
        return "gap" if self.syntax.repeat and self.syntax.trigger else "plain"

    def _in_tail(self, text: str) -> str:
        text, self._held = self._held + text, ""
        body = text.lstrip(_WS)
        end = self.syntax.end
        if body.startswith(end):
            self._mode = self._after_region()
            return body[len(end) :]
        if end.startswith(body):
            self._held = text
            return ""
        self._mode = self._after_region()  # no end marker: lenient
        return text

    # --- reported by the scanner ---

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.append(text)
            self.content.append(text)

    def _call_opened(self) -> _CallState:
        call = ToolCall(len(self.calls), new_call_id())
        self.calls.append(call)
        return _CallState(call)

    def _announce(self, state: _CallState) -> None:
        if state.announced:
            return
        state.announced = True
        call = state.call
        self._deltas[call.index] = [call.id, call.name, list(state.held)]
        state.held.clear()

    def _arguments(self, state: _CallState, text: str) -> None:
        if not text:
            return
        state.call.arguments += text
        if state.announced:
            self._deltas.setdefault(state.call.index, [None, None, []])[2].append(text)
        else:
            state.held.append(text)

    def _call_closed(self, state: _CallState) -> None:
        state.call.complete = True
        self._announce(state)  # a call without a name is announced with an empty one

    def _call_cut(self, state: _CallState) -> None:
        """The output ended inside this call: kept if its name was written, else no call at all (nothing of it
        was streamed: a call is announced with its name)."""
        if state.announced:
            return
        if state.call.name:
            self._announce(state)
        else:
            self.calls.remove(state.call)


def _partial_suffix(text: str, trigger: str) -> int:
    """The length of the longest end of `text` that is a proper start of `trigger` (0 when none): only the
    places of the trigger's first character are tried, so plain text costs one `find`."""
    if not trigger:
        return 0
    at = text.find(trigger[0], max(0, len(text) - len(trigger) + 1))
    while at >= 0:
        if trigger.startswith(text[at:]):
            return len(text) - at
        at = text.find(trigger[0], at + 1)
    return 0
