"""Tool calling's parts: the formats table, their grammars (checked by llguidance's own matcher), the rendering
of tools and of a history with calls and results, and the incremental parser against independent parses
(json and regular expressions), over every way of grouping a recorded generation's ids into messages."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridgate.models import ChatTemplate, IncrementalDetokenizer
from hybridgate.router.config import TOOL_CALL_FORMATS
from hybridgate.router.tools import FORMATS, ToolRequest, build_grammar, choose_format, merge_deltas, plan
from hybridgate.router.toolparse import ToolCallParser

HERMES_TEMPLATE = (Path(__file__).parents[1] / "golden" / "hermes_tools.jinja").read_text()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

# Recorded generations (text a model wrote) in each format, with two parallel calls to one function.
RECORDED = {
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"ZH\\""}}\n</tool_call>',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": -3, "b": 40}}]',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 5, "b": 6}}',
    "generic": '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "add", "arguments": {"a": 7, "b": 8}}]}',
}


def reference_calls(fmt: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, the arguments' JSON text as written)]) by regular expressions and json, not the parser."""
    if fmt == "hermes":
        bodies = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        content = text[: text.index("<tool_call>")]
    elif fmt == "mistral":
        bodies, content = [json.dumps(c) for c in json.loads(text[len("[TOOL_CALLS]"):])], ""
    elif fmt == "llama3_json":
        bodies, content = text.split("; "), ""
    else:
        bodies, content = [json.dumps(c) for c in json.loads(text)["tool_calls"]], ""
    calls = []
    for body in bodies:
        key = "parameters" if fmt == "llama3_json" else "arguments"
        raw = re.search(r'"%s": (.*)\}$' % key, body, re.S).group(1)
        calls.append((json.loads(body)["name"], raw))
    return content, calls


def parse_groups(tokenizer, fmt: str, ids: list[int], cuts: list[int]) -> tuple[str, list[tuple[str, str]], list]:
    """Feed the ids grouped at `cuts` through the detokenizer and the parser, as the stream does; returns the
    content, the calls reassembled from the deltas alone, and the ids seen."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    parser = ToolCallParser(FORMATS[fmt].syntax)
    content, names, args, seen = [], {}, {}, []
    bounds = [0, *cuts, len(ids)]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        text = detok.steps(ids[a:b]) + (detok.flush() if b == len(ids) else "")
        c, deltas = parser.feed(text)
        if b == len(ids):
            rest, more = parser.finish()
            c, deltas = c + rest, merge_deltas(deltas, more)
        content.append(c)
        for d in deltas:
            if d.name is not None:
                assert d.index not in names and d.id.startswith("call_")
                names[d.index] = d.id
                seen.append((d.index, d.id, d.name))
            args[d.index] = args.get(d.index, "") + d.arguments
    calls = [(name, args[i]) for i, _, name in seen]
    assert [c.arguments for c in parser.calls] == [a for _, a in calls]  # the deltas add up to the calls
    return "".join(content), calls, seen


@pytest.mark.parametrize("fmt", sorted(RECORDED))
def test_every_grouping_of_a_short_call_and_random_ones_of_long_ones_give_the_same_calls(tokenizer, fmt):
    text = RECORDED[fmt]
    ids = tokenizer.encode(text)
    want = reference_calls(fmt, text)
    content, calls, seen = parse_groups(tokenizer, fmt, ids, [])
    assert (content, calls) == want
    assert len({i for i, _, _ in seen}) == len({d for _, d, _ in seen}) == 2  # distinct indexes and ids
    short = ids[:12]  # every split of the first 12 ids: 2**11 groupings
    ref = parse_groups(tokenizer, fmt, short, [])[:2]
    for mask in range(1 << (len(short) - 1)):
        cuts = [k + 1 for k in range(len(short) - 1) if mask >> k & 1]
        assert parse_groups(tokenizer, fmt, short, cuts)[:2] == ref


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_random_groupings_of_a_long_generation_reassemble_to_the_same_calls(tokenizer, data):
    fmt = data.draw(st.sampled_from(sorted(RECORDED)))
    ids = tokenizer.encode(RECORDED[fmt])
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids) - 1)))
    content, calls, _ = parse_groups(tokenizer, fmt, ids, cuts)
    assert (content, calls) == reference_calls(fmt, RECORDED[fmt])


@pytest.mark.parametrize(("text", "content"), [
    ("No call: <tool but <tool_callx> and <tool_call> not json", "No call: <tool but <tool_callx> and <tool_call> not json"),
    ("Plain answer.\n", "Plain answer.\n"),
])
def test_text_without_a_call_is_content_as_written(text, content):
    for cut in range(len(text) + 1):
        parser = ToolCallParser(FORMATS["hermes"].syntax)
        a, _ = parser.feed(text[:cut])
        b, _ = parser.feed(text[cut:])
        c, _ = parser.finish()
        assert a + b + c == content and parser.calls == []


def test_only_a_possible_trigger_prefix_is_held_back():
    parser = ToolCallParser(FORMATS["hermes"].syntax)
    assert parser.feed("Hello <tool")[0] == "Hello "
    assert parser.feed("box>")[0] == "<toolbox>"


def test_the_generic_envelope_streams_its_response_decoded():
    text = '{"response": "caf\\u00e9 \\ud83d\\ude00 \\"q\\"\\n"}'
    for cut in range(len(text) + 1):
        parser = ToolCallParser(FORMATS["generic"].syntax)
        out = parser.feed(text[:cut])[0] + parser.feed(text[cut:])[0] + parser.finish()[0]
        assert out == json.loads(text)["response"]


def test_format_names_are_the_settings_choices_and_templates_choose_theirs(tokenizer):
    assert {"auto", *FORMATS} == set(TOOL_CALL_FORMATS)
    assert choose_format("auto", HERMES_TEMPLATE).name == "hermes"
    assert choose_format("auto", tokenizer.chat_template).name == "generic"  # SmolLM2's takes no tools
    assert choose_format("auto", "{% if tools %}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert choose_format("mistral", None).name == "mistral"


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    return llguidance.LLTokenizer(tokenizer._with_special.to_str(), eos_token=tokenizer.eos_token_id)


CALLED = {  # one call to add in each format, and a free answer
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "add", "parameters": {"a": 1, "b": 2}}',
    "generic": '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}',
}


def accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    ok = matcher.consume_tokens(tokenizer.encode(text, special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("fmt", sorted(CALLED))
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "add"}}])
def test_grammars_compile_and_accept_calls_and_free_text_only_for_auto(tokenizer, ll_tokenizer, fmt, choice):
    request = ToolRequest.from_openai(TOOLS, choice, True)
    grammar = build_grammar(FORMATS[fmt], request, tokenizer.special_tokens)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    assert accepts(ll_tokenizer, tokenizer, grammar, CALLED[fmt])
    bad_arguments = CALLED[fmt].replace('"b": 2', '"b": "two"')
    assert not accepts(ll_tokenizer, tokenizer, grammar, bad_arguments)  # arguments follow the schema
    free = '{"response": "Hi."}' if fmt == "generic" else "Hi there."
    assert accepts(ll_tokenizer, tokenizer, grammar, free) == (choice == "auto")
    if fmt == "hermes" and choice == "auto":  # text before a call, and after the trigger a valid call only
        assert accepts(ll_tokenizer, tokenizer, grammar, "Sure.\n" + CALLED[fmt])
        assert not accepts(ll_tokenizer, tokenizer, grammar, "Sure. <tool_call>\n{\"name\": \"nope\"")


def test_a_sampled_grammar_walk_gives_arguments_valid_for_the_schema(tokenizer, ll_tokenizer):
    """Forced and random allowed tokens through the `required` grammar: the parsed arguments validate."""
    import random

    request = ToolRequest.from_openai(TOOLS, "required", False)
    grammar = build_grammar(FORMATS["hermes"], request, tokenizer.special_tokens)
    rng = random.Random(0)
    for _ in range(20):
        matcher, ids = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0), []
        while not matcher.is_stopped() and len(ids) < 600:
            mask = matcher.compute_bitmask()
            allowed = [i for i in range(tokenizer.vocab_size) if mask[i // 8] >> (i % 8) & 1]
            if tokenizer.eos_token_id in allowed and rng.random() < 0.5:
                break
            closing = [i for i in allowed if tokenizer.token_bytes[i] in (b'"', b"}", b"\n")]
            short = [i for i in allowed if len(tokenizer.token_bytes[i]) <= 2] or allowed
            tid = rng.choice(closing if closing and rng.random() < 0.3 else short)
            assert matcher.consume_token(tid)
            ids.append(tid)
        parser = ToolCallParser(FORMATS["hermes"].syntax)
        parser.feed(tokenizer.decode(ids))
        parser.finish()
        assert len(parser.calls) == 1, tokenizer.decode(ids)
        call = parser.calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_history_with_calls_and_results_renders_in_both_kinds_of_template(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    request = ToolRequest.from_openai(TOOLS)
    hermes = plan(FORMATS["hermes"], messages, request, tokenizer.special_tokens)
    text = ChatTemplate(tokenizer, HERMES_TEMPLATE).render(hermes.messages, tools=hermes.template_tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and '"name": "add"' in text
    generic = plan(FORMATS["generic"], messages, request, tokenizer.special_tokens)
    text = ChatTemplate(tokenizer).render(generic.messages)
    assert generic.template_tools is None and '"name": "add"' in text.split("<|im_end|>")[0]
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]}' in text
    assert '{"tool_response": {"tool_call_id": "call_1", "content": "21 C"}}' in text
    none = plan(FORMATS["hermes"], messages, ToolRequest.from_openai(TOOLS, "none"), tokenizer.special_tokens)
    assert none.template_tools is None and none.constraint is None and none.syntax is None


@pytest.mark.parametrize(("text", "content", "calls"), [
    # cut inside the end marker: the markup is no content
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_ca', "", [("add", '{"a": 1}')]),
    # cut before the second call's name: one call, not a nameless second one
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "a', "",
     [("add", '{"a": 1}')]),
    ('Hi <tool_call>\n{"arguments": {"a": 1}, "na', "Hi ", []),
    # cut inside the next call's trigger
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_', "", [("add", '{"a": 1}')]),
])
def test_an_output_cut_short_leaves_no_markup_and_no_nameless_call(text, content, calls):
    for cut in range(len(text) + 1):
        parser = ToolCallParser(FORMATS["hermes"].syntax)
        a, da = parser.feed(text[:cut])
        b, db = parser.feed(text[cut:])
        c, dc = parser.finish()
        deltas = merge_deltas(merge_deltas(da, db), dc)
        assert a + b + c == content
        assert [(c.name, c.arguments) for c in parser.calls] == calls
        assert [(d.name, d.arguments) for d in deltas] == calls


@pytest.fixture(scope="module")
def mistral_tokenizer(gguf_model):
    """The default model's tokenizer with its control token `<empty_output>` (id 16) renamed `[TOOL_CALLS]`,
    as Mistral's vocabularies have it: a control token whose text a prompt can also spell in plain pieces."""
    from hybridgate.models import Tokenizer

    meta = dict(gguf_model.metadata)
    tokens = list(meta["tokenizer.ggml.tokens"])
    tokens[tokens.index("<empty_output>")] = "[TOOL_CALLS]"
    meta["tokenizer.ggml.tokens"] = tokens
    return Tokenizer(meta)


def test_the_mistral_trigger_is_recognised_as_a_control_token_and_as_text(mistral_tokenizer):
    tok = mistral_tokenizer
    control = tok.special_tokens["[TOOL_CALLS]"]
    text = RECORDED["mistral"]
    body = tok.encode(text[len("[TOOL_CALLS]"):])
    as_text = tok.encode("[TOOL_CALLS]", special_tokens=False)
    assert control not in as_text and len(as_text) > 1  # spelled in plain pieces
    want = reference_calls("mistral", text)
    step = plan(FORMATS["mistral"], [{"role": "user", "content": "x"}], ToolRequest.from_openai(TOOLS, "required"),
                tok.special_tokens)
    assert step.keep_special  # the request's detokenizer keeps control tokens' text, so the trigger reaches the parser
    for ids in ([control, *body], [*as_text, *body]):
        for cuts in ([], list(range(1, len(ids))), [1], [len(ids) - 1]):
            content, calls, seen = parse_groups(tok, "mistral", ids, cuts)
            assert (content, calls) == want
            assert len({i for i, _, _ in seen}) == len({d for _, d, _ in seen}) == 2
    # the grammar opens the region with the control token itself
    ll = llguidance.LLTokenizer(tok._with_special.to_str(), eos_token=tok.eos_token_id)
    matcher = llguidance.LLMatcher(ll, step.constraint.grammar, log_level=0)
    assert matcher.consume_tokens([control, *body]) and matcher.is_accepting()
    assert not llguidance.LLMatcher(ll, step.constraint.grammar, log_level=0).consume_tokens(as_text)
