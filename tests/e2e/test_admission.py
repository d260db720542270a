"""Admission control end to end: a gateway at its --max-inflight-requests refuses at once with a
retry pushback, and a request whose deadline passes in the worker's queue never runs.

Real processes: an instant worker (the real worker process and wire, a runner that streams a
fixed text at a set step time, two sequences at a time) and `hybridgate gateway`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from dataclasses import replace

import grpc
import pytest

from conftest import TIME_FACTOR
from hybridgate.bench.instant import run_instant_worker
from hybridgate.v1 import generation_pb2 as pb
from hybridgate.workers.process import WorkerConfig
from hybridgate.workers.scheduler import SchedulerConfig
from procs import Proc, metrics, stub, wait_metric

STEP_S = 0.02
LIMIT = 8
PROMPT = "Tell me about lighthouses."  # under one KV block (16 tokens): no prefix-cache hits to discount


@pytest.fixture(scope="module")
def gateway(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("admission")
    endpoint = f"ipc://{folder}/instant-0"
    config = replace(WorkerConfig(model_path=str(model_path), endpoint=endpoint, parent_pid=os.getpid()),
                     scheduler=SchedulerConfig(max_num_seqs=2))
    worker = mp.get_context("spawn").Process(target=run_instant_worker, args=(config, STEP_S))
    worker.start()
    gw = Proc(["gateway", "--model", str(model_path), "--port", "0", "--metrics-port", "0", "--worker", endpoint,
               "--max-inflight-requests", str(LIMIT)], folder / "gateway.log")
    try:
        port = gw.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        url = gw.wait_for(r"metrics on (http://\S+)").group(1)
        gw.wait_for(r"hybridgate: READY")
        yield f"127.0.0.1:{port}", url, gw
    finally:
        gw.stop()
        worker.terminate()
        worker.join(30)


def _request(max_tokens: int, prompt: str = PROMPT) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0)


def test_over_the_limit_is_refused_at_once_with_a_pushback(gateway):
    target, url, _ = gateway
    generation = stub(target)
    results: list[tuple] = [None] * 40
    go = threading.Barrier(40)

    def one(i: int) -> None:
        go.wait()
        start = time.monotonic()
        try:
            msgs = list(generation.Generate(_request(32), timeout=60 * TIME_FACTOR))
            results[i] = ("ok", msgs, time.monotonic() - start)
        except grpc.RpcError as exc:
            results[i] = (exc.code(), dict(exc.trailing_metadata() or ()), time.monotonic() - start)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90 * TIME_FACTOR)
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if r[0] == "ok"]
    assert len(refused) == 40 - LIMIT and len(done) == LIMIT, [r[0] for r in results]
    for _, trailers, elapsed in refused:
        assert int(trailers["grpc-retry-pushback-ms"]) > 0
        # at once: well before the first accepted request could finish (32 steps of 20 ms)
        assert elapsed < 32 * STEP_S * TIME_FACTOR, elapsed
    for _, msgs, _ in done:
        assert sum(len(m.token_ids) for m in msgs) == 32
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    samples = metrics(url)
    assert sum(v for k, v in samples.items()
               if k.startswith("hybridgate:requests_rejected_total{") and "reason=max_inflight_requests" in k) == 40 - LIMIT


def test_a_request_whose_deadline_passes_in_the_queue_never_runs(gateway):
    target, url, _ = gateway
    wait_metric(url, "hybridgate:num_requests_running{}", lambda v: v == 0)
    before = wait_metric(url, "hybridgate:engine_prefill_tokens_total{}", lambda v: True)
    generation = stub(target)
    # Two long streams fill the worker's two sequence slots; the third waits in its queue.
    long = [generation.Generate(_request(100), timeout=60 * TIME_FACTOR) for _ in range(2)]
    firsts = [next(call) for call in long]
    wait_metric(url, "hybridgate:num_requests_running{}", lambda v: v == 2)
    late = "Write a short poem about the sea and the wind."  # another prompt length than PROMPT's
    with pytest.raises(grpc.RpcError) as info:
        list(generation.Generate(_request(8, late), timeout=0.3))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finals = [list(call)[-1] for call in long]
    assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f in finals)
    wait_metric(url, "hybridgate:num_requests_waiting{}", lambda v: v == 0)
    wait_metric(url, "hybridgate:num_requests_running{}", lambda v: v == 0)
    # The worker ran the two long prompts and nothing else: the late request left its queue unrun.
    prompt_tokens = sum(f.usage.prompt_tokens for f in finals)
    assert firsts and prompt_tokens > 0
    after = metrics(url)["hybridgate:engine_prefill_tokens_total{}"]
    assert after - before == prompt_tokens
