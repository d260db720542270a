"""gpt-oss's harmony output: reasoning, content and tool calls out of streamed text, whatever the split.

The harmony response format (OpenAI, "OpenAI Harmony Response Format", the
openai-cookbook article and the `openai/harmony` renderer) writes every message
as `<|start|>{header}<|message|>{body}<|end|>`; the prompt ends with
`<|start|>assistant`, so the output begins inside a header. A header holds the
role, `<|channel|>NAME` and optionally a recipient `to=NAME` (in the role or the
channel part) and `<|constrain|>TYPE`. The last message ends with `<|return|>`
(the answer is done) or `<|call|>` (a tool is called); both are stop tokens, so
the output may also just end there. Where a body goes (`Route`):

- channel `analysis` (the chain of thought): reasoning, never content;
- recipient `functions.NAME` (on any channel, as the cookbook's "the recipient
  might be defined in the role or channel section"): a call of NAME whose
  arguments are the body, JSON (`<|constrain|>json`);
- channel `final`, or `commentary` without a recipient (a preamble meant for
  the user): content;
- any other recipient (the built-in `browser.*` and `python` tools, which the
  gateway does not run) or channel: reasoning.

`HarmonyParser` is a `channels.ChannelParser`. Only a possible start of a
marker is held back; a header is held until its `<|message|>`. A call is sent
whole when its message ends (`<|call|>`, `<|end|>`, the next `<|start|>`, or the output's end), once its
body parses as JSON: a body that does not (a cut or malformed call) is no call
and is not content either (it was never meant for the user).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hybridgate.router.channels import ChannelParser, first_of, held_prefix
from hybridgate.router.toolparse import ToolCallDelta

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
BODY_ENDS = (END, RETURN, CALL, START)  # what ends a body (`<|start|>`: a model that skipped `<|end|>`)
HEADER_ENDS = (MESSAGE, END, RETURN, CALL, START)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_CONTENT_CHANNELS = ("final", "commentary")


@dataclass(frozen=True)
class Route:
    """Where one message's body goes: "content", "reasoning" or "call" (`name`: the function's)."""

    kind: str
    name: str = ""


def route_of(header: str) -> Route:
    """The route of a message whose header (the text between `<|start|>` and `<|message|>`) is `header`."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        to = recipient.group(1)
        return Route("call", to[len(FUNCTIONS):]) if to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS) \
            else Route("reasoning")
    channel = _CHANNEL.search(header)
    return Route("content" if channel is not None and channel.group(1) in _CONTENT_CHANNELS else "reasoning")


def grammar(functions: Sequence[tuple[str, Mapping]], special_ids: Mapping[str, int]) -> str | None:
    """The llguidance grammar (Lark syntax) of an answer that calls one of `functions` ((name, JSON schema of
    its arguments)) as the harmony guide writes a call: an optional analysis message, then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>ARGUMENTS<|call|>` (one call: `<|call|>`
    stops the turn). None when the vocabulary (`special_ids`, control token -> id) lacks one of those tokens."""
    needed = (CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL)
    if any(t not in special_ids for t in needed):
        return None
    tok = {t: f"<[{special_ids[t]}]>" for t in needed}
    rules = ["%llguidance {}"]
    for i, (name, schema) in enumerate(functions):
        rules.append(f'fn_{i}: {json.dumps(name + " ")} {tok[CONSTRAIN]} "json" {tok[MESSAGE]} args_{i}')
        rules.append(f"args_{i}: %json " + json.dumps(schema))
    rules += ["fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))),
              "TEXT: /(.|\\n)*/",
              f'analysis: {tok[CHANNEL]} "analysis" {tok[MESSAGE]} TEXT {tok[END]} {tok[START]} "assistant"',
              f'start: analysis? {tok[CHANNEL]} "commentary to=functions." fn {tok[CALL]}']
    return "\n".join(rules) + "\n"


class HarmonyParser(ChannelParser):
    """Content, reasoning and calls of one harmony output, fed delta by delta (see the module doc)."""

    def __init__(self) -> None:
        super().__init__("header")  # header | body | between
        # _buf: header: its text so far; body: a possible marker's start; between: a possible <|start|>
        self._route = Route("reasoning")
        self._body: list[str] = []  # a call's arguments so far

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The output ended (a stop token's text is not always there): a body's held text is its own, a call
        whose arguments parse is complete; a header without its `<|message|>` is dropped."""
        if self._mode == "body":
            self._emit(self._buf)
            self._end_message()
        self._buf, self._mode = "", "between"
        return self._take()

    # --- modes ---

    def _in_header(self) -> bool:
        at, marker = first_of(self._buf, HEADER_ENDS)
        if at < 0:
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(marker):]
        if marker == MESSAGE:
            self._route, self._body, self._mode = route_of(header), [], "body"
        else:  # a header that never reached its body: no message
            self._mode = "header" if marker == START else "between"
        return True

    def _in_body(self) -> bool:
        at = self._buf.find("<|")
        if at < 0:  # a last "<" may begin a marker
            keep = 1 if self._buf.endswith("<") else 0
            self._emit(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._emit(self._buf[:at])
        rest = self._buf[at:]
        for marker in BODY_ENDS:
            if rest.startswith(marker):
                self._buf = rest[len(marker):]
                self._end_message()
                self._mode = "header" if marker == START else "between"
                return True
        if held_prefix(rest, BODY_ENDS) == len(rest):
            self._buf = rest
            return False
        self._emit("<|")  # not a marker: text
        self._buf = rest[2:]
        return True

    def _in_between(self) -> bool:
        at = self._buf.find(START)
        if at < 0:  # text between messages is no message's: dropped, but a possible <|start|> is kept
            self._buf = self._buf[len(self._buf) - held_prefix(self._buf, (START,)):]
            return False
        self._buf, self._mode = self._buf[at + len(START):], "header"
        return True

    # --- where a body's text goes ---

    def _emit(self, text: str) -> None:
        if self._route.kind == "call":
            self._body.append(text)
        elif self._route.kind == "content":
            self._to_content(text)
        else:
            self._to_reasoning(text)

    def _end_message(self) -> None:
        if self._route.kind != "call":
            return
        arguments = "".join(self._body).strip()
        self._body = []
        try:
            json.loads(arguments)
        except ValueError:
            return  # cut or malformed: no call
        self._send_call(self._route.name, arguments)
