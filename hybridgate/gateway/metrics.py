"""Prometheus metrics of the gateway and, through the router's clients, of the engines."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from hybridgate.router.handoff import SECONDS_BUCKETS

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class GatewayMetrics:
    """Per-request histograms and counters, plus engine counters read from worker clients."""

    def __init__(self, clients: Callable[[], Iterable] | None = None,
                 handoff: Callable[[], object] | None = None):
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
            self.registry.register(_HandoffWorkerCollector(clients))
        if handoff is not None:
            self.registry.register(_HandoffRouterCollector(handoff))


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
        for client in self._clients():
            s, name = client.stats, client.endpoint
            steps.add_metric([name], s.steps)
            after.add_metric([name], s.tokens_after_abort)
            kv.add_metric([name], s.kv_cache_bytes)
            running.add_metric([name], s.running)
            hits.add_metric([name], s.kernel_cache_hits)
            misses.add_metric([name], s.kernel_cache_misses)
            for n, c in sorted(s.batch_size_counts.items()):
                by_size.add_metric([name, str(n)], c)
            buckets = [(str(b), sum(c for n, c in s.batch_size_counts.items() if n <= b)) for b in _BATCH_BUCKETS]
            buckets.append(("+Inf", sum(s.batch_size_counts.values())))
            batch.add_metric([name], buckets, sum(n * c for n, c in s.batch_size_counts.items()))
        yield from (steps, after, kv, running, by_size, batch, hits, misses)


_DIRECTION = "gpu_to_cpu"


class _HandoffRouterCollector:
    """The router's view of its hand-offs (`hybridgate.router.handoff.HandoffMetrics`)."""

    def __init__(self, metrics: Callable[[], object]):
        self._metrics = metrics

    def collect(self):
        m = self._metrics()
        total = CounterMetricFamily("hybridgate:kv_handoff", "KV hand-offs by outcome (router: done = import "
                                    "confirmed; refused = ran on the GPU; resumed = resumed on the GPU after "
                                    "export; aborted = cancelled or lost before import).",
                                    labels=["direction", "outcome"])
        for outcome, n in m.outcomes.items():
            total.add_metric([_DIRECTION, outcome], n)
        seconds = HistogramMetricFamily("hybridgate:kv_handoff_seconds",
                                        "KV hand-off time, export start (HandoffExported) to import confirmed "
                                        "(HandoffImported), as the router sees its messages, seconds.",
                                        labels=["direction"])
        buckets = [(str(b), c) for b, c in zip(SECONDS_BUCKETS, m.bucket_counts)]
        buckets.append(("+Inf", m.seconds_count))
        seconds.add_metric([_DIRECTION], buckets, m.seconds_sum)
        yield from (total, seconds)


class _HandoffWorkerCollector:
    """Hand-off counters and gauges as each worker last reported them in its EngineStats."""

    def __init__(self, clients: Callable[[], Iterable]):
        self._clients = clients

    def collect(self):
        labels = ["worker", "direction"]
        fam = {
            "bytes": CounterMetricFamily("hybridgate:kv_handoff_bytes", "K and V bytes exported (GPU worker) or "
                                         "imported (CPU worker).", labels=labels),
            "copy": CounterMetricFamily("hybridgate:kv_handoff_copy_seconds", "Gather copies of the KV cache "
                                        "into pinned buffers, seconds.", labels=labels),
            "hidden": CounterMetricFamily("hybridgate:kv_handoff_copy_hidden_seconds", "The part of the gather "
                                          "copies that ran while a compute step was in flight, seconds.",
                                          labels=labels),
            "export": CounterMetricFamily("hybridgate:kv_handoff_export_seconds", "GPU worker: export start to "
                                          "the send queued, seconds.", labels=labels),
            "import": CounterMetricFamily("hybridgate:kv_handoff_import_seconds", "CPU worker: header received "
                                          "to the sequence scheduled, seconds.", labels=labels),
            "outcomes": CounterMetricFamily("hybridgate:kv_handoff_worker", "KV hand-offs by outcome, as each "
                                            "worker counts them.", labels=[*labels, "outcome"]),
            "waits": CounterMetricFamily("hybridgate:kv_handoff_pool_waits", "Exports that waited for a free "
                                         "pinned buffer.", labels=labels),
            "in_use": GaugeMetricFamily("hybridgate:kv_handoff_pool_bytes_in_use", "Pinned hand-off buffer "
                                        "bytes held now.", labels=labels),
            "peak": GaugeMetricFamily("hybridgate:kv_handoff_pool_peak_bytes", "Most pinned hand-off buffer "
                                      "bytes held at once.", labels=labels),
            "parked": GaugeMetricFamily("hybridgate:kv_handoff_parked", "GPU worker: sequences exported and "
                                        "parked now.", labels=labels),
            "reservations": GaugeMetricFamily("hybridgate:kv_handoff_reservations", "CPU worker: live hand-off "
                                              "reservations now.", labels=labels),
            "recomputed": CounterMetricFamily("hybridgate:kv_handoff_recomputed", "CPU worker: imported "
                                              "sequences preempted and recomputed.", labels=labels),
        }
        for client in self._clients():
            s, key = client.stats, [client.endpoint, _DIRECTION]
            for name, value in (("bytes", s.handoff_bytes_total), ("copy", s.handoff_copy_seconds_total),
                                ("hidden", s.handoff_copy_hidden_seconds_total),
                                ("export", s.handoff_export_seconds_total),
                                ("import", s.handoff_import_seconds_total), ("waits", s.handoff_pool_waits),
                                ("in_use", s.handoff_pool_bytes_in_use), ("peak", s.handoff_pool_peak_bytes),
                                ("parked", s.handoff_parked), ("reservations", s.handoff_reservations),
                                ("recomputed", s.handoff_recomputed)):
                fam[name].add_metric(key, value)
            for outcome, n in sorted(s.handoff_outcomes.items()):
                fam["outcomes"].add_metric([*key, outcome], n)
        yield from fam.values()
