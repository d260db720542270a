"""Whether each runner can serve a model: its weights built as the worker builds them, the error kept.

Used by `hybridgate info`. A runner's requirements are its packages (torch for `gpu`, Numba for
`cpu`) and what its model class accepts (architecture, tensor types, shapes); building that class
is the one check that cannot drift from the runner itself. No KV cache is allocated and no
kernel is compiled (Numba compiles on first call).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from hybridgate.models import GGUFModel


@dataclass(frozen=True)
class RunnerModel:
    """Where a runner's model class lives: `module.attribute(model)` builds its weights."""

    kind: str
    description: str
    module: str
    attribute: str


RUNNER_MODELS = (
    RunnerModel("gpu", "PyTorch runner", "hybridgate.workers.gpu.model", "LlamaModel"),
    RunnerModel("cpu", "Numba runner", "hybridgate.workers.cpu.model", "CpuLlama"),
)


def runner_refusal(runner: RunnerModel, model: GGUFModel) -> str:
    """"" when `runner` builds `model`'s weights; else one line saying why (a missing package, or
    the error its model class raised, which names the tensor, type or setting)."""
    try:
        build = getattr(importlib.import_module(runner.module), runner.attribute)
    except (ImportError, AttributeError) as exc:
        return f"cannot be loaded here: {exc}"
    try:
        build(model)
    except (ValueError, KeyError, NotImplementedError, TypeError) as exc:
        text = str(exc) if not isinstance(exc, KeyError) else f"tensor {exc} is missing"
        return text.splitlines()[0] if text else type(exc).__name__
    return ""
