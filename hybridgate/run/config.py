"""The settings of `serve` and `gateway` as deployments: which workers, and how `serve` restarts them.

Data only (the settings root composes it); `hybridgate.run.serve` and
`hybridgate.run.supervise` read these sections.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridgate.config import Spec, check_settings, parse_text, setting

# A served model's name: what the OpenAI `model` field, the gRPC `model` field and the health service
# name carry (letters, digits and . _ - / :, as Hugging Face ids such as org/model-1.5B).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}")
_OLD_COUNTS = re.compile(r".*:(gpu|cpu)=\d+")  # the NAME=PATH:gpu=N:cpu=N form of before


@dataclass(frozen=True)
class ModelSpec:
    """One `--model` value: `PATH`, or `NAME=PATH` followed by the model's own settings,
    `NAME=PATH,key=value,...` (keys: `hybridgate.settings.MODEL_SETTINGS`' flag names). `name` "" is a model
    named after its GGUF file (`hybridgate.models.model_names`); `path` "" is the default model. `values`:
    the settings given for this model, (setting path, value) in the order given."""

    name: str
    path: str
    values: tuple[tuple[str, Any], ...] = ()

    def given(self, path: str) -> bool:
        return any(p == path for p, _ in self.values)


def parse_model_spec(text: str, keys: Mapping[str, Spec]) -> ModelSpec:
    """A `--model` value as a ModelSpec; `keys`: the per-model settings by flag name.

    Raises ValueError naming --model, the model, and the accepted forms, the unknown key and the keys
    there are, or the key and its limit ("must be one of auto, f32, i16, i8, got 'x'").
    """
    head, *pairs = text.split(",")
    name, sep, path = head.partition("=")
    if not sep:
        name, path = "", head
    elif not MODEL_NAME.fullmatch(name) or name in keys:
        raise ValueError(f"--model: the name in {text!r} must be 1-128 letters, digits or . _ - / : (starting "
                         "with a letter or digit, and no per-model key); give PATH or NAME=PATH[,key=value...]")
    who = f"model {name!r}" if name else "the model"
    if _OLD_COUNTS.fullmatch(path):
        raise ValueError(f"--model: {who}: per-model settings follow commas now: NAME=PATH,gpu-workers=N,"
                         f"cpu-workers=N (got {text!r})")
    if not path:
        raise ValueError(f"--model: {text!r} names no GGUF file; give NAME=PATH[,key=value...]")
    values: dict[str, Any] = {}
    for pair in pairs:
        key, eq, raw = pair.strip().partition("=")
        spec = keys.get(key)
        if spec is None or not eq:
            raise ValueError(f"--model: {who}: {key!r} is not a per-model key=value; the keys are "
                             f"{', '.join(keys)}")
        try:
            value = parse_text(spec, raw)
        except ValueError as exc:
            raise ValueError(f"--model: {who}, key {key}: {exc}") from None
        if spec.kind is tuple:  # repeated, as its flag is: served-model-name=a,served-model-name=b
            value = values.get(spec.path, ()) + value
        elif spec.path in values:
            raise ValueError(f"--model: {who}, key {key}: given twice")
        values[spec.path] = value
    return ModelSpec(name, path, tuple(values.items()))


def check_model_specs(values: tuple[str, ...], keys: Mapping[str, Spec]) -> None:
    """The `model` setting: each value parses, names are unique, at most one model is unnamed, and
    several models are all named (requests pick them by name). Raises ValueError naming --model."""
    specs = [parse_model_spec(v, keys) for v in values]
    names = [s.name for s in specs]
    if len(specs) > 1 and "" in names:
        raise ValueError("--model: with several models, name each one: NAME=PATH (the first is the default)")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"--model: the name {twice[0]!r} is given twice; each model needs its own name")


@dataclass(frozen=True)
class LayoutConfig:
    """Which workers the gateway talks to: those `serve` starts, or running ones (`gateway`)."""

    gpu_workers: int | None = setting(
        None, "GPU workers (the PyTorch runner; on a CPU torch device where there is no CUDA); "
              "default: 1 where CUDA is present, else 0", low=0)
    cpu_workers: int = setting(1, "CPU workers (Numba kernels on the GGUF blocks); the workers that compute "
                                  "on the CPU get disjoint slices of its cores (--cpu-cores) and, unless "
                                  "--threads is given, a thread per core", low=0)
    worker_endpoints: tuple[str, ...] = setting(
        (), "a running worker's endpoint (ipc://PATH or tcp://HOST:PORT); repeat for several", flag="--worker")
    gateways: int = setting(
        1, "gateway processes serving the one gRPC port (SO_REUSEPORT among themselves only: a port another "
           "program holds is still refused), each with its own router, all sharing the workers; with "
           "--metrics-port P, gateway i serves its metrics on P+i", low=1, high=64)

    def __post_init__(self) -> None:
        check_settings(self)


@dataclass(frozen=True)
class SupervisorConfig:
    restart_backoff_s: float = setting(
        0.5, "seconds before restarting a worker that exited; doubles with each restart within the window",
        low=0, flag="--worker-restart-backoff")
    restart_backoff_max_s: float = setting(10.0, "longest wait before a worker restart, seconds", low=0,
                                           flag="--worker-restart-backoff-max")
    max_restarts: int = setting(5, "restarts of one worker within --worker-restart-window after which it stays down",
                                low=0, flag="--worker-max-restarts")
    restart_window_s: float = setting(60.0, "seconds over which --worker-max-restarts counts restarts", low=0,
                                      low_open=True, flag="--worker-restart-window")

    def __post_init__(self) -> None:
        check_settings(self)
