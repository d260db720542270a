"""Make tests/golden/unused_tokens.json: llama.cpp's text of ids that include filler (unused) tokens.

The reference is llama.cpp itself through llama-cpp-python 0.3.36 (built from source, the
`bench` extra; about ten minutes on 2 cores), on the two vocabulary-only files of
`unused_vocab.py` loaded with `vocab_only=True`. For each file and id sequence of
`unused_vocab.id_cases`: each id's piece (`llama_token_to_piece`, no lstrip, special
tokens rendered) and the sequence's text (`llama_detokenize`, special tokens kept and
rendered). Run from the repository root in an environment with llama-cpp-python and gguf:

    python tests/reference/make_unused_golden.py
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden" / "unused_tokens.json"
sys.path.insert(0, str(HERE))

from unused_vocab import VOCABS, id_cases, write_unused_vocab  # noqa: E402


def _piece(vocab, token: int) -> str:
    import llama_cpp

    buf = (ctypes.c_char * 64)()
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, 64, 0, True)
    return bytes(buf[:n]).decode("utf-8", "replace")


def _detokenize(vocab, ids: list[int]) -> str:
    import llama_cpp

    arr = (llama_cpp.llama_token * len(ids))(*ids)
    buf = (ctypes.c_char * 1024)()
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, 1024, False, True)
    return bytes(buf[:n]).decode("utf-8", "replace")


def main() -> None:
    import llama_cpp

    out = {"source": f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}: llama_token_to_piece "
                     "(lstrip 0, special true) and llama_detokenize (remove_special false, unparse_special true) "
                     "on the vocab_only files of tests/reference/unused_vocab.py", "vocabs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model in VOCABS:
            path = write_unused_vocab(Path(tmp) / f"unused-{model}.gguf", model)
            llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
            vocab = llama_cpp.llama_model_get_vocab(llm.model)
            cases = id_cases(model)
            out["vocabs"][model] = {
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                "cases": [{"ids": ids, "pieces": [_piece(vocab, i) for i in ids], "text": _detokenize(vocab, ids)}
                          for ids in cases]}
            llm.close()
    GOLDEN.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print("wrote", GOLDEN)


if __name__ == "__main__":
    main()
