"""Failures that used to be swallowed: each is logged at WARNING, saying what was lost, and counted in a metric."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from hybridgate import wire
from hybridgate.gateway.metrics import GatewayMetrics
from hybridgate.wire import Abort, Hello, HandoffRefused
from tests.conftest import TIME_FACTOR


async def test_a_queued_send_that_then_fails_is_said_and_counted(tmp_path, caplog):
    """A NOBLOCK send queued behind a blocking one (zmq.asyncio defers it) that then times out: `_send`
    had already said True, and the failure used to be read and dropped by its done callback."""
    from hybridgate.router.client import ZmqWorkerClient

    client = ZmqWorkerClient(f"ipc://{tmp_path}/nobody.sock", name="w0", ctx=zmq.asyncio.Context())
    client._open_socket()  # nothing listens: with IMMEDIATE, nothing can be sent
    client._socket.setsockopt(zmq.SNDTIMEO, 50)
    try:
        ahead = client._socket.send_multipart([b"x"])  # a blocking send: waits for a peer, then times out
        with caplog.at_level(logging.WARNING, "hybridgate.router"):
            assert client._send(Abort(["r1"]))  # queued behind it: the future is not done yet
            with pytest.raises(zmq.Again):
                await asyncio.wait_for(ahead, 5 * TIME_FACTOR)
            deadline = time.monotonic() + 5 * TIME_FACTOR
            while client.sends_lost == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        assert client.sends_lost == 1
        assert any(r.levelno == logging.WARNING and "Abort" in r.getMessage() and "lost" in r.getMessage()
                   for r in caplog.records)
        text = generate_latest(GatewayMetrics(clients=lambda: [client]).registry).decode()
        assert 'hybridgate:router_sends_lost_total{worker="w0"} 1.0' in text
    finally:
        await client.close()
        client._ctx.destroy(0)


async def test_a_stream_whose_close_raises_is_said_and_counted_and_the_other_choices_still_close(caplog):
    """A stream's `__aexit__` raising is a bug, not a fault a test can cause from outside: a stand-in raises."""
    from hybridgate.gateway.http_stream import Run

    class Stream:
        prompt_ids, ids = [1, 2], [3]

        def __init__(self, rid: str, fails: bool):
            self.request_id, self.fails, self.closed = rid, fails, False

        async def __aexit__(self, *exc):
            self.closed = True
            if self.fails:
                raise RuntimeError("the abort could not be sent")

    metrics = GatewayMetrics()
    states = [SimpleNamespace(index=i, stream=Stream(f"r{i}", i == 0), entered=True, finish="stop") for i in range(2)]
    run = Run(SimpleNamespace(metrics=metrics, log_requests=False), states, SimpleNamespace(name="m"))
    with caplog.at_level(logging.WARNING, "hybridgate.gateway"):
        await run.close()
    assert all(s.stream.closed for s in states)
    assert any(r.levelno == logging.WARNING and "r0" in r.getMessage() and "RuntimeError" in r.getMessage()
               for r in caplog.records)
    assert 'hybridgate:stream_close_errors_total{model_name="m"} 1.0' in generate_latest(metrics.registry).decode()


def test_a_handoff_reply_to_a_gone_sender_is_said_and_counted(tmp_path, caplog):
    """The refusal a CPU worker answers a hand-off's sender with, when the sender is gone: it used to be
    dropped silently (the socket took unknown peers) or logged at INFO."""
    from hybridgate.workers.engine_loop import Inbox
    from hybridgate.workers.io_thread import WorkerIO, handoff_frame_bytes

    ctx = zmq.Context()
    hello = Hello("cpu", "fp", 8, 64, 1, True, name="c0", handoff_endpoint=f"ipc://{tmp_path}/h.sock")
    io = WorkerIO(ctx, f"ipc://{tmp_path}/w.sock", hello, Inbox(), 0.1,
                  handoff_max_frame_bytes=handoff_frame_bytes(64, 1, 8))
    try:
        io.engine_sender(ctx)
        reply = io.engine_handoff_sender()
        reply(b"gone-gpu-worker", HandoffRefused("r1", "token", "spent"))
        assert io.from_engine.poll(5000 * TIME_FACTOR)
        with caplog.at_level(logging.WARNING, "hybridgate.worker"):
            io._forward_engine_output()
        assert io.handoff_replies_lost == 1 and io.stats.handoff_replies_lost == 1
        assert any(r.levelno == logging.WARNING and "HANDOFF_REFUSED" in r.getMessage() and "lost" in r.getMessage()
                   for r in caplog.records)
        client = SimpleNamespace(name="c0", kind="cpu", endpoint="", stats=io.stats)
        text = generate_latest(GatewayMetrics(clients=lambda: [client]).registry).decode()
        assert 'hybridgate:kv_handoff_replies_lost_total{worker="c0"} 1.0' in text
    finally:
        io.close()
        ctx.term()
