"""Embedding requests on both runners against transformers, and batched beside a generation.

Reference: a tiny random `Qwen3ForCausalLM` made in transformers (fp32, tied LM head), written as a
GGUF with last-token pooling (`tiny_gguf.write_hf_qwen3`); its `Qwen3Model`'s `last_hidden_state` (after
the final norm) pooled as each request asks (last token, mean, first) and L2-normalised is what the
engine's vector, normalised, must equal within 1e-4. Prompts run in chunks of 16 tokens (chunked
prefill), and an embedding shares steps with a greedy generation whose ids must be transformers' greedy
ids (its own argmax over the tied head), whichever way they are batched.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from hybridgate.models import load_gguf, model_fingerprint
from hybridgate.wire import AddRequest, PoolingType, SamplingParams
from hybridgate.workers.cpu.runner import NumbaRunner
from hybridgate.workers.engine import EngineCore, output_of
from hybridgate.workers.gpu.runner import TorchRunner
from hybridgate.workers.scheduler import SchedulerConfig
from hf_embedding import tiny_qwen3_embedder, want_embedding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-4
PROMPTS = ([5, 17, 99, 3, 250], list(range(40, 80)), [7] * 3 + list(range(100, 130)))  # 5, 40, 33 tokens
GREEDY = SamplingParams(temperature=0, ignore_eos=True)
GENERATED = 8
ROUTER = b"router-1"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path, model = tiny_qwen3_embedder(tmp_path_factory.mktemp("qwen3-embed"))
    return load_gguf(path), model


def want_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GENERATED, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["torch", "numba"])
def engine(request, reference):
    gguf_model, _ = reference
    if request.param == "torch":
        runner = TorchRunner(gguf_model, torch.device("cpu"), torch.float32, kv_cache_memory="4MiB")
    else:
        runner = NumbaRunner(gguf_model, kv_cache_memory="4MiB", threads=1, kv_cache_dtype="fp32", activations="f32")
    return EngineCore(runner, SchedulerConfig(max_num_batched_tokens=16), model_fingerprint(gguf_model))


def run(engine: EngineCore, requests: list[AddRequest]) -> tuple[dict[str, list[int]], dict[str, np.ndarray]]:
    """Every request to its end: generated ids and (normalised) embeddings by request id."""
    for r in requests:
        assert engine.add(r, ROUTER) is None
    ids, vectors = defaultdict(list), {}
    while engine.has_work():
        for seq in engine.step():
            out = output_of(seq)
            ids[seq.request_id] += out.token_ids
            if out.embedding:
                v = np.frombuffer(out.embedding, "<f4").astype(np.float64)
                vectors[seq.request_id] = v / np.linalg.norm(v)
    assert engine.allocator.num_used == 0
    return ids, vectors


def embed(rid: str, prompt: list[int], pooling: PoolingType) -> AddRequest:
    return AddRequest(rid, prompt, SamplingParams(temperature=0), 0, 1, -1, pooling=int(pooling))


@pytest.mark.parametrize("pooling", [PoolingType.LAST, PoolingType.MEAN, PoolingType.CLS])
def test_pooled_hidden_state_matches_transformers(engine, reference, pooling):
    _, model = reference
    ids, vectors = run(engine, [embed(str(i), p, pooling) for i, p in enumerate(PROMPTS)])
    for i, prompt in enumerate(PROMPTS):
        want = want_embedding(model, prompt, pooling)
        assert vectors[str(i)].shape == want.shape == (64,)
        assert np.abs(vectors[str(i)] - want).max() < TOL, (pooling.name, len(prompt))
        assert ids[str(i)] == []  # no token sampled


def test_embedding_batched_with_a_generation_changes_neither(engine, reference):
    _, model = reference
    gen_prompt = PROMPTS[1]
    greedy = want_greedy(model, gen_prompt)
    # The generation's prompt chunks and decodes share steps with three embeddings (one chunked).
    ids, vectors = run(engine, [AddRequest("gen", gen_prompt, GREEDY, 0, GENERATED, -1),
                                *(embed(f"e{i}", p, PoolingType.LAST) for i, p in enumerate(PROMPTS))])
    assert ids["gen"] == greedy
    for i, prompt in enumerate(PROMPTS):
        assert np.abs(vectors[f"e{i}"] - want_embedding(model, prompt, PoolingType.LAST)).max() < TOL
    assert max(engine.stats.batch_size_counts) >= 2  # they did share steps
