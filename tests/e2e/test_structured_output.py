"""End to end: structured output through `hybridgate serve`, the `openai` SDK and gRPC. Sampled answers at
temperature 1.0 under a JSON schema (nested objects, arrays, enums, `$ref` to `$defs`, `anyOf`, required and
optional fields, string patterns) each validate with `jsonschema`; regex, choice and Lark grammar outputs match
(Python's re, the list); `client.chat.completions.parse` returns the pydantic model; an unsupported feature is a
400 / INVALID_ARGUMENT naming it and its JSON pointer; max_tokens inside a value ends with `length`."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import jsonschema
import openai
import pydantic
import pytest

from conftest import TIME_FACTOR
from procs import Serve, stub

from hybridgate.v1 import generation_pb2 as pb

MODEL = "hg-smollm"
MAX_BYTES = 4096  # the serve's --max-constraint-bytes, below the default so the limit is seen
# Every string and number bounded and the keys short, so a sampled answer ends well inside max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,5}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"$ref": "#/$defs/color"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                 "required": ["city"], "additionalProperties": False},
        "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
    },
    "required": ["name", "color", "home"],
    "additionalProperties": False,
    "$defs": {"color": {"enum": ["red", "blue"]}},
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLES = 20


@pytest.fixture(scope="module")
def serve(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("structured") / "serve.log", "--cpu-workers", "1", "--gpu-workers", "0",
                 "--served-model-name", MODEL, "--max-constraint-bytes", str(MAX_BYTES))
    yield proc
    assert proc.stop() == 0, proc.text()


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=120 * TIME_FACTOR)


def choices(client, n: int, seed: int, max_tokens: int = 64, messages=ASK, **kw):
    """`n` sampled choices (seeds seed .. seed + n - 1) of one chat request at temperature 1.0."""
    reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, seed=seed, n=n,
                                           max_tokens=max_tokens, **kw)
    return reply.choices


def grpc_json(serve, seed: int) -> tuple[str, int]:
    """(text, finish reason) of one gRPC request constrained by PERSON."""
    text, finish = [], 0
    for msg in stub(serve.target).Generate(pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in ASK]), temperature=1.0, seed=seed, max_tokens=64,
            json_schema=json.dumps(PERSON)), timeout=120 * TIME_FACTOR):
        text.append(msg.text)
        finish = msg.finish_reason or finish
    return "".join(text), finish


def test_json_schema_samples_validate_over_http_and_grpc(serve, client):
    """20 sampled answers through each door, all in flight together (one batch)."""
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    half = SAMPLES // 2
    with ThreadPoolExecutor(2 + SAMPLES) as pool:
        http = [pool.submit(choices, client, half, seed, response_format=rf) for seed in (0, half)]
        grpcs = list(pool.map(lambda seed: grpc_json(serve, seed), range(100, 100 + SAMPLES)))
        answers = [c for f in http for c in f.result()]
    assert len(answers) == SAMPLES
    for choice in answers:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    for text, finish in grpcs:
        assert finish in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP), text  # EOS, or the end-of-turn id
        jsonschema.validate(json.loads(text), PERSON)


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = pydantic.Field(ge=0, le=8)


class Owner(pydantic.BaseModel):
    first_name: str = pydantic.Field(max_length=12)
    pets: list[Pet] = pydantic.Field(max_length=2)


def test_sdk_parse_returns_the_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "An owner and pets."}],
                                          response_format=Owner, temperature=1.0, seed=3, max_tokens=64)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(reply.choices[0].message.parsed, Owner)


@pytest.mark.parametrize(("fields", "matches"), [
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,2}"}},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,6} (is|was) [0-9]{1,2}", t)),
    ({"guided_choice": ["Paris", "Lyon", "Nice"]}, lambda t: t in ("Paris", "Lyon", "Nice")),
    ({"structured_outputs": {"grammar": 'start: "The capital is " CITY "."\nCITY: /[A-Z][a-z]{2,8}/\n'}},
     lambda t: re.fullmatch(r"The capital is [A-Z][a-z]{2,8}\.", t)),
])
def test_regex_choice_and_grammar_outputs_match(client, fields, matches):
    for choice in choices(client, 5, 7, max_tokens=24, messages=[{"role": "user", "content": "A city?"}],
                          extra_body=fields):
        assert choice.finish_reason == "stop" and matches(choice.message.content), choice.message.content


def test_completions_take_structured_outputs(client):
    reply = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=1.0, seed=1,
                                      n=3, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert [c.text in ("yes", "no") for c in reply.choices] == [True] * 3


def test_max_tokens_inside_a_value_is_length(client):
    long = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    choice = choices(client, 1, 0, max_tokens=6, response_format={
        "type": "json_schema", "json_schema": {"name": "s", "schema": long}})[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"story": "')


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "if": {"minLength": 1}}}}}}},
     "response_format.json_schema.schema", ['JSON pointer "/properties/a/if"', '"if"']),
    ({"extra_body": {"structured_outputs": {"json": {"type": "object", "properties": {
        "d": {"$ref": "#/$defs/D"}}, "$defs": {"D": {"type": "string", "format": "weird"}}}}}},
     "structured_outputs.json", ['JSON pointer "/$defs/D/format"', "weird"]),
    ({"extra_body": {"guided_regex": "(?=a)b"}}, "guided_regex", ["does not compile", "look-around"]),
    ({"extra_body": {"guided_choice": ["x" * 100] * 50}}, "guided_choice", ["--max-constraint-bytes", "4096"]),
])
def test_an_unsupported_feature_is_a_400_naming_it(client, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == param, error
    assert error["message"].startswith(param + ": ") and all(w in error["message"] for w in words), error


def test_grpc_invalid_argument_names_the_feature(serve):
    with pytest.raises(grpc.RpcError) as e:
        list(stub(serve.target).Generate(pb.GenerateRequest(prompt="x", max_tokens=4, json_schema=json.dumps(
            {"type": "array", "items": {"type": "object", "not": {}}})), timeout=60 * TIME_FACTOR))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'JSON pointer "/items/not"' in e.value.details(), e.value.details()


def test_grpc_named_tool_call_is_in_the_last_response(serve):
    weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
               "additionalProperties": False}
    msgs = list(stub(serve.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Weather in Paris?")]),
        tools=[pb.Tool(name="get_weather", parameters=json.dumps(weather))], tool_function="get_weather",
        temperature=1.0, seed=4, max_tokens=48), timeout=120 * TIME_FACTOR))
    assert all(not m.tool_calls for m in msgs[:-1])
    calls = msgs[-1].tool_calls
    assert [c.name for c in calls] == ["get_weather"] * len(calls) and calls, msgs[-1]
    assert calls[0].id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), weather)
