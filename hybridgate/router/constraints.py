"""Structured output: the request forms of a constraint, their llguidance grammars, and the check before any token.

Every form becomes one `wire.Constraint` whose grammar is Lark text in llguidance's
syntax (llguidance docs/syntax.md; JSON schemas inlined with `%json {...}`,
docs/json_schema.md):

- `json_object` (OpenAI `response_format: {"type": "json_object"}`, vLLM
  `structured_outputs.json_object`): `start: %json {"type": "object"}`;
- `json_schema` (OpenAI `response_format: {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}`, vLLM `structured_outputs.json`, `guided_json`;
  gRPC `json_schema`): `start: %json SCHEMA`;
- `regex` (vLLM `structured_outputs.regex`, `guided_regex`; gRPC `regex`):
  `start: /REGEX/`, escaped by llguidance itself;
- `choice` (vLLM `structured_outputs.choice`, `guided_choice`; gRPC `choice`):
  `start: "a" | "b" ...`;
- `grammar` (vLLM `structured_outputs.grammar`, `guided_grammar`; gRPC
  `grammar`): the Lark text (a GBNF one converted by llguidance).

JSON is written without free whitespace, with llguidance's separators set to
`", "` and `": "` (vLLM's `disable_any_whitespace`: `","` and `":"`), so an answer
cannot wander through blank space until `max_tokens`; a schema's own
`x-guidance` object overrides this (llguidance's JSON options). `strict` is
accepted and changes nothing: every schema is enforced, and one with a feature
llguidance does not enforce is refused, never relaxed.

`ConstraintCheck` compiles a grammar with llguidance's validator on a thread
(never on the event loop), once per distinct grammar (an LRU keyed by a SHA-256
of its text), and raises `InvalidRequestError` naming the form and, for a JSON
schema, the unsupported feature and its JSON pointer (RFC 6901), found by
compiling the schema's subschemas alone, deepest first.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridgate.router.config import RouterConfig
from hybridgate.router.errors import InvalidRequestError
from hybridgate.wire import Constraint

CHECK_CACHE_SIZE = 512  # distinct grammars whose verdict is kept
MAX_PROBES = 256  # subschema compiles spent finding an error's JSON pointer
_SPACED = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_ANY_OBJECT = {"type": "object"}
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# vLLM's structured_outputs: the one constraint it holds, and options accepted without effect here
# (there is one backend and no fallback).
_SO_FORMS = ("json", "regex", "choice", "grammar", "json_object")
_SO_IGNORED = ("disable_fallback", "backend")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True)
class ConstraintLimits:
    """Bounds of a request's constraint: `max_bytes` of its schema (as compact JSON), regex, grammar or
    choices together (UTF-8); `max_choices` strings in a choice."""

    max_bytes: int = RouterConfig.max_constraint_bytes
    max_choices: int = RouterConfig.max_constraint_choices

    @classmethod
    def of(cls, config: RouterConfig) -> ConstraintLimits:
        return cls(config.max_constraint_bytes, config.max_constraint_choices)


def _check_size(field: str, nbytes: int, limits: ConstraintLimits) -> None:
    if nbytes > limits.max_bytes:
        raise InvalidRequestError(field, f"at most {limits.max_bytes} bytes (--max-constraint-bytes), got {nbytes}")


# --- the forms --------------------------------------------------------------------------------------------------


def json_schema(schema: Any, field: str, limits: ConstraintLimits = ConstraintLimits(),
                compact: bool = False) -> Constraint:
    """A JSON schema (an object, or its JSON text) as a constraint. Raises InvalidRequestError naming `field`."""
    if isinstance(schema, str):
        _check_size(field, len(schema.encode()), limits)
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(field, f"is not valid JSON ({exc})") from None
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(field, f"must be a JSON schema object, got {type(schema).__name__}")
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    _check_size(field, len(text.encode()), limits)
    kind = "json_object" if schema == _ANY_OBJECT else "json_schema"
    return Constraint(kind=kind, grammar=_json_grammar(schema, compact))


def json_object(compact: bool = False) -> Constraint:
    """Any JSON object (OpenAI's JSON mode)."""
    return Constraint(kind="json_object", grammar=_json_grammar(_ANY_OBJECT, compact))


def with_separators(schema: Mapping, compact: bool = False) -> Mapping:
    """`schema` with llguidance's JSON options set to fixed separators and no free whitespace (see the module
    doc), unless it sets its own `x-guidance`."""
    if "x-guidance" in schema:
        return schema
    return {"x-guidance": _COMPACT if compact else _SPACED, **schema}


def _json_grammar(schema: Mapping, compact: bool) -> str:
    return "start: %json " + json.dumps(with_separators(schema, compact)) + "\n"


def regex(pattern: Any, field: str, limits: ConstraintLimits = ConstraintLimits()) -> Constraint:
    """A regular expression (Rust regex syntax, llguidance's) the whole output matches."""
    import llguidance

    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequestError(field, "must be a non-empty string")
    _check_size(field, len(pattern.encode()), limits)
    lark = json.loads(llguidance.LLMatcher.grammar_from_regex(pattern))["grammars"][0]["lark_grammar"]
    return Constraint(kind="regex", grammar=lark + "\n")


def choice(options: Any, field: str, limits: ConstraintLimits = ConstraintLimits()) -> Constraint:
    """One of `options` (strings), exactly."""
    if not isinstance(options, (list, tuple)) or not options:
        raise InvalidRequestError(field, "must be a non-empty list of strings")
    if len(options) > limits.max_choices:
        raise InvalidRequestError(field, f"at most {limits.max_choices} choices (--max-constraint-choices), "
                                  f"got {len(options)}")
    for i, option in enumerate(options):
        if not isinstance(option, str) or not option:
            raise InvalidRequestError(f"{field}[{i}]", f"must be a non-empty string, got {option!r}")
    _check_size(field, sum(len(o.encode()) for o in options), limits)
    return Constraint(kind="choice", grammar="start: " + " | ".join(json.dumps(o) for o in options) + "\n")


def grammar(text: Any, field: str, limits: ConstraintLimits = ConstraintLimits()) -> Constraint:
    """A grammar in llguidance's Lark syntax (a GBNF one is converted by llguidance)."""
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(text, str) or not text.strip():
        raise InvalidRequestError(field, "must be a non-empty grammar")
    _check_size(field, len(text.encode()), limits)
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter raises what its parser raises
        raise InvalidRequestError(field, f"is neither Lark nor GBNF that converts to it: {exc}") from None
    return Constraint(kind="grammar", grammar=lark if lark.endswith("\n") else lark + "\n")


_BUILDERS: dict[str, Callable[..., Constraint]] = {"json": json_schema, "regex": regex, "choice": choice,
                                                   "grammar": grammar}


# --- the OpenAI / vLLM request fields ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Requested:
    """A request's constraint and the request field that set it (errors name it)."""

    constraint: Constraint
    field: str


def from_openai(fields: Mapping[str, Any], limits: ConstraintLimits = ConstraintLimits()) -> Requested | None:
    """The constraint of an OpenAI request body's fields (`response_format`, `structured_outputs`,
    `guided_*`; None: free text). At most one of them may be set.

    Raises:
        InvalidRequestError: naming the field: an unknown type or option, two constraints, a bad value,
            a size over `limits`.
    """
    given = [name for name in ("response_format", "structured_outputs", *_GUIDED)
             if fields.get(name) not in (None, False) and not (name == "response_format" and
                                                            (fields[name] or {}).get("type") == "text")]
    if len(given) > 1:
        raise InvalidRequestError(given[1], f"only one output constraint per request, got {' and '.join(given)}")
    if not given:
        return None
    name = given[0]
    if name == "response_format":
        return _response_format(fields[name], limits)
    if name == "structured_outputs":
        return _structured_outputs(fields[name], limits)
    form = _GUIDED[name]
    return Requested(_BUILDERS[form](fields[name], name, limits), name)


def _response_format(rf: Any, limits: ConstraintLimits) -> Requested:
    if not isinstance(rf, Mapping):
        raise InvalidRequestError("response_format", "must be an object with a type")
    kind = rf.get("type")
    if kind == "json_object":
        return Requested(json_object(), "response_format")
    if kind != "json_schema":
        raise InvalidRequestError("response_format.type", f"must be text, json_object or json_schema, got {kind!r}")
    spec = rf.get("json_schema")
    if not isinstance(spec, Mapping):
        raise InvalidRequestError("response_format.json_schema", "must be an object with a name and a schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError("response_format.json_schema.name",
                                  f"must be 1 to 64 letters, digits, _ or -, got {name!r}")
    if spec.get("strict") not in (None, True, False):
        raise InvalidRequestError("response_format.json_schema.strict", f"must be a boolean, got {spec['strict']!r}")
    field = "response_format.json_schema.schema"
    if spec.get("schema") is None:
        raise InvalidRequestError(field, "is required")
    return Requested(json_schema(spec["schema"], field, limits), field)


def _structured_outputs(so: Any, limits: ConstraintLimits) -> Requested:
    if not isinstance(so, Mapping):
        raise InvalidRequestError("structured_outputs", f"must be an object with one of {', '.join(_SO_FORMS)}")
    # A client that serializes every option (vLLM's own) sends the unset ones as null or false.
    unknown = [k for k, v in so.items() if k not in (*_SO_FORMS, *_SO_IGNORED, "disable_any_whitespace")
               and v not in (None, False)]
    if unknown:
        raise InvalidRequestError(f"structured_outputs.{unknown[0]}", "is not supported by this server (supported: "
                                  f"{', '.join((*_SO_FORMS, 'disable_any_whitespace', *_SO_IGNORED))})")
    forms = [k for k in _SO_FORMS if so.get(k) not in (None, False)]
    if len(forms) != 1:
        raise InvalidRequestError("structured_outputs", f"must set exactly one of {', '.join(_SO_FORMS)}, "
                                  f"got {', '.join(forms) or 'none'}")
    form, compact = forms[0], bool(so.get("disable_any_whitespace"))
    field = f"structured_outputs.{form}"
    if form == "json_object":
        return Requested(json_object(compact), field)
    if form == "json":
        return Requested(json_schema(so[form], field, limits, compact), field)
    return Requested(_BUILDERS[form](so[form], field, limits), field)


# --- the check --------------------------------------------------------------------------------------------------


_CONTEXT = re.compile(r"\n\s*\d+ \| .*", re.S)  # llguidance's echo of the grammar source, after its message
_LOCATION = re.compile(r"^at \d+\(\d+\): ")
_SCHEMA_PREFIX = "failed to compile JSON schema: "
# Where a JSON schema holds subschemas (JSON Schema 2020-12, core and applicator vocabularies); $defs first,
# so a feature inside a definition is found there rather than at the $ref that uses it.
_SUB_MAPS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUB_ONE = ("items", "additionalProperties", "additionalItems", "contains", "not", "if", "then", "else",
            "propertyNames", "unevaluatedProperties", "unevaluatedItems")


def compile_error(grammar_text: str) -> str | None:
    """llguidance's verdict on a grammar: None when it compiles, else its error without the echoed source."""
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text)
    if not failed:
        return None
    return _LOCATION.sub("", _CONTEXT.sub("", messages[0]).strip())


def _schema_error(schema: Mapping) -> str | None:
    error = compile_error("start: %json " + json.dumps(schema))
    return error[len(_SCHEMA_PREFIX):] if error is not None and error.startswith(_SCHEMA_PREFIX) else error


def _children(node: Mapping):
    for key in _SUB_MAPS:
        if isinstance(node.get(key), Mapping):
            for name, sub in node[key].items():
                if isinstance(sub, Mapping):
                    yield (key, name), sub
    for key in _SUB_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                if isinstance(sub, Mapping):
                    yield (key, str(i)), sub
    for key in _SUB_ONE:
        if isinstance(node.get(key), Mapping):
            yield (key,), node[key]


def locate(schema: Mapping, reason: str) -> str:
    """The JSON pointer (RFC 6901) of the part of `schema` that fails with `reason`: the deepest subschema
    that fails alone with the same reason (given the root's definitions, so its $refs resolve), then the
    keyword the reason names (an unimplemented key, `format`, `pattern`)."""
    defs = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), Mapping)}
    node, path, probes, descended = schema, [], 0, True
    while descended and probes < MAX_PROBES:
        descended = False
        for tokens, sub in _children(node):
            probes += 1
            if _schema_error({**defs, **sub}) == reason:
                node, path, descended = sub, path + list(tokens), True
                break
            if probes >= MAX_PROBES:
                break
    path += _keyword(node, reason)
    return "".join("/" + t.replace("~", "~0").replace("/", "~1") for t in path)


def _keyword(node: Mapping, reason: str) -> list[str]:
    if reason.startswith("Unimplemented keys: "):
        try:
            keys = json.loads(reason[len("Unimplemented keys: "):].splitlines()[0])
        except ValueError:
            keys = []
        return [k for k in keys if k in node][:1]
    if reason.startswith("Unknown format") and "format" in node:
        return ["format"]
    if "regex" in reason and "pattern" in node:
        return ["pattern"]
    return [k for k in node if reason.startswith(k + " ")][:1]  # "oneOf constraints are not supported"


def _feature(reason: str) -> str:
    """The schema feature a reason names, on one line (`the keyword "if"`, `Unknown format: weird`)."""
    if reason.startswith("Unimplemented keys: "):
        try:
            keys = json.loads(reason[len("Unimplemented keys: "):].splitlines()[0])
            return "the keyword " + ", ".join(json.dumps(k) for k in keys) + " is not supported"
        except ValueError:
            pass
    lines = reason.splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    return f"{lines[0].rstrip(':')}: {errors[-1][len('error: '):]}" if errors else lines[0]


def _schemas(grammar_text: str):
    """The JSON schemas inlined in a grammar (`%json {...}`), in order."""
    decoder, at = json.JSONDecoder(), 0
    while (at := grammar_text.find("%json ", at)) >= 0:
        try:
            schema, end = decoder.raw_decode(grammar_text, at + len("%json "))
        except ValueError:
            at += 1
            continue
        if isinstance(schema, Mapping):
            yield schema
        at = end


def explain(constraint: Constraint) -> str | None:
    """Why `constraint` cannot be enforced (None: it compiles): llguidance's error, and for a JSON schema the
    feature and its JSON pointer. Blocking (compiles the grammar, and subschemas on error): call off the loop."""
    error = compile_error(constraint.grammar)
    if error is None:
        return None
    kind = "" if constraint.kind == "tools" else constraint.kind + ": "  # the field, "tools", says it already
    if not error.startswith(_SCHEMA_PREFIX):
        return f"{kind}does not compile: {error}"
    for schema in _schemas(constraint.grammar):
        reason = _schema_error(schema)
        if reason is not None:
            where = " (of the schema made of the tools' parameters)" if not kind else ""
            return (f"{kind}the JSON schema cannot be enforced at JSON pointer {json.dumps(locate(schema, reason))}"
                    f"{where}: {_feature(reason)}")
    return f"{kind}the JSON schema cannot be enforced: {error[len(_SCHEMA_PREFIX):]}"


class ConstraintCheck:
    """Each distinct grammar compiled once, on one of `threads` threads of its own (so compiles never queue
    ahead of the default executor's short work: inline prompt encodes, /detokenize); verdicts kept in an LRU
    of `size` by SHA-256 of the text. Identical grammars checked at once share one compile. A compile that
    runs longer than `timeout_s` (from its start on a thread) is refused, and that verdict cached; its thread
    stays busy until it ends (a compile cannot be interrupted). Counters (exported by the gateway's
    metrics): `compiles` (cache misses), `hits` (a verdict cached or a compile in flight joined), `refused`
    (checks answered with an error, cached verdicts included) and `compile_seconds` (wall time of the
    compiles, on their threads, counted as each ends)."""

    def __init__(self, size: int = CHECK_CACHE_SIZE, threads: int = RouterConfig.constraint_compile_threads,
                 timeout_s: float = RouterConfig.constraint_compile_timeout_s):
        self.size, self.timeout_s = size, timeout_s
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="constraint-compile")
        self._verdicts: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._running: dict[str, asyncio.Future] = {}
        self.compiles = 0
        self.hits = 0
        self.refused = 0
        self.compile_seconds = 0.0

    def close(self) -> None:
        """Drop the compiles not started; those running end on their threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def check(self, constraint: Constraint | None, field: str = "constraint") -> None:
        """Return when `constraint` (None: nothing) compiles. Raises InvalidRequestError naming `field`."""
        if constraint is None:
            return
        key = hashlib.sha256(constraint.grammar.encode()).hexdigest()
        if key in self._verdicts:
            self.hits += 1
            self._verdicts.move_to_end(key)
            verdict = self._verdicts[key]
        elif key in self._running:
            self.hits += 1
            verdict = await asyncio.shield(self._running[key])
        else:
            self.compiles += 1
            future = asyncio.ensure_future(self._compile(constraint))
            self._running[key] = future
            try:
                verdict = await asyncio.shield(future)
            finally:
                self._running.pop(key, None)
            self._verdicts[key] = verdict
            while len(self._verdicts) > self.size:
                self._verdicts.popitem(last=False)
        if verdict is not None:
            self.refused += 1
            raise InvalidRequestError(field, verdict)


    async def _compile(self, constraint: Constraint) -> str | None:
        """`explain(constraint)` on the compile threads, or the refusal of a compile that ran past the timeout
        (whether still running then, or measured on its thread when it ended first)."""
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def run() -> tuple[str | None, float]:
            with contextlib.suppress(RuntimeError):  # the loop closed while this waited for a thread
                loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
            return _timed(explain, constraint)

        future = loop.run_in_executor(self._executor, run)
        future.add_done_callback(self._count_seconds)
        await asyncio.wait([started, future], return_when=asyncio.FIRST_COMPLETED)  # queueing does not count
        await asyncio.wait([future], timeout=self.timeout_s)
        if future.done():
            verdict, seconds = future.result()
            if seconds <= self.timeout_s:
                return verdict
        kind = "" if constraint.kind == "tools" else constraint.kind + ": "  # as explain's
        return f"{kind}took longer than {self.timeout_s:g} s to compile (--constraint-compile-timeout)"

    def _count_seconds(self, future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.compile_seconds += future.result()[1]


def _timed(fn: Callable, *args) -> tuple[Any, float]:
    """(fn(*args), its wall time in seconds)."""
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start
