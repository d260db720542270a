"""Gemma 4's output: thinking, content and tool calls out of streamed text, whatever the split.

Gemma 4's chat template (google/gemma-4 `chat_template.jinja`, its `format_argument`
macro) and its function-calling docs write a call as
`<|tool_call>call:NAME{key:VALUE,...}<tool_call|>`, one block per call, and the
thinking as `<|channel>thought\\n...<channel|>`; all of these markers are control
tokens, whose text the detokenizer keeps for a chat in this format. The
arguments are not JSON: keys are bare, a string is written between two `<|"|>`
tokens with nothing escaped, objects `{k:v,...}` and arrays `[v,...]` nest,
and numbers, `true`, `false` and `null` are bare (`parse_arguments` reads them,
also a JSON-quoted string where a model writes one, and turns them into JSON).

`Gemma4Parser` is a `channels.ChannelParser`; the thought channel's name (its
first line) is not part of the reasoning.
Only a possible start of a marker is held back; a call is held until its
`<tool_call|>` and then sent whole. A block whose body does not parse is content
as written (as a trigger without a call is in `toolparse`); a block the output
ends inside is no call and no content. The turn's end, `<turn|>` or (after its
calls, the model waiting for their results) `<|tool_response>`, is a stop token
whose text comes last: it and anything after it are neither content nor thinking.
"""

from __future__ import annotations

import json
import re

from hybridgate.router.channels import ChannelParser, first_of, held_prefix
from hybridgate.router.toolparse import ToolCallDelta

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>", "<channel|>"
TURN_ENDS = ("<turn|>", "<|tool_response>")  # stop tokens, whose text a stream keeping control tokens has
_OPENERS = (CALL_OPEN, THOUGHT_OPEN, *TURN_ENDS)
_THOUGHT_ENDS = (THOUGHT_CLOSE, *TURN_ENDS)
_CALL_ENDS = (CALL_CLOSE, *TURN_ENDS)
_CALL = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\s*(\{.*\})\s*", re.S)
_BARE_END = re.compile(r"[,}\]:]")
_WS = " \t\r\n"


class _Syntax(ValueError):
    """The arguments are not in Gemma 4's syntax."""


def parse_arguments(text: str) -> object:
    """The value of a call's arguments (`{key:VALUE,...}` as Gemma 4 writes it) as Python data (json's types).
    Raises ValueError when `text` is not one whole value in that syntax."""
    value, end = _value(text, _skip(text, 0))
    if _skip(text, end) != len(text):
        raise _Syntax(f"text after the value at {end}")
    return value


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value(text: str, i: int) -> tuple[object, int]:
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise _Syntax(f"a string opened at {i} is not closed")
        return text[i + len(QUOTE): end], end + len(QUOTE)
    if i >= len(text):
        raise _Syntax("a value is missing at the end")
    c = text[i]
    if c == '"':
        return json.JSONDecoder().raw_decode(text, i)
    if c == "{":
        return _container(text, i, "}", keyed=True)
    if c == "[":
        return _container(text, i, "]", keyed=False)
    m = _BARE_END.search(text, i)
    end = m.start() if m else len(text)
    word = text[i:end].strip()
    if not word:
        raise _Syntax(f"a value is missing at {i}")
    try:
        return json.loads(word), end  # a number, true, false or null
    except ValueError:
        return word, end  # a bare word: a string, as a lenient reader takes it


def _container(text: str, i: int, close: str, keyed: bool) -> tuple[object, int]:
    out: dict | list = {} if keyed else []
    i = _skip(text, i + 1)
    if text.startswith(close, i):
        return out, i + 1
    while True:
        if keyed:
            key, i = _key(text, i)
            value, i = _value(text, _skip(text, i))
            out[key] = value
        else:
            value, i = _value(text, i)
            out.append(value)
        i = _skip(text, i)
        if text.startswith(close, i):
            return out, i + 1
        if not text.startswith(",", i):
            raise _Syntax(f"expected ',' or {close!r} at {i}")
        i = _skip(text, i + 1)


def _key(text: str, i: int) -> tuple[str, int]:
    if text.startswith(QUOTE, i) or text.startswith('"', i):
        key, i = _value(text, i)
    else:
        colon = text.find(":", i)
        if colon < 0:
            raise _Syntax(f"a key at {i} has no ':'")
        key, i = text[i:colon].strip(), colon
    i = _skip(text, i)
    if not isinstance(key, str) or not key or not text.startswith(":", i):
        raise _Syntax(f"expected a key and ':' at {i}")
    return key, i + 1


class Gemma4Parser(ChannelParser):
    """Content, thinking and calls of one Gemma 4 output, fed delta by delta (see the module doc)."""

    def __init__(self) -> None:
        super().__init__("content")  # content | thought_name | thought | call | ended

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: held text is content (or thinking) as written; a call block not closed is dropped."""
        if self._mode == "content":
            self._to_content(self._buf)
        elif self._mode == "thought":
            self._to_reasoning(self._buf)
        self._buf, self._mode = "", "content"
        return self._take()

    # --- modes ---

    def _in_content(self) -> bool:
        at, marker = first_of(self._buf, _OPENERS)
        if at < 0:
            keep = held_prefix(self._buf, _OPENERS)
            self._to_content(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._to_content(self._buf[:at])
        self._buf = self._buf[at + len(marker):]
        self._mode = "call" if marker == CALL_OPEN else "thought_name" if marker == THOUGHT_OPEN else "ended"
        return True

    def _in_thought_name(self) -> bool:
        """The channel's name, up to its newline (or the channel's end), is not thinking."""
        at, marker = first_of(self._buf, ("\n", THOUGHT_CLOSE))
        if at < 0:
            return False
        self._buf = self._buf[at + (1 if marker == "\n" else 0):]
        self._mode = "thought"
        return True

    def _in_thought(self) -> bool:
        at, marker = first_of(self._buf, _THOUGHT_ENDS)
        if at < 0:
            keep = held_prefix(self._buf, _THOUGHT_ENDS)
            self._to_reasoning(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._to_reasoning(self._buf[:at])
        self._buf, self._mode = self._buf[at + len(marker):], "content" if marker == THOUGHT_CLOSE else "ended"
        return True

    def _in_ended(self) -> bool:
        """After the turn's end (its stop token's text): nothing more is the answer's."""
        self._buf = ""
        return False

    def _in_call(self) -> bool:
        at, marker = first_of(self._buf, _CALL_ENDS)
        if at < 0:
            return False
        if marker != CALL_CLOSE:  # the turn ended inside the block: cut, no call
            self._buf, self._mode = "", "ended"
            return False
        body, self._buf, self._mode = self._buf[:at], self._buf[at + len(CALL_CLOSE):], "content"
        m = _CALL.fullmatch(body)
        try:
            arguments = parse_arguments(m.group(2)) if m is not None else None
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            self._to_content(CALL_OPEN + body + CALL_CLOSE)
            return True
        self._send_call(m.group(1), json.dumps(arguments, ensure_ascii=False))
        return True
