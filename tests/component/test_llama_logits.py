"""Torch runner logits (fp32, CPU) against transformers' logits (tests/golden/logits.npz, tiny.npz)."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch

from conftest import golden_npz
from corpus import TINY_MODELS, TINY_PROMPT_LENGTHS
from hybridgate.models import load_gguf
from hybridgate.workers.gpu.model import LlamaModel
from tiny_gguf import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-3
LOGITS = golden_npz("logits.npz")
TINY = golden_npz("tiny.npz")


def run_packed(model: LlamaModel, prompts: list[np.ndarray]) -> np.ndarray:
    caches = [model.new_cache() for _ in prompts]
    ids = torch.from_numpy(np.concatenate(prompts))
    return model.forward(ids, [len(p) for p in prompts], caches).numpy()


def max_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max())


@pytest.mark.parametrize("i", [0, 1, 2])
def test_short_prompt(llama, i):
    got = run_packed(llama, [LOGITS[f"short{i}_ids"]])[0]
    assert max_diff(got, LOGITS[f"short{i}_logits"]) < TOL
    assert got.argmax() == LOGITS[f"short{i}_logits"].argmax()


def test_long_prompt(llama):
    ids = LOGITS["long_ids"]
    assert len(ids) >= 2048
    got = run_packed(llama, [ids])[0]
    assert max_diff(got, LOGITS["long_logits"]) < TOL


def test_packed_batch_of_four_lengths(llama):
    prompts = [LOGITS[f"batch{i}_ids"] for i in range(4)]
    assert len({len(p) for p in prompts}) == 4
    got = run_packed(llama, prompts)
    for i in range(4):
        assert max_diff(got[i], LOGITS[f"batch{i}_logits"]) < TOL, i


def test_chunks_and_decode_steps_over_the_cache(llama):
    # The 131-token prompt in pieces: chunked prefill (past > 0, n > 1), then single-token decode steps.
    ids = LOGITS["batch3_ids"]
    cache = llama.new_cache(capacity=16)
    for a, b in [(0, 100), (100, 128), (128, 129), (129, 130), (130, 131)]:
        logits = llama.forward(torch.from_numpy(ids[a:b]), [b - a], [cache]).numpy()[0]
    assert cache.length == 131
    assert max_diff(logits, LOGITS["batch3_logits"]) < TOL


def test_context_length_is_enforced(llama):
    cache = llama.new_cache()
    cache.length = llama.config.max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        llama.forward(torch.tensor([5]), [1], [cache])


def _weights_checksum(path) -> str:
    h = hashlib.sha256()
    for t in gguf.GGUFReader(path).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize(("seed", "case"), list(enumerate(TINY_MODELS)), ids=[c[0] for c in TINY_MODELS])
def test_tiny_random_models_head_counts(tmp_path, seed, case):
    name, heads, kv_heads, tied = case
    path = write_tiny_llama(tmp_path / f"{name}.gguf", heads=heads, kv_heads=kv_heads, tied=tied, seed=seed)
    # The golden logits belong to these exact weights; a changed RNG stream would show here first.
    assert _weights_checksum(path) == str(TINY[f"{name}_checksum"])
    model = LlamaModel(load_gguf(path), device=torch.device("cpu"), dtype=torch.float32)
    assert model.config.tie_word_embeddings is tied
    prompts = [TINY[f"{name}_{n}_ids"] for n in TINY_PROMPT_LENGTHS]
    got = run_packed(model, prompts)
    for row, n in zip(got, TINY_PROMPT_LENGTHS):
        assert max_diff(row, TINY[f"{name}_{n}_logits"]) < TOL, n
