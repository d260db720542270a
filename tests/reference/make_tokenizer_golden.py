"""Make tests/golden/gemma3_tokenizer.json: Gemma 3 270M's ids and decoded text, from transformers.

Run from the repository root after `make install` (about two minutes on 2 cores; transformers
parses the 262,144-token vocabulary of the GGUF):

    .venv/bin/python tests/reference/make_tokenizer_golden.py

The reference is transformers' tokenizer loaded from the GGUF itself
(`AutoTokenizer.from_pretrained(folder, gguf_file=name)`, its `gemma_tokenizer`
builder), on the strings of `TOKENIZER_CORPUS`, llama.cpp's tokenizer test strings
(`ggml-vocab-llama-spm.gguf.inp`) and a few of Gemma's chat-turn shapes. For each
string: `encode(text, add_special_tokens=False)` (which parses special-token strings
such as `<start_of_turn>` as their ids, like our `encode(text)`) and `decode(ids)`.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden" / "gemma3_tokenizer.json"
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


def main() -> None:
    from transformers import AutoTokenizer

    path = testdata.gemma3_270m()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    strings = list(TOKENIZER_CORPUS) + [text for text, _ in testdata.vocab_cases("llama-spm")] + EXTRA
    ids = [reference.encode(s, add_special_tokens=False) for s in strings]
    out = {
        "source": f"transformers {importlib.metadata.version('transformers')} AutoTokenizer from "
                  f"{testdata.GEMMA3_FILE} (sha256 {testdata.GEMMA3_SHA256}), encode(add_special_tokens=False)",
        "strings": strings,
        "ids": ids,
        "decoded": [reference.decode(i) for i in ids],
    }
    GOLDEN.write_text(json.dumps(out, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN} ({len(strings)} strings)")


if __name__ == "__main__":
    main()
