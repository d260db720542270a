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
- `vllm:num_preemptions_total`: sequences preempted, summed over the workers' reports.
- `vllm:prompt_tokens_total`: prompt tokens of the requests that got their first token;
  `vllm:generation_tokens_total`: generated tokens streamed (both doors, as they stream).
- `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`: histograms of each finished request's
  prompt and generated tokens, buckets 1, 2, 5, 10, ... up to the max model length (vLLM's).
- `vllm:request_success_total`: finished requests by `finished_reason`, in vLLM's values: `stop` (an
  end-of-sequence token or a stop string: hybridgate's `eos` and `stop`), `length`, `abort`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from hybridgate.mempool.blocks import DEFAULT_BLOCK_SIZE

# hybridgate name → vLLM name, for the series re-exported sample by sample.
RENAMED = {
    "hybridgate:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "hybridgate:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "hybridgate:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "hybridgate:request_success": "vllm:request_success",
    "hybridgate:prompt_tokens": "vllm:prompt_tokens",
    "hybridgate:generation_tokens": "vllm:generation_tokens",
    "hybridgate:request_prompt_tokens": "vllm:request_prompt_tokens",
    "hybridgate:request_generation_tokens": "vllm:request_generation_tokens",
}
# hybridgate finish reason → vLLM's `finished_reason` (vllm/v1/engine FinishReason: stop, length, abort).
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


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
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                          labels=labels)
        preemptions.add_metric([model_name], sum(s.preemptions for _, s in stats))
        return running, waiting, usage, config, preemptions

    def _renamed(self, family: Metric) -> Metric:
        name = RENAMED[family.name]
        out = Metric(name, family.documentation, family.type)
        if "finished_reason" not in {k for sample in family.samples for k in sample.labels}:
            for sample in family.samples:
                out.add_sample(name + sample.name[len(family.name):], sample.labels, sample.value,
                               sample.timestamp, sample.exemplar)
            return out
        # Reasons that vLLM counts as one (eos and stop): their counts summed, the earliest `_created`.
        merged: dict[tuple, float] = {}
        for sample in family.samples:
            labels = {**sample.labels, "finished_reason": FINISHED_REASON.get(sample.labels["finished_reason"],
                                                                      sample.labels["finished_reason"])}
            key = (name + sample.name[len(family.name):], tuple(sorted(labels.items())))
            combine = min if sample.name.endswith("_created") else (lambda a, b: a + b)
            merged[key] = combine(merged[key], sample.value) if key in merged else sample.value
        for (sample_name, labels), value in merged.items():
            out.add_sample(sample_name, dict(labels), value)
        return out
