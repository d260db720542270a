"""Make tests/golden/gemma3_logits.json from transformers (the reference) on Gemma 3 270M Q4_K_M.

Run from the repository root after `make install` (the file comes from `testdata.gemma3_270m()`):

    .venv/bin/python tests/reference/make_gemma3_logits_golden.py

Takes about a minute. The prompts are token ids looked up in the file's own vocabulary (no
tokenizer involved): two short ones, and 540 seeded random ids after the BOS, past the 512-token
sliding window. For each, transformers' fp32 logits at the last position (the model loaded and
corrected by `hf_reference.load_reference`, as issue 26 set it) as `hf_reference.logit_sample`
keeps them (the largest ids, seeded others, the largest logit); then GREEDY greedy ids after the first prompt
(full forward passes, no cache), each with its top-2 logit gap. So the torch runner's test compares
against the reference without loading transformers (33 s here) in the suite.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from hf_reference import greedy, last_logits, load_reference, logit_sample  # noqa: E402
from testdata import GEMMA3_SHA256, gemma3_270m  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "gemma3_logits.json"
WORDS = (["The", "▁capital", "▁of", "▁France", "▁is"],
         ["Once", "▁upon", "▁a", "▁time", ",", "▁there", "▁was", "▁a"])
LONG_PROMPT = 540  # random ids after the BOS: past the 512-token sliding window
GREEDY = 16


def prompts(metadata: dict, bos: int) -> list[list[int]]:
    index = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    out = [[bos] + [index[w] for w in words] for words in WORDS]
    rng = np.random.default_rng(11)
    out.append([bos] + rng.integers(1000, 200000, size=LONG_PROMPT).tolist())
    return out


def main() -> None:
    from hybridgate.models import load_gguf

    path = gemma3_270m()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == GEMMA3_SHA256, f"{path}: sha256 {digest}, expected {GEMMA3_SHA256}"
    model = load_gguf(path)
    ref = load_reference(path, model.metadata)
    rng = np.random.default_rng(5)
    cases = []
    for prompt in prompts(model.metadata, model.config.bos_token_id):
        cases.append({"prompt_ids": prompt} | logit_sample(last_logits(ref, prompt), rng))
    greedy_ids, gaps = greedy(ref, cases[0]["prompt_ids"], GREEDY)
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "torch", "gguf")}
    GOLDEN.write_text(json.dumps({
        "model_file": path.name, "model_sha256": digest, "dtype": "float32", "versions": versions,
        "python": platform.python_version(), "cases": cases,
        "greedy": {"ids": greedy_ids, "top2_gaps": gaps},
    }) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
