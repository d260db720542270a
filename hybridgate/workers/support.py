"""Whether each runner can serve a model: its weights built as the worker builds them, the error kept.

Used by `hybridgate info`. A runner's requirements are its packages (torch for `gpu`, Numba for
`cpu`) and what its model class accepts (architecture, tensor types, shapes); building that class
is the one check that cannot drift from the runner itself. No KV cache is allocated and no
kernel is compiled (Numba compiles on first call); the torch model is built on the "meta" device,
so its checks run on shapes without dequantizing the file.

The verdicts are kept (`runner_verdicts`) per model fingerprint and code: importing torch and
repacking the CPU runner's weights cost `hybridgate info` most of its time (about 4 s of CPU for
Gemma 3 270M on 2 cores), and neither answer changes until the file, hybridgate's runner code or
the runners' packages do, which are all in the key. A model's first check runs the two side by side
(`side_by_side`: torch's import in a forked child while this process repacks the CPU runner's weights).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import ModuleType

from hybridgate.models import GGUFModel
from hybridgate.models.gguf_file import header_cache_dir

log = logging.getLogger("hybridgate.workers")

# The packages the runners' models need: a verdict holds while their versions do.
RUNNER_PACKAGES = ("torch", "numba", "llvmlite", "numpy", "gguf")


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


def _verdict_key(fingerprint: str) -> str:
    """A hash of the model, the source of hybridgate's models and workers packages, and RUNNER_PACKAGES' versions."""
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=16)
    package = Path(__file__).resolve().parents[1]
    for path in sorted([*package.joinpath("models").rglob("*.py"), *package.joinpath("workers").rglob("*.py")]):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    for name in RUNNER_PACKAGES:
        try:
            digest.update(f"{name}={version(name)}".encode())
        except PackageNotFoundError:
            digest.update(f"{name}=none".encode())
    return digest.hexdigest()


def runner_verdicts(model: GGUFModel, fingerprint: str) -> list[tuple[RunnerModel, str]]:
    """(runner, `runner_refusal`) for each of RUNNER_MODELS, from the cache folder
    ($HYBRIDGATE_CACHE_DIR/runners) when this model, code and packages were checked before;
    `fingerprint` is `model_fingerprint(model)`. A cache that cannot be written is only slower."""
    path = header_cache_dir().parent / "runners" / (_verdict_key(fingerprint) + ".json")
    try:
        kept = json.loads(path.read_text())
        return [(runner, kept[runner.kind]) for runner in RUNNER_MODELS]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    verdicts = side_by_side([lambda runner=runner: runner_refusal(runner, model) for runner in RUNNER_MODELS])
    verdicts = list(zip(RUNNER_MODELS, verdicts))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({runner.kind: refusal for runner, refusal in verdicts}))
        tmp.replace(path)
    except OSError as exc:
        log.debug("runner verdicts not cached: %s", exc)
    return verdicts


def side_by_side(checks: list[Callable[[], str]]) -> list[str]:
    """Each check's text, every check but the last run in a forked child while this process runs the last, so that
    the runners' checks overlap: torch's import (about 2 s of CPU, and its libraries' first read from disk) beside
    the CPU runner's weight repacking (a second for Gemma 3 270M). One after another where there is no fork.
    Raises RuntimeError naming a child's error (its type and message) when a check raised there."""
    if not hasattr(os, "fork"):
        return [check() for check in checks]
    waits = [_in_child(check) for check in checks[:-1]]
    try:
        last = checks[-1]()
    finally:  # the children are waited for whatever this process's check did
        answers = [wait() for wait in waits]
    return answers + [last]


def _in_child(check: Callable[[], str]) -> Callable[[], str]:
    """Start `check` in a forked child; the call returned waits for the child and returns its text. The child
    writes "ok" or "error" and the text through a pipe, then leaves by os._exit (no atexit, no second flush)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            answer = "ok\0" + check()
        except BaseException as exc:  # whatever it was, the parent raises it by name
            answer = f"error\0{type(exc).__name__}: {exc}"
        with os.fdopen(write, "wb") as out:
            out.write(answer.encode("utf-8", "replace"))
        os._exit(0)
    os.close(write)

    def wait() -> str:
        with os.fdopen(read, "rb") as answer:
            status, _, text = answer.read().decode("utf-8").partition("\0")
        _, code = os.waitpid(pid, 0)
        if status != "ok":
            raise RuntimeError(f"a runner check failed in its child process (pid {pid}, wait status {code}): "
                               f"{text or 'no answer'}")
        return text

    return wait
