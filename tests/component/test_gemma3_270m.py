"""The real Gemma 3 270M (Q4_K, Q5_0, Q6_K, Q8_0 and F32 tensors) on the torch runner against transformers.

Both sides dequantize with gguf to fp32. The reference's answers are in tests/golden/gemma3_logits.json
(`tests/reference/make_gemma3_logits_golden.py`: transformers, its GGUF loader corrected as
hf_reference.py says): at each prompt's last position the logits at the 64 largest ids and 64 seeded
random ones, and the largest; then 16 greedy ids with their top-2 gaps. Prompts are token ids looked up
in the file's own vocabulary (no tokenizer involved); the long one passes the 512-token sliding window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_reference import assert_greedy_matches, assert_logits_match
from hybridgate.models import load_gguf
from hybridgate.workers.gpu.model import DecoderModel
from testdata import GEMMA3_SHA256

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "gemma3_logits.json"
TOL = 1e-3


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["model_sha256"] == GEMMA3_SHA256  # the golden was made from the file the tests load
    return DecoderModel(load_gguf(gemma3_path), torch.device("cpu"), torch.float32), golden


def test_config_has_the_sliding_layers_the_long_prompt_needs(gemma):
    model, golden = gemma
    assert len(golden["cases"][-1]["prompt_ids"]) > max(model.config.layer_windows) == 512


def test_last_position_logits_match_transformers(gemma):
    model, golden = gemma
    for case in golden["cases"]:
        prompt = case["prompt_ids"]
        got = model.forward(torch.tensor(prompt), [len(prompt)], [model.new_cache()])[0].numpy()
        assert_logits_match(got, case, TOL, len(prompt))


def test_greedy_ids_match_transformers(gemma):
    model, golden = gemma
    prompt, want = golden["cases"][0]["prompt_ids"], golden["greedy"]
    cache, out = model.new_cache(), []
    logits = model.forward(torch.tensor(prompt), [len(prompt)], [cache])
    for _ in range(16):
        out.append(int(logits[0].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), [1], [cache])
    assert_greedy_matches(out, want["ids"], want["top2_gaps"])
