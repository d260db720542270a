"""Router side of the wire: a fake worker's ROUTER socket sends malformed, unknown and unexpected
frames to a real `ZmqWorkerClient`; its receive task survives, the drops are counted, and a valid
HELLO afterwards still brings it to READY (here through a new boot id, which renews its socket)."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TIME_FACTOR
from hybridgate import wire
from hybridgate.router.client import ZmqWorkerClient
from hybridgate.wire import Abort, Connect, EngineStats, Hello, Load, MsgType, Ready, RequestError, WorkerState

BOOT, NEW_BOOT = "1" * 32, "2" * 32
KNOWN_TYPES = {t.value for t in MsgType}


class FakeWorker:
    """A bare ROUTER socket playing the worker, and the client under test on its own event loop."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.loop = asyncio.new_event_loop()
        self.client = ZmqWorkerClient(endpoint, dead_after_s=600.0)
        self.seen: list = []
        self.peer = b""
        self.beats = 0

    def on_message(self, client, msg) -> None:
        self.seen.append(msg)
        if isinstance(msg, RequestError) and msg.message == "raise":
            raise RuntimeError("a handler that raises must not end the receive task")

    def run_until(self, cond, what: str, timeout: float = 10.0) -> None:
        async def wait():
            deadline = time.monotonic() + timeout * TIME_FACTOR
            while not cond():
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {what}")
                await asyncio.sleep(0.002)

        self.loop.run_until_complete(wait())

    def answer_connect(self, boot: str) -> None:
        """Wait for the client's CONNECT; answer HELLO (ready) from `boot`."""
        got = []

        def connect_arrived() -> bool:
            try:
                ident, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            if isinstance(wire.decode(frames), Connect):
                got.append(ident)
            return bool(got)

        self.run_until(connect_arrived, "CONNECT")
        self.peer = got[0]
        self.send(wire.encode(Hello("gpu", "f" * 64, 8, 8192, 1, True, boot_id=boot, name="gpu-0")))
        self.run_until(lambda: self.client.state == WorkerState.READY and self.client.hello.boot_id == boot, "READY")

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([self.peer, *frames])

    def sync(self) -> None:
        """A heartbeat with a fresh step count, and wait for it: every frame sent before is handled."""
        self.beats += 1
        self.send(wire.encode(Load(EngineStats(steps=self.beats))))
        self.run_until(lambda: self.client.stats.steps == self.beats, "the heartbeat")

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    worker = FakeWorker(f"ipc://{tmp_path_factory.mktemp('fuzz')}/w.sock")
    worker.loop.run_until_complete(worker.client.start(worker.on_message))
    worker.answer_connect(BOOT)
    yield worker
    worker.close()


# Cases as (frames, surely_bad): surely_bad frames must be counted; the rest (random bytes that
# could happen to decode) must only not hurt.
types = st.sampled_from(sorted(KNOWN_TYPES))
unknown_type = st.binary(min_size=0, max_size=3).filter(lambda b: b not in KNOWN_TYPES)
cases = st.one_of(
    st.tuples(st.lists(st.binary(max_size=64), min_size=1, max_size=5), st.just(False)),  # random frames
    st.tuples(st.lists(st.binary(max_size=32), min_size=1, max_size=1), st.just(True)),  # truncated: no body
    st.tuples(st.tuples(unknown_type, st.binary(max_size=32)).map(list), st.just(True)),
    st.tuples(st.tuples(types, st.binary(max_size=32).map(lambda b: b"\xc1" + b)).map(list), st.just(True)),
    st.tuples(st.sampled_from([[b"X", b"\xc1"], [b"O", b""], [b"H", b"\x90"], [b"L", b"\x80"]]), st.just(True)),
    st.tuples(st.sampled_from([wire.encode(Connect("r")), wire.encode(Abort(["x"])),  # router → worker types
                               wire.encode(wire.AddRequest("x", [1], wire.SamplingParams(), 0, 1, 2))]), st.just(True)),
    st.tuples(st.integers(1 << 16, 1 << 20).map(lambda n: [b"O", b"\x91" * n]), st.just(True)),  # oversized, nested
    st.tuples(st.just(wire.encode(RequestError("x", "raise"))), st.just(True)),  # the handler raises
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batch=st.lists(cases, min_size=1, max_size=4))
def test_no_frame_stops_the_client(fake, batch):
    before = fake.client.wire_errors
    for frames, _ in batch:
        fake.send(frames)
    fake.sync()
    dropped = fake.client.wire_errors - before
    assert sum(bad for _, bad in batch) <= dropped <= len(batch)
    assert fake.client.state == WorkerState.READY
    assert all(not t.done() for t in fake.client._tasks), "the receive task and the ticker still run"


def test_after_the_fuzz_a_new_worker_is_admitted(fake):
    fake.send([b"X", b"\xc1"])
    fake.sync()
    old_socket = fake.client._socket
    fake.send(wire.encode(Hello("gpu", "f" * 64, 8, 8192, 2, True, boot_id=NEW_BOOT, name="gpu-0")))
    fake.run_until(lambda: fake.client._socket is not old_socket, "a new socket")
    fake.answer_connect(NEW_BOOT)  # the CONNECT comes from the new socket's identity
    assert fake.client.name == "gpu-0"
    fake.send(wire.encode(Ready("gpu")))
    fake.sync()
    assert fake.client.state == WorkerState.READY and isinstance(fake.seen[-1], Ready)


def test_decoding_is_typed_not_pickled():
    with pytest.raises(ValueError, match="bad HELLO"):
        wire.decode([b"H", msgspec.msgpack.encode({"kind": 1})])


def test_a_receive_task_that_dies_anyway_is_restarted_loudly(tmp_path, caplog):
    worker = FakeWorker(f"ipc://{tmp_path}/w.sock")
    try:
        worker.loop.run_until_complete(worker.client.start(worker.on_message))
        worker.answer_connect(BOOT)
        dispatch = worker.client._dispatch

        def broken_once(frames):  # a bug past the guard, once
            worker.client._dispatch = dispatch
            raise RuntimeError("a bug in the dispatch itself")

        worker.client._dispatch = broken_once
        worker.send(wire.encode(Load(EngineStats(steps=99))))
        worker.sync()  # handled by the restarted task
        assert "task _recv_loop ended (RuntimeError('a bug in the dispatch itself')); restarting it" in caplog.text
    finally:
        worker.close()
