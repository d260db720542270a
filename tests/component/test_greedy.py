"""Greedy decoding with the torch runner and the sampler against transformers' generate (greedy.json)."""

from __future__ import annotations

import pytest
import torch

from conftest import golden_json
from hybridgate.wire import SamplingParams
from hybridgate.workers.sampling import sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = golden_json("greedy.json")


def greedy_generate(llama, prompt_ids: list[int], max_new: int, eos: int) -> tuple[list[int], str]:
    params = [SamplingParams(temperature=0.0)]
    cache, ids, new = llama.new_cache(), prompt_ids, []
    while len(new) < max_new:
        logits = llama.forward(torch.tensor(ids), [len(ids)], [cache]).numpy()
        token = int(sample(logits, params, [0], [len(new)], [prompt_ids + new])[0])
        new.append(token)
        if token == eos:
            return new, "eos"
        ids = [token]
    return new, "length"


@pytest.mark.parametrize("name", ["france", "haiku", "gravity"])
def test_greedy_ids_equal_reference(llama, chat_template, tokenizer, name):
    case = GREEDY[name]
    prompt = chat_template.encode([{"role": "user", "content": case["question"]}])
    assert prompt == case["prompt_ids"]
    max_new = 16 if name == "france" else 32
    new, finish = greedy_generate(llama, prompt, max_new, tokenizer.eos_token_id)
    assert new == case["ids"][: len(new)] and len(new) == len(case["ids"])
    if name == "france":
        assert tokenizer.decode(new, skip_special_tokens=True) == "The capital of France is Paris."
        assert len(new) == 8 and new[-1] == 2 and finish == "eos"
    else:
        assert finish == "length" and 2 not in new
