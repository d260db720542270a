"""The parts behind agent traffic, each against a reference:

- `hoist_definitions` / the generic envelope: `jsonschema` (the reference validator) accepts a call whose
  arguments its tool's own schema accepts, and refuses one it refuses, for Pydantic schemas with `$defs`,
  draft 7 `definitions`, a recursive root (`"$ref": "#"`), escaped pointers and two tools with one name in
  their definitions; llguidance compiles every format's grammar of them.
- `ToolCallStream`: only complete calls reach the client, whole; a call cut by the end is left out.
- `min_tokens`: the step's bitmask row loses EOS and the stop ids below it (`ban_ends`), so the sampler's
  step 0 never picks them even where they are the argmax; validation names the field.
"""

from __future__ import annotations

import asyncio

import jsonschema
import llguidance
import numpy as np
import pytest

from hybridgate.router.deltas import Delta
from hybridgate.router.tools import FORMATS, ToolCallStream, ToolRequest, _envelope_schema, build_grammar
from hybridgate.wire import AddRequest, FinishReason, InvalidFieldError, SamplingParams
from hybridgate.workers import sampling
from hybridgate.workers.constraints import Constraints, ban_ends, bitmask_words
from hybridgate.workers.sequence import Sequence

ADDRESS_BOOK = {"$defs": {"Address": {"type": "object", "properties": {"street": {"type": "string"},
                                                                          "city": {"type": "string"}},
                                      "required": ["street", "city"], "additionalProperties": False}},
                "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"},
                                                 "others": {"type": "array", "items": {"$ref": "#/$defs/Address"}}},
                "required": ["home"]}
ZIP_BOOK = {"definitions": {"Address": {"type": "object", "properties": {"zip": {"type": "integer"}},
                                        "required": ["zip"], "additionalProperties": False},
                            "a/b~c": {"enum": [1, 2]}},
            "type": "object", "properties": {"to": {"$ref": "#/definitions/Address"},
                                             "odd": {"$ref": "#/definitions/a~1b~0c"},
                                             "same": {"$ref": "#/properties/odd"}},
            "required": ["to"]}
TREE = {"type": "object", "properties": {"value": {"type": "integer"}, "children": {"type": "array",
                                                                                      "items": {"$ref": "#"}}},
        "required": ["value", "children"], "additionalProperties": False}
SCHEMAS = {"book": ADDRESS_BOOK, "ship": ZIP_BOOK, "tree": TREE}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
ARGUMENTS = [
    ("book", {"home": {"street": "1 Main", "city": "Oslo"}, "others": [{"street": "2", "city": "Rome"}]}),
    ("book", {"home": {"zip": 12345}}),
    ("book", {"home": {"street": "1 Main", "city": "Oslo"}, "others": [{"zip": 1}]}),
    ("ship", {"to": {"zip": 12345}, "odd": 2, "same": 1}),
    ("ship", {"to": {"street": "1 Main", "city": "Oslo"}}),
    ("ship", {"to": {"zip": 1}, "same": 3}),
    ("tree", {"value": 1, "children": [{"value": 2, "children": []}]}),
    ("tree", {"value": 1, "children": [{"value": 2, "children": [{"value": "x", "children": []}]}]}),
]


def _valid(schema, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(("name", "arguments"), ARGUMENTS)
def test_the_envelope_accepts_exactly_what_each_tool_accepts(name, arguments, parallel):
    request = ToolRequest.from_openai(TOOLS, "required", parallel)
    envelope = _envelope_schema(request, request.chosen())
    call = {"name": name, "arguments": arguments}
    instance = {"tool_calls": [call]} if parallel else {"tool_call": call}
    assert _valid(envelope, instance) == _valid(SCHEMAS[name], arguments)
    assert set(envelope["$defs"]) == {"book.Address", "ship.definitions.Address", "ship.definitions.a/b~c",
                                      "ship", "tree"}


@pytest.mark.parametrize("fmt", sorted(f for f in FORMATS if FORMATS[f].syntax is not None))  # those with grammars
@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "ship"}}])
def test_every_format_compiles_tools_with_definitions(fmt, choice):
    grammar = build_grammar(FORMATS[fmt], ToolRequest.from_openai(TOOLS, choice), {"[TOOL_CALLS]": 5})
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    assert not failed, messages


class _Replay:
    """A request stream that replays deltas of the given texts, the last one finished (`finish`)."""

    def __init__(self, texts: list[str], finish: FinishReason):
        self._deltas = [Delta("r", i, t, [i], finish if i == len(texts) - 1 else None) for i, t in enumerate(texts)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)


def _run(texts: list[str], finish: FinishReason) -> tuple[list, ToolCallStream]:
    stream = ToolCallStream(_Replay(texts, finish), FORMATS["hermes"].syntax)

    async def collect():
        return [d async for d in stream]

    return asyncio.run(collect()), stream


def test_a_call_is_streamed_whole_once_its_object_closes():
    texts = ['<tool_call>\n{"name": "add", ', '"arguments": {"a": ', '1}}\n</tool_call>\n<tool_call>\n{"na',
             'me": "add", "arguments": {"a": 2}}\n</tool_call>']
    deltas, stream = _run(texts, FinishReason.EOS)
    sent = [[(c.index, c.name, c.arguments) for c in d.tool_calls] for d in deltas]
    assert sent == [[], [], [(0, "add", '{"a": 1}')], [(1, "add", '{"a": 2}')]]
    assert all(c.id.startswith("call_") for d in deltas for c in d.tool_calls)
    assert [(c.name, c.arguments) for c in stream.calls] == [("add", '{"a": 1}'), ("add", '{"a": 2}')]


def test_a_call_cut_by_the_end_is_never_sent():
    texts = ['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n', '<tool_call>\n{"name": "add", '
             '"arguments": {"a": 2']
    deltas, stream = _run(texts, FinishReason.LENGTH)
    assert [[(c.name, c.arguments) for c in d.tool_calls] for d in deltas] == [[("add", '{"a": 1}')], []]
    assert [(c.name, c.arguments) for c in stream.calls] == [("add", '{"a": 1}')]
    assert [c.complete for c in stream.parser.calls] == [True, False]  # parsed, but held back


def _sequence(min_tokens: int, generated: int, stop_ids=(7,), ignore_eos=False) -> Sequence:
    params = SamplingParams(min_tokens=min_tokens, stop_token_ids=stop_ids, ignore_eos=ignore_eos, temperature=0)
    seq = Sequence(AddRequest("r", [1, 2, 3], params, 0, 64, 2))
    seq.output_ids = [5] * generated
    return seq


def test_below_min_tokens_eos_and_stop_ids_are_masked_out_until_the_minimum():
    vocab = 40
    constraints = Constraints(None)
    seqs = [_sequence(4, 3), _sequence(4, 4), _sequence(4, 0, ignore_eos=True), _sequence(0, 0)]
    masks = constraints.start_masks(seqs, vocab)
    rows = masks.for_rows(seqs)
    allowed = sampling.allowed_of_bitmask(rows, vocab)
    assert set(np.flatnonzero(~allowed[0])) == {2, 7}  # EOS and the stop id
    assert allowed[1].all() and allowed[3].all()  # reached the minimum; none asked
    assert set(np.flatnonzero(~allowed[2])) == {7}  # EOS ends nothing when ignored
    logits = np.zeros(vocab, np.float32)
    logits[[2, 7, 11]] = [9.0, 8.0, 1.0]  # EOS the argmax, then the stop id
    assert sampling.sample_row(logits, seqs[0].params, 0, 3, [], bitmask=rows[0]) == 11
    assert constraints.start_masks([_sequence(4, 4), _sequence(0, 0)], vocab) is None


def test_a_grammar_that_only_accepts_its_end_keeps_it():
    row = np.zeros(bitmask_words(40), np.int32)
    row.view(np.uint32)[0] = 1 << 2  # EOS only
    ban_ends(row, _sequence(4, 1), 40)
    assert np.flatnonzero(sampling.allowed_of_bitmask(row[None], 40)[0]).tolist() == [2]


@pytest.mark.parametrize(("fields", "message"), [({"min_tokens": -1}, "must be >= 0"),
                                                  ({"min_tokens": 5, "max_tokens": 4}, "at most max_tokens (4)")])
def test_min_tokens_out_of_range_names_the_field(fields, message):
    with pytest.raises(InvalidFieldError) as e:
        SamplingParams(**fields).validate()
    assert e.value.field == "min_tokens" and message in str(e.value)

