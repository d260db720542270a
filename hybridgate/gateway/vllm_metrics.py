"""The gateway's metrics under vLLM's names, for what the Kubernetes inference ecosystem scrapes.

The Gateway API Inference Extension's endpoint picker, llm-d's scheduler and the common KEDA/HPA recipes
read a model server's `vllm:*` series. A gateway is one such endpoint for each model it serves: these
series sum that model's workers (as a vLLM server sums its engine's sequences) and re-export its own
request histograms, at scrape time, from the same observations as the `hybridgate:*` ones (nothing more
is done per token), whose `model_name` label they keep.
Names and meanings are vLLM v1's (vllm/v1/metrics/loggers.py, docs/design/metrics.md), labelled by
`model_name` as vLLM labels them (the served model name):

- `vllm:num_requests_running`, `vllm:num_requests_waiting`: sequences running / queued, summed over
  the workers as they last reported.
- `vllm:kv_cache_usage_perc`: KV blocks in use over the workers' KV blocks, 0 to 1 (1 = full).
- `vllm:cache_config_info`: 1, with the KV cache's `block_size`, `num_gpu_blocks` (GPU workers'
  blocks) and `num_cpu_blocks` (CPU workers') as labels.
- `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds`: the gateway's histograms, same buckets.
- `vllm:request_success_total`: finished requests by `finished_reason`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from hybridgate.mempool.blocks import DEFAULT_BLOCK_SIZE

# hybridgate name → vLLM name, for the series re-exported sample by sample.
RENAMED = {
    "hybridgate:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "hybridgate:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "hybridgate:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "hybridgate:request_success": "vllm:request_success",
}


class VllmCollector:
    """A prometheus_client collector of the `vllm:*` series of the served models.

    models: (served name, its router's worker clients) per model (each client with `.stats`, a
    `wire.EngineStats`, and `.kind`); sources: the gateway's Histogram and Counter objects whose names
    are keys of `RENAMED`, labelled `model_name`."""

    def __init__(self, models: Iterable[tuple[str, Callable[[], Iterable]]], sources: Iterable[Histogram | Counter],
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self._models, self._sources, self.block_size = list(models), list(sources), block_size

    def collect(self):
        families = [self._engine_families(name, clients) for name, clients in self._models]
        for group in zip(*families):  # one family per name, a sample per model
            out = group[0]
            for other in group[1:]:
                out.samples.extend(other.samples)
            yield out
        for source in self._sources:
            for family in source.collect():
                yield self._renamed(family)

    def _engine_families(self, model_name: str, clients: Callable[[], Iterable]):
        labels = ["model_name"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
        stats = [(getattr(c, "kind", ""), c.stats) for c in clients()]
        used, total = sum(s.blocks_used for _, s in stats), sum(s.blocks_total for _, s in stats)
        running.add_metric([model_name], sum(s.running for _, s in stats))
        waiting.add_metric([model_name], sum(s.waiting for _, s in stats))
        usage.add_metric([model_name], used / total if total else 0.0)
        config = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig.",
                                   labels=["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks"])
        gpu = sum(s.blocks_total for kind, s in stats if kind == "gpu")
        config.add_metric([model_name, str(self.block_size), str(gpu), str(total - gpu)], 1.0)
        return running, waiting, usage, config

    def _renamed(self, family: Metric) -> Metric:
        name = RENAMED[family.name]
        out = Metric(name, family.documentation, family.type)
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            out.add_sample(name + suffix, sample.labels, sample.value,
                           sample.timestamp, sample.exemplar)
        return out
