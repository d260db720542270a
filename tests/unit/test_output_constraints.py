"""Output constraints: each request form's grammar (its language checked with llguidance's own matcher against
independent references: jsonschema, Python's re, the choice list), errors naming the field, the unsupported
feature and its JSON pointer, the limits, the check's cache, the response cache key and the gRPC fields."""

from __future__ import annotations

import asyncio
import json
import re
import time

import jsonschema
import llguidance
import pytest

from hybridgate.gateway import openai_api as api
from hybridgate.gateway.convert import delta_to_proto, request_to_native, tools_to_native
from hybridgate.router import constraints as c
from hybridgate.router.constraints import ConstraintCheck, ConstraintLimits
from hybridgate.router.deltas import Delta, Timings, Usage
from hybridgate.router.response_cache import cache_key
from hybridgate.router.toolparse import ToolCall
from hybridgate.router.tools import FORMATS, ToolRequest, plan
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.wire import Constraint, FinishReason, InvalidFieldError, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "color": {"$ref": "#/$defs/color"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                 "additionalProperties": False},
        "id": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    },
    "required": ["name", "color"],
    "additionalProperties": False,
    "$defs": {"color": {"enum": ["red", "green"]}},
}
INSTANCES = [
    {"name": "Ada", "color": "red"},
    {"name": "Bo", "age": 7, "color": "green", "tags": ["a", "b"], "home": {"city": "Oslo"}, "id": None},
    {"name": "Cy", "color": "green", "id": 4},
    {"name": "ada", "color": "red"},  # pattern
    {"name": "Ada", "color": "blue"},  # enum behind a $ref
    {"name": "Ada"},  # required
    {"name": "Ada", "color": "red", "tags": ["c"]},  # enum of items
    {"name": "Ada", "color": "red", "home": {}},  # nested required
    {"name": "Ada", "color": "red", "id": "x"},  # anyOf
    {"name": "Ada", "color": "red", "extra": 1},  # additionalProperties
]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.LLTokenizer(tokenizer._with_special.to_str(), eos_token=tokenizer.eos_token_id)


def accepts(ll_tokenizer, tokenizer, constraint: Constraint, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, constraint.grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer.encode(text, special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


def test_a_json_schema_accepts_exactly_the_valid_instances(ll_tokenizer, tokenizer):
    constraint = c.json_schema(SCHEMA, "f")
    assert constraint.kind == "json_schema"
    for instance in INSTANCES:
        valid = jsonschema.Draft202012Validator(SCHEMA).is_valid(instance)
        assert accepts(ll_tokenizer, tokenizer, constraint, json.dumps(instance)) == valid, instance
    assert sum(jsonschema.Draft202012Validator(SCHEMA).is_valid(i) for i in INSTANCES) == 3
    # No free whitespace (separators ", " and ": "); compact ones on request.
    assert not accepts(ll_tokenizer, tokenizer, constraint, json.dumps(INSTANCES[0], indent=1))
    compact = c.json_schema(json.dumps(SCHEMA), "f", compact=True)  # the schema as JSON text, too
    assert accepts(ll_tokenizer, tokenizer, compact, json.dumps(INSTANCES[0], separators=(",", ":")))


def test_json_object_is_any_object(ll_tokenizer, tokenizer):
    constraint = c.json_object()
    assert accepts(ll_tokenizer, tokenizer, constraint, '{"a": [1, {"b": null}]}')
    assert not accepts(ll_tokenizer, tokenizer, constraint, "[1]")


@pytest.mark.parametrize("pattern", [r"\d{3}-[a-z]+", r"(yes|no)/maybe", r"[A-Z]\w*@x\.org"])
def test_a_regex_accepts_what_python_re_fullmatches(ll_tokenizer, tokenizer, pattern):
    constraint = c.regex(pattern, "f")
    for text in ["123-abc", "12-abc", "yes/maybe", "no/", "Ab_1@x.org", "ab@x.org", "123-"]:
        assert accepts(ll_tokenizer, tokenizer, constraint, text) == bool(re.fullmatch(pattern, text)), text


def test_a_choice_accepts_exactly_its_strings(ll_tokenizer, tokenizer):
    options = ["positive", "négatif", 'say "hi"', "back\\slash"]
    constraint = c.choice(options, "f")
    for text in options:
        assert accepts(ll_tokenizer, tokenizer, constraint, text)
    for text in ["posit", "positive!", "negatif", "say hi"]:
        assert not accepts(ll_tokenizer, tokenizer, constraint, text)


def test_a_lark_grammar_and_a_gbnf_one(ll_tokenizer, tokenizer):
    lark = c.grammar('start: "The answer is " NUMBER "."\nNUMBER: /[0-9]+/\n', "f")
    assert accepts(ll_tokenizer, tokenizer, lark, "The answer is 42.")
    assert not accepts(ll_tokenizer, tokenizer, lark, "The answer is x.")
    gbnf = c.grammar('root ::= "yes" | "no"', "f")
    assert accepts(ll_tokenizer, tokenizer, gbnf, "no") and not accepts(ll_tokenizer, tokenizer, gbnf, "nope")


@pytest.mark.parametrize(("fields", "field", "kind"), [
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     "response_format.json_schema.schema", "json_schema"),
    ({"structured_outputs": {"json": SCHEMA}}, "structured_outputs.json", "json_schema"),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "disable_fallback": True}}, "structured_outputs.json",
     "json_schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs.regex", "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs.choice", "choice"),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "structured_outputs.grammar", "grammar"),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs.json_object", "json_object"),
    ({"structured_outputs": {"json": None, "regex": "[a-z]+", "choice": None, "grammar": None, "json_object": None,
                             "disable_fallback": False, "disable_any_whitespace": False,
                             "disable_additional_properties": False, "whitespace_pattern": None,
                             "structural_tag": None}}, "structured_outputs.regex", "regex"),  # vLLM's client
    ({"guided_json": SCHEMA}, "guided_json", "json_schema"),
    ({"guided_regex": "[a-z]+"}, "guided_regex", "regex"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "choice"),
    ({"guided_grammar": 'start: "x"'}, "guided_grammar", "grammar"),
])
def test_each_request_form_gives_its_constraint_and_field(fields, field, kind):
    requested = c.from_openai(fields)
    assert (requested.field, requested.constraint.kind) == (field, kind)
    assert c.explain(requested.constraint) is None  # it compiles
    # The same form through the HTTP body and through the gRPC oneof gives the same grammar.
    params = api.sampling_params(api.ChatCompletionRequest(messages=[], **fields), None,
                                 api.output_constraint(api.ChatCompletionRequest(messages=[], **fields),
                                                       ConstraintLimits()))
    assert params.constraint == requested.constraint


def test_no_constraint_and_text():
    assert c.from_openai({}) is None
    assert c.from_openai({"response_format": {"type": "text"}}) is None
    assert c.from_openai({"structured_outputs": None, "guided_json": None}) is None


@pytest.mark.parametrize(("fields", "field", "words"), [
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "only one"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "not valid JSON"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json", "schema object"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_choice": ["a", ""]}, "guided_choice[1]", "non-empty"),
    ({"guided_grammar": "  "}, "guided_grammar", "non-empty"),
])
def test_bad_forms_name_their_field(fields, field, words):
    with pytest.raises(InvalidFieldError) as e:
        c.from_openai(fields)
    assert e.value.field == field and words in str(e.value)


def test_limits_name_the_field_and_the_setting():
    limits = ConstraintLimits(max_bytes=100, max_choices=3)
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}}
    assert len(json.dumps(big, separators=(",", ":"))) > 100
    with pytest.raises(InvalidFieldError, match=r"structured_outputs\.json: at most 100 bytes "
                                                r"\(--max-constraint-bytes\), got \d+"):
        c.from_openai({"structured_outputs": {"json": big}}, limits)
    with pytest.raises(InvalidFieldError, match=r"guided_choice: at most 3 choices \(--max-constraint-choices\), "
                                                r"got 4"):
        c.from_openai({"guided_choice": list("abcd")}, limits)
    with pytest.raises(InvalidFieldError, match="guided_regex: at most 100 bytes"):
        c.from_openai({"guided_regex": "a" * 101}, limits)
    assert c.from_openai({"guided_regex": "a" * 100}, limits) is not None  # the limit itself passes
    assert ConstraintLimits() == ConstraintLimits(64 << 10, 1000)  # the README's defaults


@pytest.mark.parametrize(("schema", "pointer", "feature"), [
    ({"type": "object", "properties": {"a": {"type": "string", "if": {"minLength": 1}}}}, "/properties/a/if",
     '"if"'),
    ({"type": "object", "properties": {"c": {"$ref": "#/$defs/C"}}, "$defs": {"C": {"type": "string",
                                                                                    "format": "weird"}}},
     "/$defs/C/format", "weird"),
    ({"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "(?=x)y"}]}},
     "/items/anyOf/1/pattern", "look-around"),
    ({"type": "object", "properties": {"a/b~": {"type": "object", "not": {}}}}, "/properties/a~1b~0/not", '"not"'),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}, "/properties/x", "missing"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "/oneOf", "oneOf"),
    ({"type": "object", "properties": {"n": {"type": 5}}}, "/properties/n/type", "type must be"),  # not valid at all
])
def test_an_unsupported_feature_is_named_with_its_json_pointer(schema, pointer, feature):
    check = ConstraintCheck()
    with pytest.raises(InvalidFieldError) as e:
        asyncio.run(check.check(c.json_schema(schema, "f")))
    message = str(e.value)
    assert e.value.field == "constraint" and message.startswith("constraint: json_schema: ")
    assert f"JSON pointer {json.dumps(pointer)}" in message and feature in message, message


@pytest.mark.parametrize(("constraint", "words"), [
    (c.regex("a(b", "f"), "unclosed group"),
    (c.grammar("start: foo", "f"), 'unknown name: "foo"'),
])
def test_a_regex_or_grammar_that_does_not_compile_says_why(constraint, words):
    with pytest.raises(InvalidFieldError) as e:
        asyncio.run(ConstraintCheck().check(constraint))
    assert f"{constraint.kind}: does not compile" in str(e.value) and words in str(e.value)


@pytest.mark.parametrize("fmt", ["hermes", "generic"])
def test_a_tool_whose_parameters_use_an_unsupported_feature_is_refused(tokenizer, fmt):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "not": {"const": ""}}}}}}]
    constraint = plan(FORMATS[fmt], [{"role": "user", "content": "x"}], ToolRequest.from_openai(tools, "required"),
                      tokenizer.special_tokens).constraint
    with pytest.raises(InvalidFieldError) as e:
        asyncio.run(ConstraintCheck().check(constraint, "tools"))
    assert str(e.value).startswith("tools: the JSON schema cannot be enforced at JSON pointer ")
    assert '/properties/q/not"' in str(e.value) and '"not"' in str(e.value)


def test_each_grammar_compiles_once_and_verdicts_are_cached():
    check = ConstraintCheck(size=2)
    good, bad = c.json_schema(SCHEMA, "f"), c.json_schema({"type": "object", "if": {}}, "f")

    async def run():
        await asyncio.gather(check.check(good), check.check(good), check.check(None))  # one compile shared
        await check.check(good)
        for _ in range(2):
            with pytest.raises(InvalidFieldError):
                await check.check(bad, "tools")
        await check.check(c.regex("x", "f"))
        await check.check(c.regex("y", "f"))  # the LRU holds two: the first verdict is gone
        await check.check(good)

    asyncio.run(run())
    assert (check.compiles, check.hits) == (5, 3)


def test_the_checks_counters_are_gateway_metrics():
    """Three checks of one grammar (one compile, two hits) and one refused schema, read back from the
    exposition text by prometheus_client's own parser."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hybridgate.gateway.metrics import GatewayMetrics

    check = ConstraintCheck()

    async def run():
        for _ in range(3):
            await check.check(c.regex("ab+", "f"))
        with pytest.raises(InvalidFieldError):
            await check.check(c.json_schema({"type": "object", "not": {}}, "f"))

    start = time.perf_counter()
    asyncio.run(run())
    wall_s = time.perf_counter() - start
    text = generate_latest(GatewayMetrics(constraint_check=check).registry).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["hybridgate:constraint_check_compiles_total"] == 2
    assert got["hybridgate:constraint_check_cache_hits_total"] == 2
    assert got["hybridgate:constraint_check_refused_total"] == 1
    # The two compiles ran one after the other inside run(): their measured seconds fit in its wall time.
    assert 0 < got["hybridgate:constraint_check_compile_seconds_total"] <= wall_s


def test_the_response_cache_key_includes_the_constraint():
    params = SamplingParams(temperature=0.0)
    keys = {cache_key("fp", [1, 2], p, 8, "auto") for p in (
        params, SamplingParams(temperature=0.0, constraint=c.regex("a+", "f")),
        SamplingParams(temperature=0.0, constraint=c.regex("b+", "f")),
        SamplingParams(temperature=0.0, constraint=c.choice(["a+"], "f")))}
    assert len(keys) == 4


def test_http_errors_name_the_field_the_request_set():
    body = api.ChatCompletionRequest(messages=[], structured_outputs={"regex": "a(b"})
    assert api.param_of("constraint", body) == "structured_outputs.regex"
    body = api.ChatCompletionRequest(messages=[], response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}})
    assert api.param_of("constraint", body) == "response_format.json_schema.schema"
    assert api.param_of("constraint", api.CompletionRequest(prompt="p", guided_grammar="x")) == "guided_grammar"


@pytest.mark.parametrize(("request_fields", "expected"), [
    ({"json_schema": json.dumps(SCHEMA)}, c.json_schema(SCHEMA, "f")),
    ({"regex": "[0-9]+"}, c.regex("[0-9]+", "f")),
    ({"grammar": 'start: "a"'}, c.grammar('start: "a"', "f")),
    ({"choice": pb.Choices(choices=["x", "y"])}, c.choice(["x", "y"], "f")),
    ({}, None),
])
def test_grpc_constraint_oneof(request_fields, expected):
    _, params = request_to_native(pb.GenerateRequest(prompt="p", **request_fields))
    assert params.constraint == expected


def test_grpc_constraint_errors_name_the_proto_field():
    with pytest.raises(InvalidFieldError, match=r"^choice\.choices: at most 2 choices"):
        request_to_native(pb.GenerateRequest(prompt="p", choice=pb.Choices(choices=list("abc"))),
                          ConstraintLimits(max_choices=2))
    with pytest.raises(InvalidFieldError, match=r"^json_schema: is not valid JSON"):
        request_to_native(pb.GenerateRequest(prompt="p", json_schema="{"))


def test_grpc_tools_history_and_final_calls():
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = pb.GenerateRequest(
        chat=pb.Chat(messages=[
            pb.ChatMessage(role="user", content="hi"),
            pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="call_1", name="w", arguments="{}")]),
            pb.ChatMessage(role="tool", content="21", tool_call_id="call_1")]),
        tools=[pb.Tool(name="w", description="weather", parameters=json.dumps(weather)), pb.Tool(name="n")],
        tool_function="w", parallel_tool_calls=False)
    prompt, _ = request_to_native(req)
    assert prompt[1]["tool_calls"] == [{"id": "call_1", "type": "function",
                                        "function": {"name": "w", "arguments": "{}"}}]
    assert prompt[2]["tool_call_id"] == "call_1"
    tools = tools_to_native(req)
    assert (tools.choice, tools.parallel, [f.name for f in tools.functions]) == ("w", False, ["w", "n"])
    assert tools.functions[0].parameters == weather
    assert tools_to_native(pb.GenerateRequest(prompt="p")) is None
    assert tools_to_native(pb.GenerateRequest(tools=[pb.Tool(name="w")], tool_mode="required")).choice == "required"
    with pytest.raises(InvalidFieldError, match=r"^tools\[0\]\.parameters: is not valid JSON"):
        tools_to_native(pb.GenerateRequest(tools=[pb.Tool(name="w", parameters="{")]))
    last = Delta("r", 3, "", [2], FinishReason.EOS, Usage(5, 4, 0), Timings(0, 1, 2), "gpu")
    msg = delta_to_proto(last, [ToolCall(0, "call_9", "w", '{"city": "Oslo"}')])
    assert [(t.id, t.name, t.arguments) for t in msg.tool_calls] == [("call_9", "w", '{"city": "Oslo"}')]
    assert not delta_to_proto(Delta("r", 0, "x", [5])).tool_calls


def _many_patterns(n: int) -> dict:
    """A schema of `n` required strings, each with its own pattern: about 20 ms to compile at 400."""
    return {"type": "object", "additionalProperties": False, "required": [f"p{i}" for i in range(n)],
            "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},{i % 7 + 20}}}x[0-9]{{2,9}}$"}
                           for i in range(n)}}


def test_a_constraint_that_compiles_past_the_timeout_is_refused_naming_the_field_and_the_limit():
    """A real schema whose compile (tens of ms) runs past a 1 ms limit; the verdict is cached, so the same
    schema is refused again without compiling. (Compiles had no limit.)"""
    slow = c.json_schema(_many_patterns(400), "f")
    check = ConstraintCheck(timeout_s=0.001)

    async def run():
        for field in ("constraint", "tools"):
            with pytest.raises(InvalidFieldError) as e:
                await check.check(slow, field)
            assert str(e.value) == f"{field}: json_schema: took longer than 0.001 s to compile (--constraint-compile-timeout)"
            assert e.value.field == field

    try:
        asyncio.run(run())
    finally:
        check.close()
    assert (check.compiles, check.hits, check.refused) == (1, 1, 2)


def test_a_prompt_encode_is_not_queued_behind_a_burst_of_compiles(tokenizer, monkeypatch):
    """Compiles blocked on their threads (more than the default executor has threads) leave the default
    executor, where inline prompt encodes and /detokenize run, free: an encode completes at once. (Compiles
    shared that executor, so the encode waited for them.)"""
    import threading

    release = threading.Event()

    def blocked(constraint):
        release.wait(30)
        return None

    monkeypatch.setattr(c, "explain", blocked)
    check = ConstraintCheck(threads=2)
    burst = 40  # more than the default executor's threads (at most 32)

    async def run():
        compiles = [asyncio.ensure_future(check.check(c.regex(f"a{i}", "f"))) for i in range(burst)]
        await asyncio.sleep(0)  # every compile submitted
        try:
            ids = await asyncio.wait_for(asyncio.to_thread(tokenizer.encode, "hello world"), timeout=5)
            assert tokenizer.decode(ids) == "hello world"
            assert not any(f.done() for f in compiles)  # the compiles were still blocked meanwhile
        finally:
            release.set()
        await asyncio.gather(*compiles)

    try:
        asyncio.run(run())
    finally:
        release.set()
        check.close()
