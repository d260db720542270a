"""The worker's settings: `WorkerConfig` with its `scheduler` and `engine` sections.

Data only: the settings root composes these classes, and a gateway process,
which reads the whole root, loads this module and the package's `__init__`
(which imports nothing) and no worker behaviour (tests/unit/test_imports.py).
The worker modules import their settings from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridgate.config import check_settings, setting

KV_CACHE_DTYPES = ("fp32", "fp16", "bf16")  # the rows of workers.cpu.kvdtype.KV_DTYPES
DEFAULT_KV_DTYPE = "fp16"  # see --kv-cache-dtype's help for why


def parse_memory(value: str | float | int | None, gpu: bool) -> float:
    """Bytes ("2GiB", "512MiB", "1e9") or a fraction in (0, 1] of free device memory after
    weights (GPU) or of available memory (CPU). Default: 0.9 on a GPU; 1 GiB on a CPU
    (about 23,000 tokens of the default model), which `num_blocks_for` caps at 0.2 of available.

    Raises:
        ValueError: naming `--kv-cache-memory` and what it accepts.
    """
    if value is None:
        return 0.9 if gpu else float(1 << 30)
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        text = value.strip()
        units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9}
        scale = next((u for u in units if text.endswith(u)), None)
        try:
            number = float(text[: -len(scale)] if scale else text) * (units[scale] if scale else 1)
        except ValueError:
            raise ValueError(f"--kv-cache-memory: expected bytes (e.g. 2GiB) or a fraction in (0, 1], got {value!r}") from None
    if number <= 0 or (1 < number < 1 << 20):
        raise ValueError(f"--kv-cache-memory: expected bytes (at least 1 MiB) or a fraction in (0, 1], got {value!r}")
    return number


def _check_factor(value: float) -> None:
    if value != 0 and not value >= 1:
        raise ValueError(f"must be 0 (off) or >= 1 (a step is at least its decodes), got {value}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = setting(64, "most sequences a worker runs at once", low=1)
    max_num_batched_tokens: int = setting(
        2048, "token budget of one engine step; longer prompts are prefilled in chunks", low=1)
    max_num_waiting: int = setting(
        1024, "most requests a worker queues beyond those it runs; one more is refused (RESOURCE_EXHAUSTED "
              "once every worker refuses it)", low=1)
    mixed_step_budget: float = setting(
        4.0, "a step that carries decodes runs only as many prompt tokens as the worker's measured rates say "
             "fit in this many times its decode step, so a long prompt does not stall the running streams "
             "(0: off, prompt chunks of the whole token budget)", check=_check_factor)
    min_prefill_chunk: int = setting(
        8, "fewest prompt tokens a step that carries decodes runs (when a prompt waits), so long prompts "
           "progress whatever --mixed-step-budget allows; small, since at a long context a prompt token costs "
           "several times a short one's (its attention)", low=1)

    def __post_init__(self) -> None:
        check_settings(self)


def _check_memory(value: str) -> None:
    parse_memory(value, gpu=False)


def _check_bytes(value: str) -> None:
    try:
        size = parse_memory(value, gpu=False)
    except ValueError:
        size = 0
    if size <= 1:  # a fraction parses to <= 1: this setting takes bytes only
        raise ValueError(f"must be a size in bytes such as 256MiB, got {value!r}")


def _check_cpu_isa(value: str) -> None:
    """Refuse, before any worker starts, a path this CPU cannot run (a worker would only die of it)."""
    from hybridgate.workers.cpu import isa  # stdlib and llvmlite only: no Numba

    try:
        runnable = isa.best(isa.host_features())
    except ImportError:  # no llvmlite (no cpu extra): no CPU worker to start here either
        return
    if value in isa.ISAS and isa.ISAS.index(value) < isa.ISAS.index(runnable):
        raise ValueError(f"this CPU cannot run {value} (it runs at most {runnable})")


def _check_endpoint(value: str) -> None:
    if not value.startswith(("ipc://", "tcp://", "inproc://")):
        raise ValueError(f"must start with ipc://, tcp:// or inproc://, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """How a worker's runner uses its device: the settings `build_runner` passes on."""

    threads: int | None = setting(
        None, "CPU threads per worker (default: as many as its cores: --cpu-cores, else all the process may run on; "
              "under serve, the workers computing on the CPU split them)", low=1)
    cpu_cores: str = setting(
        "", "the cores a worker's threads run on, a Linux cpulist such as 0-3,8 (the worker pins itself before its "
            "compute threads start; its threads default to their count; default: unpinned). Under serve, the "
            "cores that the workers computing on the CPU (CPU workers; GPU workers too without CUDA) split into "
            "contiguous, disjoint slices, one per worker in start order; default there: the cores serve may run "
            "on (or --numa-node's), split when there are at least as many as those workers (else unpinned, "
            "with a warning), a lone such worker unpinned")
    numa_node: int | None = setting(
        None, "NUMA node whose cores a worker's threads run on (/sys/devices/system/node/nodeN/cpulist; with "
              "--cpu-cores, those cores, which must lie on the node) and whose memory it prefers (set_mempolicy "
              "MPOL_PREFERRED; a warning where that cannot be set); under serve, every worker's node", low=0)
    device: str | None = setting(None, "torch device of the GPU worker (default: cuda if present, else cpu)")
    kv_cache_memory: str | None = setting(
        None, "KV cache size: bytes (e.g. 2GiB) or a fraction of free device memory after weights (GPU) "
              "or of available memory (CPU); default: on CUDA what --gpu-memory-utilization leaves, on a CPU "
              "1GiB", check=_check_memory)
    gpu_memory_utilization: float = setting(
        0.9, "GPU worker on CUDA: the fraction of the device's total memory the worker may use, as vLLM's "
             "--gpu-memory-utilization; the KV cache gets it less the weights, the runtime (and other processes "
             "on the device), the peak activations of a profiled step of --max-num-batched-tokens tokens and "
             "the decode graphs, as the start-up line says (--kv-cache-memory, when set, wins)",
        low=0, low_open=True, high=1)
    prefix_caching: bool = setting(True, "reuse the KV blocks of cached prompt prefixes")
    enforce_eager: bool = setting(False, "on CUDA, run decode steps eagerly instead of replaying captured CUDA graphs")
    gpu_attention: str = setting(
        "auto", "GPU worker's kernels: triton (our paged Triton attention, reading the KV cache in place through "
                "the block table, with the layer's residual add + RMSNorm, RoPE and activation fused in Triton; "
                "on CUDA decode steps replay CUDA graphs, one per batch size, unless --enforce-eager), reference "
                "(torch ops throughout: gather the context, then SDPA; decode steps run eagerly), auto (triton on "
                "CUDA, reference on a CPU device)",
        choices=("auto", "triton", "reference"))
    measure_rates: bool = setting(
        True, "before READY, time prefill steps of 32 and 256 tokens and decode steps of 1 and 8 "
              "sequences, so the router's cost model places the first requests on this worker's own figures "
              "(1-3 s on 2 cores); off: the first placements use no figures until real steps have run")
    cpu_isa: str | None = setting(
        None, "CPU worker: the instruction set its kernels are compiled for (default: the best this CPU runs)",
        choices=("avx512", "avx2", "generic"), check=_check_cpu_isa)
    cpu_amx: str = setting(
        "auto", "CPU worker on the avx512 path: auto multiplies the prompt tokens of prompts of 32 tokens or more "
                "on AMX-BF16 tiles where the CPU has them (Xeons since Sapphire Rapids; weights rounded to bf16, "
                "activations split into two bf16 halves; every weight type but F32, F16, Q4_0 and Q4_1), off keeps "
                "every token on the int16 kernels", choices=("auto", "off"))
    cpu_activations: str = setting(
        "auto", "CPU worker: the activation format of the quantized matmuls: f32 (float32 activations times "
                "dequantized weights, for every weight type), i16 (activations quantized to int16 per 32- or 256-block "
                "wherever a type has an int16 kernel, integer multiply-adds, about 2e-5 relative error), i8 (as i16, "
                "but the prompt tokens of prompts of 32 tokens or more multiply with int8 activations per 32-block "
                "where the type has an int8 prompt kernel: Q4_K, Q5_K and Q6_K on avx2 and avx512; Q8_0, Q4_0, Q4_1, "
                "MXFP4 and on avx2 Q5_0 under i8 only), auto (the kernel table's choice per "
                "weight type on this ISA path, int8 or AMX prompt kernels included, and on avx512 an int16 GEMM for Q8_0 "
                "prompts of 64 tokens or more; `hybridgate info --model FILE` "
                "prints it); f32 and i16 keep prompts on the decode kernels",
        choices=("auto", "f32", "i16", "i8"))
    cpu_thread_wait: str = setting(
        "passive", "CPU worker: how its kernel threads wait between parallel regions: passive sleeps at once (a "
                   "core another process keeps busy slows a step by little), active spins a while first (the "
                   "OpenMP runtimes' default; a busy core can slow a step many times over)",
        choices=("passive", "active"))
    cpu_thread_fallback: bool = setting(
        True, "CPU worker: time its decode steps and, every 2 s, a few on half (or twice) the threads, and move to "
              "the count that measures faster (cores shared with other processes slow the full count)")
    kv_cache_dtype: str = setting(
        DEFAULT_KV_DTYPE, "CPU worker: the KV cache's element format; fp16 and bf16 round K and V to nearest even as they "
                "are stored and widen them to float32 as attention reads them, for half the bytes per token (twice "
                "the blocks in --kv-cache-memory) and less to read per step; fp32 stores them exactly. fp16 is the "
                "default: it held top-1 100% and mean KL 6e-7 against the fp32 reference (bf16: 99.8%, 4e-5) and "
                "decoded 1.4x faster than fp32 at 1,024 tokens of context. GPU workers ignore it: their cache has "
                "the compute dtype (bf16 on CUDA, fp32 on a CPU torch device)",
        choices=KV_CACHE_DTYPES)
    grammar_cache_size: int = setting(
        256, "structured output: compiled grammars a worker keeps (least recently used dropped first), keyed by "
             "a hash of the grammar text", low=1)
    grammar_compile_threads: int = setting(
        1, "structured output: threads that compile grammars beside the engine loop (a sequence waits for its "
           "grammar without holding up the batch)", low=1)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.cpu_cores or self.numa_node is not None:
            from hybridgate.cpuset import worker_cores  # stdlib only; loaded where the settings are used

            worker_cores(self.cpu_cores, self.numa_node)  # raises naming the setting: bad list, cores or node


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process needs; plain values, so it crosses `spawn`."""

    model_path: str = setting("", "GGUF file (set from --model)", cli=False)
    endpoint: str | None = setting(None, "where to bind: ipc://PATH or tcp://127.0.0.1:PORT", check=_check_endpoint)
    kind: str = setting("cpu", "cpu: the Numba runner on the GGUF blocks; gpu: the PyTorch runner "
                               "(on a CPU torch device without CUDA)", choices=("cpu", "gpu"))
    heartbeat_s: float = setting(0.1, "seconds between LOAD heartbeats", low=0, low_open=True, cli=False)
    parent_pid: int | None = setting(None, "exit when this process dies (set by serve)", cli=False)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    name: str = setting("", "this worker's stable name in the gateway's metrics (default: its endpoint; "
                            "serve names its workers kind-index, e.g. gpu-0)", flag="--worker-name")

    advertise: str = setting(
        "", "with --redis-url: the endpoint routers on other hosts connect to, tcp://HOST:PORT (default: this "
            "host's name and the bound port for a tcp:// endpoint, the endpoint itself for ipc://)",
        flag="--advertise", check=lambda v: v and _check_endpoint(v))
    handoff_endpoint: str = setting(
        "", "CPU workers: where to bind the socket for incoming KV hand-offs (ipc://PATH or tcp://HOST:PORT); "
        "default: ENDPOINT.handoff for an ipc:// endpoint, none for tcp://; bound on every interface "
        "(tcp://0.0.0.0:PORT) it is advertised under the host of the worker's --advertise (or this host's name)",
        flag="--handoff-endpoint")
    max_model_len: int | None = setting(
        None, "GPU workers: most tokens per sequence (default: serve's --max-model-len, else the model's context, "
              "lowered to what the KV cache holds, which the start-up line says)", flag="--worker-max-model-len",
        low=2)
    handoff_buffer_memory: str = setting(
        "256MiB", "GPU workers: the pinned host slab KV hand-offs stream through (bytes, e.g. 256MiB); "
        "hand-offs larger than it stream layer by layer", flag="--handoff-buffer-memory", check=_check_bytes)
    cache_imported_kv: bool = setting(
        False, "CPU workers: register KV imported by hand-offs in the prefix cache (off: a worker's outputs "
        "never depend on which hand-offs came before)", flag="--cache-imported-kv")
    handoff_reservation_timeout_s: float = setting(
        30.0, "CPU workers: seconds a KV hand-off reservation waits for its KV",
        low=0, low_open=True)
    model_name: str = setting("", "the served model's name, in HELLO and the registry (set from --model NAME=PATH; "
                                  "default the GGUF file's stem, hybridgate.models.served_name)", cli=False)

    def __post_init__(self) -> None:
        check_settings(self)
        if self.handoff_endpoint and not self.handoff_endpoint.startswith(("ipc://", "tcp://", "inproc://")):
            raise ValueError(f"handoff_endpoint: must start with ipc://, tcp:// or inproc://, got "
                             f"{self.handoff_endpoint!r}")
        self.handoff_buffer_bytes  # raises on a bad size

    # The flat names of before the split into sections, for readers.
    max_num_seqs = property(lambda self: self.scheduler.max_num_seqs)
    max_num_batched_tokens = property(lambda self: self.scheduler.max_num_batched_tokens)
    threads = property(lambda self: self.engine.threads)
    device = property(lambda self: self.engine.device)
    kv_cache_memory = property(lambda self: self.engine.kv_cache_memory)
    prefix_caching = property(lambda self: self.engine.prefix_caching)
    enforce_eager = property(lambda self: self.engine.enforce_eager)
    measure_rates = property(lambda self: self.engine.measure_rates)

    @property
    def handoff_buffer_bytes(self) -> int:
        value = parse_memory(self.handoff_buffer_memory, gpu=False)
        if value <= 1:
            raise ValueError(f"handoff_buffer_memory: expected bytes (e.g. 256MiB), got {self.handoff_buffer_memory!r}")
        return int(value)

    @property
    def resolved_handoff_endpoint(self) -> str:
        """CPU workers: the hand-off socket's endpoint ("" = none): the setting, else derived from `endpoint`."""
        if self.kind != "cpu":
            return ""
        if self.handoff_endpoint:
            return self.handoff_endpoint
        return "" if not self.endpoint or self.endpoint.startswith("tcp://") else self.endpoint + ".handoff"


