"""Slow tier: re-check against live transformers (the golden files' source) on fresh inputs."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from conftest import golden_json, missing
from corpus import CHAT_CASES, TOKENIZER_CORPUS

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


@pytest.fixture(scope="module")
def reference(model_path):
    try:
        import make_golden
    except ImportError as exc:  # transformers is in the `test` extra
        if os.environ.get("CI") == "true":
            raise
        missing(f"transformers ({exc})")
    return make_golden.load_reference(model_path)


def random_strings(n: int, seed: int) -> list[str]:
    pool = list("abcxyz ABC\t\n  0123456789.,;:!?'\"()[]{}<>/\\-_=+*&^%$#@") + list("éüñßøЖждкあい中文한글😀🎉👍🏽\u0301\u200d")
    pool += ["the ", " and", "ing", "  ", "\n\n", "<|im_end|>", "http://", "42", "'s"]
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(pool, size=int(rng.integers(1, 40)))) for _ in range(n)]


def test_tokenizer_agrees_on_fresh_strings(tokenizer, reference):
    tok = reference[0]
    strings = TOKENIZER_CORPUS + random_strings(300, seed=5)
    disagree = [s for s in strings if tokenizer.encode(s) != tok.encode(s, add_special_tokens=False)]
    assert not disagree, disagree[:5]


def test_decode_agrees_on_random_ids(tokenizer, reference):
    tok = reference[0]
    rng = np.random.default_rng(9)
    for _ in range(200):
        ids = rng.integers(0, tokenizer.vocab_size, size=int(rng.integers(1, 30))).tolist()
        assert tokenizer.decode(ids) == tok.decode(ids)


def test_chat_template_agrees(chat_template, reference):
    tok = reference[0]
    for messages in CHAT_CASES.values():
        for gen in (True, False):
            want = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert chat_template.render(messages, add_generation_prompt=gen) == want


@torch.inference_mode()
def test_logits_agree_on_a_fresh_prompt(llama, reference):
    model = reference[2]
    ids = np.random.default_rng(11).integers(0, 49152, size=300)
    want = model(torch.from_numpy(ids)[None]).logits[0, -1].numpy()
    got = llama.forward(torch.from_numpy(ids), [len(ids)], [llama.new_cache()]).numpy()[0]
    assert np.abs(got - want).max() < 1e-3


def test_golden_files_are_current(reference):
    tok = reference[0]
    golden = golden_json("tokenizer.json")
    assert [tok.encode(s, add_special_tokens=False) for s in golden["strings"]] == golden["ids"]
