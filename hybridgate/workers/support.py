"""Whether each runner can serve a model: its weights built as the worker builds them, the error kept.

Used by `hybridgate info`. A runner's requirements are its packages (torch for `gpu`, Numba for
`cpu`) and what its model class accepts (architecture, tensor types, shapes); building that class
is the one check that cannot drift from the runner itself. No KV cache is allocated and no
kernel is compiled (Numba compiles on first call); the torch model is built on the "meta" device,
so its checks run on shapes without dequantizing the file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from hybridgate.models import GGUFModel


@dataclass(frozen=True)
class RunnerModel:
    """Where a runner's model class lives: `module.attribute(model, *args)` builds its weights, args
    built by `args` from the module (the torch model on the "meta" device: shapes only, nothing
    dequantized or allocated)."""

    kind: str
    description: str
    module: str
    attribute: str
    args: Callable[[ModuleType], tuple] = lambda module: ()


RUNNER_MODELS = (
    RunnerModel("gpu", "PyTorch runner", "hybridgate.workers.gpu.model", "DecoderModel",
                lambda module: (module.torch.device("meta"),)),
    RunnerModel("cpu", "Numba runner", "hybridgate.workers.cpu.model", "CpuModel"),
)


def runner_refusal(runner: RunnerModel, model: GGUFModel) -> str:
    """"" when `runner` builds `model`'s weights; else one line saying why (a missing package, or
    the error its model class raised, which names the tensor, type or setting)."""
    try:
        module = importlib.import_module(runner.module)
        build = getattr(module, runner.attribute)
    except (ImportError, AttributeError) as exc:
        return f"cannot be loaded here: {exc}"
    try:
        build(model, *runner.args(module))
    except (ValueError, KeyError, NotImplementedError, TypeError) as exc:
        text = str(exc) if not isinstance(exc, KeyError) else f"tensor {exc} is missing"
        return text.splitlines()[0] if text else type(exc).__name__
    return ""
