"""The vLLM-named series that Kubernetes inference schedulers read, from known worker reports."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.wire import EngineStats


def samples(metrics: GatewayMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}": s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_vllm_series_sum_the_workers_and_share_the_gateways_observations():
    workers = [SimpleNamespace(kind="gpu", name="gpu-0", endpoint="e0",
                               stats=EngineStats(running=3, waiting=1, blocks_used=30, blocks_total=100)),
               SimpleNamespace(kind="cpu", name="cpu-0", endpoint="e1",
                               stats=EngineStats(running=2, waiting=4, blocks_used=10, blocks_total=60)),
               SimpleNamespace(kind="cpu", name="cpu-1", endpoint="e2",
                               stats=EngineStats(running=0, waiting=0, blocks_used=0, blocks_total=40))]
    metrics = GatewayMetrics(lambda: workers, model=("tiny", "f" * 64))
    series = metrics.of("tiny")
    for ttft in (0.03, 0.2):
        series.ttft.observe(ttft)
    series.finished("stop")
    series.finished("stop")
    got = samples(metrics)
    m = "model_name=tiny"
    assert got[f"vllm:num_requests_running{{{m}}}"] == 5
    assert got[f"vllm:num_requests_waiting{{{m}}}"] == 5
    assert got[f"vllm:kv_cache_usage_perc{{{m}}}"] == 40 / 200
    assert got[f"vllm:cache_config_info{{block_size=16,{m},num_cpu_blocks=100,num_gpu_blocks=100}}"] == 1
    assert got[f"vllm:time_to_first_token_seconds_count{{{m}}}"] == 2
    assert abs(got[f"vllm:time_to_first_token_seconds_sum{{{m}}}"] - 0.23) < 1e-12
    assert got[f"vllm:time_to_first_token_seconds_bucket{{le=0.04,{m}}}"] == 1
    assert got[f"vllm:request_success_total{{finished_reason=stop,{m}}}"] == 2


def test_no_workers_means_an_empty_cache_not_a_division_by_zero():
    got = samples(GatewayMetrics(lambda: [], model=("tiny", "f" * 64)))
    assert got["vllm:kv_cache_usage_perc{model_name=tiny}"] == 0
    assert got["vllm:num_requests_running{model_name=tiny}"] == 0


def test_token_series_and_finished_reasons_are_vllms():
    """Names and values as vLLM v1 exports them (vllm/v1/metrics/loggers.py): prompt and generation token
    counters, per-request token histograms with 1-2-5 buckets up to the max model length, preemptions
    summed over the workers, and `finished_reason` stop for both an EOS and a stop string."""
    workers = [SimpleNamespace(kind="cpu", name="cpu-0", endpoint="e0", stats=EngineStats(preemptions=3)),
               SimpleNamespace(kind="cpu", name="cpu-1", endpoint="e1", stats=EngineStats(preemptions=2))]
    metrics = GatewayMetrics(lambda: workers, model=("tiny", "f" * 64), max_model_len=100)
    series = metrics.of("tiny")
    for prompt, generated, reason in ((7, 12, "eos"), (30, 4, "stop"), (7, 50, "length"), (3, 0, "abort")):
        series.first_token(prompt)
        series.streamed(generated)
        series.finished(reason, prompt, generated)
    got = samples(metrics)
    m = "model_name=tiny"
    assert got[f"vllm:prompt_tokens_total{{{m}}}"] == 47
    assert got[f"vllm:generation_tokens_total{{{m}}}"] == 66
    assert got[f"vllm:num_preemptions_total{{{m}}}"] == 5
    assert {k: v for k, v in got.items() if k.startswith("vllm:request_success_total")} == {
        f"vllm:request_success_total{{finished_reason=stop,{m}}}": 2,
        f"vllm:request_success_total{{finished_reason=length,{m}}}": 1,
        f"vllm:request_success_total{{finished_reason=abort,{m}}}": 1}
    assert got[f"hybridgate:request_success_total{{finished_reason=eos,{m}}}"] == 1  # ours tells them apart
    prompt = {k.split("le=")[1].split(",")[0]: v for k, v in got.items()
              if k.startswith("vllm:request_prompt_tokens_bucket")}
    assert prompt == {"1.0": 0, "2.0": 0, "5.0": 1, "10.0": 3, "20.0": 3, "50.0": 4, "100.0": 4, "+Inf": 4}
    generation = {k.split("le=")[1].split(",")[0]: v for k, v in got.items()
                  if k.startswith("vllm:request_generation_tokens_bucket")}
    assert generation["1.0"] == 1 and generation["5.0"] == 2 and generation["20.0"] == 3 and generation["50.0"] == 4
    assert got[f"vllm:request_generation_tokens_sum{{{m}}}"] == 66
    assert got[f"vllm:request_prompt_tokens_count{{{m}}}"] == 4
