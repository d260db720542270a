"""Make tests/golden/gemma3_greedy.json from transformers (the reference) on Gemma 3 270M Q4_K_M.

Run from the repository root after `make install` (the file comes from `testdata.gemma3_270m()`):

    .venv/bin/python tests/reference/make_gemma3_golden.py [--only chat]

Takes 10-20 minutes on 2 busy cores (full forward passes, no cache). For each prompt of PROMPTS: the prompt ids as transformers'
GGUF tokenizer makes them (BOS first: the file says `add_bos_token`), then GREEDY_TOKENS greedy
ids of `AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)` in fp32 (the weights
dequantized by transformers), each with the gap between the two largest logits at its step, so a
test can accept a first difference where that gap is below 1e-3 (issue 26's rule). No stop at
EOS: the test asks for `ignore_eos`. And one chat (`chat`): CHAT rendered with CHAT_TEMPLATE (the
file has no template of its own) by transformers' `apply_chat_template`, its ids and greedy ids alike.

Provenance: transformers' GGUF loader sets gemma3's `query_pre_attn_scalar` to 256 and derives
the layer types from its default sliding-window pattern, not from the file; llama.cpp
(src/llama-model.cpp, LLM_ARCH_GEMMA3) scales queries by 1/sqrt(head_dim) and makes every sixth
layer global. Both are set here by hand on the loaded config (for this file they already agree:
head_dim is 256 and the pattern is 6), so the reference is llama.cpp's model computed exactly.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from testdata import GEMMA3_SHA256, gemma3_270m  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "gemma3_greedy.json"
GREEDY_TOKENS = 16
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: gemma3 layers (i + 1) % 6 != 0 use the sliding window
PROMPTS = (
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Water boils at a temperature of",
)


# A Gemma-style chat template (the file has none: a base model), for the test that serves chats with
# --chat-template; transformers renders and tokenizes it (`apply_chat_template`) for the reference ids.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CHAT = [{"role": "user", "content": "Name a fruit that is yellow."}]


def load_reference(path: Path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.query_pre_attn_scalar = config.head_dim
    config.layer_types = ["sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention"
                          for i in range(config.num_hidden_layers)]
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return tokenizer, model.eval()


@torch.no_grad()
def greedy(model, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """GREEDY_TOKENS argmax ids from full forward passes (no cache), and the top-2 logit gap of each."""
    ids, gaps = list(prompt_ids), []
    for _ in range(GREEDY_TOKENS):
        logits = model(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(logits, 2)
        ids.append(int(top.indices[0]))
        gaps.append(float(top.values[0] - top.values[1]))
    return ids[len(prompt_ids):], gaps


def chat_case(tokenizer, model) -> dict:
    """CHAT rendered with CHAT_TEMPLATE and tokenized by transformers, and its greedy continuation."""
    text = tokenizer.apply_chat_template(CHAT, chat_template=CHAT_TEMPLATE, add_generation_prompt=True,
                                         tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes the BOS
    ids, gaps = greedy(model, prompt_ids)
    print("chat", repr(text), "->", repr(tokenizer.decode(ids)), f"(smallest gap {min(gaps):.4f})")
    return {"template": CHAT_TEMPLATE, "messages": CHAT, "rendered": text, "prompt_ids": prompt_ids,
            "greedy_ids": ids, "top2_gaps": gaps, "text": tokenizer.decode(ids)}


def main() -> None:
    path = gemma3_270m()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == GEMMA3_SHA256, f"{path}: sha256 {digest}, expected {GEMMA3_SHA256}"
    tokenizer, model = load_reference(path)
    if sys.argv[1:] == ["--only", "chat"]:  # add the chat case to an existing file
        golden = json.loads(GOLDEN.read_text())
        golden["chat"] = chat_case(tokenizer, model)
        GOLDEN.write_text(json.dumps(golden, indent=1) + "\n")
        print(f"wrote the chat case into {GOLDEN}")
        return
    cases = []
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        ids, gaps = greedy(model, prompt_ids)
        cases.append({"prompt": prompt, "prompt_ids": prompt_ids, "greedy_ids": ids, "top2_gaps": gaps,
                      "text": tokenizer.decode(ids)})
        print(repr(prompt), "->", repr(cases[-1]["text"]), f"(smallest gap {min(gaps):.4f})")
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "torch", "gguf")}
    GOLDEN.write_text(json.dumps({
        "model_file": path.name, "model_sha256": digest, "dtype": "float32",
        "config_set_by_hand": {"query_pre_attn_scalar": model.config.query_pre_attn_scalar,
                               "sliding_window_pattern": SLIDING_WINDOW_PATTERN},
        "versions": versions, "python": platform.python_version(), "cases": cases,
        "chat": chat_case(tokenizer, model),
    }, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
