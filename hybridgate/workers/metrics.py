"""A worker's own Prometheus endpoint (`hybridgate worker --metrics-port`): its engine under vLLM's names.

An inference scheduler that scrapes model servers one by one (the Gateway API Inference Extension's
endpoint picker, llm-d) or an autoscaler's recipe reads `vllm:num_requests_running`,
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and `vllm:cache_config_info`, labelled
`model_name`; a worker serves them for itself, with the gateway's shapes
(`hybridgate.vllm_metrics`), from the stats its engine refreshes every pass (the figures its
LOAD heartbeats carry). The request histograms (TTFT, ITL) are the gateway's, which sees the streams.
The port binds the host of the worker's tcp:// endpoint (0.0.0.0 in a container), loopback for ipc://.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server

from hybridgate.vllm_metrics import VllmCollector
from hybridgate.wire import EngineStats


def metrics_host(endpoint: str) -> str:
    """The address the metrics port binds: the tcp:// endpoint's host ("*" as 0.0.0.0), else 127.0.0.1."""
    if not endpoint.startswith("tcp://"):
        return "127.0.0.1"
    host = endpoint.removeprefix("tcp://").rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host == "*" else host


class _Engine:
    """The one "client" of the collector: this worker, its kind and its live stats."""

    def __init__(self, kind: str, stats: Callable[[], EngineStats]):
        self.kind, self._stats = kind, stats

    @property
    def stats(self) -> EngineStats:
        return self._stats()


def serve_metrics(port: int, endpoint: str, model_name: str, kind: str, stats: Callable[[], EngineStats]):
    """Start the HTTP metrics server on a daemon thread; returns the server (its `server_port` is the bound
    port: 0 picks one). Raises OSError naming --metrics-port when the port cannot be bound."""
    registry = CollectorRegistry()
    registry.register(VllmCollector([(model_name, lambda: [_Engine(kind, stats)])], ()))
    host = metrics_host(endpoint)
    try:
        httpd, _ = start_http_server(port, host, registry=registry)
    except OSError as exc:
        raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (--metrics-port)") from None
    return httpd
