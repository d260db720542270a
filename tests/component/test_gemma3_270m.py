"""The real Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) on the torch runner against transformers.

Both sides dequantize with gguf to fp32. The reference's GGUF loader is corrected as hf_reference.py
says (query scale, layer types). Prompts are token ids looked up in the file's own vocabulary (no
tokenizer involved); the long one passes the 512-token sliding window.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_reference import assert_greedy_matches, greedy, last_logits, load_reference
from hybridgate.models import load_gguf
from hybridgate.workers.gpu.model import DecoderModel

pytestmark = pytest.mark.slow

TOL = 1e-3
WORDS = (["The", "▁capital", "▁of", "▁France", "▁is"],
         ["Once", "▁upon", "▁a", "▁time", ",", "▁there", "▁was", "▁a"])


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    model = load_gguf(gemma3_path)
    vocab = model.metadata["tokenizer.ggml.tokens"]
    index = {t: i for i, t in enumerate(vocab)}
    bos = model.config.bos_token_id
    prompts = [[bos] + [index[w] for w in words] for words in WORDS]
    rng = np.random.default_rng(11)
    prompts.append([bos] + rng.integers(1000, 200000, size=540).tolist())  # past the 512-token window
    ref = load_reference(gemma3_path, model.metadata)
    want = [last_logits(ref, p) for p in prompts]
    want_greedy, gaps = greedy(ref, prompts[0], 16)
    del ref
    return DecoderModel(model, torch.device("cpu"), torch.float32), prompts, want, want_greedy, gaps


def test_config_has_the_sliding_layers_the_long_prompt_needs(gemma):
    model, prompts, *_ = gemma
    assert len(prompts[-1]) > max(model.config.layer_windows) == 512


def test_last_position_logits_match_transformers(gemma):
    model, prompts, want, *_ = gemma
    for prompt, ref in zip(prompts, want):
        got = model.forward(torch.tensor(prompt), [len(prompt)], [model.new_cache()])[0].numpy()
        assert np.abs(got - ref).max() < TOL, len(prompt)


def test_greedy_ids_match_transformers(gemma):
    model, prompts, _, want_greedy, gaps = gemma
    cache, out = model.new_cache(), []
    logits = model.forward(torch.tensor(prompts[0]), [len(prompts[0])], [cache])
    for _ in range(16):
        out.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), [1], [cache])
    assert_greedy_matches(out, want_greedy, gaps)
