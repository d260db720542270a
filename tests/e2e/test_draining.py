"""End to end: a `serve` told SIGINT drains. Its doors stay open through --grace-period, health turns
NOT_SERVING / 503 at once (also on a connection opened before), new generation requests are refused
(UNAVAILABLE, 503 with Retry-After), streams in flight finish, or end with an error when they outlive the
grace period; no traceback in the log."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.parse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import TIME_FACTOR
from hybridgate.v1 import generation_pb2 as pb
from procs import Serve, stub

ONE_WORKER = ("--cpu-workers", "1", "--gpu-workers", "0")
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = "Once upon a time"
DRAIN_SEEN_S = 0.1  # SIGINT to NOT_SERVING (gRPC) and 503 (/health, on a connection held from before), at most


class Streams:
    """A gRPC and an HTTP SSE stream of `max_tokens` each, read to their end on threads."""

    def __init__(self, server: Serve, max_tokens: int):
        self.grpc_ids: list[int] = []
        self.grpc_last: pb.GenerateResponse | None = None
        self.grpc_error: grpc.RpcError | None = None
        self.sse = b""
        self.started = threading.Barrier(3)
        self.threads = [threading.Thread(target=self._grpc, args=(server, max_tokens)),
                        threading.Thread(target=self._http, args=(server, max_tokens))]
        for t in self.threads:
            t.start()
        self.started.wait(120 * TIME_FACTOR)  # each has its first token

    def _grpc(self, server: Serve, max_tokens: int) -> None:
        call = stub(server.target).Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=max_tokens,
                                                               ignore_eos=True, temperature=0))
        try:
            for i, msg in enumerate(call):
                self.grpc_ids += msg.token_ids
                self.grpc_last = msg
                if i == 0:
                    self.started.wait()
        except grpc.RpcError as exc:
            self.grpc_error = exc

    def _http(self, server: Serve, max_tokens: int) -> None:
        conn = connection(server)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": max_tokens,
                     "ignore_eos": True, "temperature": 0, "stream": True}), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        self.sse = resp.readline()
        self.started.wait()
        self.sse += resp.read()

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def join(self, timeout: float) -> None:
        for t in self.threads:
            t.join(timeout * TIME_FACTOR)
        assert self.done()

    def events(self) -> list[bytes]:
        """The SSE payloads, the framing checked: `data: ...` events, each ended by a blank line."""
        assert self.sse.endswith(b"\n\n"), self.sse[-200:]
        frames = self.sse[:-2].split(b"\n\n")
        assert all(f.startswith(b"data: ") for f in frames), frames
        return [f[len(b"data: "):] for f in frames]


def connection(server: Serve) -> http.client.HTTPConnection:
    return http.client.HTTPConnection(urllib.parse.urlsplit(server.http_url).netloc, timeout=60 * TIME_FACTOR)


def http_health(conn: http.client.HTTPConnection) -> int:
    """GET /health on a kept-alive connection."""
    conn.request("GET", "/health")
    resp = conn.getresponse()
    resp.read()
    return resp.status


def watch_health(server: Serve):
    """gRPC and HTTP health clients whose connections are open (and answered SERVING / 200) now."""
    check = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target)).Check
    grpc_health = lambda: check(health_pb2.HealthCheckRequest(service="hybridgate.v1.Generation"),  # noqa: E731
                                timeout=5 * TIME_FACTOR).status
    conn = connection(server)
    assert grpc_health() == SERVING and http_health(conn) == 200
    return grpc_health, lambda: http_health(conn)


def test_draining_refuses_new_requests_and_lets_streams_finish(tmp_path, model_path):
    server = Serve(tmp_path / "serve.log", *ONE_WORKER, "--grace-period", str(120 * TIME_FACTOR))
    try:
        grpc_health, http_health_now = watch_health(server)
        streams = Streams(server, max_tokens=300)
        server.popen.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        flipped: dict[str, float] = {}  # door -> seconds from SIGINT to the first NOT_SERVING / 503 it answered
        while len(flipped) < 2:
            assert time.monotonic() - signalled < 5 * TIME_FACTOR and not streams.done()
            checks = (("grpc", lambda: grpc_health() == NOT_SERVING), ("http", lambda: http_health_now() == 503))
            for door, turned in checks:
                if door not in flipped and turned():
                    flipped[door] = time.monotonic() - signalled
            time.sleep(0.005)
        assert max(flipped.values()) < DRAIN_SEEN_S * TIME_FACTOR, flipped  # "at once": within 100 ms
        flipped_s = max(flipped.values())
        assert http_health_now() == 503 and not streams.done()
        with pytest.raises(grpc.RpcError) as info:
            list(stub(server.target).Generate(pb.GenerateRequest(prompt="A new one", max_tokens=4),
                                              timeout=10 * TIME_FACTOR))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in info.value.details()
        conn = connection(server)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "A new one", "max_tokens": 4}),
                     {"Content-Type": "application/json"})
        refused = conn.getresponse()
        body = json.loads(refused.read())
        assert refused.status == 503 and refused.getheader("Retry-After") == "1"
        assert body["error"]["type"] == "service_unavailable_error" and "shutting down" in body["error"]["message"]
        assert not streams.done(), "the checks ran while the streams were in flight"
        streams.join(120)
        print(f"\nSIGINT to NOT_SERVING: {flipped_s * 1e3:.0f} ms")
        assert streams.grpc_error is None and len(streams.grpc_ids) == 300
        assert streams.grpc_last.finish_reason == pb.FINISH_REASON_LENGTH
        payloads = streams.events()
        assert payloads[-1] == b"[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert server.popen.wait(30 * TIME_FACTOR) == 0
    finally:
        server.stop()
    assert "Traceback" not in server.text(), server.text()


def test_a_stream_that_outlives_the_grace_period_ends_with_an_error(tmp_path, model_path):
    server = Serve(tmp_path / "serve.log", *ONE_WORKER, "--grace-period", "1")
    try:
        streams = Streams(server, max_tokens=4000)
        server.popen.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        streams.join(30)
        ended_s = time.monotonic() - signalled
        # Ended by the 1 s grace period, not by its 4,000 tokens (minutes); 5 s of shutdown slack, scaled.
        assert 1.0 <= ended_s < 1.0 + 5 * TIME_FACTOR, ended_s
        assert streams.grpc_error is not None and streams.grpc_error.code() == grpc.StatusCode.UNAVAILABLE
        assert "--grace-period" in streams.grpc_error.details()
        assert 0 < len(streams.grpc_ids) < 4000
        payloads = streams.events()
        assert payloads[-1] == b"[DONE]"
        error = json.loads(payloads[-2])["error"]
        assert error["type"] == "service_unavailable_error" and "--grace-period" in error["message"]
        assert server.popen.wait(30 * TIME_FACTOR) == 0
    finally:
        server.stop()
    assert "Traceback" not in server.text(), server.text()
