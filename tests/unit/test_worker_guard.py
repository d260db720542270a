"""The worker's guards without a model: ADD checks, the refusal counter, the fault hook, the I/O
thread's dispatch table and its two send failures (router gone, router congested)."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from hybridgate import wire
from hybridgate.mempool import PoolStats
from hybridgate.wire import (
    Abort,
    AddRequest,
    Connect,
    Hello,
    InvalidFieldError,
    Load,
    Overload,
    RequestError,
    SamplingParams,
)
from hybridgate.workers.engine import EngineCore
from hybridgate.workers.engine_loop import ClientCongested, ClientGone, EngineLoop, Inbox
from hybridgate.workers.faults import FAULT_ENV, FaultHook, InjectedFault
from hybridgate.workers.guard import WireErrors, check_add
from hybridgate.workers.io_thread import WorkerIO, max_frame_bytes
from hybridgate.workers.threads import EXIT_THREAD_DIED
from hybridgate.workers.scheduler import ScheduledBatch, SchedulerConfig
from hybridgate.workers.sequence import Sequence
from tests.conftest import TIME_FACTOR

VOCAB, MAX_LEN = 1000, 64


def add(rid="r", ids=(1, 2, 3), max_tokens=4, seed=0, eos=2, first=0, **params) -> AddRequest:
    return AddRequest(rid, list(ids), SamplingParams(**{"temperature": 0, **params}), seed, max_tokens, eos, first)


@pytest.mark.parametrize("request_, field", [
    (add(ids=[1, VOCAB]), "prompt_ids"),
    (add(ids=[-1]), "prompt_ids"),
    (add(ids=[]), "prompt_ids"),
    (add(ids=[1] * (MAX_LEN + 1)), "prompt_ids"),
    (add(max_tokens=0), "max_tokens"),
    (add(ids=[1] * 10, max_tokens=MAX_LEN - 9), "max_tokens"),
    (add(temperature=-0.5), "temperature"),
    (add(temperature=math.nan), "temperature"),
    (add(top_p=0.0), "top_p"),
    (add(top_k=-2), "top_k"),
    (add(repetition_penalty=0.0), "repetition_penalty"),
    (add(stop=("x",) * 17), "stop"),
    (add(seed=-1), "seed"),
    (add(seed=2**64), "seed"),
    (add(eos=VOCAB), "eos_token_id"),
    (add(first=-1), "first_token_index"),
    (add(rid=""), "request_id"),
    (add(rid="x" * 257), "request_id"),
])
def test_check_add_names_the_field(request_, field):
    with pytest.raises(InvalidFieldError) as info:
        check_add(request_, VOCAB, MAX_LEN)
    assert info.value.field == field


def test_check_add_takes_the_limits_themselves():
    check_add(add(ids=[0, VOCAB - 1], max_tokens=MAX_LEN - 2, seed=2**64 - 1, eos=-1, first=7, top_k=-1,
                  top_p=1.0, stop=("x",) * 16), VOCAB, MAX_LEN)


def test_wire_errors_count_everything_and_log_once_a_second_per_kind(caplog):
    errors = WireErrors(interval_s=60)
    with caplog.at_level(logging.WARNING, "hybridgate.worker"):
        for _ in range(5):
            errors.record("oversized", "x")
        errors.record("unknown type", "y")
    assert errors.total == 6
    assert len(caplog.records) == 2  # one line per kind within the interval
    errors.interval_s = 0
    with caplog.at_level(logging.WARNING, "hybridgate.worker"):
        errors.record("oversized", "z")
    assert "4 more oversized" in caplog.records[-1].getMessage()


def test_fault_hook_from_the_environment(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "fail_request:r3, oom_over_tokens:10")
    hook = FaultHook.from_env()
    assert hook == FaultHook(frozenset({"r3"}), 10)
    seq = lambda rid, n: (Sequence(add(rid, ids=[1] * n)), n)  # noqa: E731
    hook.check(ScheduledBatch([seq("a", 5), seq("b", 5)]))
    with pytest.raises(InjectedFault):
        hook.check(ScheduledBatch([seq("a", 1), seq("r3", 1)]))
    with pytest.raises(MemoryError):
        hook.check(ScheduledBatch([seq("a", 6), seq("b", 5)]))
    monkeypatch.setenv(FAULT_ENV, "")
    assert FaultHook.from_env() is None
    with pytest.raises(ValueError, match=FAULT_ENV):
        FaultHook.parse("explode:now")


class FakeRunner:
    """What EngineCore asks of a runner before any step."""

    kind, max_model_len, vocab_size, num_blocks, block_size, block_bytes = "gpu", MAX_LEN, VOCAB, 2, 16, 1024

    def kernel_cache_stats(self):
        return 0, 0

    def pool_stats(self):
        return PoolStats()


def test_engine_refuses_counts_and_answers():
    errors = WireErrors()
    engine = EngineCore(FakeRunner(), SchedulerConfig(), wire_errors=errors)
    assert engine.add(add("ok"), b"c1") is None
    refused = engine.add(add("oov", ids=[VOCAB]), b"c1")
    assert refused.code == "invalid_request" and "prompt_ids" in refused.message
    assert engine.add(add("ok"), b"c1") is None  # a duplicate of a live request: dropped, counted
    assert engine.add(add("ok"), b"c2") is None  # the same id from another router is another request
    assert engine.add(add(rid=""), b"c1") is None  # nothing to answer
    big = engine.add(add("big", ids=[1] * 20, max_tokens=13), b"c1")  # 33 tokens, 2 blocks of 16
    assert big.code == "no_kv_blocks" and "KV blocks" in big.message
    assert errors.total == 3 and engine.refresh_stats().wire_decode_errors == 3
    assert [s.request_id for s in engine.scheduler.waiting] == ["ok", "ok"]


def test_a_congested_router_is_told_which_requests_ended():
    engine = EngineCore(FakeRunner(), SchedulerConfig())
    for rid in ("a", "b"):
        engine.add(add(rid), b"slow")
    engine.add(add("c"), b"fast")
    sent = []
    loop = EngineLoop(engine, Inbox(), lambda client, msg: sent.append((client, msg)))
    loop._handle(b"slow", ClientCongested("its queue is full"))
    assert sent == [(b"slow", Overload(["a", "b"], "its queue is full"))]
    loop._handle(b"fast", ClientGone())
    assert not engine.has_work() and len(sent) == 1


def test_an_abort_then_the_same_id_again_runs_the_new_request():
    # A router aborts a request and resends it under the same id: the abort applies first.
    engine = EngineCore(FakeRunner(), SchedulerConfig())
    inbox = Inbox()
    loop = EngineLoop(engine, inbox, lambda *_: None)
    loop._handle(b"c", add("r"))
    old = engine._by_id[(b"c", "r")]
    inbox.put_abort(b"c", Abort(["r"]))
    loop._handle(b"c", add("r", ids=[4, 5]))
    new = engine._by_id[(b"c", "r")]
    assert new is not old and new.prompt_ids == [4, 5] and engine.wire_errors.total == 0


@pytest.fixture
def worker_io(tmp_path):
    ctx = zmq.Context()
    hello = Hello("cpu", "fp", 8, MAX_LEN, 1, True)
    io = WorkerIO(ctx, f"ipc://{tmp_path}/w.sock", hello, Inbox(), 0.1, send_hwm=10)
    dealers = []

    def dealer(name: bytes, rcvhwm: int = 1000):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, name)
        d.setsockopt(zmq.RCVHWM, rcvhwm)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"ipc://{tmp_path}/w.sock")
        dealers.append(d)
        return d

    yield io, dealer
    for d in dealers:
        d.close(0)
    io.close()
    ctx.term()


def recv(sock) -> msgspec.Struct:
    assert sock.poll(5000), "nothing arrived"
    return wire.decode(sock.recv_multipart())


def test_every_frame_goes_through_the_guarded_table(worker_io):
    io, dealer = worker_io
    frames = lambda *fs: [zmq.Frame(f) for f in fs]  # noqa: E731
    io._on_frames(b"r", frames(b"X", b"\xc1"))  # issue 9: this ABORT used to end the I/O thread
    io._on_frames(b"r", frames(b"X"))
    io._on_frames(b"r", frames(b"Q", b"\x80"))
    io._on_frames(b"r", frames(b"A", b"\x00" * (max_frame_bytes(MAX_LEN) + 1)))
    io._on_frames(b"r", frames(*wire.encode(Abort(["x"])), b"extra"))
    assert io.wire_errors.total == 5
    io._on_frames(b"r", frames(*wire.encode(Abort(["x"]))))
    assert io.inbox.take_aborts() == [(b"r", ["x"])] and io.wire_errors.total == 5
    d = dealer(b"router-1")
    d.send_multipart(wire.encode(Connect("router-1")))
    assert io.socket.poll(5000)
    io._recv_from_router()
    assert isinstance(recv(d), Hello) and isinstance(recv(d), wire.Ready)  # hello.ready is set
    # An ADD that does not decode but whose request id can be read is answered.
    body = msgspec.msgpack.encode({"request_id": "half", "prompt_ids": "not a list"})
    io._on_frames(b"router-1", frames(b"A", body))
    err = recv(d)
    assert isinstance(err, RequestError) and err.request_id == "half" and err.code == "invalid_request"
    assert io.wire_errors.total == 6


def test_a_gone_router_ends_its_requests_quietly(worker_io, caplog):
    io, _ = worker_io
    io.clients.add(b"gone")
    with caplog.at_level(logging.INFO, "hybridgate.worker"):
        assert io._send(b"gone", Load(wire.EngineStats())) == "gone"
    assert io.inbox.requests.get_nowait() == (b"gone", ClientGone())
    assert [r.levelno for r in caplog.records] == [logging.INFO] and "unreachable" not in caplog.text


def test_a_congested_router_gets_overload_once_it_reads(worker_io):
    io, dealer = worker_io
    d = dealer(b"slow", rcvhwm=1)
    d.send_multipart(wire.encode(Connect("slow")))
    assert io.socket.poll(5000)
    io._recv_from_router()
    big = wire.encode(Load(wire.EngineStats(batch_size_counts={n: n for n in range(4000)})))  # ~20 KB
    # Until the pipe (10 messages) and the kernel's socket buffers are full: sends refused for 0.2 s on end.
    # (The first refusal alone is not enough: ZeroMQ's I/O thread then moves the pipe into the kernel's
    # buffers, and an overload queued next went out at once, unmerged: once in a full run of the suite.)
    refused_since, deadline = None, time.monotonic() + 10
    while refused_since is None or time.monotonic() - refused_since < 0.2:
        assert time.monotonic() < deadline
        if io._send(b"slow", None, big) == "again":
            refused_since = refused_since or time.monotonic()
            time.sleep(0.01)
        else:
            refused_since = None
    assert io.congested == {b"slow"}
    told = []  # one per episode: a send that went through ended the one before
    while not io.inbox.requests.empty():
        told.append(io.inbox.requests.get_nowait())
    assert told and all(c == b"slow" and isinstance(m, ClientCongested) for c, m in told), told
    assert io._send(b"slow", None, big) == "again" and io.inbox.requests.empty()  # told once per episode
    io._queue_overload(b"slow", Overload(["a"], "full"))
    io._queue_overload(b"slow", Overload(["b"], "full"))
    got = []
    deadline = time.monotonic() + 5
    while not any(isinstance(m, Overload) for m in got):
        assert time.monotonic() < deadline
        while d.poll(10):
            got.append(wire.decode(d.recv_multipart()))
        io._retry_overloads()
    assert Overload(["a", "b"], "full") in got and not io._pending_overload


def test_a_dead_worker_thread_ends_the_process():
    code = ("import threading, time\n"
            "from hybridgate.workers.threads import exit_if_raises\n"
            "threading.Thread(target=exit_if_raises(lambda: 1 / 0, 'I/O thread')).start()\n"
            "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert proc.returncode == EXIT_THREAD_DIED, proc.stderr  # the main thread alone would sleep, then exit 0
    assert "I/O thread died" in proc.stderr and "ZeroDivisionError" in proc.stderr


def test_a_dead_registration_thread_ends_the_worker():
    """It used to die quietly: the worker ran on while its registry entry expired."""
    code = ("import time\n"
            "from hybridgate.security.redisconf import RedisConfig, WorkerEntry\n"
            "from hybridgate.workers.registration import Registration\n"
            "entry = WorkerEntry('ipc:///nowhere', 'cpu', 1j, 1, 'boot')  # 1j: not JSON, the thread raises\n"
            "Registration(RedisConfig(url='redis://127.0.0.1:1'), entry).start()\n"
            "time.sleep(30)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60 * TIME_FACTOR)
    assert proc.returncode == EXIT_THREAD_DIED, proc.stderr  # the main thread alone would sleep, then exit 0
    assert "registration thread died" in proc.stderr


def test_every_worker_thread_runs_under_the_exit_on_death_wrapper():
    """A thread of a worker process is made by `workers.threads.worker_thread` (or wrapped by
    exit_if_raises); the in-process client's engine thread runs in the embedding service's own
    process, which must not exit with it."""
    root = Path(__file__).resolve().parents[2] / "hybridgate" / "workers"
    bare = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
            if path.name not in ("threads.py", "inprocess.py")
            for n, line in enumerate(path.read_text().splitlines(), 1) if "threading.Thread(" in line]
    assert bare == []


def test_the_load_report_counts_the_blocks_each_sequence_is_promised():
    class Roomy(FakeRunner):
        num_blocks = 16

    engine = EngineCore(Roomy(), SchedulerConfig())
    engine.add(add("chat", ids=[5] * 20, max_tokens=13), b"c1")  # 33 tokens at its end: 3 blocks of 16
    engine.add(add("long", ids=[5] * 3, max_tokens=61), b"c1")  # 64 tokens: 4 blocks
    # A hand-off holds its KV here up to its first token only: 21 tokens, 2 blocks.
    handoff = AddRequest("h", [5] * 20, SamplingParams(temperature=0), 0, 40, 2,
                         handoff=wire.HandoffTarget("ipc:///nowhere", "t"))
    engine.add(handoff, b"c1")
    stats = engine.refresh_stats()
    assert (stats.blocks_used, stats.blocks_committed) == (0, 3 + 4 + 2)


def test_the_inbox_refuses_adds_past_its_bound_with_queue_full_and_counts_them(tmp_path):
    """It used to grow without end while a busy engine took nothing."""
    from prometheus_client import generate_latest

    from hybridgate.gateway.metrics import GatewayMetrics

    ctx = zmq.Context()
    inbox = Inbox(max_adds=2)
    io = WorkerIO(ctx, f"ipc://{tmp_path}/w.sock", Hello("cpu", "fp", 8, MAX_LEN, 1, True), inbox, 0.1)
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"ipc://{tmp_path}/w.sock")
    try:
        d.send_multipart(wire.encode(Connect("router-1")))
        assert io.socket.poll(5000)
        io._recv_from_router()
        assert isinstance(recv(d), Hello) and isinstance(recv(d), wire.Ready)
        client = next(iter(io.clients))
        for rid in ("x", "y", "z"):  # hand-off messages share the ADD handler but not its bound
            io._on_frames(client, [zmq.Frame(f) for f in wire.encode(wire.HandoffRelease(rid))])
        assert not d.poll(100) and inbox.refusals.counts() == {}
        for _ in range(3):
            inbox.requests.get_nowait()
        for rid in ("a", "b", "c"):
            io._on_frames(client, [zmq.Frame(f) for f in wire.encode(add(rid))])
        err = recv(d)
        assert isinstance(err, RequestError) and err.request_id == "c" and err.code == "queue_full", err
        assert "--max-num-waiting" in err.message and inbox.refusals.counts() == {"inbox": 1}
        engine = EngineCore(FakeRunner(), SchedulerConfig())
        engine.refusals = inbox.refusals
        loop = EngineLoop(engine, inbox, lambda *_: None)
        loop._drain(block=False)  # the engine takes a and b: room for two more
        io._on_frames(client, [zmq.Frame(f) for f in wire.encode(add("d"))])
        assert inbox.requests.get_nowait() == (client, add("d")) and not d.poll(100)
        stats = engine.refresh_stats()
        assert stats.queue_refusals == {"inbox": 1}
        worker = type("W", (), {"stats": stats, "name": "cpu-0", "kind": "cpu", "endpoint": ""})()
        text = generate_latest(GatewayMetrics(lambda: [worker]).registry).decode()
        assert 'hybridgate:worker_queue_refusals_total{queue="inbox",worker="cpu-0"} 1.0' in text
    finally:
        d.close(0)
        io.close()
        ctx.term()


def test_the_handoff_socket_drops_a_peer_sending_a_frame_past_the_largest_handoff_frame(tmp_path):
    """A frame past the largest a hand-off carries (one layer's K of a full context in float32) ends the
    sender's connection unread; one of exactly that size still arrives. (The socket used to take any size.)"""
    from zmq.utils.monitor import recv_monitor_message

    from hybridgate.workers.handoff import KVSpec
    from hybridgate.workers.io_thread import handoff_frame_bytes

    max_len, kv_heads, head_dim = 2048, 4, 64
    largest = KVSpec("fp", 16, 1, kv_heads, head_dim).frame_bytes(max_len, "float32")  # 2 MiB
    cap = handoff_frame_bytes(max_len, kv_heads, head_dim)
    assert cap == largest
    ctx = zmq.Context()
    handoff = f"ipc://{tmp_path}/h.sock"
    hello = Hello("cpu", "fp", 8, max_len, 1, True, handoff_endpoint=handoff)
    io = WorkerIO(ctx, f"ipc://{tmp_path}/w.sock", hello, Inbox(), 0.1, handoff_max_frame_bytes=cap)
    monitor = io.handoff_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    senders = [ctx.socket(zmq.DEALER) for _ in range(2)]
    part = wire.encode(wire.HandoffPart("r", "t", 0, 1))
    try:
        for s in senders:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(handoff)
        senders[0].send_multipart([*part, b"\0" * (cap + 1), b"\0" * 8])
        assert monitor.poll(5000 * TIME_FACTOR), "the oversize sender was not disconnected"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        senders[1].send_multipart([*part, b"\0" * cap, b"\0" * 8])
        assert io.handoff_socket.poll(5000 * TIME_FACTOR)
        io._recv_handoff()
        _, got = io.inbox.requests.get_nowait()
        assert [len(f.buffer) for f in got.frames] == [cap, 8] and io.inbox.requests.empty()
    finally:
        io.handoff_socket.disable_monitor()
        monitor.close(0)
        for s in senders:
            s.close(0)
        io.close()
        ctx.term()


def test_a_worker_with_a_handoff_endpoint_needs_its_frame_cap(tmp_path):
    hello = Hello("cpu", "fp", 8, MAX_LEN, 1, True, handoff_endpoint=f"ipc://{tmp_path}/h.sock")
    ctx = zmq.Context()
    try:
        with pytest.raises(ValueError, match="handoff_max_frame_bytes"):
            WorkerIO(ctx, f"ipc://{tmp_path}/w.sock", hello, Inbox(), 0.1)
    finally:
        ctx.destroy(0)
