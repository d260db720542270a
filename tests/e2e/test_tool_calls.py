"""End to end: tool calling through `hybridgate serve` and the `openai` SDK, with a Hermes-style template given by
--chat-template (SmolLM2's own takes no tools). Streaming and non-streaming answers agree; tool_choice none
never calls; a history with tool results renders; bad tools are 400s naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from conftest import TIME_FACTOR
from procs import Serve

TEMPLATE = Path(__file__).parents[1] / "golden" / "hermes_tools.jinja"
MODEL = "hg-smollm"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("tools") / "serve.log", "--cpu-workers", "0", "--gpu-workers", "1",
                 "--served-model-name", MODEL, "--chat-template", str(TEMPLATE))
    yield openai.OpenAI(base_url=proc.http_url + "/v1", api_key="unused", max_retries=0, timeout=120 * TIME_FACTOR)
    assert proc.stop() == 0, proc.text()


def streamed(client, **kw) -> tuple[str | None, list[dict], str]:
    """(content, calls, finish_reason) reassembled from the chunks as a client does."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
        finish = choice.finish_reason or finish
    return "".join(content) or None, [calls[i] for i in sorted(calls)], finish


def whole(client, **kw) -> tuple[str | None, list[dict], str]:
    choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("seed", [1, 2])
def test_streaming_equals_non_streaming_with_tools(client, seed):
    kw = dict(messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=32)
    a, b = streamed(client, **kw), whole(client, **kw)
    strip = lambda r: (r[0], [(c["name"], c["arguments"]) for c in r[1]], r[2])  # noqa: E731 (ids are fresh)
    assert strip(a) == strip(b)
    assert (b[2] == "tool_calls") == bool(b[1])
    if b[1]:
        assert len({c["id"] for c in b[1]}) == len(b[1])


def test_tool_choice_none_never_calls(client):
    for seed in range(2):
        content, calls, finish = whole(client, messages=ASK, tools=TOOLS, tool_choice="none", temperature=1.0,
                                       seed=seed, max_tokens=32)
        assert calls == [] and finish in ("stop", "length") and content is not None


def test_history_with_a_tool_result_renders_and_answers(client):
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": json.dumps({"celsius": 21})}]
    content, calls, finish = whole(client, messages=history, tools=TOOLS, temperature=0, max_tokens=24)
    assert finish in ("stop", "length", "tool_calls") and (content or calls)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param
