"""Make tests/golden/tiny_logits.json from transformers (the reference) on the tiny per-architecture GGUFs.

Run from the repository root after `make install`:

    .venv/bin/python tests/reference/make_tiny_golden.py

Takes about two minutes. For each family of `tiny_gguf.TINY_SPECS` (the tiny random-weight file
with its real llama.cpp vocabulary, as the `tiny_models` fixture writes it): three prompts of
PROMPT_LENGTHS random ids (the last two pass the 16-token windows), the reference's last-position
logits of each (`hf_reference.logit_sample`: the largest ids, seeded others and the largest logit),
and GREEDY_STEPS greedy ids after the longest with their top-2 gaps. For each quant type of
QUANT_TYPES, the `QUANT_SPEC` file in that type: one 24-id prompt and its logits. Each entry names
the weights it was made from (`hf_reference.weights_digest`), so a fixture that changes fails its
test with a message to run this again. transformers loads each file as `hf_reference.load_reference`
corrects it (about 4 s a file, which the suite no longer spends).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from hf_reference import greedy, last_logits, load_reference, logit_sample, rope_tensors, weights_digest  # noqa: E402
from testdata import llama_vocab_dir  # noqa: E402
from tiny_gguf import QUANT_SPEC, TINY_SPECS, write_tiny_model  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "tiny_logits.json"
PROMPT_LENGTHS = (5, 23, 40)
GREEDY_STEPS = 16
QUANT_TYPES = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
QUANT_PROMPT = 24


def family_prompts(name: str, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(len(name))
    return [rng.integers(0, vocab, size=n).tolist() for n in PROMPT_LENGTHS]


def main() -> None:
    from hybridgate.models import load_gguf

    vocabs, folder = llama_vocab_dir(), Path(tempfile.mkdtemp())
    families, quants = {}, {}
    for name, spec in TINY_SPECS.items():
        path = write_tiny_model(folder / f"{name}.gguf", spec, vocabs / f"ggml-vocab-{spec.vocab}.gguf")
        model = load_gguf(path)
        ref = load_reference(path, model.metadata, rope_tensors(model))
        prompts = family_prompts(name, model.config.vocab_size)
        rng = np.random.default_rng(17)
        ids, gaps = greedy(ref, prompts[-1], GREEDY_STEPS)
        families[name] = {"weights_sha256": weights_digest(model), "prompts": prompts,
                          "logits": [logit_sample(last_logits(ref, p), rng) for p in prompts],
                          "greedy": {"ids": ids, "top2_gaps": gaps}}
        print(name, "greedy", ids, f"(smallest gap {min(gaps):.4f})", flush=True)
    for kind in QUANT_TYPES:
        path = write_tiny_model(folder / f"quant-{kind}.gguf", QUANT_SPEC,
                                vocabs / f"ggml-vocab-{QUANT_SPEC.vocab}.gguf", ggml_type=kind)
        model = load_gguf(path)
        prompt = np.random.default_rng(7).integers(0, model.config.vocab_size, size=QUANT_PROMPT).tolist()
        ref = load_reference(path, model.metadata)
        quants[kind] = {"weights_sha256": weights_digest(model), "prompt": prompt,
                        "logits": logit_sample(last_logits(ref, prompt), np.random.default_rng(19))}
        print(kind, "done", flush=True)
    versions = {name: importlib.metadata.version(name) for name in ("transformers", "torch", "gguf", "numpy")}
    GOLDEN.write_text(json.dumps({"dtype": "float32", "versions": versions, "python": platform.python_version(),
                                  "families": families, "quant": quants}) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
