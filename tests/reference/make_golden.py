"""Make the golden files in tests/golden/ from transformers (the reference).

Run from the repository root after `make install`:

    .venv/bin/python tests/reference/make_golden.py

Takes about two minutes on 2 cores. Writes:
- tokenizer.json: ids of TOKENIZER_CORPUS.
- chat.json: renders and ids of CHAT_CASES (`apply_chat_template`), and the
  reference ids for a content that holds special-token strings, encoded as text.
- logits.npz: last-position fp32 logits for short prompts, one prompt of more
  than 2048 tokens and 4 prompts of different lengths.
- greedy.json: greedy ids for the chats of GREEDY_CASES.
- logprobs.json: for the greedy answer of the "france" chat, per generated
  token: its log-probability (float64 log-softmax of the fp32 logits at the
  position before it) and the 5 most likely ids with theirs
  (`--only logprobs` writes this file alone).
- tiny.npz: last-position logits of tiny random GGUF files (tiny_gguf.py) with
  several head / KV-head counts, and a checksum of their weights.
- versions.json: the versions and the model file's sha256 that produced them.

Provenance note: transformers builds the GGUF tokenizer from the file's
metadata but ignores `tokenizer.ggml.pre = smollm` (5.24 maps no such
pre-tokenizer), so it merges a run of spaces before a digit that SmolLM2's own
tokenizer.json (and llama.cpp, whose `smollm` pre-tokenizer splits every digit
first) keep apart. The reference here sets the pre-tokenizer of SmolLM2's
published tokenizer.json: Digits(individual_digits=True) then
ByteLevel(add_prefix_space=False, use_regex=True). Strings where the unpatched
transformers tokenizer differs are listed in tokenizer.json under
`transformers_gguf_differs`.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GOLDEN = ROOT / "tests" / "golden"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

from corpus import (  # noqa: E402
    CHAT_CASES,
    GREEDY_CASES,
    INJECTION_CONTENT,
    LONG_TEXT_PARAGRAPH,
    SHORT_PROMPTS,
    TINY_MODELS,
    TINY_PROMPT_LENGTHS,
    TOKENIZER_CORPUS,
)
from tiny_gguf import write_tiny_llama  # noqa: E402


def model_file() -> Path:
    from hybridgate.models import default_model_path

    return default_model_path()


def load_reference(path: Path):
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    plain = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tok = copy.deepcopy(plain)  # a second from_pretrained would parse the GGUF again (seconds)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return tok, plain, model


def tokenizer_golden(tok, plain) -> dict:
    ids = [tok.encode(s, add_special_tokens=False) for s in TOKENIZER_CORPUS]
    differs = [s for s, i in zip(TOKENIZER_CORPUS, ids) if plain.encode(s, add_special_tokens=False) != i]
    decoded = [tok.decode(i) for i in ids]
    return {"strings": TOKENIZER_CORPUS, "ids": ids, "decoded": decoded, "transformers_gguf_differs": differs}


def chat_golden(tok) -> dict:
    cases = {}
    for name, messages in CHAT_CASES.items():
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        cases[name] = {"messages": messages, "text": text, "ids": list(ids)}
    # The reference encodes special strings in content as control tokens; the
    # expected ids splice in the content encoded with split_special_tokens.
    messages = [{"role": "user", "content": INJECTION_CONTENT}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    start = text.index(INJECTION_CONTENT)
    end = start + len(INJECTION_CONTENT)
    ids = (
        tok.encode(text[:start], add_special_tokens=False)
        + tok(INJECTION_CONTENT, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        + tok.encode(text[end:], add_special_tokens=False)
    )
    cases["injection"] = {"messages": messages, "text": text, "ids": ids}
    return cases


def long_prompt_ids(tok) -> list[int]:
    text, i = "", 0
    while len(tok.encode(text, add_special_tokens=False)) < 2100:
        text += LONG_TEXT_PARAGRAPH.format(i=i)
        i += 1
    return tok.encode(text, add_special_tokens=False)


@torch.inference_mode()
def last_logits(model, ids: list[int]) -> np.ndarray:
    return model(torch.tensor([ids])).logits[0, -1].float().numpy()


def logits_golden(tok, model) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for i, prompt in enumerate(SHORT_PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=False)
        out[f"short{i}_ids"] = np.array(ids, dtype=np.int64)
        out[f"short{i}_logits"] = last_logits(model, ids)
    long_ids = long_prompt_ids(tok)
    out["long_ids"] = np.array(long_ids, dtype=np.int64)
    out["long_logits"] = last_logits(model, long_ids)
    for i, (start, length) in enumerate([(0, 5), (40, 17), (300, 64), (900, 131)]):
        ids = long_ids[start : start + length]
        out[f"batch{i}_ids"] = np.array(ids, dtype=np.int64)
        out[f"batch{i}_logits"] = last_logits(model, ids)
    return out


@torch.inference_mode()
def greedy_golden(tok, model) -> dict:
    out = {}
    for name, (question, max_new) in GREEDY_CASES.items():
        messages = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        prompt_ids = list(prompt["input_ids"])
        gen = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
        new = gen[0, len(prompt_ids) :].tolist()
        out[name] = {"question": question, "prompt_ids": prompt_ids, "ids": new, "text": tok.decode(new)}
    return out


def logprobs_golden(model, greedy: dict) -> dict:
    case = greedy["france"]
    prompt, ids = case["prompt_ids"], case["ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].double()  # [positions, vocab]
    lp = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(ids) - 1], dim=-1)
    top = torch.topk(lp, 5, dim=-1)
    return {"case": "france", "prompt_ids": prompt, "ids": ids,
            "logprobs": [float(lp[i, t]) for i, t in enumerate(ids)],
            "top_ids": top.indices.tolist(), "top_logprobs": top.values.tolist()}


def weights_checksum(path: Path) -> str:
    import gguf

    h = hashlib.sha256()
    for t in gguf.GGUFReader(path).tensors:
        h.update(t.name.encode())
        h.update(np.ascontiguousarray(t.data).tobytes())
    return h.hexdigest()


@torch.inference_mode()
def tiny_golden() -> dict[str, np.ndarray]:
    from transformers import AutoModelForCausalLM

    out: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(1234)
    with tempfile.TemporaryDirectory() as tmp:
        for seed, (name, heads, kv_heads, tied) in enumerate(TINY_MODELS):
            path = write_tiny_llama(Path(tmp) / f"{name}.gguf", heads=heads, kv_heads=kv_heads, tied=tied, seed=seed)
            model = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32)
            if model.config.tie_word_embeddings != tied:
                raise RuntimeError(f"{name}: reference tie_word_embeddings={model.config.tie_word_embeddings}")
            out[f"{name}_checksum"] = np.array(weights_checksum(path))
            for n in TINY_PROMPT_LENGTHS:
                ids = rng.integers(0, model.config.vocab_size, size=n)
                out[f"{name}_{n}_ids"] = ids.astype(np.int64)
                out[f"{name}_{n}_logits"] = last_logits(model, ids.tolist())
    return out


def versions(path: Path) -> dict:
    import tokenizers
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "gguf": importlib.metadata.version("gguf"),
        "numpy": np.__version__,
        "model_file": path.name,
        "model_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def main() -> None:
    torch.manual_seed(0)
    path = model_file()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    tok, plain, model = load_reference(path)
    dump = lambda name, obj: (GOLDEN / name).write_text(json.dumps(obj, ensure_ascii=False, indent=1) + "\n")
    if sys.argv[1:] == ["--only", "logprobs"]:
        dump("logprobs.json", logprobs_golden(model, json.loads((GOLDEN / "greedy.json").read_text())))
        return
    dump("tokenizer.json", tokenizer_golden(tok, plain))
    dump("chat.json", chat_golden(tok))
    greedy = greedy_golden(tok, model)
    dump("greedy.json", greedy)
    dump("logprobs.json", logprobs_golden(model, greedy))
    np.savez_compressed(GOLDEN / "logits.npz", **logits_golden(tok, model))
    np.savez_compressed(GOLDEN / "tiny.npz", **tiny_golden())
    dump("versions.json", versions(path))
    print("wrote", sorted(p.name for p in GOLDEN.iterdir()))


if __name__ == "__main__":
    main()
