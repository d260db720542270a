"""Shared fixtures: the real model file, golden files, and the time factor for limits."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
sys.path.insert(0, str(ROOT / "tests" / "reference"))

# Every gateway and serve the tests start binds its HTTP API on a free port unless a test says otherwise
# (the default, 8000, would collide between tests and with anything else on the machine).
os.environ.setdefault("HYBRIDGATE_HTTP_PORT", "0")

# The GPU worker's Triton kernels run on CPU tensors under Triton's interpreter (FACTS.md); `@triton.jit` reads
# this when the kernels' module is imported. `make gpu-check` sets it to 0 to compile them for the GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Every time limit in the tests is multiplied by this one factor (slow machines: raise it).
TIME_FACTOR = float(os.environ.get("HYBRIDGATE_TEST_TIME_FACTOR", "1"))

# Hypothesis: under CI a fixed seed (derandomize) and no per-example deadline (shared runners
# stall), so a green CI means the same thing every time; locally the default random search
# (`--hypothesis-seed=N` replays one run, `--hypothesis-profile=ci` the CI one).
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", settings.get_profile("default"))
settings.load_profile("ci" if os.environ.get("CI") == "true" else "dev")


def start_children(commands: dict) -> dict:
    """`{key: (argv, env)}` → `{key: its Popen}`, all started at once in the repository root: children that
    compile Numba kernels from a cold cache, mostly on one core each, overlap on the cores, and with the tests
    this process runs meanwhile. Their output goes to files, not pipes, so that none blocks on output no one
    reads yet; `child_output` and `collect_json` wait for them."""
    import subprocess
    import tempfile

    procs = {}
    for key, (argv, env) in commands.items():
        files = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        procs[key] = subprocess.Popen(argv, stdout=files[0], stderr=files[1], text=True, cwd=ROOT, env=env)
        procs[key].output_files = files
    return procs


def child_output(proc, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of a child of `start_children` once it exits, within `timeout` seconds times
    TIME_FACTOR (`subprocess.TimeoutExpired` past it)."""
    proc.wait(timeout * TIME_FACTOR)
    texts = []
    for f in proc.output_files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    return texts[0], texts[1]


def collect_json(procs: dict, timeout: float) -> dict:
    """`{key: Popen}` (`start_children`) → `{key: the JSON on the last line of that child's stdout}`. `timeout`
    (seconds, times TIME_FACTOR) bounds each child's wait; a child that fails raises with its key and the tail
    of its stderr, and the others are killed."""
    try:
        out = {}
        for key, proc in procs.items():
            stdout, stderr = child_output(proc, timeout)
            assert proc.returncode == 0, (key, stderr[-3000:])
            out[key] = json.loads(stdout.strip().splitlines()[-1])
        return out
    finally:
        stop_children(procs)


def stop_children(procs: dict) -> None:
    """Kills those of `{key: Popen}` still running."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def json_children(commands: dict, timeout: float) -> dict:
    """`collect_json(start_children(commands), timeout)`: together the children take about the time of the
    slowest on a machine with a core each, instead of the sum."""
    return collect_json(start_children(commands), timeout)


def fresh_asm(*kernels) -> str:
    """The assembly of Numba `kernels` (dispatchers that have run in this process). A kernel loaded from the
    on-disk cache has none to show (Numba warns and returns a placeholder), so it is compiled again here,
    uncached, with its own options, for the signatures it ran with; its callees come from the cache as LLVM
    bitcode and are linked into the copy, so their code is in its assembly too. A kernel compiled here shows
    its own. So a child that reads some kernels' machine code takes every other kernel from the shared cache
    (`isa.select`'s folder, or NUMBA_CACHE_DIR) instead of compiling them all into a fresh one."""
    import numba

    texts = []
    for kernel in kernels:
        if not any(kernel.stats.cache_hits.values()):  # compiled here, not loaded: its own assembly is there
            texts += kernel.inspect_asm().values()
            continue
        copy = numba.jit(**kernel.targetoptions)(kernel.py_func)
        for signature in kernel.signatures:
            copy.compile(signature)
        texts += copy.inspect_asm().values()
    return "\n".join(texts)


def missing(what: str) -> None:
    """Skip on a developer machine; fail under CI, where nothing may be missing."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} is missing (CI=true: a missing model or service is a failure)")
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="session")
def model_path() -> Path:
    from hybridgate.models import ModelLoadError, default_model_path

    try:
        return default_model_path()
    except ModelLoadError as exc:
        missing(f"the default model ({exc})")


@pytest.fixture(scope="session")
def gguf_model(model_path):
    """The default model, its tensors dequantized once each (`dequantized_once`)."""
    from hybridgate.models import load_gguf

    return dequantized_once(load_gguf(model_path))


def dequantized_once(model):
    """`model` (a `GGUFModel`) whose tensor views keep what gguf's reference dequantizer returns them and hand
    each caller a copy: the dequantizer is numpy over groups of 16 rows (a third of a torch runner's start on
    the default model, 0.6 of 1.9 s on a near-idle 2-core machine, 8 of 12 s on a loaded one), and the
    session's torch runners and reference models of the one model asked it for the same values again and
    again. The values kept are the model's in float32 (about 0.5 GB for the session). A view made from one of
    these (`replace`) is another view, with values of its own."""
    import dataclasses

    from hybridgate.models.gguf_file import TensorView

    kept = {}  # id(view) -> (the view, its float32 values)

    class DequantizedOnce(TensorView):
        def dequantize(self):
            if id(self) not in kept:
                kept[id(self)] = (self, super().dequantize())
            return kept[id(self)][1].copy()

    views = {name: DequantizedOnce(**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)})
             for name, t in model.tensors.items()}
    return dataclasses.replace(model, tensors=views)


@pytest.fixture(scope="session")
def tokenizer(gguf_model):
    from hybridgate.models import Tokenizer

    return Tokenizer.from_model(gguf_model)


@pytest.fixture(scope="session")
def chat_template(tokenizer):
    from hybridgate.models import ChatTemplate

    return ChatTemplate(tokenizer)


@pytest.fixture(scope="session")
def llama(gguf_model):
    import torch

    from hybridgate.workers.gpu.model import LlamaModel

    return LlamaModel(gguf_model, device=torch.device("cpu"), dtype=torch.float32)


def golden_json(name: str):
    return json.loads((GOLDEN / name).read_text())


def golden_npz(name: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / name) as data:
        return {k: data[k] for k in data.files}


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 bits by numpy alone: round to nearest even on the top 16 bits (finite x)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16, as float32 (`bf16_bits` widened)."""
    return (bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


@pytest.fixture(scope="session")
def gpu_model_path(tmp_path_factory):
    """For the GPU-marked tests: $HYBRIDGATE_GPU_CHECK_MODEL, else the default model if installed, else a
    random-weight GGUF of its shapes (the GPU machine has no 98 MB file)."""
    path = os.environ.get("HYBRIDGATE_GPU_CHECK_MODEL")
    if path:
        return path
    from hybridgate.models import ModelLoadError, default_model_path

    try:
        return str(default_model_path())
    except ModelLoadError:
        from tiny_gguf import write_default_shaped

        return str(write_default_shaped(tmp_path_factory.mktemp("gguf") / "random.gguf"))


# Lines of protoc's output that carry the generator's own version; they differ between grpcio-tools releases.
_GENERATOR_VERSION_LINE = re.compile(
    r"(Protobuf Python Version|GRPC_GENERATED_VERSION|_runtime_version\.ValidateProtobufRuntimeVersion"
    r"|^\s+_runtime_version\.Domain\.PUBLIC,|^\s+\d+,\s*$|^\s+'',\s*$)")


def generated_code_lines(text: str) -> list[str]:
    """The lines of a protoc-generated module, less those naming the generator's version."""
    return [line for line in text.splitlines() if not _GENERATOR_VERSION_LINE.search(line)]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, taken below the kernel's ephemeral range (port 0 binds and outgoing
    connections draw from that range, so a port from it can be taken by another process's connection, or
    handed out twice, before the process it is meant for binds it)."""
    import random
    import socket

    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        port = random.SystemRandom().randrange(10000, max(low, 10001))  # not the tests' seeded generator
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # nothing free below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A real `redis-server` on a free loopback port, no persistence; `stop()`/`start()` for outage tests."""

    def __init__(self, folder: Path):
        import shutil

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            missing("redis-server (Debian: apt-get install redis-server)")
        self.folder, self.port = folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        import subprocess
        import time

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10 * TIME_FACTOR
        import redis

        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=1).ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, socket_timeout=2)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh Redis for one test (its URL: `redis_server.url`)."""
    server = RedisServer(tmp_path)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def llama_vocab_dir() -> Path:
    """llama.cpp's tokenizer test data (`ggml-vocab-*.gguf`, `.inp`, `.out`), fetched once into a cache."""
    import testdata

    try:
        return testdata.llama_vocab_dir()
    except testdata.TestDataMissing as exc:
        missing(f"llama.cpp's tokenizer test data ({exc})")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """Gemma 3 270M base, Q4_K_M: the real second model (see tests/reference/testdata.py)."""
    import testdata

    try:
        return testdata.gemma3_270m()
    except testdata.TestDataMissing as exc:
        missing(f"the Gemma 3 270M file ({exc})")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module: models this small gain nothing from a second thread, and on a shared,
    loaded machine two threads spinning at every op's barrier ran the paged engine 20x slower (0.45 s against 10 s).
    Every module that runs a torch model in process takes it (`pytestmark`), and none sets the count itself: a
    module that did left it at one for the rest of the session, so a module's speed hung on the order of the run."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, llama_vocab_dir):
    """`tiny_models(name, ggml_type="F32", window=None, seed=0) -> Path`: a tiny random-weight GGUF of
    `tiny_gguf.TINY_SPECS[name]` (or `"quant"`: `QUANT_SPEC`, rows of 256 for every quant type) with
    its real llama.cpp vocabulary, written once per session and arguments into one tmp folder."""
    import tiny_gguf

    folder = tmp_path_factory.mktemp("tiny-models")
    written: dict[tuple, Path] = {}

    def get(name: str, ggml_type: str = "F32", window: int | None = None, seed: int = 0) -> Path:
        key = (name, ggml_type, window, seed)
        if key not in written:
            spec = tiny_gguf.QUANT_SPEC if name == "quant" else tiny_gguf.TINY_SPECS[name]
            path = folder / f"{name}-{ggml_type}-w{window}-s{seed}.gguf"
            written[key] = tiny_gguf.write_tiny_model(path, spec, llama_vocab_dir / f"ggml-vocab-{spec.vocab}.gguf",
                                                      ggml_type=ggml_type, seed=seed, window=window)
        return written[key]

    return get
