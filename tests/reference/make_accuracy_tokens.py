"""Make hybridgate/bench/data/accuracy_tokens.json: 8 chat prompts, 64 greedy ids each.

Greedy from transformers fp32 on the default GGUF with EOS masked
(`min_new_tokens=64`), ids only. Run from the repository root after `make install`:

    .venv/bin/python tests/reference/make_accuracy_tokens.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "Give three tips for writing clean Python code.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List the planets of the solar system in order.",
]


@torch.inference_mode()
def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, __version__

    from hybridgate.models import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    cases = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
        cases.append({"prompt_ids": list(ids), "ids": out[0, len(ids):].tolist()})
    target = ROOT / "hybridgate" / "bench" / "data" / "accuracy_tokens.json"
    target.write_text(json.dumps({"source": f"transformers {__version__} fp32 greedy, min_new_tokens=64, "
                                  f"{path.name}", "cases": cases}) + "\n")
    print("wrote", target)


if __name__ == "__main__":
    main()
