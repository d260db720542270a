"""Make tests/golden/gemma3_tokenizer.json and gemma4_tokenizer.json: ids and decoded text, from transformers.

Run from the repository root after `make install` (about two minutes on 2 cores; transformers
parses the 262,144-token vocabulary of the GGUF); name one of `gemma3`, `gemma4` to make only that one:

    .venv/bin/python tests/reference/make_tokenizer_golden.py [gemma3|gemma4]

The reference is transformers' tokenizer loaded from the GGUF itself
(`AutoTokenizer.from_pretrained(folder, gguf_file=name)`, its `gemma_tokenizer`
builder), on the strings of `TOKENIZER_CORPUS`, llama.cpp's tokenizer test strings
(`ggml-vocab-llama-spm.gguf.inp`) and a few of Gemma's chat-turn shapes. For each
string: `encode(text, add_special_tokens=False)` (which parses special-token strings
such as `<start_of_turn>` as their ids, like our `encode(text)`) and `decode(ids)`.

Gemma 4: llama.cpp's vocabulary-only `ggml-vocab-gemma-4.gguf`, whose model config transformers cannot
build (`head_count_kv` per layer), so its GGUF tokenizer builder is called directly
(`get_gguf_tokenizer` and `convert_gguf_tokenizer`: `GemmaTokenizer` with the file's merges), on
`TOKENIZER_CORPUS`, runs of 1 to 70 newlines and Gemma 4's chat-turn shapes; `decode` keeps special tokens.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden" / "gemma3_tokenizer.json"
GOLDEN_GEMMA4 = HERE.parent / "golden" / "gemma4_tokenizer.json"
sys.path.insert(0, str(HERE))

import testdata  # noqa: E402
from corpus import TOKENIZER_CORPUS  # noqa: E402

EXTRA = [
    "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n",
    "   three leading spaces and a tab\t",
    "a\n\n\n\nb",
    "  \n  x  \n",
    "<0x41> is not a byte token in text",
]

EXTRA_GEMMA4 = [
    "<|turn>user\nWhat is the capital of France?<turn|>\n<|turn>model\n",
    "<|turn>model\n<|channel>thought\nhm<channel|>Paris<turn|>",
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
    "a\n\n\n\nb", "  \n  x  \n", "\r\n\r\n", "\n \n", "<0x41> is not a byte token in text",
    *("\n" * n for n in range(1, 71)),
]


def _write(path: Path, source: str, strings: list[str], ids: list[list[int]], decoded: list[str]) -> None:
    out = {"source": source, "strings": strings, "ids": ids, "decoded": decoded}
    path.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {path} ({len(strings)} strings)")


def gemma4() -> None:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    path = testdata.llama_vocab("gemma-4")
    reference, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(path))[:2])
    strings = list(TOKENIZER_CORPUS) + EXTRA_GEMMA4
    ids = [reference.encode(s, add_special_tokens=False).ids for s in strings]
    source = (f"transformers {importlib.metadata.version('transformers')} convert_gguf_tokenizer on llama.cpp's "
              f"{path.name} (llama-cpp-python 0.3.36 sdist), encode(add_special_tokens=False)")
    _write(GOLDEN_GEMMA4, source, strings, ids, [reference.decode(i, skip_special_tokens=False) for i in ids])


def gemma3() -> None:
    from transformers import AutoTokenizer

    path = testdata.gemma3_270m()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    strings = list(TOKENIZER_CORPUS) + [text for text, _ in testdata.vocab_cases("llama-spm")] + EXTRA
    ids = [reference.encode(s, add_special_tokens=False) for s in strings]
    source = (f"transformers {importlib.metadata.version('transformers')} AutoTokenizer from "
              f"{testdata.GEMMA3_FILE} (sha256 {testdata.GEMMA3_SHA256}), encode(add_special_tokens=False)")
    _write(GOLDEN, source, strings, ids, [reference.decode(i) for i in ids])


if __name__ == "__main__":
    for name, make in {"gemma3": gemma3, "gemma4": gemma4}.items():
        if sys.argv[1:] in ([], [name]):
            make()
