"""The Redis worker registry, end to end: gateways and tcp workers as real processes, a real redis-server.

One scenario in phases (each worker start costs seconds of model load on these cores): a worker started after
the gateway is used within 2 s; a second gateway shares the pool; a worker on another model is refused; a
worker killed with SIGKILL is dropped within its TTL and gets no new request; restarted on the same endpoint it
is used again by the same gateway process.
"""

from __future__ import annotations

import re
import signal
import time

import grpc
import pytest

from conftest import TIME_FACTOR, free_port, golden_json
from hybridgate.v1 import generation_pb2 as pb
from procs import Proc, stub
from tiny_gguf import write_tiny_llama

TTL = 1.0
GREEDY = golden_json("greedy.json")["france"]  # transformers' greedy ids for this chat (tests/reference)


def gateway(tmp_path, name: str, url: str) -> tuple[Proc, str]:
    proc = Proc(["gateway", "--port", "0", "--redis-url", url, "--registry-ttl", str(TTL), "--insecure-tcp"],
                tmp_path / f"{name}.log")
    port = proc.wait_for(r"gRPC on 127\.0\.0\.1:(\d+)").group(1)
    proc.wait_for(r"hybridgate: READY \(.*workers from Redis at redis://127\.0\.0\.1:\d+/0\)", 30)
    return proc, f"127.0.0.1:{port}"


def worker(tmp_path, name: str, url: str, port: int, *extra: str) -> Proc:
    endpoint = f"tcp://127.0.0.1:{port}"
    return Proc(["worker", "--endpoint", endpoint, "--advertise", endpoint, "--threads", "1", "--redis-url", url,
                 "--registry-ttl", str(TTL), "--insecure-tcp", *extra], tmp_path / f"{name}.log")


def chat(target: str, timeout: float = 30.0) -> list[int]:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=GREEDY["question"])]),
                                 max_tokens=len(GREEDY["ids"]), temperature=0)
    return [i for m in stub(target).Generate(request, timeout=timeout * TIME_FACTOR) for i in m.token_ids]


def first_success(target: str, limit_s: float) -> tuple[list[int], float]:
    """Retry the chat until it succeeds; (ids, seconds it took to succeed)."""
    start = time.monotonic()
    while True:
        try:
            return chat(target), time.monotonic() - start
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() - start > limit_s:
                raise
            time.sleep(0.02)


def test_registry_discovery_sharing_refusal_expiry_and_restart(tmp_path, redis_server, model_path):
    port = free_port()
    g1, t1 = gateway(tmp_path, "g1", redis_server.url)
    other = write_tiny_llama(tmp_path / "tiny.gguf", heads=4, kv_heads=2)
    # The torch runner: the tiny model's head_dim 8 is below the CPU runner's vector width.
    stranger = worker(tmp_path, "stranger", redis_server.url, free_port(), "--model", str(other), "--kind", "gpu")
    w1 = worker(tmp_path, "w1", redis_server.url, port)
    g2 = None
    try:
        w1.wait_for(r"hybridgate worker: READY", 120)
        ids, took = first_success(t1, 10 * TIME_FACTOR)
        assert ids == GREEDY["ids"]
        # Used at the registry's next poll (every 0.25 s) plus a HELLO, not at some later reconnect: 2 s,
        # scaled by the suite's one factor for a loaded machine.
        assert took < 2.0 * TIME_FACTOR, f"a worker registered after the gateway took {took:.2f} s to be used"

        g2, t2 = gateway(tmp_path, "g2", redis_server.url)
        assert first_success(t2, 5 * TIME_FACTOR)[0] == ids  # the same pool (one worker) serves both gateways
        g2.wait_for(rf"cpu worker tcp://127\.0\.0\.1:{port} joined \(boot [0-9a-f]{{8}}\)", 5)

        stranger.wait_for(r"hybridgate worker: READY", 120)
        match = g1.wait_for(r"refusing worker (\S+) \(registry\): it serves model fingerprint ([0-9a-f]{64}), "
                            r"but this router's model has fingerprint ([0-9a-f]{64})", 10)
        assert match.group(2) != match.group(3)
        assert f":{port}" not in match.group(1)

        w1.popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        w1.popen.wait()
        g1.wait_for(rf"dropping cpu worker tcp://127\.0\.0\.1:{port}: its registry entry expired", TTL + 5)
        dropped = time.monotonic() - killed
        # Dropped when its entry expires (TTL), not at a later poll; 0.5 s for the expiry to be seen.
        assert dropped < (TTL + 0.5) * TIME_FACTOR, f"dropped {dropped:.2f} s after SIGKILL (ttl {TTL} s)"
        with pytest.raises(grpc.RpcError) as info:  # no worker of this model is left: refused at once
            chat(t1, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        w1 = worker(tmp_path, "w1-again", redis_server.url, port)
        w1.wait_for(r"hybridgate worker: READY", 120)
        again, took = first_success(t1, 10 * TIME_FACTOR)
        assert again == ids and took < 2.0 * TIME_FACTOR
        assert g1.popen.poll() is None  # the same gateway process throughout
    finally:
        for proc in (g1, g2, w1, stranger):
            if proc is not None:
                proc.stop()
