"""End to end with separate gateway and worker processes: death, refusal, sharing, shutdown."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TIME_FACTOR, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, Serve, alive, children_of, metrics, stub, wait_metric
from tiny_gguf import write_tiny_llama

GREEDY = golden_json("greedy.json")
FRANCE = "What is the capital of France?"


def start_worker(tmp_path, name: str, *extra: str) -> tuple[Proc, str]:
    endpoint = f"ipc://{tmp_path}/{name}.sock"
    proc = Proc(["worker", "--endpoint", endpoint, "--threads", "1", *extra], tmp_path / f"{name}.log")
    return proc, endpoint


def start_gateway(tmp_path, name: str, *endpoints: str, extra=()) -> tuple[Proc, str]:
    args = ["gateway", "--port", "0", "--wait-for-workers"]  # its worker is still loading
    for ep in endpoints:
        args += ["--worker", ep]
    proc = Proc([*args, *extra], tmp_path / f"{name}.log")
    port = proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
    return proc, f"127.0.0.1:{port}"


def health(target: str) -> int:
    return health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Check(
        health_pb2.HealthCheckRequest(service="hybridgate.v1.Generation")).status


def test_worker_killed_mid_stream(tmp_path, model_path):
    # Resume off: with it on, the stream would wait for a READY worker up to the stall timeout
    # (tests/e2e/test_resume.py covers that).
    worker, endpoint = start_worker(tmp_path, "w")
    gateway, target = start_gateway(tmp_path, "g", endpoint, extra=("--no-resume-on-worker-loss",))
    try:
        gateway.wait_for(r"hybridgate: READY")
        call = stub(target).Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=2000, ignore_eos=True))
        next(call)
        killed = time.monotonic()
        worker.popen.send_signal(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Ended by the worker's death (its socket and heartbeats gone), not by running out its 2,000 tokens
        # (minutes on these cores): 2 s, scaled by the suite's one factor for a loaded machine.
        assert time.monotonic() - killed < 2.0 * TIME_FACTOR
        assert health(target) == health_pb2.HealthCheckResponse.NOT_SERVING
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(stub(target).Generate(pb.GenerateRequest(prompt="hi", max_tokens=2)))
        # Refused at once (no live worker), not queued until the request's stall timeout (seconds).
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < 0.5 * TIME_FACTOR
        assert gateway.popen.poll() is None
    finally:
        assert gateway.stop() == 0, gateway.text()
        worker.stop()


def test_worker_with_another_model_is_refused(tmp_path, model_path):
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", heads=4, kv_heads=2)
    # The torch runner: the tiny model's head_dim 8 is below the CPU runner's vector width.
    worker, endpoint = start_worker(tmp_path, "w", "--model", str(tiny), "--kind", "gpu")
    gateway, _ = start_gateway(tmp_path, "g", endpoint)
    try:
        match = gateway.wait_for(r"error: worker \S+ serves model fingerprint ([0-9a-f]{64}), "
                                 r"but this router's model has fingerprint ([0-9a-f]{64})")
        assert match.group(1) != match.group(2)
        gateway.popen.wait(10 * TIME_FACTOR)
        assert gateway.popen.returncode == 1
    finally:
        gateway.stop()
        worker.stop()


def test_two_gateways_share_a_worker(tmp_path, model_path):
    worker, endpoint = start_worker(tmp_path, "w")
    (g1, t1), (g2, t2) = start_gateway(tmp_path, "g1", endpoint), start_gateway(tmp_path, "g2", endpoint)
    try:
        g1.wait_for(r"hybridgate: READY"), g2.wait_for(r"hybridgate: READY")
        prompts = {t1: "The first gateway says", t2: "The second gateway says"}
        solo = {t: list(stub(t).Generate(pb.GenerateRequest(prompt=p, max_tokens=24, temperature=0, ignore_eos=True)))
                for t, p in prompts.items()}
        both = {}

        def run(t):
            both[t] = list(stub(t).Generate(pb.GenerateRequest(prompt=prompts[t], max_tokens=24, temperature=0,
                                                              ignore_eos=True)))

        threads = [threading.Thread(target=run, args=(t,)) for t in prompts]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for t in prompts:
            ids = [i for m in both[t] for i in m.token_ids]
            assert ids == [i for m in solo[t] for i in m.token_ids] and len(ids) == 24
            assert len({m.request_id for m in both[t]}) == 1
    finally:
        assert g1.stop() == 0 and g2.stop() == 0
        worker.stop()


def test_default_layout_streams_the_reference_answer(tmp_path, model_path):
    """`serve` with no layout flags: its workers (one CPU worker here; a GPU worker too under CUDA)
    answer the France chat with transformers' greedy ids (tests/golden/greedy.json), EOS included."""
    from hybridgate.run.serve import cuda_present

    server = Serve(tmp_path / "serve.log")
    try:
        ready = re.search(r"READY \(([^)]*)\)", server.text()).group(1)
        assert ready == ("gpu, cpu workers" if cuda_present() else "cpu worker")
        call = stub(server.target).Generate(pb.GenerateRequest(
            chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=FRANCE)]), max_tokens=16, temperature=0))
        messages = list(call)
        assert [i for m in messages for i in m.token_ids] == GREEDY["france"]["ids"]
        assert messages[-1].finish_reason == pb.FINISH_REASON_EOS
        if not cuda_present():
            assert messages[-1].route.startswith("cpu ("), messages[-1].route
    finally:
        assert server.stop() == 0, server.text()


def test_cpu_worker_compiles_once_then_starts_from_the_caches(tmp_path, model_path):
    # Fresh kernel and GGUF-header caches: the first start compiles (misses), the second loads
    # everything (no misses). Its kernels are ready in under 0.3x the first's time, by the worker's own
    # clock, and it reaches READY sooner. The whole start is not held to 0.3x: it also holds the imports,
    # the model load and the rate measurement, which no cache shortens (on one CI machine 6.5 s of
    # a 21 s cold start).
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba"), "HYBRIDGATE_CACHE_DIR": str(tmp_path / "cache")}
    times, counts = [], []
    for run in range(2):
        start = time.monotonic()
        server = Serve(tmp_path / f"serve{run}.log", "--cpu-workers", "1", "--gpu-workers", "0", env=env)
        times.append(time.monotonic() - start)
        try:  # the worker reports its counts with its first heartbeat
            first = "hybridgate:kernel_cache_hits_total{}" if run else "hybridgate:kernel_cache_misses_total{}"
            wait_metric(server.metrics_url, first, lambda v: v > 0)
            m = metrics(server.metrics_url)
            counts.append((m["hybridgate:kernel_cache_hits_total{}"], m["hybridgate:kernel_cache_misses_total{}"]))
        finally:
            assert server.stop() == 0, server.text()
    (cold_hits, cold_misses), (warm_hits, warm_misses) = counts
    assert cold_misses > 0 and warm_misses == 0 and warm_hits == cold_hits + cold_misses
    kernels = [float(re.search(r"CPU kernels ready in ([0-9.]+) s", (tmp_path / f"serve{run}.log").read_text())[1])
               for run in range(2)]
    assert kernels[1] < 0.3 * kernels[0] and times[1] < times[0], (kernels, times)


def test_serve_sigint_finishes_streams_and_exits_zero_with_no_child_left(tmp_path, model_path):
    server = Serve(tmp_path / "serve.log", "--gpu-workers", "1", "--cpu-workers", "1")
    # A prompt long enough for the prompt-encoding pool, so its processes are there for the Ctrl-C too.
    long = list(stub(server.target).Generate(pb.GenerateRequest(prompt="hello " * 3000, max_tokens=1)))
    assert long[-1].finish_reason == pb.FINISH_REASON_LENGTH
    children = children_of(server.pid)
    assert len(children) >= 3, "serve has a child per worker, and the prompt pool's"
    call = stub(server.target).Generate(pb.GenerateRequest(prompt="Once upon a time", max_tokens=48, ignore_eos=True))
    first = next(call)
    os.killpg(server.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group (serve's own session)
    rest = list(call)  # the in-flight stream finishes within the grace period
    assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 48
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert server.stop(signal.SIGINT) == 0, server.text()
    deadline = time.monotonic() + 5 * TIME_FACTOR
    while any(alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(c) for c in children)
    assert "Traceback" not in server.text(), server.text()
    # each worker says why it stops in the operator's terms: they pressed Ctrl-C, not sent a SIGTERM
    assert server.text().count("stopping (the server is shutting down)") == 2 and "SIGTERM" not in server.text(), \
        server.text()


def test_serve_killed_takes_its_worker_down(tmp_path, model_path):
    server = Serve(tmp_path / "serve.log")
    workers = children_of(server.pid)  # the worker (and multiprocessing's resource tracker)
    assert workers
    server.popen.send_signal(signal.SIGKILL)
    server.popen.wait()
    killed = time.monotonic()
    while any(alive(c) for c in workers) and time.monotonic() - killed < 2.0 * TIME_FACTOR:
        time.sleep(0.05)
    assert not any(alive(c) for c in workers)
    server.stop()
    # Nothing ran to remove its socket folder; the next serve does (its serve.pid is dead).
    from hybridgate.run.serve import remove_stale_socket_dirs

    folder = re.search(r"ipc://(/\S+)/worker-0\.sock", server.text()).group(1)
    assert os.path.isdir(folder) and folder in remove_stale_socket_dirs() and not os.path.exists(folder)
