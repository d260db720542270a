"""Make tests/golden/gemma4.json from llama.cpp (the reference) on the tiny Gemma 4 files of `tiny_gemma4`.

Run from the repository root once llama-cpp-python is installed in the environment:

    .venv/bin/python tests/reference/make_gemma4_golden.py

llama.cpp (llama-cpp-python's bundled build, version recorded) is exact on F32 weights with an F32 KV cache, so it
is the reference here (transformers' `Gemma4ForCausalLM` is the other: `test_gemma4_transformers.py`): one thread,
F32 K and V, no flash attention, weight repacking off (`use_extra_bufts`, see FACTS.md). Per file (the dense one and
the MoE one, each written from its seed; the sha256 of the bytes llama.cpp read is recorded, so the test can check
it rebuilds the same file): the last-position logits of three seeded prompts of 5, 23 and 40 ids, each evaluated
from an empty cache, and the greedy continuation of the 40-id prompt for 16 tokens with the top-2 logit gap at each
step.

llama.cpp's CPU GELU reads a table of fp16 values (`gemma4_numpy.gelu_fp16_table`), which moves its logits by a
few 1e-3 from an exact forward on these files. So each file also gets the float64 forward written from
llama.cpp's graph (`gemma4_numpy`) with the exact tanh GELU (`float64_logits`), after checking that the same
forward with llama.cpp's table GELU gives llama.cpp's logits within CHECK_TOL (the largest difference is
recorded as `llama_cpp_vs_float64_table_gelu`): the test holds the runners to the float64 logits within 1e-3
and to llama.cpp's greedy ids.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

import gemma4_numpy  # noqa: E402
from tiny_gemma4 import VOCAB, write_gemma4_gguf  # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "gemma4.json"
FILES = {"dense": dict(moe=False, seed=0), "moe": dict(moe=True, seed=1)}
PROMPT_LENGTHS = (5, 23, 40)
GREEDY = 16
CHECK_TOL = 1e-3  # llama.cpp against the float64 forward with llama.cpp's own GELU


def prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(100 + seed)
    return [rng.integers(3, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


def open_llama(path: Path):
    """llama.cpp on `path`: one thread, F32 KV cache, every position's logits kept."""
    import llama_cpp

    return llama_cpp.Llama(str(path), n_ctx=128, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                           logits_all=True, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                           flash_attn=False, use_mmap=False, verbose=False)


def last_logits(llm, ids: list[int]) -> np.ndarray:
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[len(ids) - 1], np.float64)


def greedy(llm, ids: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy ids after `ids` (the cache kept between steps, as a server decodes) and each step's top-2 gap."""
    llm.reset()
    llm.eval(ids)
    out, gaps = [], []
    for _ in range(steps):
        logits = np.array(llm.scores[llm.n_tokens - 1], np.float64)
        top2 = np.sort(logits)[-2:]
        out.append(int(logits.argmax()))
        gaps.append(float(top2[1] - top2[0]))
        llm.eval(out[-1:])
    return out, gaps


def golden_of(path: Path, seed: int) -> dict:
    llm = open_llama(path)
    cases = prompts(seed)
    ids, gaps = greedy(llm, cases[-1], GREEDY)
    logits = [last_logits(llm, p) for p in cases]
    meta, tensors = gemma4_numpy.read(path)
    table = [gemma4_numpy.last_logits(meta, tensors, p, gemma4_numpy.gelu_fp16_table) for p in cases]
    check = max(float(np.abs(a - b).max()) for a, b in zip(logits, table))
    assert check < CHECK_TOL, f"{path.name}: llama.cpp and the float64 forward with its GELU differ by {check:.2e}"
    exact = [gemma4_numpy.last_logits(meta, tensors, p) for p in cases]
    return {"seed": seed, "gguf_sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "prompts": cases,
            "logits": [x.round(6).tolist() for x in logits], "float64_logits": [x.round(7).tolist() for x in exact],
            "llama_cpp_vs_float64_table_gelu": check, "greedy": {"ids": ids, "top2_gaps": gaps}}


def main() -> None:
    out = {"reference": f"llama-cpp-python {importlib.metadata.version('llama_cpp_python')} (F32 weights and KV "
                        "cache, 1 thread)", "gguf": importlib.metadata.version("gguf")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in FILES.items():
            path = write_gemma4_gguf(Path(tmp) / f"gemma4-{name}.gguf", **args)
            out[name] = golden_of(path, args["seed"])
    GOLDEN.write_text(json.dumps(out) + "\n")
    print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
