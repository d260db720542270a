"""OpenAI tool calling: the request's tools, the formats a model writes calls in, their grammars and rendering.

A format is a row of `FORMATS` (data, not branches): how a template is recognised
(`detect`, markers in its source), how the model writes calls (`syntax`, read by
`hybridgate.router.toolparse`), and the pieces its grammar is built from. The
format in use is RouterConfig.tool_call_format, or (`auto`) the first row whose
markers the chat template's source holds; a template that does not mention
`tools` gets the generic format, as llama.cpp does for templates without tool
support (common/chat.cpp): the tools are described in a system message and the
whole answer is a JSON envelope, either `{"response": "..."}` or the calls.

Constraints (kind "tools", llguidance's Lark syntax, docs/syntax.md):
`required` and a named function force at least one call (the named one) whose
arguments are JSON of the function's `parameters` schema; `auto` leaves the text
free until the format's trigger and constrains the call after it (a `lazy` head,
llguidance's tool-calling pattern), so once a call starts its arguments are
valid; `none` renders no tools, builds no grammar and parses nothing. JSON in a
grammar is written as structured output writes it (`constraints.with_separators`:
`", "` and `": "`, no free whitespace), so a call cannot spend `max_tokens` on blanks.
"""

from __future__ import annotations

import dataclasses
import json
import re
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from hybridgate.router.constraints import with_separators
from hybridgate.router.errors import InvalidRequestError
from hybridgate.router.gemma4 import Gemma4Parser
from hybridgate.router.harmony import HarmonyParser
from hybridgate.router.harmony import grammar as harmony_grammar
from hybridgate.router.toolparse import ANY, CallSyntax, ToolCall, ToolCallDelta, ToolCallParser
from hybridgate.wire import Constraint

MAX_TOOLS = 128
MAX_SCHEMA_BYTES = 64 << 10  # one function's parameters schema, as JSON
CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Function:
    """One tool: `parameters` is the JSON schema of its arguments (an object schema)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = dataclasses.field(default_factory=lambda: dict(_EMPTY_PARAMETERS))

    def as_openai(self) -> dict:
        fn = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools: `choice` is none, auto, required, or the name of the one function to call."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def from_openai(cls, tools: Sequence[Any] | None, tool_choice: Any = None,
                    parallel_tool_calls: bool | None = None) -> ToolRequest | None:
        """The OpenAI fields as a ToolRequest (None: no tools). Raises InvalidRequestError naming the field."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice", "needs tools")
            return None
        if len(tools) > MAX_TOOLS:
            raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
        functions = tuple(_function(i, tool) for i, tool in enumerate(tools))
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tools", f"function names must be unique, got {names}")
        return cls(functions, _choice(tool_choice, names), True if parallel_tool_calls is None else
                   bool(parallel_tool_calls))

    def chosen(self) -> tuple[Function, ...]:
        """The functions a call may name: all, or only the named one."""
        return self.functions if self.choice in CHOICES else tuple(f for f in self.functions if f.name == self.choice)


def _function(i: int, tool: Any) -> Function:
    field = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f"{field}.type", "only tools of type 'function' are supported")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise InvalidRequestError(f"{field}.function", "must be an object with a name")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"{field}.function.name", f"must be 1 to 64 letters, digits, _ or -, got {name!r}")
    params = fn.get("parameters")
    params = dict(_EMPTY_PARAMETERS) if params is None else params
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f"{field}.function.parameters", "must be a JSON schema object")
    size = len(json.dumps(params))
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"{field}.function.parameters", f"at most {MAX_SCHEMA_BYTES} bytes of JSON, "
                                  f"got {size}")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"{field}.function.description", "must be a string")
    return Function(name, description, params)


def _choice(tool_choice: Any, names: list[str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidRequestError("tool_choice", f"must be one of {', '.join(CHOICES)} or a named function, "
                                      f"got {tool_choice!r}")
        return tool_choice
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
    if name not in names:
        raise InvalidRequestError("tool_choice.function.name", f"must name one of the tools ({', '.join(names)}), "
                                  f"got {name!r}")
    return name


# --- formats ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    """One way of writing calls. `head`/`tail` surround a call's arguments (`{name}` is its name);
    `open`/`close` surround a region of calls, joined by `sep` inside one region (`listed`) or
    between regions; `auto` says how a free answer and calls mix: "lazy" (free text until the
    trigger), "leading" (an answer that starts like a call is one) or "envelope" (JSON either way).
    `native`: the template renders the tools; `special_trigger`: the trigger is a control token,
    whose text the detokenizer must keep. `architectures`: the GGUF `general.architecture` values
    that choose the format under `auto` before any template marker.

    A format whose calls are not a JSON value (`syntax` None) names its own `parser` class
    (`feed`/`finish` as `ToolCallParser`'s, and `take_reasoning`) and builds no grammar for `auto`;
    tool_choice `required` and a named function are enforced by its `forced_grammar` (harmony's),
    else only asked of the model (gemma4, whose arguments are not JSON), and with `channels`
    has its output parsed on every chat, with or without tools, so that its reasoning is kept out
    of the content; `turn_end` (not None) replaces the vocabulary's end-of-turn tokens by these
    control tokens (harmony's `<|end|>` ends a message, not the turn). An assistant message's
    `reasoning_content` is passed to the template as `reasoning_key` (gpt-oss's reads `thinking`)."""

    name: str
    detect: tuple[str, ...]
    syntax: CallSyntax | None
    head: str = ""
    tail: str = ""
    open: str = ""
    close: str = ""
    sep: str = ""
    listed: bool = False
    auto: str = "lazy"
    native: bool = True
    special_trigger: bool = False
    architectures: tuple[str, ...] = ()
    parser: Callable[[], Any] | None = None
    channels: bool = False
    turn_end: tuple[str, ...] | None = None
    reasoning_key: str = ""  # the message key its template reads an assistant's reasoning under
    forced_grammar: Callable[..., str | None] | None = None  # (functions, special ids) -> required call's grammar

    def new_parser(self):
        """A fresh parser of one output in this format."""
        return self.parser() if self.parser is not None else ToolCallParser(self.syntax)


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), CallSyntax("<tool_call>", "</tool_call>"),
                         '{{"name": "{name}", "arguments": ', "}", "<tool_call>\n", "\n</tool_call>", "\n",
                         listed=False, auto="lazy"),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), CallSyntax("[TOOL_CALLS]", calls_at=((ANY,),), repeat=False),
                          '{{"name": "{name}", "arguments": ', "}", "[TOOL_CALLS][", "]", ", ",
                          listed=True, auto="lazy", special_trigger=True),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>", '"parameters"'),
                              CallSyntax('{"name"', keep_trigger=True, gap=" \t\r\n;"),
                              '{{"name": "{name}", "parameters": ', "}", "", "", "; ", listed=False,
                              auto="leading"),
    "generic": ToolFormat("generic", (), CallSyntax("", calls_at=(("tool_calls", ANY), ("tool_call",)),
                                                    content_at=("response",), repeat=False),
                          "", "", "", "", "", listed=True, auto="envelope", native=False),
    "harmony": ToolFormat("harmony", ("<|channel|>", "to=functions"), None, architectures=("gpt-oss",),
                          parser=HarmonyParser, channels=True, turn_end=("<|return|>", "<|call|>"),
                          reasoning_key="thinking", forced_grammar=harmony_grammar),
    "gemma4": ToolFormat("gemma4", ("<|tool_call>",), None, architectures=("gemma4",), parser=Gemma4Parser,
                         channels=True, turn_end=("<turn|>", "<|tool_response>")),
}
FORMAT_NAMES = tuple(FORMATS)  # RouterConfig.tool_call_format takes these or "auto"


def choose_format(setting: str, template_source: str | None, architecture: str = "") -> ToolFormat:
    """The format named by `setting`, or for "auto" the row of the model's `architecture` (GGUF
    `general.architecture`), else the first row whose markers all appear in a template that mentions
    `tools`; otherwise the generic one."""
    if setting != "auto":
        return FORMATS[setting]
    for fmt in FORMATS.values():
        if architecture and architecture in fmt.architectures:
            return fmt
    source = template_source or ""
    if "tools" in source:
        for fmt in FORMATS.values():
            if fmt.detect and all(marker in source for marker in fmt.detect):
                return fmt
    return FORMATS["generic"]


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def build_grammar(fmt: ToolFormat, request: ToolRequest, special_ids: Mapping[str, int]) -> str:
    """The llguidance grammar (Lark syntax) of `request`'s calls in `fmt` (see the module doc)."""
    functions = request.chosen()
    if fmt.auto == "envelope":
        return "%llguidance {}\nstart: %json " + json.dumps(with_separators(_envelope_schema(request, functions)))
    rules = ["%llguidance {}"]
    for i, f in enumerate(functions):
        rules.append(f"fn_{i}: {_lit(fmt.head.format(name=f.name))} args_{i} {_lit(fmt.tail)}")
        rules.append(f"args_{i}: %json " + json.dumps(with_separators(f.parameters)))
    rules.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(functions))))
    trigger = fmt.syntax.trigger
    opener = f"<[{special_ids[trigger]}]> {_lit(fmt.open[len(trigger):])}" \
        if fmt.special_trigger and trigger in special_ids else _lit(fmt.open)
    many = request.parallel
    body = f"fn ({_lit(fmt.sep)} fn)*" if fmt.listed and many else "fn"
    rules.append(f"region: {opener} {body} {_lit(fmt.close)}" if fmt.open or fmt.close else f"region: {body}")
    regions = "region" if fmt.listed or not many else f"region ({_lit(fmt.sep)} region)*"
    rules.append("TEXT: /(.|\\n)*/")
    if request.choice != "auto":
        rules.append(f"start: {regions}")
    elif fmt.auto == "leading":
        rules += ["FREE: /([^{](.|\\n)*)?/", f"start: FREE | {regions}"]
    elif fmt.special_trigger:
        rules.append("start: TEXT | TEXT region")
    else:
        rules.append(f"head[lazy]: TEXT {_lit(fmt.open)}")
        rules.append(f"called: head {body} {_lit(fmt.close)}")
        rules.append("start: called* TEXT" if many else "start: TEXT | called /[ \\t\\r\\n]*/")
    return "\n".join(rules) + "\n"


_DEFINITIONS = ("$defs", "definitions")  # where a schema keeps its subschemas (2020-12's name, draft 7's)


def _pointer_tokens(ref: str) -> list[str] | None:
    """The reference tokens of a same-document `$ref` ("#", "#/a/b~1c"; RFC 6901 with RFC 3986's
    percent-encoding), None for any other reference (left as written: llguidance names what it refuses)."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    return [t.replace("~1", "/").replace("~0", "~") for t in urllib.parse.unquote(ref[1:]).split("/")[1:]]


def _pointer(tokens: Sequence[str]) -> str:
    return "#" + "".join("/" + urllib.parse.quote(t.replace("~", "~0").replace("/", "~1"), safe="$")
                         for t in tokens)


def _rebased(node: Any, rebase) -> Any:
    """`node` (a JSON value) with every same-document `$ref` string rewritten by `rebase(tokens)`."""
    if isinstance(node, Mapping):
        out = {}
        for key, value in node.items():
            tokens = _pointer_tokens(value) if key == "$ref" and isinstance(value, str) else None
            out[key] = _pointer(rebase(tokens)) if tokens is not None else _rebased(value, rebase)
        return out
    if isinstance(node, list):
        return [_rebased(v, rebase) for v in node]
    return node


def hoist_definitions(schemas: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, dict], dict[str, Any]]:
    """Several root schemas (by a unique name) made ready to sit inside one new document.

    Each schema's `$defs` and `definitions` move to the new root's `$defs`, renamed `NAME.DEF`
    (`NAME.definitions.DEF` for draft 7's), so two tools with an `Address` each keep their own; each
    schema itself is also put there as `NAME` (a recursive model refers to its root, `"$ref": "#"`).
    Every same-document `$ref` is rewritten to point into those (`#/$defs/Address/properties/city` ->
    `#/$defs/NAME.Address/properties/city`, `#` -> `#/$defs/NAME`); other references stay as written.
    Returns ({name: the schema to embed in place of the original}, the new root's `$defs`): the schema
    embedded is `{"$ref": "#/$defs/NAME"}` when something refers to the root, else the root inlined.
    """
    defs: dict[str, Any] = {}
    embedded: dict[str, dict] = {}
    for name, schema in schemas.items():
        root_referred = False

        def rebase(tokens: list[str], name=name) -> list[str]:
            nonlocal root_referred
            if len(tokens) >= 2 and tokens[0] in _DEFINITIONS:
                prefix = name if tokens[0] == "$defs" else f"{name}.definitions"
                return ["$defs", f"{prefix}.{tokens[1]}", *tokens[2:]]
            root_referred = True
            return ["$defs", name, *tokens]

        for where in _DEFINITIONS:
            for key, sub in (schema.get(where) or {}).items():
                prefix = name if where == "$defs" else f"{name}.definitions"
                defs[f"{prefix}.{key}"] = _rebased(sub, rebase)
        root = _rebased({k: v for k, v in schema.items() if k not in _DEFINITIONS}, rebase)
        if root_referred:
            defs[name] = root
            embedded[name] = {"$ref": _pointer(["$defs", name])}
        else:
            embedded[name] = root
    return embedded, defs


def _envelope_schema(request: ToolRequest, functions: Sequence[Function]) -> dict:
    """The generic format's JSON schema: the calls (`tool_calls`, or one `tool_call` when not parallel),
    or for `auto` also `{"response": string}`. Each function's parameters keep their own definitions
    (`hoist_definitions`)."""
    arguments, defs = hoist_definitions({f.name: f.parameters for f in functions})
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": arguments[f.name]},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if request.parallel:
        called = {"type": "object", "properties": {"tool_calls": {"type": "array", "items": call, "minItems": 1}},
                  "required": ["tool_calls"], "additionalProperties": False}
    else:
        called = {"type": "object", "properties": {"tool_call": call}, "required": ["tool_call"],
                  "additionalProperties": False}
    if request.choice != "auto":
        return {**called, "$defs": defs} if defs else called
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
             "additionalProperties": False}
    return {"anyOf": [called, reply], "$defs": defs} if defs else {"anyOf": [called, reply]}


# --- rendering --------------------------------------------------------------------------------------------------


def _generic_system(request: ToolRequest) -> str:
    tools = json.dumps([f.as_openai()["function"] for f in request.functions], ensure_ascii=False)
    key = '"tool_calls": [{"name": ..., "arguments": {...}}, ...]' if request.parallel else \
        '"tool_call": {"name": ..., "arguments": {...}}'
    return (f"You can call these tools: {tools}\nAnswer with one JSON object: either {{{key}}} to call tools, "
            'or {"response": "..."} to reply to the user.')


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the template wants them: a JSON string parsed (templates dump them with tojson)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def render_messages(fmt: ToolFormat, messages: Sequence[Mapping[str, Any]],
                    request: ToolRequest | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, the template's `tools`) for a chat with tools in `fmt`: a native format passes the
    tools and the history's calls (arguments parsed) to the template; the generic one describes the
    tools in a system message and writes the history's calls and results as the JSON it asks for."""
    tools = [f.as_openai() for f in request.functions] if request is not None and request.choice != "none" else None
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments": _arguments_object(
                c.get("function", {}).get("arguments"))}} for c in calls]
        if fmt.reasoning_key and m.get("reasoning_content"):
            m[fmt.reasoning_key] = m["reasoning_content"]
        if not fmt.native:
            m = _generic_message(m)
        m["content"] = m.get("content") or ""
        out.append(m)
    if fmt.native or tools is None:
        return out, tools
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + _generic_system(request)}
    else:
        out.insert(0, {"role": "system", "content": _generic_system(request)})
    return out, None


def _generic_message(m: dict) -> dict:
    if m.get("tool_calls"):
        calls = [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments"), "id": c.get("id")}
                 for c in m["tool_calls"]]
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)}
    if m.get("role") == "tool":
        result = {"tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}
        return {"role": "user", "content": json.dumps({"tool_response": result}, ensure_ascii=False)}
    return m


@dataclass(frozen=True)
class ToolPlan:
    """What a chat with tools becomes: its messages and the template's tools, its constraint (None: free),
    and the syntax its output is parsed with (None: not parsed, tool_choice none)."""

    messages: list[dict]
    template_tools: list[dict] | None
    constraint: Constraint | None
    syntax: CallSyntax | None
    keep_special: bool
    new_parser: Callable[[], Any] | None = None  # the output's parser (None: not parsed)


def plan(fmt: ToolFormat, messages: Sequence[Mapping[str, Any]], request: ToolRequest | None,
         special_ids: Mapping[str, int]) -> ToolPlan:
    """The `ToolPlan` of a chat in format `fmt` (`request` None: a history with calls but no tools)."""
    rendered, tools = render_messages(fmt, messages, request)
    if request is None or request.choice == "none":
        return ToolPlan(rendered, tools, None, None, fmt.channels, fmt.new_parser if fmt.channels else None)
    constraint = Constraint(kind="tools", grammar=build_grammar(fmt, request, special_ids)) if fmt.syntax else \
        _forced_constraint(fmt, request, special_ids)
    return ToolPlan(rendered, tools, constraint, fmt.syntax, fmt.special_trigger or fmt.channels, fmt.new_parser)


def _forced_constraint(fmt: ToolFormat, request: ToolRequest, special_ids: Mapping[str, int]) -> Constraint | None:
    """A format without a JSON call syntax: the grammar of a required (or named) call, if it has one."""
    if request.choice == "auto" or fmt.forced_grammar is None:
        return None
    grammar = fmt.forced_grammar([(f.name, with_separators(f.parameters)) for f in request.chosen()], special_ids)
    return Constraint(kind="tools", grammar=grammar) if grammar is not None else None


# --- the stream -------------------------------------------------------------------------------------------------


def merge_deltas(first: list[ToolCallDelta], second: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Two lists of call deltas as one (a call in both: the first's id and name, arguments joined)."""
    out: dict[int, ToolCallDelta] = {d.index: d for d in first}
    for d in second:
        if d.index in out:
            a = out[d.index]
            out[d.index] = ToolCallDelta(d.index, a.id or d.id, a.name if a.name is not None else d.name,
                                         a.arguments + d.arguments)
        else:
            out[d.index] = d
    return [out[i] for i in sorted(out)]


class ToolCallStream:
    """A request stream (GenerationStream or the response cache's) whose deltas have the calls parsed out:
    `Delta.text` is the content only, `Delta.tool_calls` the calls' deltas and `Delta.reasoning` the
    reasoning (a format with channels); `calls` the calls so far. Everything else is the wrapped stream's.
    `parser`: a `CallSyntax` (parsed by `ToolCallParser`) or a parser (`ToolFormat.new_parser`).

    Only complete calls are streamed (docs: "a call cut by max_tokens"): a call's deltas are held until its
    JSON object closes, then sent together (its id, name and whole arguments), so every call a client
    receives, streamed or not, has arguments that parse. A call the output ends inside (finish `length`)
    is never sent, and `calls` leaves it out; its tokens still count in the usage.
    """

    def __init__(self, stream, parser):
        self._stream = stream
        self.parser = ToolCallParser(parser) if isinstance(parser, CallSyntax) else parser
        self._take_reasoning = getattr(self.parser, "take_reasoning", str)  # str() is ""
        self._held: list[ToolCallDelta] = []  # deltas of calls not yet complete

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.parser.calls if c.complete]

    async def __aenter__(self) -> ToolCallStream:
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._stream.__aexit__(*exc)

    def __aiter__(self) -> ToolCallStream:
        return self

    async def __anext__(self):
        delta = await self._stream.__anext__()
        content, calls = self.parser.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = self.parser.finish()
            content, calls = content + rest, merge_deltas(calls, more)
        held = merge_deltas(self._held, calls)
        complete = {c.index for c in self.parser.calls if c.complete}
        self._held = [d for d in held if d.index not in complete]
        ready = tuple(d for d in held if d.index in complete)
        return msgspec.structs.replace(delta, text=content, tool_calls=ready, reasoning=self._take_reasoning())
