"""Placement by the cost policy with real processes: a torch worker and a Numba worker under `serve`.

The reference for "the worker that prefills fastest" is each worker's own
start-up measurement, as it logs it; the observed TTFT comes from the client.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import HYBRIDGATE, Serve, metrics, stub

WORDS = ("apple", "river", "stone", "cloud", "field", "green", "music", "table")


def prompt(word_index: int, n: int) -> str:
    """About n tokens of text (" word" is one token each), a different word per request so that no
    request finds another's prefix in a cache."""
    return "Count:" + f" {WORDS[word_index]}" * n


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("placement")
    serve = Serve(tmp / "serve.log", "--gpu-workers", "1", "--cpu-workers", "1", "--log-requests")
    try:
        yield serve
    finally:
        serve.stop()


def measured_prefill(serve: Serve) -> dict[str, float]:
    """kind → the prefill tokens/s each worker logged at its largest measured step size."""
    out = {}
    for kind, table in re.findall(r"(gpu|cpu) worker measured its rates in [\d.]+ s: prefill tokens/s by step "
                                  r"tokens (\{[^}]*\})", serve.text()):
        rates = ast.literal_eval(table)
        out[kind] = rates[max(rates)]
    assert set(out) == {"gpu", "cpu"}, serve.text()
    return out


def generate_with_metadata(target: str, text: str, max_tokens: int, **kw):
    """(responses, trailing metadata) of one greedy request."""
    call = stub(target).Generate(pb.GenerateRequest(prompt=text, max_tokens=max_tokens, temperature=0),
                                 timeout=120 * TIME_FACTOR, **kw)
    return list(call), dict(call.trailing_metadata())


def worker_gauge(url: str, name: str) -> dict[str, float]:
    """{worker name: value} of one per-worker gauge."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_a_long_prompt_goes_to_the_faster_prefiller_and_the_cli_prints_the_placement(served):
    rates = measured_prefill(served)
    faster = max(rates, key=rates.get)
    out = subprocess.run([HYBRIDGATE, "generate", "--target", served.target, "--json", "--max-tokens", "1",
                          "--temperature", "0", prompt(0, 600)], capture_output=True, text=True,
                         timeout=120 * TIME_FACTOR)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    meta = lines[-1]["trailing_metadata"]
    assert meta["hybridgate-plan"] == faster and meta["hybridgate-policy"] == "cost"
    assert lines[-2]["route"].startswith(f"{faster} ({faster}-0)")
    # An idle worker's predicted TTFT is within 50% of the one the router observed.
    predicted, observed = float(meta["hybridgate-predicted-ttft-ms"]), float(meta["hybridgate-observed-ttft-ms"])
    assert 0.5 * observed <= predicted <= 1.5 * observed, (predicted, observed, rates)


def test_a_short_request_avoids_the_worker_busy_with_a_long_prefill(served):
    long_result = {}
    long_call = threading.Thread(target=lambda: long_result.update(
        zip(("responses", "meta"), generate_with_metadata(served.target, prompt(1, 1500), 1))))
    long_call.start()
    # Wait until the long prompt is queued on a worker, as that worker reports it.
    deadline, busy = time.monotonic() + 30 * TIME_FACTOR, []
    while not busy:
        assert time.monotonic() < deadline, "the long prompt never showed in a worker's queue"
        queued = worker_gauge(served.metrics_url, "hybridgate:queued_prefill_tokens")
        busy = [name for name, tokens in queued.items() if tokens >= 1000]
        time.sleep(0.02)
    busy_kind = busy[0].split("-")[0]
    # Its cache is promised the whole prompt and the one token asked for, beside whatever it holds now.
    committed = worker_gauge(served.metrics_url, "hybridgate:kv_cache_blocks_committed")[busy[0]]
    assert committed >= -(-(queued[busy[0]] + 1) // 16), (committed, queued)
    other = "cpu" if busy_kind == "gpu" else "gpu"
    responses, meta = generate_with_metadata(served.target, prompt(2, 20), 4)
    long_call.join(120 * TIME_FACTOR)
    assert long_result["meta"]["hybridgate-plan"] == busy_kind
    # Behind 1,500 queued tokens the short request's predicted TTFT was seconds; on the idle worker, one step.
    assert meta["hybridgate-plan"] == other, (meta, long_result["meta"])
    assert responses[-1].route.startswith(f"{other} ({other}-0)")
    assert float(meta["hybridgate-predicted-ttft-ms"]) < float(long_result["meta"]["hybridgate-predicted-ttft-ms"])
    samples = metrics(served.metrics_url)
    assert samples[f"hybridgate:placements_total{{plan={other},policy=cost}}"] >= 1
    assert samples["hybridgate:ttft_prediction_error_seconds_count{}"] >= 3


def test_a_50_ms_deadline_behind_long_prompts_is_refused_before_any_work(served):
    before = worker_gauge(served.metrics_url, "hybridgate:engine_prefill_tokens_total")
    results: dict[int, list] = {}
    calls = [threading.Thread(target=lambda k=k: results.update(
        {k: generate_with_metadata(served.target, prompt(3 + k, 1500), 1)[0]})) for k in range(2)]
    for call in calls:
        call.start()
    # The long prompts queued, on one worker or on both (where depends on the prefill rates each measured; two
    # on one worker share a step, and a worker reports its queue between steps, so wait for what one step leaves).
    deadline = time.monotonic() + 30 * TIME_FACTOR
    while sum(worker_gauge(served.metrics_url, "hybridgate:queued_prefill_tokens").values()) < 500:
        assert time.monotonic() < deadline, "the long prompts never showed in the workers' queues"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub(served.target).Generate(pb.GenerateRequest(prompt=prompt(5, 20), max_tokens=4), timeout=0.05))
    assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for call in calls:
        call.join(120 * TIME_FACTOR)
    # The workers prefilled the two long prompts and nothing else: the refused request never reached them.
    after = worker_gauge(served.metrics_url, "hybridgate:engine_prefill_tokens_total")
    expected = sum(results[k][-1].usage.prompt_tokens - results[k][-1].usage.cached_tokens for k in range(2))
    assert sum(after.values()) - sum(before.values()) == expected
