"""gpt-oss's harmony and Gemma 4's output formats: recorded generations (tests/golden/channel_outputs.json,
written after OpenAI's harmony guide and Gemma 4's chat template, each with the reasoning, content and calls
it holds written out by hand) parsed whole, split at every byte boundary, split at random, and streamed
through the router's ToolCallStream and the OpenAI door's formatting: the same reasoning, content and calls
every way, and no reasoning in the content. The Gemma 4 samples are also read by transformers' own response
parser, which gives what the test data says."""

from __future__ import annotations

import asyncio
import codecs
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.gateway.convert import delta_to_proto
from hybridgate.router.config import TOOL_CALL_FORMATS
from hybridgate.router.gemma4 import parse_arguments
from hybridgate.router.stream import Delta, Timings, Usage
from hybridgate.router.tools import FORMATS, ToolCallStream, ToolRequest, choose_format, plan
from hybridgate.wire import FinishReason

SAMPLES = json.loads((Path(__file__).parents[1] / "golden" / "channel_outputs.json").read_text())
CASES = [(fmt, s) for fmt, samples in SAMPLES.items() for s in samples]
BY_NAME = {s["name"]: s["text"] for s in SAMPLES["harmony"]}
IDS = [f"{fmt}-{s['name']}" for fmt, s in CASES]
MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>",
           "<|channel>", "<channel|>", "<|tool_call>call:", "<turn|>", "<|tool_response>")


def wanted(fmt: str, sample: dict) -> tuple[str, str, list]:
    """(reasoning, content, calls) as the sample writes them; a harmony call's arguments are its body as
    written, a Gemma 4 call's the JSON of its value."""
    calls = [(name, args if fmt == "harmony" else json.dumps(args, ensure_ascii=False))
             for name, args in sample["calls"]]
    return sample["reasoning"], sample["content"], calls


def parse_pieces(fmt: str, pieces: list[bytes]) -> tuple[str, str, list]:
    """Feed the pieces of an output's UTF-8 bytes as the detokenizer would (never half a character); returns
    (reasoning, content, calls) rebuilt from what was streamed, and checks the parser's own record agrees."""
    parser = FORMATS[fmt].new_parser()
    decoder = codecs.getincrementaldecoder("utf-8")()
    reasoning, content, sent = [], [], {}
    for k, piece in enumerate(pieces):
        c, deltas = parser.feed(decoder.decode(piece, final=k == len(pieces) - 1))
        content.append(c)
        reasoning.append(parser.take_reasoning())
        for d in deltas:
            assert d.index not in sent and d.id.startswith("call_")
            sent[d.index] = (d.name, d.arguments)
    c, deltas = parser.finish()
    content.append(c)
    reasoning.append(parser.take_reasoning())
    sent.update({d.index: (d.name, d.arguments) for d in deltas})
    calls = [sent[i] for i in sorted(sent)]
    assert [(c.name, c.arguments) for c in parser.calls] == calls and all(c.complete for c in parser.calls)
    assert "".join(parser.content) == "".join(content) and "".join(parser.reasoning) == "".join(reasoning)
    return "".join(reasoning), "".join(content), calls


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_every_byte_split_gives_the_recorded_reasoning_content_and_calls(fmt, sample):
    raw = sample["text"].encode()
    want = wanted(fmt, sample)
    assert parse_pieces(fmt, [raw]) == want
    for cut in range(1, len(raw)):
        assert parse_pieces(fmt, [raw[:cut], raw[cut:]]) == want, cut
    assert parse_pieces(fmt, [raw[i:i + 1] for i in range(len(raw))]) == want  # byte by byte


@pytest.mark.parametrize("sample", SAMPLES["gemma4"], ids=[s["name"] for s in SAMPLES["gemma4"]])
def test_the_gemma4_samples_read_as_transformers_reads_them(sample):
    """transformers' own response parser with its Gemma 4 response template (`transformers serve`'s) reads
    each sample as written out in the test data; a call cut short it refuses (the test data: no call)."""
    from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    from transformers.utils.chat_parsing import parse_response

    template = next(t for names, t in _RESPONSE_TEMPLATE_FALLBACKS.items() if "gemma4" in names)
    if sample["name"] in ("call_cut_by_max_tokens", "turn_ended_inside_a_call"):
        with pytest.raises(ValueError):
            parse_response(sample["text"], template, prefix="<|turn>model\n")
        return
    got = parse_response(sample["text"], template, prefix="<|turn>model\n")
    assert got.get("reasoning_content", "") == sample["reasoning"] and got.get("content", "") == sample["content"]
    assert [[c["function"]["name"], c["function"]["arguments"]] for c in got.get("tool_calls", [])] == sample["calls"]


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_reasoning_and_markup_never_reach_the_content(fmt, sample):
    reasoning, content, _ = parse_pieces(fmt, [sample["text"].encode()])
    if reasoning:
        assert reasoning not in content
    if not sample["name"].startswith("malformed"):  # a Gemma 4 block that does not parse is content as written
        assert not any(m in content for m in MARKERS)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_splits_give_the_recorded_reasoning_content_and_calls(data):
    fmt, sample = data.draw(st.sampled_from(CASES))
    raw = sample["text"].encode()
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=40)))
    pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]
    assert parse_pieces(fmt, pieces) == wanted(fmt, sample)


@pytest.mark.parametrize(("text", "want"), [
    ('{city:<|"|>Paris<|"|>}', {"city": "Paris"}),
    ('{a:1,b:-2.5e3,c:true,d:false,e:null}', {"a": 1, "b": -2500.0, "c": True, "d": False, "e": None}),
    ('{ q : <|"|>a "quoted", {braced} [text]<|"|> , n : [ 1 , <|"|>x<|"|> , {k:[]} ] }',
     {"q": 'a "quoted", {braced} [text]', "n": [1, "x", {"k": []}]}),
    ('{"json_key":"json \\"string\\""}', {"json_key": 'json "string"'}),
    ("{}", {}),
])
def test_gemma4_arguments_are_read_as_its_template_writes_them(text, want):
    assert parse_arguments(text) == want


@pytest.mark.parametrize("text", ['{a:<|"|>open}', "{a:1", "{a 1}", "{a:1,}", '{a:1} tail'])
def test_gemma4_arguments_out_of_its_syntax_are_refused(text):
    with pytest.raises(ValueError):
        parse_arguments(text)


def test_the_formats_are_chosen_by_architecture_and_template_and_named_in_the_setting():
    assert {"harmony", "gemma4"} <= set(TOOL_CALL_FORMATS)
    assert choose_format("auto", None, "gpt-oss").name == "harmony"
    assert choose_format("auto", None, "gemma4").name == "gemma4"
    assert choose_format("auto", "{% if tools %}<|start|>assistant<|channel|>commentary to=functions.x{% endif %}",
                         "llama").name == "harmony"
    assert choose_format("auto", "{% if tools %}<|tool_call>call:{% endif %}", "llama").name == "gemma4"
    assert choose_format("hermes", None, "gpt-oss").name == "hermes"  # a named format wins


def test_a_chat_in_a_format_with_channels_is_parsed_and_keeps_control_tokens_without_tools():
    messages = [{"role": "user", "content": "hi"}]
    for fmt in ("harmony", "gemma4"):
        for request in (None, ToolRequest.from_openai([{"type": "function", "function": {"name": "f"}}], "none")):
            step = plan(FORMATS[fmt], messages, request, {})
            assert step.keep_special and step.new_parser == FORMATS[fmt].new_parser and step.constraint is None
        step = plan(FORMATS[fmt], messages, ToolRequest.from_openai([{"type": "function", "function": {"name": "f"}}]),
                    {})
        assert step.template_tools[0]["function"]["name"] == "f" and step.constraint is None


def test_an_assistants_reasoning_goes_back_to_a_template_that_takes_it():
    """gpt-oss's template renders an assistant's `thinking` as its analysis message (the reasoning that led to
    a call must be given back, the harmony guide says); the HTTP door and gRPC take it as reasoning_content."""
    from hybridgate.gateway import openai_api as api
    from hybridgate.gateway.convert import _message
    from hybridgate.v1 import generation_pb2 as pb

    history = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "", "reasoning_content": "Need add.",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    assert plan(FORMATS["harmony"], history, None, {}).messages[1]["thinking"] == "Need add."
    assert "thinking" not in plan(FORMATS["gemma4"], history, None, {}).messages[1]
    body = api.ChatCompletionRequest(messages=history)
    assert api.chat_messages(body)[1]["reasoning_content"] == "Need add."
    msg = pb.ChatMessage(role="assistant", content="", reasoning_content="Need add.")
    assert _message(msg)["reasoning_content"] == "Need add."


class _Replay:
    """A request stream replaying the given texts as deltas, the last one finished (`finish`)."""

    def __init__(self, texts: list[str], finish: FinishReason):
        self.prompt_ids, self.ids = [1, 2, 3], []
        self._deltas = [Delta("r", i, t, [i], finish if i == len(texts) - 1 else None,
                              Usage(3, len(texts), 0) if i == len(texts) - 1 else None,
                              Timings(1.0, 1.0, 2.0) if i == len(texts) - 1 else None)
                        for i, t in enumerate(texts)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._deltas:
            raise StopAsyncIteration
        self.ids.append(len(self.ids))
        return self._deltas.pop(0)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return None


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_the_router_stream_and_the_grpc_response_carry_reasoning_apart(fmt, sample):
    want_reasoning, want_content, want_calls = wanted(fmt, sample)
    for size in (1, 3, 7, 1 << 20):
        stream = ToolCallStream(_Replay(_pieces(sample["text"], size), FinishReason.EOS), FORMATS[fmt].new_parser())

        async def collect(stream=stream):
            return [d async for d in stream]

        deltas = asyncio.run(collect())
        protos = [delta_to_proto(d, stream.calls if d.finish_reason is not None else ()) for d in deltas]
        assert "".join(p.reasoning_content for p in protos) == want_reasoning
        assert "".join(p.text for p in protos) == want_content
        assert [(c.name, c.arguments) for c in protos[-1].tool_calls] == want_calls
        assert [(c.name, c.arguments) for d in deltas for c in d.tool_calls] == want_calls


@pytest.fixture(scope="module")
def formatter(gguf_model):
    from hybridgate.gateway.openai_format import Formatter
    from hybridgate.router import Router, RouterConfig

    router = Router(gguf_model, [], RouterConfig(prompt_processes=1))
    yield Formatter(router, "m")
    router.prompts.close()


@pytest.mark.parametrize(("fmt", "sample"), CASES, ids=IDS)
def test_the_openai_door_answers_reasoning_content_apart_streamed_or_not(formatter, fmt, sample):
    """vLLM's shape: `message.reasoning_content` and `delta.reasoning_content` beside `content` and `tool_calls`,
    through the door's own run of a request's choices and its response and chunk builders."""
    from hybridgate.gateway.admission import Admission
    from hybridgate.gateway.http_stream import Run
    from hybridgate.gateway.metrics import GatewayMetrics
    from hybridgate.gateway.openai_format import ChoiceState

    want_reasoning, want_content, want_calls = wanted(fmt, sample)
    door = SimpleNamespace(metrics=GatewayMetrics(), log_requests=False)

    async def answer(stream: bool):
        stream_of = ToolCallStream(_Replay(_pieces(sample["text"], 5), FinishReason.EOS), FORMATS[fmt].new_parser())
        states = [ChoiceState(0, stream_of)]
        run = Run(door, states, SimpleNamespace(name="m", admission=Admission(4)))
        await run.enter()
        if not stream:
            await run.finish()
            await run.close()
            return formatter.whole("chat", states)
        chunks = formatter.chunks("chat", states, include_usage=False)
        out = [c for c in chunks.opening()]
        async for state, delta in run.deltas():
            out += chunks.delta(state, delta)
        await run.close()
        return [json.loads(c.removeprefix(b"data: ")) for c in out]

    whole = asyncio.run(answer(False))["choices"][0]
    message = whole["message"]
    assert message.get("reasoning_content", "") == want_reasoning
    assert (message["content"] or "") == want_content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == want_calls
    assert whole["finish_reason"] == ("tool_calls" if want_calls else "stop")
    chunks = [c["choices"][0] for c in asyncio.run(answer(True))]
    assert "".join(c["delta"].get("reasoning_content", "") for c in chunks) == want_reasoning
    assert "".join(c["delta"].get("content") or "" for c in chunks) == want_content
    streamed = [(t["function"]["name"], t["function"]["arguments"])
                for c in chunks for t in c["delta"].get("tool_calls", [])]
    assert streamed == want_calls


def test_a_router_in_a_format_with_channels_parses_every_chat_and_ends_turns_at_the_formats_tokens(gguf_model,
                                                                                                   gemma3_path):
    """A chat's stream is parsed and keeps control tokens' text, a completion is left as it is; the turn ends at
    the format's tokens instead of the vocabulary's: Gemma 3's `<end_of_turn>` ends no Gemma 4 turn (`<turn|>`
    would; its vocabulary has none), EOS still does."""
    from hybridgate.models import load_gguf
    from hybridgate.router import Router, RouterConfig

    plain = Router(gguf_model, [], RouterConfig(prompt_processes=1))
    router = Router(gguf_model, [], RouterConfig(prompt_processes=1, tool_call_format="harmony"))
    gemma3 = load_gguf(gemma3_path)
    as_gemma4 = Router(gemma3, [], RouterConfig(prompt_processes=1, tool_call_format="gemma4"))
    try:
        chat = router.generate([{"role": "user", "content": "hi"}])
        assert isinstance(chat, ToolCallStream) and isinstance(chat.parser, type(FORMATS["harmony"].new_parser()))
        assert chat.params.skip_special_tokens is False
        assert not isinstance(router.generate("hi"), ToolCallStream)
        assert not isinstance(plain.generate([{"role": "user", "content": "hi"}]), ToolCallStream)
        tokenizer = as_gemma4.tokenizer
        end_of_turn = tokenizer.special_tokens["<end_of_turn>"]
        assert end_of_turn in tokenizer.stop_token_ids and as_gemma4.end_of_turn_ids == {tokenizer.eos_token_id}
        assert end_of_turn not in as_gemma4.generate("hi").params.stop_token_ids
    finally:
        for r in (plain, router, as_gemma4):
            r.prompts.close()


HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>", "<|return|>")
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def harmony_vocab(tokenizer):
    """SmolLM2's vocabulary with harmony's control tokens added (gpt-oss's own is not at hand): (the
    tokenizers object, llguidance's tokenizer, control token -> id)."""
    import llguidance
    import tokenizers

    hf = tokenizers.Tokenizer.from_str(tokenizer._with_special.to_str())
    hf.add_special_tokens(list(HARMONY_TOKENS))
    return hf, llguidance.LLTokenizer(hf.to_str(), eos_token=tokenizer.eos_token_id), \
        {t: hf.token_to_id(t) for t in HARMONY_TOKENS}


@pytest.mark.parametrize(("choice", "text", "accepted"), [
    ("required", BY_NAME["call_ended_by_its_stop_token"] + "<|call|>", True),  # reasoning, then add's call
    ("required", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
                 "<|call|>", True),
    ("required", "<|channel|>final<|message|>4<|return|>", False),  # an answer without a call
    ("required", '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>', False),
    ("required", "<|channel|>analysis<|message|>a <|call|> inside<|end|><|start|>assistant", False),
    ("add", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     False),
    ("add", BY_NAME["call_ended_by_its_stop_token"] + "<|call|>", True),
])
def test_a_required_harmony_call_is_held_to_its_schema_by_the_grammar(harmony_vocab, choice, text, accepted):
    """llguidance's own matcher over the harmony grammar: an optional analysis message, then one call of a chosen
    function whose arguments fit its schema (as structured output writes JSON); `auto` builds none."""
    import llguidance

    hf, ll_tokenizer, ids = harmony_vocab
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    step = plan(FORMATS["harmony"], [{"role": "user", "content": "x"}], ToolRequest.from_openai(TOOLS, tool_choice),
                ids)
    matcher = llguidance.LLMatcher(ll_tokenizer, step.constraint.grammar, log_level=0)
    ok = matcher.consume_tokens(hf.encode(text, add_special_tokens=False).ids)
    assert (ok and not matcher.is_error() and matcher.is_accepting()) == accepted
    assert plan(FORMATS["harmony"], [], ToolRequest.from_openai(TOOLS), ids).constraint is None
    assert plan(FORMATS["harmony"], [], ToolRequest.from_openai(TOOLS, "required"), {}).constraint is None
