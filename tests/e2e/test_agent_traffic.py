"""End to end: agent traffic as the frameworks send it, on both runners (a `serve` with one torch worker, one
with one Numba worker; SmolLM2's template takes no tools, so calls are in the generic JSON envelope).

- Tools made by `openai.pydantic_function_tool` (strict) and by Pydantic's own `model_json_schema()` (not
  strict), from models with nested models, lists of them, `Optional`, `Literal`, an enum and a recursive tree:
  every returned call's arguments validate with `jsonschema` against the tool's own schema (its `$defs` and
  `$ref`s as Pydantic wrote them), for `required`, a named function and `auto`, through the `openai` client
  and gRPC, streamed equal to non-streamed. Two tools whose `$defs` both hold an `Address` of different shapes
  keep their own.
- `min_tokens` (vLLM's): the greedy answer that ends after 8 ids (transformers' reference, FACTS) goes on to
  at least `min_tokens`, the same text through both doors; above max_tokens it is refused naming the field.
- A call cut by max_tokens is not returned (docs: "A call cut by max_tokens"): finish `length`, no call, the
  same streamed, not streamed and over gRPC.
"""

from __future__ import annotations

import enum
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, Optional

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import TIME_FACTOR
from procs import Serve, stub
from hybridgate.v1 import generation_pb2 as pb

MODEL = "hg-smollm"
RUNNERS = {"gpu": ("--gpu-workers", "1", "--cpu-workers", "0"), "cpu": ("--gpu-workers", "0", "--cpu-workers", "1")}


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Address(BaseModel):
    street: str = Field(max_length=16)
    city: str = Field(max_length=12)


class Booking(BaseModel):
    guest: str = Field(max_length=12)
    address: Address
    others: list[Address] = Field(max_length=2)
    note: Optional[str] = Field(max_length=12)
    kind: Literal["room", "suite"]
    color: Color


class Tree(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list[Tree] = Field(max_length=2)


class ShipAddress(BaseModel):  # another `Address` in its tool's $defs: a zip code, no street
    zip: int = Field(ge=10000, le=99999)


class Shipment(BaseModel):
    weight: int = Field(ge=1, le=99)
    to: ShipAddress


def _renamed(schema: dict, old: str, new: str) -> dict:
    """`schema` with its definition `old` renamed `new` (the text of its refs too)."""
    return json.loads(json.dumps(schema).replace(f'"#/$defs/{old}"', f'"#/$defs/{new}"')
                      .replace(f'"{old}": {{', f'"{new}": {{', 1))


TOOLS = [openai.pydantic_function_tool(Booking, name="book"),
         openai.pydantic_function_tool(Tree, name="tree"),
         {"type": "function", "function": {"name": "book_loose", "parameters": Booking.model_json_schema()}},
         {"type": "function", "function": {"name": "ship", "strict": True, "parameters": _renamed(
             openai.pydantic_function_tool(Shipment)["function"]["parameters"], "ShipAddress", "Address")}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Book a suite for Ann at 1 Main St, Oslo, and ship 3 kg to 12345."}]


def valid_call(name: str, arguments: str) -> None:
    """Raises unless `arguments` is JSON that tool `name`'s own schema accepts (jsonschema, the reference)."""
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module", params=sorted(RUNNERS))
def serve(request, tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp(f"agents-{request.param}") / "serve.log", *RUNNERS[request.param],
                 "--served-model-name", MODEL)
    yield proc
    assert proc.stop() == 0, proc.text()


@pytest.fixture(scope="module")
def client(serve):
    return openai.OpenAI(base_url=serve.http_url + "/v1", api_key="unused", max_retries=0, timeout=120 * TIME_FACTOR)


def streamed(client, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) reassembled from the chunks as a client does."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or ():
            name, args = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), args + (d.function.arguments or ""))
        finish = choice.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def whole(choice) -> tuple[str | None, list[tuple[str, str]], str]:
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content or None, calls, choice.finish_reason


def grpc_calls(serve, seed: int, max_tokens: int, **tool_choice) -> tuple[list[tuple[str, str]], int]:
    """([(name, arguments)], finish reason) of one gRPC request with TOOLS."""
    tools = [pb.Tool(name=t["function"]["name"], parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    msgs = list(stub(serve.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in ASK]), tools=tools, temperature=1.0, seed=seed,
        max_tokens=max_tokens, **tool_choice), timeout=120 * TIME_FACTOR))
    assert all(not m.tool_calls for m in msgs[:-1])
    return [(c.name, c.arguments) for c in msgs[-1].tool_calls], msgs[-1].finish_reason


CHOICES = {"required": "required", "auto": "auto", "named-ship": {"type": "function", "function": {"name": "ship"}},
           "named-tree": {"type": "function", "function": {"name": "tree"}}}


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_pydantic_tools_give_calls_valid_for_their_own_schemas(client, serve, choice):
    """Sampled calls through both doors validate against the named tool's schema; one seed streamed equals
    the same seed not streamed."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=CHOICES[choice], temperature=1.0,
              max_tokens=128)
    grpc_choice = {"tool_mode": choice} if choice in ("required", "auto") else \
        {"tool_function": CHOICES[choice]["function"]["name"]}
    with ThreadPoolExecutor(3) as pool:  # one batch: three HTTP choices, one streamed, one over gRPC
        over_grpc = pool.submit(grpc_calls, serve, 11, 128, **grpc_choice)
        one = pool.submit(streamed, client, seed=0, **kw)
        runs = client.chat.completions.create(seed=0, n=3, **kw).choices
    calls = [c for run in runs for c in whole(run)[1]] + over_grpc.result()[0]
    if choice != "auto":
        assert calls, [run.message for run in runs]
    for name, arguments in calls:
        assert name in SCHEMAS and (choice[6:] == name if choice.startswith("named") else True)
        valid_call(name, arguments)
    assert one.result() == whole(runs[0])  # choice 0 has the request's seed


def test_two_tools_with_an_address_each_keep_their_own(client):
    """`book` and `ship` both define `Address` (street and city; a zip code): forced to `ship`, the call has a
    zip and no street, and validates against `ship`'s schema, not `book`'s."""
    runs = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=5, n=3,
                                          max_tokens=40, tool_choice=CHOICES["named-ship"]).choices
    done = [whole(run)[1] for run in runs if run.finish_reason == "tool_calls"]
    assert done, [run.message for run in runs]
    for calls in done:
        for name, arguments in calls:
            assert name == "ship"
            valid_call("ship", arguments)
            assert set(json.loads(arguments)["to"]) == {"zip"}


FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_min_tokens_holds_eos_back_equally_on_both_doors(client, serve):
    free = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32)
    assert (free.usage.completion_tokens, free.choices[0].finish_reason) == (8, "stop")  # EOS after 8 ids
    held = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=32,
                                          extra_body={"min_tokens": 20})
    assert held.usage.completion_tokens >= 20
    assert held.choices[0].message.content.startswith(free.choices[0].message.content)
    text = "".join(m.text for m in stub(serve.target).Generate(pb.GenerateRequest(
        chat=pb.Chat(messages=[pb.ChatMessage(**m) for m in FRANCE]), temperature=0, max_tokens=32, min_tokens=20),
        timeout=120 * TIME_FACTOR))
    assert text == held.choices[0].message.content


def test_min_tokens_above_max_tokens_is_refused_naming_it(client, serve):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens" and "max_tokens (4)" in e.value.body["message"]
    with pytest.raises(grpc.RpcError) as g:
        list(stub(serve.target).Generate(pb.GenerateRequest(prompt="hi", max_tokens=4, min_tokens=5),
                                         timeout=60 * TIME_FACTOR))
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in g.value.details()


def test_a_call_cut_by_max_tokens_is_not_returned(client, serve):
    """Ten tokens end inside the first call's arguments: finish `length` and no call, on both doors."""
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
              max_tokens=10)
    content, calls, finish = whole(client.chat.completions.create(**kw).choices[0])
    assert (calls, finish) == ([], "length") and not content
    assert streamed(client, **kw) == (content, [], "length")
    assert grpc_calls(serve, 3, 10, tool_mode="required") == ([], pb.FINISH_REASON_LENGTH)
