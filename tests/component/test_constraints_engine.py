"""Constraints in the real engine, on both runners (the torch runner on a CPU device, the Numba runner):
sampled JSON-schema outputs validate with `jsonschema`, regex outputs match with `re`, choices are one of
them; an unconstrained batch mate gets the ids it gets alone; a bad grammar is refused as the field
`constraint`; abort frees the matcher; a resumed constrained stream continues the undisturbed ids.

One engine run per runner holds every sampled case (one batch, so the file stays fast).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from hybridgate.models import model_fingerprint
from hybridgate.router.errors import InvalidRequestError
from hybridgate.wire import ERROR_INVALID_CONSTRAINT, AddRequest, Constraint, FinishReason, SamplingParams
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.scheduler import SchedulerConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {
    "$defs": {"color": {"enum": ["red", "green", "blue"]}},
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
        "size": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
        "colors": {"type": "array", "items": {"$ref": "#/$defs/color"}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
                  "required": ["name"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "size", "colors", "owner"],
    "additionalProperties": False,
}
# Compact JSON keeps the outputs short (llguidance's `x-guidance` options; docs/syntax.md).
JSON_GRAMMAR = "start: %json " + json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})
REGEX = r"[a-z]{3}-[0-9]{2}"
REGEX_GRAMMAR = f"start: /{REGEX}/"
CHOICES = ("red", "green", "blue")
CHOICE_GRAMMAR = "start: " + " | ".join(json.dumps(c) for c in CHOICES)
SEEDS = (11, 12, 13, 14)
MAX_TOKENS = 96


def constraint(kind: str, grammar: str) -> Constraint:
    return Constraint(kind=kind, grammar=grammar)


def sampled(c: Constraint, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, constraint=c)


@pytest.fixture(scope="module", params=["torch", "numba"])
def engine(request, gguf_model):
    if request.param == "torch":
        from hybridgate.workers.gpu.runner import TorchRunner

        runner = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB")
    else:
        from hybridgate.workers.cpu.runner import NumbaRunner

        runner = NumbaRunner(gguf_model, kv_cache_memory="64MiB", threads=1)
        runner.warm_up(progress=False)
    engine = EngineCore(runner, SchedulerConfig(), model_fingerprint(gguf_model))
    yield engine
    engine.constraints.close()


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer.encode("<|im_start|>user\nDescribe a small box as JSON.<|im_end|>\n<|im_start|>assistant\n")


def run(engine: EngineCore, requests: list[AddRequest]) -> dict[str, tuple[list[int], int]]:
    """Run the requests in one batch to their ends: request id → (ids, finish reason)."""
    for r in requests:
        assert engine.add(r) is None
    out: dict[str, tuple[list[int], int]] = {r.request_id: ([], 0) for r in requests}
    while engine.has_work():
        for seq in engine.step():
            o = output_of(seq)
            ids, _ = out[seq.request_id]
            out[seq.request_id] = (ids + o.token_ids, o.finish)
    assert not engine.take_failures()
    return out


@pytest.fixture(scope="module")
def batch(engine, prompt):
    """Every sampled case in one run, beside an unconstrained greedy sequence, then that sequence alone."""
    json_c, regex_c, choice_c = (constraint("json_schema", JSON_GRAMMAR), constraint("regex", REGEX_GRAMMAR),
                                 constraint("choice", CHOICE_GRAMMAR))
    requests = [AddRequest(f"json-{s}", prompt, sampled(json_c, s), s, MAX_TOKENS, 2) for s in SEEDS]
    requests += [AddRequest(f"regex-{s}", prompt, sampled(regex_c, s), s, 16, 2) for s in SEEDS[:2]]
    requests += [AddRequest(f"choice-{s}", prompt, sampled(choice_c, s), s, 8, 2) for s in SEEDS[:2]]
    requests.append(AddRequest("json-greedy", prompt, SamplingParams(temperature=0, constraint=json_c), 0,
                               MAX_TOKENS, 2))
    free = AddRequest("free", prompt, SamplingParams(temperature=0, ignore_eos=True), 0, 12, 2)
    together = run(engine, [*requests, free])
    alone = run(engine, [AddRequest("free-alone", free.prompt_ids, free.params, 0, 12, 2)])
    return together, alone["free-alone"]


def test_sampled_json_validates_against_the_schema(batch, tokenizer):
    together, _ = batch
    for name in [f"json-{s}" for s in SEEDS] + ["json-greedy"]:
        ids, finish = together[name]
        assert finish == FinishReason.STOP, (name, tokenizer.decode(ids))  # the grammar ended it
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True)), SCHEMA)


def test_regex_and_choice_outputs(batch, tokenizer):
    together, _ = batch
    for s in SEEDS[:2]:
        assert re.fullmatch(REGEX, tokenizer.decode(together[f"regex-{s}"][0], skip_special_tokens=True))
        assert tokenizer.decode(together[f"choice-{s}"][0], skip_special_tokens=True) in CHOICES


def test_unconstrained_batch_mate_gets_the_ids_it_gets_alone(batch):
    together, alone = batch
    assert together["free"] == alone and len(alone[0]) == 12


def test_engine_stats_count_the_constrained_work(engine, batch):
    s = engine.refresh_stats()
    assert s.constrained_requests >= 9 and s.constrained_running == 0 and s.waiting_for_grammar == 0
    assert s.grammar_compiles >= 3 and s.grammar_cache_hits >= 6  # three texts; the others waited on them
    assert s.mask_fills > 0 and s.mask_fill_seconds_total > 0


def test_resumed_constrained_stream_continues_the_undisturbed_ids(engine, batch, prompt):
    """The router resends the ids already streamed at the prompt's tail: the matcher is rebuilt from them."""
    whole, finish = batch[0]["json-greedy"]
    k = len(whole) // 2
    params = SamplingParams(temperature=0, constraint=constraint("json_schema", JSON_GRAMMAR))
    rest = run(engine, [AddRequest("rest", prompt + whole[:k], params, 0, MAX_TOKENS - k, 2, first_token_index=k)])
    assert rest["rest"] == (whole[k:], finish)


def test_bad_grammar_is_refused_naming_the_constraint(engine, prompt):
    from hybridgate.router.deltas import error_of

    params = SamplingParams(temperature=0, constraint=constraint("grammar", "start: foo("))
    assert engine.add(AddRequest("bad", prompt, params, 0, 8, 2)) is None
    while engine.has_work():
        assert engine.step() == []  # never scheduled
    [(seq, error)] = engine.take_failures()
    assert seq.request_id == "bad" and error.code == ERROR_INVALID_CONSTRAINT and "Expected token" in error.message
    mapped = error_of(error)
    assert isinstance(mapped, InvalidRequestError) and mapped.field == "constraint"
    assert engine.allocator.num_used == 0


def test_abort_frees_the_matcher(engine, prompt):
    c = constraint("json_schema", JSON_GRAMMAR)
    engine.add(AddRequest("running", prompt, sampled(c, 1), 1, MAX_TOKENS, 2))
    while not engine.step():
        pass
    seq = engine._by_id[(b"", "running")]
    assert seq.matcher is not None and engine.refresh_stats().constrained_running == 1
    # and one still waiting for a grammar nobody compiled yet
    engine.add(AddRequest("compiling", prompt, sampled(constraint("regex", "start: /[0-9]{1,7}z/"), 1), 1, 8, 2))
    waiting = engine._by_id[(b"", "compiling")]
    s = engine.refresh_stats()  # queued as far as placement is concerned, outside the scheduler's queue
    assert (s.waiting_for_grammar, s.waiting) == (1, 1) and waiting not in engine.scheduler.waiting
    assert engine.abort(["running", "compiling"]) == [seq, waiting]
    assert seq.matcher is None and waiting.matcher is None
    s = engine.refresh_stats()
    assert (s.constrained_running, s.waiting_for_grammar, engine.allocator.num_used) == (0, 0, 0)
    assert not engine.has_work()


def test_through_the_router_a_constrained_chat_validates_and_a_bad_grammar_is_invalid_argument(engine, gguf_model):
    """The in-process worker's loop (woken by the compile) and the router's error mapping (one runner: the
    path is the same for both)."""
    import asyncio

    if engine.runner.kind != "cpu":
        pytest.skip("the router's path is the same for both runners; the Numba one decodes faster here")

    from hybridgate.router.router import Router
    from hybridgate.workers.inprocess import InProcessClient

    chat = [{"role": "user", "content": "Describe a small box as JSON."}]
    json_c = constraint("json_schema", JSON_GRAMMAR)

    async def main():
        async with Router(gguf_model, [InProcessClient(engine.runner, model_fingerprint(gguf_model))]) as router:
            async with router.generate(chat, SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                            constraint=json_c)) as stream:
                deltas = [d async for d in stream]
            with pytest.raises(InvalidRequestError) as refused:
                async with router.generate(chat, SamplingParams(max_tokens=8, constraint=constraint(
                        "grammar", "start: %json {\"type\": \"nonsense\"}"))) as stream:
                    [d async for d in stream]
            return deltas, refused.value

    deltas, refused = asyncio.run(main())
    assert deltas[-1].finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads("".join(d.text for d in deltas)), SCHEMA)
    assert refused.field == "constraint" and "nonsense" in str(refused)
