"""Prometheus metrics of the gateway and, through the router's clients, of the engines."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GatewayMetrics:
    """Per-request histograms and counters, plus engine counters read from worker clients."""

    def __init__(self, clients: Callable[[], Iterable] | None = None, wire_errors: Callable[[], int] | None = None):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("hybridgate:time_to_first_token_seconds", "Time to first token (TTFT), seconds.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("hybridgate:inter_token_latency_seconds", "Inter-token latency (ITL), seconds.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("hybridgate:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("hybridgate:request_success", "Finished requests by finish reason.",
                               ["finished_reason"], registry=self.registry)
        if clients is not None:
            self.registry.register(_EngineCollector(clients))
        if wire_errors is not None:
            self.registry.register(_RouterWireCollector(wire_errors))


class _RouterWireCollector:
    """Frames from workers the router dropped (undecodable, unexpected, unknown request ids)."""

    def __init__(self, wire_errors: Callable[[], int]):
        self._wire_errors = wire_errors

    def collect(self):
        errors = CounterMetricFamily("hybridgate:wire_decode_errors", "Frames dropped by the receiving side's "
                                     "guarded dispatch (malformed, unknown or inconsistent).", labels=["side"])
        errors.add_metric(["router"], self._wire_errors())
        yield errors


class _EngineCollector:
    """Engine counters as each worker last reported them (heartbeat or outputs)."""

    def __init__(self, clients: Callable[[], Iterable]):
        self._clients = clients

    def collect(self):
        steps = CounterMetricFamily("hybridgate:engine_steps", "Engine steps run.", labels=["worker"])
        after = CounterMetricFamily("hybridgate:engine_tokens_after_abort",
                                    "Tokens sampled after their request's abort arrived.", labels=["worker"])
        kv = GaugeMetricFamily("hybridgate:kv_cache_bytes", "KV-cache bytes held by live sequences.", labels=["worker"])
        running = GaugeMetricFamily("hybridgate:num_requests_running", "Sequences running.", labels=["worker"])
        by_size = CounterMetricFamily("hybridgate:engine_steps_by_batch_size", "Engine steps by sequences per step.",
                                      labels=["worker", "batch_size"])
        batch = HistogramMetricFamily("hybridgate:engine_batch_size", "Sequences per engine step.", labels=["worker"])
        hits = CounterMetricFamily("hybridgate:kernel_cache_hits", "CPU kernels loaded from the on-disk cache at start.",
                                   labels=["worker"])
        misses = CounterMetricFamily("hybridgate:kernel_cache_misses",
                                     "CPU kernels compiled because the on-disk cache lacked them.", labels=["worker"])
        # side="worker": messages each worker refused (its LOAD stats); the router's own refusals
        # of worker messages join this family with side="router" (one family, two sides).
        wire_errors = CounterMetricFamily("hybridgate:wire_decode_errors",
                                          "Messages refused as malformed or inconsistent, by the side that refused them.",
                                          labels=["worker", "side"])
        for client in self._clients():
            # The worker's stable name (HELLO, or kind-index under serve); the endpoint may be a temporary path.
            s, name = client.stats, getattr(client, "name", None) or client.endpoint
            steps.add_metric([name], s.steps)
            after.add_metric([name], s.tokens_after_abort)
            kv.add_metric([name], s.kv_cache_bytes)
            running.add_metric([name], s.running)
            hits.add_metric([name], s.kernel_cache_hits)
            misses.add_metric([name], s.kernel_cache_misses)
            wire_errors.add_metric([name, "worker"], s.wire_decode_errors)
            for n, c in sorted(s.batch_size_counts.items()):
                by_size.add_metric([name, str(n)], c)
            buckets = [(str(b), sum(c for n, c in s.batch_size_counts.items() if n <= b)) for b in _BATCH_BUCKETS]
            buckets.append(("+Inf", sum(s.batch_size_counts.values())))
            batch.add_metric([name], buckets, sum(n * c for n, c in s.batch_size_counts.items()))
        yield from (steps, after, kv, running, by_size, batch, hits, misses, wire_errors)
