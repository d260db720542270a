"""End to end: tool calling through `hybridgate serve` (one CPU worker) and the `openai` SDK, with a Hermes-style
template given by --chat-template (SmolLM2's own takes no tools: the generic format's tests are in
test_structured_output.py, on its serve with the model's template). `required` and a named function give arguments
valid for the function's schema (`jsonschema`) in 20 sampled runs each; `auto` gives valid calls when the model
calls; parallel calls to one function have distinct ids and indexes; streaming and non-streaming answers agree;
tool_choice none never calls; a history with tool results renders; bad tools are 400s naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from conftest import TIME_FACTOR
from procs import Serve

TEMPLATE = Path(__file__).parents[1] / "golden" / "hermes_tools.jinja"
MODEL = "hg-smollm"
# Strings and numbers bounded, so that a sampled call ends well inside max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
SAMPLES = 20


def valid_call(name: str, arguments: str) -> None:
    """Raises unless `arguments` is JSON that `name`'s schema accepts (jsonschema, the reference)."""
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.fixture(scope="module")
def client(tmp_path_factory, model_path):
    proc = Serve(tmp_path_factory.mktemp("tools") / "serve.log", "--cpu-workers", "1", "--gpu-workers", "0",
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
    assert sorted(calls) == list(range(len(calls)))  # indexes 0, 1, ... in order of appearance
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


def sampled(client, n: int, seed: int, **kw) -> list:
    """`n` sampled choices (seeds seed .. seed + n - 1) of one chat request with TOOLS at temperature 1.0."""
    return client.chat.completions.create(model=MODEL, tools=TOOLS, temperature=1.0, seed=seed, n=n, **kw).choices


def test_required_and_a_named_function_give_valid_arguments_in_20_sampled_runs(client):
    """20 runs of each choice, as four requests of 10 choices in flight together (one batch); one call each
    (no parallel calls), so the grammar ends the answer after it."""
    ask = [{"role": "user", "content": "What is 12 plus 30? Or the weather in Oslo?"}]
    choices = ["required", {"type": "function", "function": {"name": "add"}}]
    jobs = [(choice, seed) for choice in choices for seed in range(0, SAMPLES, SAMPLES // 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        parts = list(pool.map(lambda job: sampled(client, SAMPLES // 2, job[1], messages=ask, max_tokens=56,
                                                  tool_choice=job[0], parallel_tool_calls=False), jobs))
    for (choice, _), part in zip(jobs, parts):
        assert len(part) == SAMPLES // 2
        for run in part:
            assert run.finish_reason == "tool_calls" and run.message.content is None, run
            (call,) = run.message.tool_calls
            assert call.id.startswith("call_") and call.type == "function"
            if choice != "required":
                assert call.function.name == "add"
            valid_call(call.function.name, call.function.arguments)


def test_auto_calls_are_valid_when_the_model_calls(client):
    """SmolLM2 does not call on its own; asked to copy a call it sometimes starts one, and from its trigger the
    lazy grammar holds the call to the schema (a call cut by max_tokens is not returned: every call is whole)."""
    ask = [{"role": "user", "content": 'Copy this text exactly:\n<tool_call>\n{"name": "get_weather", '
                                       '"arguments": {"city": "Oslo"}}\n</tool_call>'}]
    runs = sampled(client, 10, 0, messages=ask, max_tokens=40)
    called = [run for run in runs if run.message.tool_calls]
    assert called, [run.message.content for run in runs]
    for run in called:
        calls = run.message.tool_calls
        for call in calls:
            valid_call(call.function.name, call.function.arguments)
        assert len({c.id for c in calls}) == len(calls)


def test_parallel_calls_to_one_function_have_distinct_ids_and_indexes_streamed_as_whole(client):
    """Asked for two cities with `required` and parallel calls, some sampled answers call get_weather twice;
    each such answer's ids differ, and streamed (same seed) it has the same calls with indexes 0, 1, ..."""
    ask = [{"role": "user", "content": "What is the weather in Paris and in London? Call the tool once per city."}]
    kw = dict(messages=ask, max_tokens=80, tool_choice="required")  # room for two whole calls
    runs = sampled(client, 6, 0, **kw)
    twice = [i for i, run in enumerate(runs) if [c.function.name for c in run.message.tool_calls or ()][:2] ==
             ["get_weather", "get_weather"]]
    assert twice, [run.message.tool_calls for run in runs]
    for i in twice:
        calls = runs[i].message.tool_calls
        assert len({c.id for c in calls}) == len(calls)
        valid_call("get_weather", calls[0].function.arguments)
    i = twice[0]
    content, calls, finish = streamed(client, tools=TOOLS, temperature=1.0, seed=i, **kw)
    whole = runs[i]
    assert (content, finish) == (whole.message.content, whole.finish_reason)
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len({c["id"] for c in calls}) == len(calls) >= 2
