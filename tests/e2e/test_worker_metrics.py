"""A standalone worker says which model it serves (HELLO, the Redis registry) and serves its engine's
figures under vLLM's names on its own --metrics-port, equal to what the gateway shows of it."""

from __future__ import annotations

import json
import time

import pytest
import redis

from conftest import TIME_FACTOR, free_port
from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, metrics, stub

NAME = "chat"


@pytest.fixture
def fleet(tmp_path, model_path, redis_server):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = Proc(["worker", "--model", f"{NAME}={model_path}", "--endpoint", endpoint, "--advertise", endpoint,
                   "--threads", "1", "--redis-url", redis_server.url, "--insecure-tcp", "--metrics-port", "0",
                   "--worker-name", "w0"], tmp_path / "worker.log")
    gateway = Proc(["gateway", "--model", f"{NAME}={model_path}", "--port", "0", "--metrics-port", "0",
                    "--redis-url", redis_server.url, "--insecure-tcp"], tmp_path / "gateway.log")
    try:
        worker_url = worker.wait_for(r"hybridgate worker: metrics on (http://\S+)", 120).group(1)
        worker.wait_for(r"hybridgate worker: READY", 120)
        target = "127.0.0.1:" + gateway.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
        gateway_url = gateway.wait_for(r"metrics on (http://\S+)").group(1)
        gateway.wait_for(r"cpu worker w0: \w+ → READY", 60)
        yield endpoint, worker_url, gateway_url, target
    finally:
        for proc in (gateway, worker):
            proc.stop()


def test_a_worker_names_its_model_and_exports_vllm_names(fleet, redis_server):
    endpoint, worker_url, gateway_url, target = fleet
    entry = json.loads(redis.Redis.from_url(redis_server.url).get(f"hybridgate:worker:{endpoint}"))
    assert (entry["model"], entry["name"], entry["kind"]) == (NAME, "w0", "cpu")
    info = stub(target).GetModelInfo(pb.GetModelInfoRequest(model=NAME))
    assert info.model_id == NAME and entry["fingerprint"] == info.fingerprint

    idle = metrics(worker_url)
    m = f"model_name={NAME}"
    assert idle[f"vllm:num_requests_running{{{m}}}"] == 0 and idle[f"vllm:kv_cache_usage_perc{{{m}}}"] == 0
    config = next(k for k in idle if k.startswith("vllm:cache_config_info{"))
    assert "block_size=16," in config and "num_gpu_blocks=0" in config and idle[config] == 1

    call = stub(target).Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=4000, ignore_eos=True,
                                                    model=NAME), timeout=120 * TIME_FACTOR)
    first = next(call)
    assert first.token_ids
    try:
        # Under the running stream: the worker's own figures, equal to the gateway's (its heartbeats) once
        # both were read between the same two steps.
        deadline, seen = time.monotonic() + 10 * TIME_FACTOR, None
        while True:
            mine, theirs = metrics(worker_url), metrics(gateway_url)
            seen = (mine[f"vllm:num_requests_running{{{m}}}"], mine[f"vllm:kv_cache_usage_perc{{{m}}}"],
                    theirs[f"vllm:num_requests_running{{{m}}}"], theirs[f"vllm:kv_cache_usage_perc{{{m}}}"],
                    theirs["hybridgate:num_requests_running{}"])
            if seen[0] == 1 and 0 < seen[1] <= 1 and seen[:2] == seen[2:4] and seen[4] == 1:
                break
            assert time.monotonic() < deadline, seen
            time.sleep(0.02)
    finally:
        call.cancel()
