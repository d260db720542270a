"""The torch runner on every architecture row against transformers on the same tiny random GGUF.

Per family (`tiny_gguf.TINY_SPECS`: 4 heads over 2 KV heads, real llama.cpp vocabularies, sliding
windows shrunk to 16 tokens): last-position logits of three packed prompts (one longer than the
window) within 1e-3 of transformers fp32; greedy ids for 16 tokens equal (or the first difference
where the reference's top-2 gap is below 1e-3); and the same greedy ids through the paged cache
with chunked prefill, the prefix cache, decode batches and preemption. Per quant type, one model's
logits against transformers on the same file (both dequantize with gguf to fp32).

transformers' answers are in tests/golden/tiny_logits.json (`tests/reference/make_tiny_golden.py`,
its GGUF loader corrected by hand where FACTS.md says it is wrong: hf_reference.py): the logits at
each prompt's 64 largest ids and 64 seeded others, and the largest; each entry names the weights it
was made from, checked against the file the fixture writes.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import assert_greedy_matches, assert_logits_match, weights_digest
from hybridgate.models import load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, SamplingParams
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.model import DecoderModel
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import SchedulerConfig
from tiny_gguf import TINY_SPECS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-3
GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "golden" / "tiny_logits.json").read_text())
PROMPT_LENGTHS = (5, 23, 40)  # the last two pass the 16-token windows
GREEDY_STEPS = 16
QUANT_TYPES = tuple(GOLDEN["quant"])  # F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K


def golden_of(entry: dict, model) -> dict:
    """A golden entry, once the fixture's file is known to hold the weights it was made from."""
    assert weights_digest(model) == entry["weights_sha256"], \
        "the tiny fixture changed: run tests/reference/make_tiny_golden.py again"
    return entry


class Case:
    """One family's file, our fp32 model on a CPU torch device, and transformers' answers on it."""

    def __init__(self, name: str, path):
        self.name, self.path = name, path
        self.gguf = load_gguf(path)
        golden = golden_of(GOLDEN["families"][name], self.gguf)
        self.prompts = golden["prompts"]
        self.want_logits = golden["logits"]  # `hf_reference.logit_sample` of each prompt's
        self.want_greedy, self.gaps = golden["greedy"]["ids"], golden["greedy"]["top2_gaps"]
        self.model = DecoderModel(self.gguf, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module", params=list(TINY_SPECS))
def case(request, tiny_models) -> Case:
    return Case(request.param, tiny_models(request.param))


def run_packed(model: DecoderModel, prompts: list[list[int]]) -> np.ndarray:
    caches = [model.new_cache() for _ in prompts]
    ids = torch.tensor([i for p in prompts for i in p])
    return model.forward(ids, [len(p) for p in prompts], caches).numpy()


def contiguous_greedy(model: DecoderModel, prompt: list[int], steps: int) -> list[int]:
    cache, out = model.new_cache(), []
    logits = model.forward(torch.tensor(prompt), [len(prompt)], [cache])
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), [1], [cache])
    return out


def test_last_position_logits_match_transformers(case):
    got = run_packed(case.model, case.prompts)
    for row, want, n in zip(got, case.want_logits, PROMPT_LENGTHS):
        assert_logits_match(row, want, TOL, (case.name, n))


def test_numba_runner_logits_match_transformers(case):
    # The Numba runner held to the same reference directly (test_cpu_architectures.py holds it to the
    # torch runner): fp32 cache and float32 activations, the kernels' exact path.
    from hybridgate.workers.cpu.runner import NumbaRunner
    from hybridgate.workers.scheduler import ScheduledBatch
    from hybridgate.workers.sequence import Sequence

    runner = NumbaRunner(case.gguf, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32", activations="f32")
    seqs = []
    for i, ids in enumerate(case.prompts):
        seq = Sequence(AddRequest(str(i), ids, SamplingParams(temperature=0), 0, 4, -1))
        seq.block_table = list(range(3 * i, 3 * i + 3))
        seqs.append(seq)
    got = runner.forward(ScheduledBatch([(seq, seq.num_tokens) for seq in seqs]))
    for row, want, n in zip(got, case.want_logits, PROMPT_LENGTHS):
        assert_logits_match(np.asarray(row), want, TOL, (case.name, n))


def test_greedy_ids_match_transformers(case):
    got = contiguous_greedy(case.model, case.prompts[-1], GREEDY_STEPS)
    assert_greedy_matches(got, case.want_greedy, case.gaps)


def run_engine(engine: EngineCore, requests: list[AddRequest]) -> dict[str, list[int]]:
    for r in requests:
        assert engine.add(r) is None
    out: dict[str, list[int]] = defaultdict(list)
    while engine.has_work():
        for s in engine.step():
            out[s.request_id] += output_of(s).token_ids
    return out


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_paged_chunked_prefill_prefix_cache_and_preemption(case, attention):
    # The 40-token prompt (past the 16-token windows) in chunks of 12, then 16 decodes. Run again with
    # two prompts sharing its first 32 tokens: prefix-cache hits, decode batches of three, and a cache of
    # 6 blocks of 16 for three sequences of up to 56 tokens, so the scheduler preempts. `triton`: the
    # GPU worker's paged kernels, under Triton's interpreter here (tests/conftest.py).
    prompt = case.prompts[-1]
    runner = TorchRunner(case.gguf, torch.device("cpu"), torch.float32, kv_cache_memory="64MiB", max_num_blocks=6,
                         attention=attention)
    assert runner.attention == attention
    engine = EngineCore(runner, SchedulerConfig(max_num_batched_tokens=12), model_fingerprint(case.gguf))
    params = SamplingParams(temperature=0, ignore_eos=True)
    add = lambda rid, ids: AddRequest(rid, ids, params, 0, GREEDY_STEPS, -1)  # noqa: E731
    first = run_engine(engine, [add("a", prompt)])["a"]
    assert_greedy_matches(first, case.want_greedy, case.gaps)
    again = run_engine(engine, [add("a", prompt), add("b", prompt[:32] + prompt[33:]),
                                add("c", prompt[:32] + prompt[34:])])
    stats = engine.refresh_stats()
    assert again["a"] == first
    assert stats.cached_tokens >= 32 and stats.preemptions > 0 and engine.allocator.num_used == 0


@pytest.fixture(scope="module", params=QUANT_TYPES)
def quant_case(request, tiny_models):
    path = tiny_models("quant", ggml_type=request.param)
    model = load_gguf(path)
    assert {t.ggml_type.name for t in model.tensors.values()} == {"F32", request.param}
    golden = golden_of(GOLDEN["quant"][request.param], model)
    return model, golden["prompt"], golden["logits"]


def test_each_quant_type_matches_transformers(quant_case):
    model, prompt, want = quant_case
    got = run_packed(DecoderModel(model, torch.device("cpu"), torch.float32), [prompt])[0]
    assert_logits_match(got, want, TOL)
