"""Constraints without a forward pass: llguidance's tokenizer over our vocabulary, the grammar compiler's
cache and thread, the bitmask applied by both sampler twins, and a matcher rebuilt from generated ids.

References: llguidance's own tokenizer built from the Hugging Face tokenizer JSON (its Rust parser, not our
token bytes), llguidance's numpy `apply_token_bitmask_inplace` (its reference masking), a bit-by-bit
reading of the bitmask layout, and the grammar's texts checked with `re` and `json`.
"""

from __future__ import annotations

import json
import re
import threading

import llguidance
import llguidance.numpy as lln
import numpy as np
import pytest
import torch

from hybridgate.wire import AddRequest, Constraint, SamplingParams
from hybridgate.workers import sampling
from hybridgate.workers.constraints import (
    Constraints,
    GrammarCompiler,
    GrammarError,
    bitmask_words,
    ll_tokenizer_of_metadata,
)
from hybridgate.workers.gpu import sampling as torch_sampling
from hybridgate.workers.sequence import Sequence

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_GRAMMAR = "start: %json " + json.dumps({**SCHEMA, "x-guidance": {"whitespace_flexible": False}})


@pytest.fixture(scope="module")
def ll_tokenizer(gguf_model):
    return ll_tokenizer_of_metadata(gguf_model.metadata)


@pytest.fixture(scope="module")
def compiler(ll_tokenizer):
    c = GrammarCompiler(lambda: ll_tokenizer, cache_size=4)
    yield c
    c.close()


def test_tokenizer_has_our_vocabulary_as_llguidance_reads_the_hf_json(ll_tokenizer, tokenizer):
    # about 1 s: llguidance parses the tokenizer JSON and its vocabulary itself
    reference = llguidance.LLTokenizer(tokenizer._with_special.to_str(), eos_token=tokenizer.eos_token_id)
    assert ll_tokenizer.vocab_size == reference.vocab_size == tokenizer.vocab_size
    ids = list(range(tokenizer.vocab_size))
    assert [ll_tokenizer.decode_bytes([i]) for i in ids] == [reference.decode_bytes([i]) for i in ids]
    assert [i for i in ids if ll_tokenizer.is_special_token(i)] == [i for i in ids if reference.is_special_token(i)]
    assert ll_tokenizer.eos_tokens == [2]  # <|im_end|>, SmolLM2's end of turn (FACTS.md)


def test_compiler_caches_by_text_and_keeps_failures(ll_tokenizer):
    c = GrammarCompiler(lambda: ll_tokenizer, cache_size=2)
    try:
        first = c.submit(JSON_GRAMMAR)
        assert c.submit(JSON_GRAMMAR) is first and c.stats.cache_hits == 1
        compiled = first.result(10)
        assert compiled.matcher.is_accepting() is False
        fresh = lln.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
        lln.fill_next_token_bitmask(llguidance.LLMatcher(ll_tokenizer, JSON_GRAMMAR), fresh, 0)
        assert (compiled.first_mask == fresh[0]).all()  # the first mask, computed once at compile time
        bad = c.submit("start: foo(")
        with pytest.raises(GrammarError, match="Expected token"):
            bad.result(10)
        assert c.submit("start: foo(") is bad  # refused again without a compile
        assert (c.stats.compiles, c.stats.compile_errors) == (2, 1)
        c.submit('start: "a"').result(10)  # a third text: the least recently used (JSON_GRAMMAR) goes
        assert c.submit(JSON_GRAMMAR) is not first and c.stats.compiles == 3
    finally:
        c.close()


def test_submit_returns_before_the_compile_which_runs_on_a_compile_thread(ll_tokenizer):
    release, threads = threading.Event(), []

    def slow_tokenizer():
        threads.append(threading.current_thread().name)
        release.wait(10)
        return ll_tokenizer

    c = GrammarCompiler(slow_tokenizer)
    try:
        future = c.submit('start: "x"')
        assert not future.done()
        release.set()
        assert not future.result(10).matcher.is_error()
        assert threads and threads[0].startswith("grammar-compile")
    finally:
        c.close()


def test_compiler_settings_are_checked():
    with pytest.raises(ValueError, match="grammar_cache_size"):
        GrammarCompiler(lambda: None, cache_size=0)
    with pytest.raises(ValueError, match="grammar_compile_threads"):
        GrammarCompiler(lambda: None, threads=0)


def random_bitmask(rng, rows: int, vocab: int) -> np.ndarray:
    return rng.integers(-2**31, 2**31, size=(rows, bitmask_words(vocab)), dtype=np.int64).astype(np.int32)


def test_allowed_ids_read_the_bitmask_as_llguidance_applies_it():
    rng = np.random.default_rng(0)
    vocab = 1000  # not a multiple of 32: the last word is partly past the vocabulary
    bitmask = random_bitmask(rng, 3, vocab)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    reference = logits.copy()
    lln.apply_token_bitmask_inplace(reference, bitmask)
    ours = sampling.allowed_of_bitmask(bitmask, vocab)
    assert (ours == np.isfinite(reference)).all()
    by_bit = np.array([[(int(bitmask[r, j // 32]) >> (j % 32)) & 1 for j in range(vocab)] for r in range(3)], bool)
    assert (ours == by_bit).all()
    assert (torch_sampling.allowed_of_bitmask(torch.from_numpy(bitmask), vocab).numpy() == ours).all()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5),
], ids=["greedy", "t1", "topk-topp-penalties"])
def test_both_twins_sample_the_same_allowed_ids(params):
    rng = np.random.default_rng(1)
    batch, vocab = 6, 3000
    logits = rng.standard_normal((batch, vocab)).astype(np.float32) * 4
    bitmask = np.zeros((batch, bitmask_words(vocab)), np.int32)
    for r in range(batch - 1):  # a few allowed ids per row, the best logits among them forbidden
        allowed = rng.choice(vocab, size=5 + r, replace=False)
        for j in allowed:
            bitmask[r, j // 32] |= np.int32(np.uint32(1 << (j % 32)).view(np.int32))
    bitmask[-1] = -1  # the last row is unconstrained
    seen = [rng.integers(0, vocab, 8).tolist() for _ in range(batch)]
    args = ([params] * batch, [7 + r for r in range(batch)], [3] * batch, seen)
    ours = sampling.sample(logits, *args, generated=seen, bitmask=bitmask)
    twin = torch_sampling.sample(torch.from_numpy(logits), *args, generated=seen, bitmask=bitmask).numpy()
    assert ours.tolist() == twin.tolist()
    allowed = sampling.allowed_of_bitmask(bitmask, vocab)
    assert all(allowed[r, ours[r]] for r in range(batch))
    free = sampling.sample(logits[-1:], [params], [7 + batch - 1], [3], seen[-1:], generated=seen[-1:])
    assert ours[-1] == free[0]  # an unconstrained row samples what it samples alone


def constrained_sequence(grammar: str, prompt: list[int], generated_before: list[int], output: list[int]) -> Sequence:
    """A sequence as a resume (earlier ids at the prompt's tail) or a hand-off import (output ids) makes it."""
    request = AddRequest("r", prompt + generated_before, SamplingParams(constraint=Constraint(kind="grammar",
                                                                                               grammar=grammar)),
                         0, 64, 2, first_token_index=len(generated_before))
    seq = Sequence(request)
    seq.output_ids = list(output)
    return seq


def test_matcher_is_rebuilt_from_the_ids_already_generated(compiler, tokenizer):
    text = '{"name":"ab","n":4'
    ids = tokenizer.encode(text)
    constraints = Constraints(compiler)
    scheduled = []
    seqs = [constrained_sequence(JSON_GRAMMAR, [1, 2, 3], ids[:3], ids[3:]),  # resumed and then handed off
            constrained_sequence(JSON_GRAMMAR, [1, 2, 3], tokenizer.encode('{"n":'), []),  # name must come first
            constrained_sequence(JSON_GRAMMAR, [1, 2, 3], [], [])]
    for seq in seqs:
        constraints.wait_for_grammar(seq, lambda seq=seq: scheduled.append(seq))
    compiler.submit(JSON_GRAMMAR).result(10)
    failed = constraints.poll()
    assert scheduled == [seqs[0], seqs[2]] and [s for s, _ in failed] == [seqs[1]]
    assert "do not satisfy" in failed[0][1] and not constraints.waiting_for_grammar
    masks = constraints.start_masks(seqs, tokenizer.vocab_size)
    rows = masks.for_rows([seqs[2], seqs[1], seqs[0]])
    allowed = sampling.allowed_of_bitmask(rows, tokenizer.vocab_size)
    first = [tokenizer.decode([i]) for i in np.flatnonzero(allowed[0])]
    forced = '{"name":"'  # compact JSON: the object opens on its first required key
    assert first and all(forced.startswith(t) or t.startswith(forced) for t in first)
    assert allowed[1].all()  # not constrained (its grammar failed): every id
    after = [tokenizer.decode([i]) for i in np.flatnonzero(allowed[2])]
    assert after and all(re.fullmatch(r"[0-9]*[,}]?[0-9]*", t) for t in after)  # digits of n, or the end
    assert tokenizer.eos_token_id not in np.flatnonzero(allowed[2])  # not accepting yet
    assert constraints.advance(seqs[0], tokenizer.encode("}")[0]) is None
    assert seqs[0].matcher.is_stopped()  # nothing may follow the object


def test_gateway_metrics_export_each_workers_constraint_stats():
    from types import SimpleNamespace

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from hybridgate.gateway.metrics import GatewayMetrics
    from hybridgate.wire import EngineStats

    stats = EngineStats(constrained_requests=5, constrained_running=2, waiting_for_grammar=1, grammar_compiles=3,
                        grammar_compile_errors=1, grammar_compile_seconds_total=0.25, grammar_cache_hits=2,
                        mask_fills=40, mask_fill_seconds_total=0.002, mask_wait_seconds_total=0.0005)
    workers = [SimpleNamespace(kind="cpu", name="cpu-0", endpoint="e0", stats=stats)]
    text = generate_latest(GatewayMetrics(lambda: workers, model=("tiny", "f" * 64)).registry).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
           if s.labels.get("worker") == "cpu-0"}
    assert got["hybridgate:constrained_requests_total"] == 5 and got["hybridgate:constrained_running"] == 2
    assert got["hybridgate:waiting_for_grammar"] == 1 and got["hybridgate:grammar_compiles_total"] == 3
    assert got["hybridgate:grammar_compile_errors_total"] == 1 and got["hybridgate:grammar_cache_hits_total"] == 2
    assert got["hybridgate:grammar_compile_seconds_total"] == 0.25
    assert got["hybridgate:constraint_mask_fills_total"] == 40
    assert got["hybridgate:constraint_mask_fill_seconds_total"] == 0.002
    assert got["hybridgate:constraint_mask_wait_seconds_total"] == 0.0005
